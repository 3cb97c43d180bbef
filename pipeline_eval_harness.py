#!/usr/bin/env python3
"""pipeline_eval_harness.py - evaluation pipeline entry point (lm-evaluation-harness benchmarks); see --help.

Run inside the environment:  source pipeline_env_activate.sh && python pipeline_eval_harness.py MODEL --tasks T
or through Slurm:            isambard_sbatch --gpus-per-node=1 pipeline_eval_submit.sbatch MODEL --tasks T
plan on a login node:        python3 pipeline_eval_harness.py MODEL ... --dry-run   (in the planner)
"""

import os
import sys
from pathlib import Path

try:
    from pipeline.cli.evaluation import main
except ModuleNotFoundError:  # a login node's python3 without the suite: start again in the venv or the planner
    if os.environ.get("PIPELINE_ENTRY"):
        raise
    here = Path(__file__).resolve()
    os.execvp("bash", ["bash", str(here.parent / "src/pipeline/common/entry.sh"), "job", str(here), *sys.argv[1:]])

if __name__ == "__main__":
    sys.exit(main())
