"""The top floor: every command-line entry point of the suite, and nothing else.

Each module parses its arguments with :mod:`pipeline.cli.parser` (a usage mistake is one line and exit 2) and calls
the layers below through typed functions; no layer below imports from here.

  data        pipeline_data_prepare.py (prepare | tokenize | pack)
  train       pipeline_training_launch.sh (resolve, preflight, records, exec torchrun / ft_launcher)
  checkpoint  pipeline_checkpoint_convert.sh (export | import | upload-all)
  coherence   pipeline_coherence_test.py (generation tests)
  sbatch      isambard_sbatch (sbatch with the shared bad-node log and submit-time checks)
  experiment  pipeline_experiment.py (sweeps, locks, multi-phase chains, status board, CSV)
"""
