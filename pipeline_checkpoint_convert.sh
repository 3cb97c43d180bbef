#!/usr/bin/env bash
# pipeline_checkpoint_convert.sh - checkpoint pipeline launcher (by hand inside salloc, or from the sbatch).
#
# Usage:
#   bash pipeline_checkpoint_convert.sh export CKPT_DIR --hf-model ID --reasoning|--no-reasoning \
#        [--iteration N] [--not-strict] [--push-to-hub]
#   bash pipeline_checkpoint_convert.sh import HF_ID [--output DIR]
#   bash pipeline_checkpoint_convert.sh upload-all CKPT_DIR --hf-model ID --no-reasoning [--poll] [--coherence]
#
# Local-engine checkpoints convert in one process on CPU. Megatron checkpoints convert through Megatron
# Bridge's AutoBridge on the node's GPUs (one torchrun rank per GPU, EP node-local).
# Logic: src/pipeline/checkpoint/cli.py. Environment: pipeline_env_config.env.
set -euo pipefail
PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PIPELINE_ROOT
source "$PIPELINE_ROOT/src/pipeline/common/lib.sh"

if [[ $# -eq 0 ]]; then
  usage "$0"
  exit 2
fi
run_in_env python -m pipeline.cli.checkpoint "$@"
