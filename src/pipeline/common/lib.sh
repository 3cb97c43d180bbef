# shellcheck shell=bash
# Shared shell helpers for the pipeline_* launchers. Source it after setting PIPELINE_ROOT:
#   PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
#   source "$PIPELINE_ROOT/src/pipeline/common/lib.sh"
# It loads pipeline_env_config.env and defines log_info/log_warn/log_error, die, usage, require_env,
# run_in_env.

: "${PIPELINE_ROOT:?PIPELINE_ROOT must be set before sourcing lib.sh}"
# shellcheck source=../../../pipeline_env_config.env
source "$PIPELINE_ROOT/pipeline_env_config.env"
# Batch and CI environments may not set USER; ch-run refuses to start without it.
export USER="${USER:-$(id -un)}"

_log_tag() { printf '%s [%s:r%s]' "$(date +%H:%M:%S)" "${SLURMD_NODENAME:-$(hostname -s 2>/dev/null || echo localhost)}" "${SLURM_NODEID:-${NODE_RANK:-0}}"; }
log_info()  { echo "$(_log_tag) INFO $*" >&2; }
log_warn()  { echo "$(_log_tag) WARN $*" >&2; }
log_error() { echo "$(_log_tag) ERROR $*" >&2; }
die() { local code="${2:-1}"; echo "error: $1" >&2; exit "$code"; }

# usage FILE: print FILE's header comment (its usage) - every comment line after the shebang up to the first
# line of code, without "#SBATCH" directives and without the "# " prefix.
usage() { awk 'NR == 1 && /^#!/ { next } /^#SBATCH/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$1"; }

# Marker directory of completed env setup steps.
env_steps_dir() { dirname "$PIPELINE_ENV_READY"; }

# The host's python3 with this checkout's src/ on its path, for the standard-library-only helpers (runtimes,
# requeue decisions) that run before, or without, any environment: the venv that has the suite installed may not
# exist yet, and the container's Python is not the batch host's.
host_python() { PYTHONPATH="$PIPELINE_ROOT/src${PYTHONPATH:+:$PYTHONPATH}" python3 "$@"; }
_runtimes() { host_python -m pipeline.env.runtimes "$@"; }

# Refuse to start without a complete environment (venv, or container image + plugin + overlay), and say
# how to make it. No silent fallback to another runtime.
require_env() {
  [[ -n "${PIPELINE_IN_CONTAINER:-}" ]] && return 0
  _runtimes check || exit 1
}

# exec_in_runtime "COMMAND": run the shell command inside the configured container, checked (the fix printed,
# exit 1), prepared and rendered by one Python start (replaces the current process).
exec_in_runtime() {
  local argv=()
  mapfile -d '' argv < <(_runtimes enter -- "$1")
  wait "$!" || exit 1
  exec "${argv[@]}"
}

# Run a command inside the configured environment (replaces the current process). The venv needs no Python start
# before the command's own: pipeline_env_activate.sh checks it (the same fix as `_runtimes check`).
run_in_env() {
  if [[ "$PIPELINE_RUNTIME" == venv || -n "${PIPELINE_IN_CONTAINER:-}" ]]; then
    # shellcheck source=../../../pipeline_env_activate.sh
    source "$PIPELINE_ROOT/pipeline_env_activate.sh" || exit 1
    exec "$@"
  fi
  local cmd
  printf -v cmd '%q ' "$@"
  exec_in_runtime "source $(printf '%q' "$PIPELINE_ROOT/pipeline_env_activate.sh") && exec $cmd"
}

# The one command that makes somewhere to plan on this machine: the venv on a venv machine, else (a container
# runtime's login node) the login node's planner.
env_fix() {
  if [[ "$PIPELINE_RUNTIME" == venv ]]; then
    echo "create the pipeline venv with: bash $PIPELINE_ROOT/pipeline_env_setup.sh"
  else
    local py="$PIPELINE_PLANNER_VENV/bin/python"
    if [[ ( -e "$py" || -L "$py" ) && ! -x "$py" ]]; then
      # a teammate's planner, made from a Python only its maker may run (a private home, a private conda)
      echo "the planner at $PIPELINE_PLANNER_VENV (PIPELINE_PLANNER_VENV) cannot be run by you: its Python $(readlink -m "$py") is not yours to run; make your own with: PIPELINE_PLANNER_VENV=\$HOME/.cache/pipeline/planner ${PIPELINE_CLUSTER:+PIPELINE_CLUSTER=$PIPELINE_CLUSTER }bash $PIPELINE_ROOT/pipeline_env_setup.sh --only planner, and export that PIPELINE_PLANNER_VENV"
    else
      echo "create the planner with: ${PIPELINE_CLUSTER:+PIPELINE_CLUSTER=$PIPELINE_CLUSTER }bash $PIPELINE_ROOT/pipeline_env_setup.sh --only planner (it is made at PIPELINE_PLANNER_VENV=$PIPELINE_PLANNER_VENV)"
    fi
  fi
}

# The login node's planner, when it exists, runs "python ARGS..." from this checkout's src/ (replaces the process).
_exec_in_planner() {
  [[ -x "$PIPELINE_PLANNER_VENV/bin/python" ]] || return 0
  shift  # "python"
  PYTHONPATH="$PIPELINE_ROOT/src${PYTHONPATH:+:$PYTHONPATH}" exec "$PIPELINE_PLANNER_VENV/bin/python" "$@"
}

_wants_help() { local a; for a in "$@"; do [[ "$a" == -h || "$a" == --help ]] && return 0; done; return 1; }

# Plan only (a --dry-run, or --help): in the job's environment when it is complete, else - a cluster's login node,
# where the container does not run - in the login node's planner (pipeline_env_setup.sh --only planner), which
# imports everything a plan needs and no torch. With neither, --help is the script's header and a plan is refused
# in one line naming the command that makes the planner (exit 2: the planner is never made silently, it takes
# minutes and the network). Usage: plan_in_env python -m MODULE ARGS...
plan_in_env() {
  if [[ -n "${PIPELINE_IN_CONTAINER:-}" ]] || _runtimes check >/dev/null 2>&1; then run_in_env "$@"; fi
  _exec_in_planner "$@"
  if _wants_help "$@"; then usage "$0"; exit 0; fi
  die "no pipeline environment or login-node planner here to plan in; $(env_fix)" 2
}

# py_usage FILE: a top-level Python entry point's header (its module docstring, without the quotes).
py_usage() {
  awk '!n && /"""/ { n = 1; sub(/^[^"]*"""/, ""); if (sub(/""".*/, "")) { print; exit } if ($0 != "") print; next }
       n && /"""/ { sub(/""".*/, ""); if ($0 != "") print; exit }
       n { print }' "$1"
}

# python_entry host|job FILE ARGS...: a top-level pipeline_*.py started by a Python that cannot import the suite
# (a login node's system python3; src/pipeline/common/entry.sh). A job entry (data, coherence) runs in the job's
# environment, and plans (--dry-run, --help) as plan_in_env does; a host entry (experiments: it plans and calls
# sbatch, so it never runs in the container) runs in the venv when the venv is complete, else in the planner.
python_entry() {
  local where="$1" file="$2"; shift 2
  if [[ "$where" == job ]]; then
    _wants_help "$@" || [[ " $* " == *" --dry-run "* ]] || run_in_env python "$file" "$@"
    if [[ -n "${PIPELINE_IN_CONTAINER:-}" ]] || _runtimes check >/dev/null 2>&1; then run_in_env python "$file" "$@"; fi
  elif [[ "$PIPELINE_RUNTIME" == venv ]] && _runtimes check >/dev/null 2>&1; then
    run_in_env python "$file" "$@"
  fi
  _exec_in_planner python "$file" "$@"
  if _wants_help "$@"; then py_usage "$file"; exit 0; fi
  die "$(basename "$file") cannot run here: no pipeline venv or login-node planner; $(env_fix)" 2
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
