# shellcheck shell=bash
# pipeline_env_activate.sh - source this to enter the pipeline environment in the current shell.
#   source pipeline_env_activate.sh || exit 1
# Puts the venv's python first on PATH (the suite is installed in it, editable), and exports every knob
# of pipeline_env_config.env. Inside the Apptainer container the NGC image's own Python runs, with the overlay
# and this checkout's src/ on PYTHONPATH: nothing can be installed into the image. Returns 1 (and prints the fix) when the environment is missing.

PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PIPELINE_ROOT
# shellcheck source=pipeline_env_config.env
source "$PIPELINE_ROOT/pipeline_env_config.env"
if [[ "${PIPELINE_IN_CONTAINER:-}" == apptainer ]]; then
  # Inside the NGC image: its Python, plus the overlay (pinned Megatron Bridge) and this checkout.
  export PYTHONPATH="$PIPELINE_ROOT/src:$PIPELINE_OVERLAY${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  # shellcheck disable=SC2317  # exit: only when executed instead of sourced
  return 0 2>/dev/null || exit 0
fi
if [[ ! -x "$PIPELINE_VENV/bin/python" || ! -f "$PIPELINE_ENV_READY" ]]; then
  echo "error: the environment is missing or incomplete ($PIPELINE_VENV); create it with: bash $PIPELINE_ROOT/pipeline_env_setup.sh" >&2
  # shellcheck disable=SC2317  # exit: only when executed instead of sourced
  return 1 2>/dev/null || exit 1
fi
export VIRTUAL_ENV="$PIPELINE_VENV"
export PATH="$PIPELINE_VENV/bin:$PATH"
export PYTHONUNBUFFERED=1
