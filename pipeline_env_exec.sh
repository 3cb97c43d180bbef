#!/usr/bin/env bash
# pipeline_env_exec.sh - run a command inside the configured environment.
#
# Usage: ./pipeline_env_exec.sh -- PROGRAM [ARGS...]    # the environment activated, PROGRAM exec'd with ARGS as given
#        ./pipeline_env_exec.sh "COMMAND"               # a shell command string, run under bash -c
#
#   ./pipeline_env_exec.sh -- python -m pipeline.cli.data prepare --dataset chatterbot-corpus --seq-length 256
#   ./pipeline_env_exec.sh "cd $PWD; source pipeline_env_activate.sh || exit 1; python -c 'import torch'"
#   ./pipeline_env_exec.sh "source pipeline_env_activate.sh && exec bash -i"
#
# Both run inside the configured runtime (PIPELINE_RUNTIME: venv on the host,
# apptainer or charliecloud in the container, with the binds and environment of pipeline_env_config.env).
set -euo pipefail
PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PIPELINE_ROOT
source "$PIPELINE_ROOT/src/pipeline/common/lib.sh"

if [[ $# -eq 0 || "$1" == "-h" || "$1" == "--help" ]]; then
  usage "$0"
  [[ $# -eq 0 ]] && exit 2 || exit 0
fi
cd "$PIPELINE_ROOT"
if [[ "$1" == "--" ]]; then
  shift
  [[ $# -ge 1 ]] || die "nothing to run after -- (see --help)" 2
  run_in_env "$@"
fi
if [[ -n "${PIPELINE_IN_CONTAINER:-}" ]]; then exec bash -c "$*"; fi
exec_in_runtime "$*"
