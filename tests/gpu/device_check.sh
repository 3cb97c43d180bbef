#!/usr/bin/env bash
# The GPU ready check (issue 32): on one GPU machine with a CUDA-torch Python, in at most 10 minutes, the suite's GPU
# paths end to end (pipeline.env.device_check; `validate --run-training` runs the same checks on the cluster):
#
#   bridge-train-resume   a few steps of the Bridge engine on a tiny GPT, save-and-exit, resume to the end
#   export-verify         a tiny Llama imported to Megatron, exported back to Hugging Face and verified
#   megatron-generate     megatron-backend greedy generation == Hugging Face greedy of the same weights
#   bridge-sft-resume     finetune() of the Nano quickstart shrunk to that tiny model, on our packs: stop, resume,
#                         losses equal to an uninterrupted run's (skipped without Transformer Engine)
#
# One line per check, `device_check: NAME PASS|FAIL|SKIP (detail)`, then `device_check: N passed, M failed`.
# Exit 0 all passed, 1 a check failed, 2 refused (no CUDA GPU visible, no torch, bad arguments).
#
# The Python: $PYTHON, else python3 (the container's, or any Python 3.12 with CUDA torch and transformers). What it
# lacks of Bridge's stack comes from the wheel folder (tests/gpu/fetch_wheels.sh fills .cache/gpu-wheels, with
# network), installed with --no-deps --no-index into a temporary site folder first on the path; a wheel whose
# distribution the Python already has is not installed, except the container overlay's pins
# (3rdparty/requirements-container.txt) at another version, which go first as the overlay does in the container. Without Transformer Engine, tests/gpu/no_te goes on PYTHONPATH (the import shim and
# megatron-core's local layer spec; read its header), and the script says so.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: bash tests/gpu/device_check.sh [--wheels DIR] [--work DIR] [--only CHECK]... [--help]

  --wheels DIR   wheels to install where missing (default: .cache/gpu-wheels, from tests/gpu/fetch_wheels.sh)
  --work DIR     working folder (default: a new temporary folder)
  --only CHECK   bridge-train-resume | export-verify | megatron-generate | bridge-sft-resume (repeatable)
  PYTHON=...     the Python to use (default python3)
Prints one line per check and a total; exit 0 all passed, 1 a check failed, 2 refused (no CUDA GPU).
EOF
}

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS="$ROOT/.cache/gpu-wheels"
WORK=""
ONLY=()
TOTAL_LIMIT=580  # seconds for the checks; with the install, within 10 minutes

while (( $# )); do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --wheels) WHEELS="${2:?--wheels needs a folder}"; shift 2 ;;
        --work) WORK="${2:?--work needs a folder}"; shift 2 ;;
        --only) ONLY+=(--only "${2:?--only needs a check name}"); shift 2 ;;
        *) echo "device_check: refused: unknown argument $1 (--help)"; exit 2 ;;
    esac
done

# Refuse in one line where no CUDA GPU is visible (nothing installed, nothing written).
why="$("$PY" -c 'import torch, sys; ok = torch.cuda.is_available(); print("" if ok else "torch " + torch.__version__
+ " sees no CUDA device"); sys.exit(0 if ok else 3)' 2>/dev/null)"
case $? in
    0) ;;
    3) echo "device_check: refused: no CUDA GPU visible ($why); run it on a GPU machine"; exit 2 ;;
    *) echo "device_check: refused: $PY cannot import torch (set PYTHON to a CUDA-torch Python)"; exit 2 ;;
esac

SITE="$(mktemp -d "${TMPDIR:-/tmp}/device-check-site.XXXXXX")"
trap 'rm -rf "$SITE"' EXIT
missing=()
if [[ -d "$WHEELS" ]]; then
    # a wheel's distribution name: the file name up to the first '-', normalised as importlib.metadata reads it
    while read -r whl; do
        missing+=("$whl")
    done < <("$PY" - "$WHEELS" "$ROOT/3rdparty/requirements-container.txt" <<'PYEOF'
import importlib.metadata as md, pathlib, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
overlay = {norm(line.split("==")[0]) for line in pathlib.Path(sys.argv[2]).read_text().splitlines()
           if "==" in line and not line.startswith("#")}
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = norm(whl.name.split("-")[0]), whl.name.split("-")[1]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        print(whl)
        continue
    if name in overlay and have != version:  # the container's overlay pin goes first on the path there too
        print(whl)
PYEOF
)
fi
if (( ${#missing[@]} )); then
    # --platform (with --target): NVRx's wheel is tagged manylinux_2_39; its pure-Python parts (what Bridge
    # imports) load on any glibc
    platform=(--only-binary=:all: --python-version "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')")
    for minor in $(seq 39 -1 17); do platform+=(--platform "manylinux_2_${minor}_$(uname -m)"); done
    if ! out="$("$PY" -m pip install --disable-pip-version-check -q --no-deps --no-index --target "$SITE" \
            "${platform[@]}" --platform manylinux2014_"$(uname -m)" --platform any "${missing[@]}" 2>&1)"; then
        echo "device_check: install FAIL (pip install --no-deps --no-index --target: $(tail -1 <<<"$out"))"
        echo "device_check: 0 passed, 1 failed"
        exit 1
    fi
    echo "device_check: installed ${#missing[@]} wheel(s) this Python lacks from $WHEELS into $SITE"
    if [[ -d "$SITE/megatron/core/datasets" ]]; then  # as every install of megatron-core gets it
        "$PY" "$ROOT/src/pipeline/env/overlay.py" complete "$SITE" | sed 's/^overlay:/device_check: overlay:/'
    fi
else
    echo "device_check: no wheels installed (${WHEELS} absent or this Python has every one)"
fi

PYPATH="$ROOT/src:$SITE"
if PYTHONPATH="$PYPATH" "$PY" -c 'import transformer_engine' >/dev/null 2>&1; then
    echo "device_check: transformer_engine importable: Bridge's own layer spec, no shim"
else
    PYPATH="$HERE/no_te:$PYPATH"
    echo "device_check: transformer_engine not importable: tests/gpu/no_te on PYTHONPATH (the Bridge import shim" \
         "for GPU-only packages, megatron-core's local layer spec, kernel fusions off)"
fi

export PYTHONPATH="$PYPATH${PYTHONPATH:+:$PYTHONPATH}"
export PIPELINE_ROOT="$ROOT" HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
args=("${ONLY[@]}")
[[ -n "$WORK" ]] && args+=(--work "$WORK")
timeout --kill-after=15 "$TOTAL_LIMIT" "$PY" -m pipeline.env.device_check "${args[@]}"
rc=$?
if (( rc == 124 || rc == 137 )); then
    echo "device_check: total FAIL (the checks ran past ${TOTAL_LIMIT}s and were stopped)"
    echo "device_check: 0 passed, 1 failed"
    exit 1
fi
exit "$rc"
