#!/usr/bin/env bash
# pipeline_env_exec.sh - run a shell command inside the configured environment.
#
# Usage: ./pipeline_env_exec.sh "COMMAND"
#
#   ./pipeline_env_exec.sh "cd $PWD; source pipeline_env_activate.sh || exit 1; python -c 'import torch'"
#   ./pipeline_env_exec.sh "source pipeline_env_activate.sh && exec bash -i"
#
# The command string runs under `bash -c` with every knob of pipeline_env_config.env exported;
# with PIPELINE_RUNTIME=venv it runs on the host (activate the venv inside the command, as above).
set -euo pipefail
PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PIPELINE_ROOT
source "$PIPELINE_ROOT/src/pipeline/common/lib.sh"

if [[ $# -eq 0 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
  [[ $# -eq 0 ]] && exit 2 || exit 0
fi
require_env
cd "$PIPELINE_ROOT"
exec bash -c "$*"
