#!/usr/bin/env python3
"""pipeline_experiment.py - sweeps and multi-phase chains of training runs from one experiment file; see --help.

Run anywhere (a login node's python3 starts again in the venv or the planner):
  python3 pipeline_experiment.py --help
  python pipeline_experiment.py list   configs/experiments/tiny_lr_batch_sweep.yaml
  python pipeline_experiment.py submit configs/experiments/tiny_lr_batch_sweep.yaml
  python pipeline_experiment.py status configs/experiments/tiny_lr_batch_sweep.yaml --watch
"""

import os
import sys
from pathlib import Path

try:
    from pipeline.cli.experiment import main
except ModuleNotFoundError:  # a login node's python3 without the suite: start again in the venv or the planner
    if os.environ.get("PIPELINE_ENTRY"):
        raise
    here = Path(__file__).resolve()
    os.execvp("bash", ["bash", str(here.parent / "src/pipeline/common/entry.sh"), "host", str(here), *sys.argv[1:]])

if __name__ == "__main__":
    sys.exit(main())
