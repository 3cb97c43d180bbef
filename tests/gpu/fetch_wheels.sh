#!/usr/bin/env bash
# Downloads, here (with network), the wheels the GPU ready check carries to a GPU machine without network
# (tests/gpu/device_check.sh installs the ones that machine's Python lacks). Python 3.12, manylinux x86_64,
# binaries only, no dependency resolution: the pins come from tests/bridge/megatron.txt (megatron-core,
# megatron-bridge, megatron-energon, nvidia-resiliency-ext: Bridge's pretrain.py imports NVRx's inprocess module
# unguarded) and tests/bridge/requirements.txt (Bridge's pure-Python dependencies).
#
#   bash tests/gpu/fetch_wheels.sh [DIR]      # default DIR: .cache/gpu-wheels (ignored by git)
#
# Not carried: torch and transformers with their own dependencies (the GPU Python has them), and the large
# compiled packages (pyarrow, pandas, numpy): the total must stay under LIMIT_MIB (the device machine takes at
# most 64 MiB of files with the working tree).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
DEST="${1:-$ROOT/.cache/gpu-wheels}"
LIMIT_MIB=60
PY="${PYTHON:-python3}"
# Bridge's dependencies that a CUDA-torch + transformers Python may lack (names as in requirements.txt).
CARRY=(omegaconf hydra-core antlr4-python3-runtime einops braceexpand webdataset filetype pydantic pydantic_core
       annotated-types typing-inspection rich markdown-it-py mdurl Pygments typer click shellingham annotated-doc
       datasets dill multiprocess xxhash absl-py tensorboard protobuf defusedxml)

# Published as a source archive only (no wheel): built here into a pure-Python wheel (pip wheel --no-deps).
SDIST_ONLY=(antlr4-python3-runtime)

pins=()
built=()
while read -r line; do
    [[ "$line" =~ ^[A-Za-z0-9] ]] && pins+=("${line%%[[:space:]]*}")
done < "$HERE/../bridge/megatron.txt"
# The container overlay's pins (3rdparty/requirements-container.txt: transformers, huggingface-hub, tokenizers at
# the versions Bridge accepts, ...): device_check.sh installs these over a different installed version, as the
# overlay goes first on the container's path.
while read -r line; do
    [[ "$line" =~ ^[A-Za-z0-9] ]] && [[ " ${pins[*]} " != *" ${line%%[[:space:]]*} "* ]] && pins+=("${line%%[[:space:]]*}")
done < "$ROOT/3rdparty/requirements-container.txt"
for name in "${CARRY[@]}"; do
    pin="$(grep -i -E "^${name}==" "$HERE/../bridge/requirements.txt" | head -1 || true)"
    [[ -n "$pin" ]] || { echo "fetch_wheels: $name is not pinned in tests/bridge/requirements.txt" >&2; exit 1; }
    if [[ " ${SDIST_ONLY[*]} " == *" $name "* ]]; then built+=("$pin"); else pins+=("$pin"); fi
done

mkdir -p "$DEST"
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
echo "fetch_wheels: ${#pins[@]} wheels to download, ${#built[@]} to build -> $DEST"
# every manylinux tag down from glibc 2.39 (NVRx 0.6.0 is published for manylinux_2_39 only; pip matches tags
# exactly, so each is named)
platform=()
for minor in $(seq 39 -1 17); do platform+=(--platform "manylinux_2_${minor}_x86_64"); done
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${platform[@]}" --platform manylinux2014_x86_64 \
    --platform any -d "$DEST" "${pins[@]}" 2>&1 | quiet
(( PIPESTATUS[0] == 0 )) || { echo "fetch_wheels: ERROR: pip download failed" >&2; exit 1; }
if (( ${#built[@]} )); then
    "$PY" -m pip wheel --disable-pip-version-check -q --no-deps -w "$DEST" "${built[@]}" 2>&1 | quiet
    (( PIPESTATUS[0] == 0 )) || { echo "fetch_wheels: ERROR: pip wheel ${built[*]} failed" >&2; exit 1; }
fi
bytes="$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)"
mib=$(( (bytes + 1048575) / 1048576 ))
echo "fetch_wheels: $(find "$DEST" -name '*.whl' | wc -l) wheels, ${mib} MiB in $DEST (limit ${LIMIT_MIB} MiB)"
if (( mib > LIMIT_MIB )); then
    echo "fetch_wheels: ERROR: ${mib} MiB > ${LIMIT_MIB} MiB: the device machine takes at most 64 MiB" >&2
    exit 1
fi
echo "fetch_wheels: carry $DEST with the working tree to the GPU machine, then run: bash tests/gpu/device_check.sh"
