#!/usr/bin/env python3
"""pipeline_coherence_test.py - coherence pipeline entry point (generation tests); see --help.

Run inside the environment:  source pipeline_env_activate.sh && python pipeline_coherence_test.py MODEL
or through Slurm:            isambard_sbatch --gpus-per-node=1 pipeline_coherence_submit.sbatch MODEL
"""

import sys

from pipeline.cli.coherence import main

if __name__ == "__main__":
    sys.exit(main())
