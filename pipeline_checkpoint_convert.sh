#!/usr/bin/env bash
# pipeline_checkpoint_convert.sh - checkpoint pipeline launcher (by hand inside salloc, or from the sbatch).
#
# Usage:
#   bash pipeline_checkpoint_convert.sh export CKPT_DIR --hf-model ID --reasoning|--no-reasoning \
#        [--iteration N] [--not-strict] [--push-to-hub]
#   bash pipeline_checkpoint_convert.sh import NAME|HF_ID [--output DIR] [--force] [--tp T --pp P --ep E]
#   bash pipeline_checkpoint_convert.sh upload-all CKPT_DIR --hf-model ID --no-reasoning [--poll] [--coherence] \
#        [--push-to-hub]   (without it nothing leaves this filesystem: each iteration goes to iter_N/hf/)
#   ... --dry-run [--nodes N] [--json]   the plan (layout, nodes, memory per GPU, launch line); needs no GPU
#
# Local-engine checkpoints convert in one process on CPU. Megatron checkpoints convert through Megatron
# Bridge's AutoBridge on one node's GPUs (one torchrun rank per GPU; Nano and Super default to EP=4); a Super
# import runs one torchrun per node it is given (the reference's --nodes=4: tp 1 pp 4 ep 4).
# Logic: src/pipeline/cli/checkpoint.py (the command line), src/pipeline/checkpoint/ (export, verify, poll, plan).
# Environment: pipeline_env_config.env.
set -euo pipefail
PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PIPELINE_ROOT
source "$PIPELINE_ROOT/src/pipeline/common/lib.sh"

if [[ $# -eq 0 ]]; then
  usage "$0"
  exit 2
fi
# A dry run (or --help) only plans: on a login node it runs in the planner when the job's environment is not there.
for arg in "$@"; do
  if [[ "$arg" == --dry-run || "$arg" == -h || "$arg" == --help ]]; then plan_in_env python -m pipeline.cli.checkpoint "$@"; fi
done
run_in_env python -m pipeline.cli.checkpoint "$@"
