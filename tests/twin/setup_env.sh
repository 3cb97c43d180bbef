#!/usr/bin/env bash
# Builds the container twin: what a job's Python sees inside the cluster container, on this CPU machine.
#
#   bash tests/twin/setup_env.sh          # idempotent: does nothing when the pins are unchanged
#
# Built once per machine (tests/machine_cache.sh): the venv and the overlay live in the machine's cache at
# twin/KEY, KEY the hash of this script, both lock files, the Python's version and TWIN_TORCH; the checkout's
# .cache/twin-venv and .cache/twin-overlay are links to them. A fresh clone with unchanged pins links in a second;
# two runs at once build it once (a flock); changed pins build a new entry.
#
#   image stand-in  .cache/twin-venv: a CPython 3.12 venv (the NGC image's Python) with the recorded image
#                   packages (3rdparty/image-packages.txt, --no-deps), except NVIDIA's own builds:
#                     torch              PyPI's torch $TWIN_TORCH (the CUDA build, run on CPU) for NVIDIA's
#                     NVRx 0.6.0         its glibc-2.39 wheel unpacked with --target (this machine has glibc
#                                        2.36: its pure-Python parts import, its C extension does not)
#                     Transformer Engine, apex, flash-attn, mamba-ssm, causal-conv1d, fast-hadamard-transform,
#                     torchvision, triton's NVIDIA build: absent (GPU kernels; megatron-core falls back to its
#                     local layer specs; triton comes as PyPI torch's own dependency)
#   overlay         .cache/twin-overlay: 3rdparty/requirements-container.txt installed exactly as the env
#                   setup's overlay step does, by the same script (src/pipeline/env/overlay.py install: the pins
#                   as wheels, source-only ones built, pip install --no-deps --target, then megatron-core's
#                   dataset-helpers Makefile), with the twin's CPython 3.12 on this machine's architecture
# tests/twin/ puts the overlay and src/ first on PYTHONPATH, as pipeline_env_activate.sh does in the container.
# Knobs: TWIN_PYTHON (a CPython 3.12; default python3.12, else pyenv's 3.12), TWIN_TORCH (2.13.0),
# PIPELINE_MACHINE_CACHE (the machine's cache; off: build inside the checkout).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="${PIPELINE_ROOT:-$(cd "$HERE/../.." && pwd)}"
VENV="$ROOT/.cache/twin-venv"
OVERLAY="$ROOT/.cache/twin-overlay"
TORCH="${TWIN_TORCH:-2.13.0}"
STAMP="$VENV/.twin-pins"
IMAGE_LIST="$ROOT/3rdparty/image-packages.txt"
OVERLAY_PINS="$ROOT/3rdparty/requirements-container.txt"
# NVIDIA's builds in the image, never installed from PyPI here (torch comes separately; see the header).
NVIDIA_BUILDS="torch|torchvision|torchaudio|triton|pytorch-triton|transformer-engine|apex|flash-attn|mamba-ssm|causal-conv1d|fast-hadamard-transform|nvidia-resiliency-ext"

say() { echo "[twin setup] $*"; }
die() { say "ERROR: $*" >&2; exit 3; }

find_python() {
  if [[ -n "${TWIN_PYTHON:-}" ]]; then echo "$TWIN_PYTHON"; return; fi
  local p
  for p in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$p"; return
    fi
  done
}
PYTHON="$(find_python)"
[[ -n "$PYTHON" ]] || die "no CPython 3.12 found (python3.12 or pyenv's 3.12; set TWIN_PYTHON)"

PLATFORM=()
for minor in $(seq 39 -1 17); do PLATFORM+=(--platform "manylinux_2_${minor}_$(uname -m)"); done
PLATFORM+=(--platform "manylinux2014_$(uname -m)" --platform "linux_$(uname -m)")

KEY="$({ cat "$HERE/setup_env.sh" "$HERE/../machine_cache.sh" "$IMAGE_LIST" "$OVERLAY_PINS" \
  "$ROOT/3rdparty/megatron-core-datasets.mk" "$ROOT/src/pipeline/env/overlay.py"; "$PYTHON" --version; } \
  | sha256sum | cut -c1-16)-$TORCH"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" && -x "$VENV/bin/python" && -d "$OVERLAY/megatron" ]]; then
  say "twin $VENV + $OVERLAY is up to date (pins $KEY); nothing to do"
  exit 0
fi
# shellcheck source=../machine_cache.sh
source "$HERE/../machine_cache.sh"
build_twin() {
  local VENV="$1/venv" OVERLAY="$1/overlay"
  t0=$SECONDS
  say "building the image stand-in $VENV with $("$PYTHON" --version 2>&1) (pins $KEY)"
  rm -rf "$VENV" "$OVERLAY"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
  quiet() { grep -v "is ignored: it is neither" || true; }
  # pip's machine-wide cap (torch<=2.14.1 on these machines) applies here as anywhere: TWIN_TORCH stays under it.
  # The image stand-in's packages go in with uv when the suite's venv has it (several times faster on torch's CUDA
  # libraries; pip's sources, src/pipeline/env/installer.py), else with pip. The overlay below is always pip: it is
  # what the env setup's overlay step runs in the container.
  IMAGE_PIP=("${PIP[@]}")
  if [[ -x "$ROOT/.venv/bin/uv" ]]; then
    mapfile -t UV_SOURCES < <("$VENV/bin/python" "$ROOT/src/pipeline/env/installer.py" uv-sources)
    IMAGE_PIP=("$ROOT/.venv/bin/uv" pip install --quiet --compile-bytecode --python "$VENV/bin/python" "${UV_SOURCES[@]}")
  fi
  say "torch $TORCH from PyPI, with its CUDA libraries (the stand-in for NVIDIA's build; a large first download)"
  "${IMAGE_PIP[@]}" "torch==$TORCH" 2>&1 | quiet
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  LIST="$(mktemp)"
  grep -vE "^\s*(#|$)" "$IMAGE_LIST" | grep -viE "^($NVIDIA_BUILDS)==" > "$LIST"
  say "the image's packages: $(wc -l < "$LIST") of $(grep -cE '==' "$IMAGE_LIST") (--no-deps; NVIDIA's builds left out)"
  "${IMAGE_PIP[@]}" --no-deps -r "$LIST" 2>&1 | quiet   # a few are sdists only (antlr4 4.9.3, wget): built here
  rm -f "$LIST"
  nvrx="$(grep -iE '^nvidia-resiliency-ext==' "$IMAGE_LIST" | head -1)"
  say "$nvrx (glibc 2.39 wheel) unpacked into the image stand-in's site-packages"
  "${PIP[@]}" --no-deps --only-binary=:all: --python-version 3.12 "${PLATFORM[@]}" --target "$SITE" --upgrade "$nvrx" 2>&1 | quiet

  say "the overlay, as the env setup's overlay step installs it: src/pipeline/env/overlay.py install $OVERLAY"
  "$VENV/bin/python" "$ROOT/src/pipeline/env/overlay.py" install "$OVERLAY" "$OVERLAY_PINS" 2>&1 | quiet
  [[ -d "$OVERLAY/megatron/bridge" && -d "$OVERLAY/megatron/core" ]] || die "megatron not installed in $OVERLAY"
  echo "$KEY" > "$VENV/.twin-pins"
  say "done in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1) + $(du -sh "$OVERLAY" | cut -f1))"
}

machine_cache_build twin "$KEY" build_twin "$ROOT/.cache"
[[ "$CACHE_BUILT" == 1 ]] || say "the machine's twin $CACHE_ENTRY (pins $KEY) is reused"
link_atomically "$CACHE_ENTRY/venv" "$VENV"
link_atomically "$CACHE_ENTRY/overlay" "$OVERLAY"
say "$VENV and $OVERLAY link to $CACHE_ENTRY"
