# shellcheck shell=bash
# Shared shell helpers for the pipeline_* launchers. Source it after setting PIPELINE_ROOT:
#   PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
#   source "$PIPELINE_ROOT/src/pipeline/common/lib.sh"
# It loads pipeline_env_config.env and defines log_info/log_warn/log_error, die, require_env,
# run_in_env.

: "${PIPELINE_ROOT:?PIPELINE_ROOT must be set before sourcing lib.sh}"
# shellcheck source=../../../pipeline_env_config.env
source "$PIPELINE_ROOT/pipeline_env_config.env"

_log_tag() { printf '%s [%s:r%s]' "$(date +%H:%M:%S)" "${SLURMD_NODENAME:-$(hostname -s 2>/dev/null || echo localhost)}" "${SLURM_NODEID:-${NODE_RANK:-0}}"; }
log_info()  { echo "$(_log_tag) INFO $*" >&2; }
log_warn()  { echo "$(_log_tag) WARN $*" >&2; }
log_error() { echo "$(_log_tag) ERROR $*" >&2; }
die() { local code="${2:-1}"; echo "error: $1" >&2; exit "$code"; }

# Marker directory of completed env setup steps.
env_steps_dir() { echo "$PIPELINE_VENV/.pipeline_steps"; }

# Refuse to start without a complete environment, and say how to make one.
require_env() {
  case "$PIPELINE_RUNTIME" in
    venv)
      if [[ ! -x "$PIPELINE_VENV/bin/python" || ! -f "$(env_steps_dir)/packages.done" ]]; then
        die "the environment is missing or incomplete ($PIPELINE_VENV); create it with: bash $PIPELINE_ROOT/pipeline_env_setup.sh" 1
      fi ;;
    *) die "unknown PIPELINE_RUNTIME '$PIPELINE_RUNTIME' (expected: venv); fix pipeline_env_config.env" 2 ;;
  esac
}

# Run a command inside the configured environment (replaces the current process).
run_in_env() {
  require_env
  # shellcheck source=../../../pipeline_env_activate.sh
  source "$PIPELINE_ROOT/pipeline_env_activate.sh"
  exec "$@"
}

with_retries() {
  local tries="$1"; shift
  local n=1
  until "$@"; do
    if (( n >= tries )); then return 1; fi
    log_warn "attempt $n/$tries failed: $*; retrying in $((n * 2))s"
    sleep $((n * 2)); n=$((n + 1))
  done
}
