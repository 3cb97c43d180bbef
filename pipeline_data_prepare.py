#!/usr/bin/env python3
"""pipeline_data_prepare.py - data pipeline entry point (prepare | tokenize | pack); see --help.

Run inside the environment:  source pipeline_env_activate.sh && python pipeline_data_prepare.py --help
or through Slurm:            isambard_sbatch pipeline_data_submit.sbatch prepare --dataset ... --seq-length 8192
"""

import sys

from pipeline.cli.data import main

if __name__ == "__main__":
    sys.exit(main())
