#!/usr/bin/env python3
"""pipeline_coherence_test.py - coherence pipeline entry point (generation tests); see --help.

Run inside the environment:  source pipeline_env_activate.sh && python pipeline_coherence_test.py MODEL
or through Slurm:            isambard_sbatch --gpus-per-node=1 pipeline_coherence_submit.sbatch MODEL
plan on a login node:        $PIPELINE_PLANNER_VENV/bin/python pipeline_coherence_test.py MODEL ... --dry-run
"""

import sys
from pathlib import Path

try:
    from pipeline.cli.coherence import main
except ImportError:  # the login node's planner (no editable install): plan from this checkout's src/
    sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))
    from pipeline.cli.coherence import main

if __name__ == "__main__":
    sys.exit(main())
