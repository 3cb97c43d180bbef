#!/usr/bin/env python3
"""pipeline_data_prepare.py - data pipeline entry point (prepare | tokenize | pack); see --help.

Run inside the environment:  source pipeline_env_activate.sh && python pipeline_data_prepare.py --help
or through Slurm:            isambard_sbatch pipeline_data_submit.sbatch prepare --dataset ... --seq-length 8192
"""

import os
import sys
from pathlib import Path

try:
    from pipeline.cli.data import main
except ModuleNotFoundError:  # a login node's python3 without the suite: start again in the venv or the planner
    if os.environ.get("PIPELINE_ENTRY"):
        raise
    here = Path(__file__).resolve()
    os.execvp("bash", ["bash", str(here.parent / "src/pipeline/common/entry.sh"), "job", str(here), *sys.argv[1:]])

if __name__ == "__main__":
    sys.exit(main())
