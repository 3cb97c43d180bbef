#!/usr/bin/env bash
# entry.sh host|job FILE ARGS... - how a top-level pipeline_*.py starts again when the Python that ran it cannot
# import the suite (a login node's system python3): in the pipeline venv, the container or the login node's
# planner, as python_entry in lib.sh decides. The .py files exec it; no import-path edits anywhere (the suite is
# an installed package).
set -euo pipefail
PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
PIPELINE_ENTRY=1  # the started-again Python raises instead of coming back here
export PIPELINE_ROOT PIPELINE_ENTRY
source "$PIPELINE_ROOT/src/pipeline/common/lib.sh"
python_entry "$@"
