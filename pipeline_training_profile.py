#!/usr/bin/env python3
"""pipeline_training_profile.py - summarise a torch.profiler trace of a training run; see --help, docs/profiling.md.

  python pipeline_training_profile.py $PIPELINE_RUNS_DIR/tiny_moe_sft            # the run's trace (rank 0)
  python pipeline_training_profile.py RUN_DIR/torch_profile/rank-0.json.gz --top 20 --plot mem.png
"""

import os
import sys
from pathlib import Path

try:
    from pipeline.cli.profile import main
except ModuleNotFoundError:  # a login node's python3 without the suite: start again in the venv or the planner
    if os.environ.get("PIPELINE_ENTRY"):
        raise
    here = Path(__file__).resolve()
    os.execvp("bash", ["bash", str(here.parent / "src/pipeline/common/entry.sh"), "host", str(here), *sys.argv[1:]])

if __name__ == "__main__":
    sys.exit(main())
