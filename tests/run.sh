#!/usr/bin/env bash
# tests/run.sh - the README's test command (CI runs it through .ci/run on a fresh clone).
#
# Usage: bash tests/run.sh [pytest args...]
#
# Installs everything the tests need (the pinned venv + test requirements, via pipeline_env_setup.sh),
# starts the local Slurm cluster, then runs pytest on two workers (tests/parallel.py; PIPELINE_TEST_WORKERS=0 for
# one process). pytest's "no tests collected" (exit 5) is a failure here,
# never a silent pass. Under CI=true (or for the tiers named in PIPELINE_REQUIRE_TIERS=slurm,bridge,...|all)
# a test tier that cannot start fails the run with one line naming the tier and the log to read; pytest's
# summary counts the tests each tier ran and skipped (tests/tiers.py).
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
# OpenMP threads that wait sleep instead of spinning: the two workers share two cores (tests/conftest.py, decision 88)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

# Which test tiers must run (tests/tiers.py): under CI=true every tier that can run here, plus those named in
# PIPELINE_REQUIRE_TIERS. A required tier that cannot start fails the run; any other is skipped, saying why.
python -m tests.tiers list >/dev/null || exit 2

# A real multi-node Slurm on this machine for the tests marked `slurm`: its own base directory and free ports,
# so it never meets another Slurm or another test run on this host.
if [[ -z "${PIPELINE_SLURM_BASE:-}" ]]; then
  PIPELINE_SLURM_BASE=$(mktemp -d /tmp/pslurm.XXXXXX)
  own_slurm_base=1
fi
export PIPELINE_SLURM_BASE
slurm_log=$(mktemp)
if bash tests/slurm/local_slurm.sh start 2>"$slurm_log"; then
  cat "$slurm_log" >&2
  eval "$(bash tests/slurm/local_slurm.sh env)"
  trap 'bash tests/slurm/local_slurm.sh stop || true; [[ -z "${own_slurm_base:-}" ]] || rm -rf "$PIPELINE_SLURM_BASE"' EXIT
else
  cat "$slurm_log" >&2
  reason=$(grep '^local_slurm: ' "$slurm_log" | tail -1 | sed 's/^local_slurm: \(error: \)\{0,1\}//')
  rm -f "$slurm_log"  # the cluster's base (and its logs, named in the reason) stays for reading
  line="test tier slurm cannot start: ${reason:-tests/slurm/local_slurm.sh start failed}"
  if python -m tests.tiers required slurm; then
    echo "error: $line [required: CI=true or PIPELINE_REQUIRE_TIERS]" >&2
    exit 1
  fi
  echo "warning: $line; tests marked slurm will be skipped" >&2
fi
rm -f "$slurm_log"

# Two pytest workers (tests/parallel.py): one runs the slurm tier's tests one after another (they mostly wait on
# their jobs) beside the other's computing; PIPELINE_TEST_WORKERS=0 runs every test in the one pytest process,
# and an -n on the command line wins.
set +e
python -m pytest -n "${PIPELINE_TEST_WORKERS:-2}" "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit $rc
