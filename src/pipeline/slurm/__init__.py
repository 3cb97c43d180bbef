"""Slurm layer: allocation facts, rendezvous, sbatch rendering, the shared bad-node log."""
