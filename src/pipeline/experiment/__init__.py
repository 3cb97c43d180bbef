"""Experiments: sweeps of Hydra overrides over the training pipeline, multi-phase chains through Slurm dependencies,
lock files, a status board with loss curves, and a results CSV (pipeline_experiment.py)."""
