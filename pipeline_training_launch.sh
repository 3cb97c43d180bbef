#!/usr/bin/env bash
# pipeline_training_launch.sh - start training on this node (by hand inside salloc, or from the sbatch).
#
# Usage:
#   bash pipeline_training_launch.sh CONFIG --model M --mode pretrain|cpt|sft [--peft lora] [--disable-ft]
#        [--dry-run] [--nodes N] [--cluster NAME] [--no-path-checks] [--max-restarts K] [hydra overrides...]
#   bash pipeline_training_launch.sh --list    # models (engine, recipes, HF id), modes, shipped configs
# Examples:
#   bash pipeline_training_launch.sh configs/local/smollm2_quickstart_sft.yaml --model smollm2-135m --mode sft
#   bash pipeline_training_launch.sh configs/quickstart/nemotron_nano_quickstart_sft.yaml --model nano --mode sft \
#        --dry-run --nodes 16 --no-path-checks train.train_iters=200
#
# The Python launcher (src/pipeline/training/launch.py) resolves the config, runs the preflight (exit 2 with
# one line per problem), writes the run records and execs torchrun / ft_launcher. Under Slurm the node
# count, node rank and rendezvous come from the allocation. Environment: pipeline_env_config.env.
set -euo pipefail
PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PIPELINE_ROOT
source "$PIPELINE_ROOT/src/pipeline/common/lib.sh"

if [[ $# -eq 0 || "$1" == "-h" || "$1" == "--help" ]]; then
  usage "$0"
  [[ $# -eq 0 ]] && exit 2 || exit 0
fi
# --list: models, modes and shipped configs (a plan: the planner is enough)
if [[ "$1" == --list ]]; then plan_in_env python -m pipeline.cli.train "$@"; fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
for arg in "$@"; do
  # A dry run only plans: on a login node it runs in the planner when the job's environment is not there.
  if [[ "$arg" == --dry-run ]]; then plan_in_env python -m pipeline.cli.train "$@"; fi
done
run_in_env python -m pipeline.cli.train "$@"
