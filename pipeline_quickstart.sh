#!/usr/bin/env bash
# pipeline_quickstart.sh - the whole suite end to end on one machine (no GPU, no internet).
#
# Usage:
#   bash pipeline_quickstart.sh            # SmolLM2-135M-Instruct SFT on the chatterbot corpus (~3-4 min, 2 cores)
#   bash pipeline_quickstart.sh --tiny     # the same chain with a tiny random-initialised MoE model (~1 min)
#
# The last step evaluates the export with lm-evaluation-harness on the local task pipeline_smoke (its data ships in
# configs/eval/tasks/: it checks the evaluation path, not model quality; EVAL_LIMIT questions, default 8).
# Each step is one of the pipelines' own commands, exactly as you would type them; run it again and
# every finished step is skipped with a message. Knobs: pipeline_env_config.env (PIPELINE_DATA_ROOT,
# PIPELINE_RUNS_DIR, WANDB_DIR, ...); W&B runs offline unless WANDB_API_KEY is set.
set -euo pipefail
PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PIPELINE_ROOT
cd "$PIPELINE_ROOT"

MODEL=smollm2-135m; CONFIG=configs/local/smollm2_quickstart_sft.yaml; HF_MODEL=HuggingFaceTB/SmolLM2-135M-Instruct
SEQ=256; MAX_TOKENS=64; EXTRA_COHERENCE=(); EVAL_LIMIT="${EVAL_LIMIT:-8}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tiny) MODEL=tiny-nemotronh-moe; CONFIG=configs/local/tiny_moe_sft.yaml; HF_MODEL=pipeline/tiny-nemotronh-moe
            MAX_TOKENS=16; EXTRA_COHERENCE=(--allow-empty) ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

declare -a TIMES=()
step() {  # step NAME CMD...: run one pipeline command, time it
  local name="$1"; shift
  echo; echo "=== quickstart: $name ==="; echo "\$ $*"
  local t0=$SECONDS
  "$@"
  TIMES+=("$name: $((SECONDS - t0)) s")
}

step "env setup" bash pipeline_env_setup.sh
source pipeline_env_activate.sh

step "data prepare" python pipeline_data_prepare.py prepare --dataset chatterbot-corpus --seq-length "$SEQ"
step "training" bash pipeline_training_launch.sh "$CONFIG" --model "$MODEL" --mode sft --disable-ft

EXP="$(python -c "import sys; from pipeline.config.loader import load_config; print(load_config(sys.argv[1]).logger.wandb_exp_name)" "$CONFIG")"
RUN_DIR="$PIPELINE_RUNS_DIR/$EXP"
CKPT="$RUN_DIR/checkpoints"
step "checkpoint export" bash pipeline_checkpoint_convert.sh export "$CKPT" --hf-model "$HF_MODEL" --no-reasoning
ITER="$(cat "$CKPT/latest_checkpointed_iteration.txt")"
HF_DIR="$CKPT/$(printf 'iter_%07d' "$ITER")/hf"
if [[ -f "$HF_DIR/coherence/coherence_hf.json" ]]; then
  echo; echo "=== quickstart: coherence test ==="
  echo "already done: $HF_DIR/coherence/coherence_hf.json (delete it to rerun)"
else
  step "coherence test" python pipeline_coherence_test.py "$HF_DIR" --max-tokens "$MAX_TOKENS" "${EXTRA_COHERENCE[@]}"
fi
if [[ -f "$HF_DIR/eval/pipeline_smoke.json" ]]; then
  echo; echo "=== quickstart: evaluation ==="
  echo "already done: $HF_DIR/eval/pipeline_smoke.json (delete it to rerun)"
else
  step "evaluation" python pipeline_eval_harness.py "$HF_DIR" --tasks pipeline_smoke --limit "$EVAL_LIMIT"
fi

cat <<EOT

=== quickstart: done ===
prepared data      $PIPELINE_DATA_ROOT/chatterbot-corpus/packed/
training run       $RUN_DIR  (config.yaml, manifest.json, progress.ndjson, metrics_summary.json)
checkpoints        $CKPT  (latest: iter $ITER)
Hugging Face model $HF_DIR  (verification.json)
coherence report   $HF_DIR/coherence/coherence_hf.md  (and .json)
evaluation         $HF_DIR/eval/pipeline_smoke.json  (lm-eval results on the local task: the path, not quality)
W&B (offline)      $WANDB_DIR/wandb/  (upload later: wandb sync $WANDB_DIR/wandb/offline-run-*)
step times         $(printf '%s; ' "${TIMES[@]}")
EOT
