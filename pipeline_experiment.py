#!/usr/bin/env python3
"""pipeline_experiment.py - sweeps and multi-phase chains of training runs from one experiment file; see --help.

Run inside the environment:  source pipeline_env_activate.sh && python pipeline_experiment.py --help
  python pipeline_experiment.py list   configs/experiments/tiny_lr_batch_sweep.yaml
  python pipeline_experiment.py submit configs/experiments/tiny_lr_batch_sweep.yaml
  python pipeline_experiment.py status configs/experiments/tiny_lr_batch_sweep.yaml --watch
"""

import sys

from pipeline.cli.experiment import main

if __name__ == "__main__":
    sys.exit(main())
