#!/usr/bin/env bash
# Builds the Bridge harness venv: Python 3.11 + the CPU torch wheel + Megatron Bridge 0.6.2 /
# megatron-core 0.19.2 (their real code) + the pinned pure-Python dependencies, for tests/bridge.
#
#   bash tests/bridge/setup_env.sh          # idempotent: does nothing when the pins are unchanged
#
# Venv: $PIPELINE_ROOT/.cache/bridge-venv (PIPELINE_ROOT defaults to the repository root), a link to the venv
# built once per machine (tests/machine_cache.sh; PIPELINE_MACHINE_CACHE=off builds it in the checkout) and keyed
# by a hash of this script, requirements.txt + megatron.txt and the Python's version: any change of pins builds a
# new one; a fresh clone with unchanged pins links the machine's in a second.
# Why 3.11 and not 3.12 (which Bridge declares): on these machines only the 3.11 CPU torch wheel is
# local; 3.12 would download the 5 GB CUDA build. Bridge's only 3.12 feature on the imported paths is
# typing.override, which the harness shim backports (tests/bridge/shim/sitecustomize.py).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="${PIPELINE_ROOT:-$(cd "$HERE/../.." && pwd)}"
VENV="$ROOT/.cache/bridge-venv"
PYTHON="${BRIDGE_HARNESS_PYTHON:-python3.11}"
STAMP="$VENV/.harness-pins"

say() { echo "[bridge-harness setup] $*"; }

command -v "$PYTHON" >/dev/null || { say "ERROR: $PYTHON not found"; exit 3; }
KEY="$({ cat "$HERE/setup_env.sh" "$HERE/../machine_cache.sh" "$HERE/requirements.txt" "$HERE/megatron.txt" \
  "$HERE/ssm.txt" \
  "$ROOT/3rdparty/megatron-core-datasets.mk" "$ROOT/src/pipeline/env/overlay.py"; \
  "$PYTHON" --version; } | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" && -x "$VENV/bin/python" ]]; then
    say "venv $VENV is up to date (pins $KEY); nothing to do"
    exit 0
fi

build_harness() {
    local VENV="$1/venv"
    say "building $VENV with $("$PYTHON" --version 2>&1) (pins $KEY)"
    "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
    # The CPU torch wheel for 3.11 is on local disk (PIP_FIND_LINKS on these machines; /opt/wheels if unset).
    if [[ -z "${PIP_FIND_LINKS:-}" && -d /opt/wheels ]]; then PIP+=(--find-links /opt/wheels); fi

    t0=$SECONDS
    say "pip install --no-deps -r requirements.txt ($(grep -c '==' "$HERE/requirements.txt") pinned packages)"
    "${PIP[@]}" --no-deps -r "$HERE/requirements.txt" 2>&1 | grep -v "is ignored: it is neither" || true
    "$VENV/bin/python" -c "import torch, transformers; print('[bridge-harness setup] torch', torch.__version__, 'transformers', transformers.__version__)"

    MEG="$VENV/megatron-site"
    say "pip install --target $MEG (--no-deps --ignore-requires-python): $(grep -v '^#' "$HERE/megatron.txt" | xargs)"
    local pyver platform=()
    pyver="$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    for minor in $(seq 39 -1 17); do platform+=(--platform "manylinux_2_${minor}_$(uname -m)"); done
    "${PIP[@]}" --no-deps --ignore-requires-python --python-version "$pyver" --only-binary=:all: "${platform[@]}" \
        --target "$MEG" -r "$HERE/megatron.txt" 2>&1 | grep -v "is ignored: it is neither" || true
    # megatron-core's dataset-helpers Makefile, as every install of it gets (Bridge's compile_helpers runs make)
    "$VENV/bin/python" "$ROOT/src/pipeline/env/overlay.py" complete "$MEG"
    # The hybrid family's kernel packages (ssm.txt): their Python from the sdists, the CUDA builds skipped
    say "pip install --no-build-isolation --target $MEG (CUDA builds skipped): $(grep -v '^#' "$HERE/ssm.txt" | xargs)"
    "${PIP[@]}" "wheel==0.45.1"
    MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE \
        CAUSAL_CONV1D_FORCE_BUILD=TRUE "${PIP[@]}" --no-deps --no-build-isolation --target "$MEG" \
        -r "$HERE/ssm.txt" 2>&1 | grep -v "is ignored: it is neither" || true
    { test -d "$MEG/mamba_ssm" && test -d "$MEG/causal_conv1d"; } || { say "ERROR: mamba-ssm / causal-conv1d not installed in $MEG"; exit 1; }
    SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$MEG" > "$SITE/megatron-harness.pth"
    { test -d "$MEG/megatron/bridge" && test -d "$MEG/megatron/core"; } || { say "ERROR: megatron not installed in $MEG"; exit 1; }

    echo "$KEY" > "$VENV/.harness-pins"
    say "done in $((SECONDS - t0)) s"
}

# shellcheck source=../machine_cache.sh
source "$HERE/../machine_cache.sh"
machine_cache_build bridge-venv "$KEY" build_harness "$ROOT/.cache"
[[ "$CACHE_BUILT" == 1 ]] || say "the machine's harness venv $CACHE_ENTRY (pins $KEY) is reused"
link_atomically "$CACHE_ENTRY/venv" "$VENV"
say "$VENV links to $CACHE_ENTRY/venv"
