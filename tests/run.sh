#!/usr/bin/env bash
# tests/run.sh - the README's test command (CI runs it through .ci/run on a fresh clone).
#
# Usage: bash tests/run.sh [pytest args...]
#
# Installs everything the tests need (the pinned venv + test requirements, via pipeline_env_setup.sh),
# then runs pytest. pytest's "no tests collected" (exit 5) is a failure here, never a silent pass.
set -euo pipefail
PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$PIPELINE_ROOT"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0; fi

bash pipeline_env_setup.sh --with-tests
# The shell linter (tests/unit/test_lint.py) comes from Debian's packages, pinned.
SHELLCHECK_VERSION=0.9.0-1
if ! command -v shellcheck >/dev/null && [[ $(id -u) -eq 0 ]]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "shellcheck=$SHELLCHECK_VERSION"; } >/dev/null \
    || echo "warning: could not install shellcheck $SHELLCHECK_VERSION; tests/unit/test_lint.py will fail" >&2
fi
# shellcheck source=../pipeline_env_activate.sh
source pipeline_env_activate.sh
export HF_HUB_OFFLINE=1 WANDB_MODE=offline

# A real multi-node Slurm on this machine for the tests marked `slurm` (they skip, saying why, without it).
if bash tests/slurm/local_slurm.sh start; then
  eval "$(bash tests/slurm/local_slurm.sh env)"
  trap 'bash tests/slurm/local_slurm.sh stop || true' EXIT
else
  echo "warning: the local Slurm cluster could not be started; tests marked slurm will be skipped" >&2
fi

set +e
python -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit $rc
