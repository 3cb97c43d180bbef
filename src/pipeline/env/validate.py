"""Validation gates of the environment: numbered, named checks that print PASS, FAIL or SKIP.

Every FAIL prints the command that fixes it; checks that need hardware this machine lacks (a GPU)
are reported as SKIP with the reason. Exit code 0 when nothing failed, 1 otherwise.

    python -m pipeline.env.validate            # all checks
    python -m pipeline.env.validate --list     # names only
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib
import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from pipeline import bridge
from pipeline.common import paths
from pipeline.common.errors import cli_main
from pipeline.config.cluster import resolve_profile
from pipeline.config.job_env import apply_job_env
from pipeline.config.models import get_model, require_local_model
from pipeline.env import closure, device_check
from pipeline.env.assets import smollm2_gguf_dir

ROOT = paths.repo_root()  # evaluated at import: PIPELINE_ROOT of the process
SETUP = f"bash {ROOT}/pipeline_env_setup.sh"


class Skip(Exception):
    """The check cannot run on this machine; the message says why."""


class CheckFailed(Exception):
    """A check failed (not ``assert``: asserts vanish under ``python -O``)."""


def _require(ok: object, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


def _cluster_container() -> bool:
    """Inside the cluster's Apptainer image (NGC): its own Python and GPU stack, not the local venv."""
    return os.environ.get("PIPELINE_IN_CONTAINER") == "apptainer"


def _local_only(what: str) -> None:
    if _cluster_container():
        raise Skip(f"apptainer (cluster container): {what} belongs to the local venv quickstart, not to the container")


@dataclasses.dataclass
class Check:
    name: str
    fn: Callable[[], str]  # returns a detail string; raises AssertionError/Exception on failure, Skip to skip
    fix: str


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line.strip())
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def check_python() -> str:
    v = sys.version_info
    if _cluster_container():
        _require((v.major, v.minor) >= (3, 12), f"Python {v.major}.{v.minor} in the container; Megatron Bridge "
                 "0.6 needs >= 3.12 (the NGC NeMo images ship 3.12)")
        return sys.version.split()[0] + " (container)"
    _require((v.major, v.minor) == (3, 11), f"Python {v.major}.{v.minor}; the local lock is for 3.11")
    return sys.version.split()[0]


def check_venv() -> str:
    if _in_container() == "apptainer":
        raise Skip("apptainer: the image's Python with the overlay, no venv")
    venv = Path(os.environ.get("PIPELINE_VENV", ROOT / ".venv"))
    _require(Path(sys.prefix).resolve() == venv.resolve(), f"running in {sys.prefix}, not the venv {venv}")
    return str(venv)


def _in_container() -> str | None:
    return os.environ.get("PIPELINE_IN_CONTAINER") or None


def check_runtime() -> str:
    rt = os.environ.get("PIPELINE_RUNTIME", "venv")
    inside = _in_container()
    if rt != "venv" and not inside:
        raise AssertionError(f"PIPELINE_RUNTIME={rt} but this check runs outside the container")
    return f"{rt}" + (f" (inside the {inside} container)" if inside else " (host)")


def check_image() -> str:
    rt = _in_container()
    if not rt:
        raise Skip("venv runtime: no container image")
    path = os.environ.get("PIPELINE_CH_IMAGE" if rt == "charliecloud" else "PIPELINE_SIF", "")
    digest = Path(path + ".digest")
    _require(digest.is_file(), f"no recorded digest {digest}")
    return f"{path} sha256:{digest.read_text().strip()[:16]}..."


def check_binds() -> str:
    needed = [ROOT] + [Path(os.environ[k]) for k in ("PIPELINE_DATA_ROOT", "PIPELINE_RUNS_DIR", "HF_HOME", "WANDB_DIR")
                       if os.environ.get(k)]
    missing = []
    for p in needed:
        q = p
        while not q.exists() and q != q.parent:
            q = q.parent  # not created yet: its nearest existing parent must be writable
        if not os.access(q, os.W_OK):
            missing.append(str(p))
    _require(not missing, f"not writable/resolvable: {', '.join(missing)}")
    return f"{len(needed)} paths resolvable and writable"


def check_nccl_plugin() -> str:
    import torch

    if not torch.cuda.is_available():
        raise Skip("no GPU: the NCCL network plugin is only loaded by NCCL on GPU nodes")
    lib = Path(os.environ.get("PIPELINE_NCCL_PLUGIN_DIR", "")) / "lib" / "libnccl-net.so"
    _require(lib.exists(), f"{lib} missing")
    ctypes.CDLL(str(lib))
    return str(lib)


def _allreduce_worker(rank: int, world: int, backend: str, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = f"cuda:{rank}" if backend == "nccl" else "cpu"
    t = torch.ones(4, device=dev) * (rank + 1)
    dist.all_reduce(t)
    out.put((rank, float(t[0])))
    dist.destroy_process_group()


def _allreduce(backend: str, world: int) -> str:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, world, backend, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    results = [q.get(timeout=5) for _ in range(world)]
    want = float(world * (world + 1) // 2)
    _require(all(v == want for _, v in results), f"all-reduce gave {results}, want {want}")
    return f"{backend} all-reduce over {world} ranks = {want:g}"


def check_gloo_allreduce() -> str:
    return _allreduce("gloo", 2)


def check_gpu_allreduce() -> str:
    import torch

    if not torch.cuda.is_available():
        raise Skip("no GPU on this machine")
    return _allreduce("nccl", torch.cuda.device_count())


def check_pins() -> str:
    if _in_container() == "apptainer":
        req = ROOT / "3rdparty" / "requirements-container.txt"
    else:
        req = Path(os.environ.get("PIPELINE_REQUIREMENTS", ROOT / "requirements" / "local.txt"))
    bad = []
    pins = _pins(req)
    for name, want in pins.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            bad.append(f"{name} missing (want {want})")
            continue
        if have.split("+")[0] != want.split("+")[0]:
            bad.append(f"{name} {have} != {want}")
    _require(not bad, "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""))
    return f"{len(pins)} packages match {req.name}"


def _import_version(mod: str) -> str:
    m = importlib.import_module(mod)
    return f"{mod} {getattr(m, '__version__', '?')}"


def check_torch() -> str:
    import torch

    x = torch.ones(4) * 2
    _require(float(x.sum()) == 8.0, f"torch computed {float(x.sum())} for 2+2+2+2")
    return f"torch {torch.__version__}, threads={torch.get_num_threads()}"


def check_gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA device on this machine (the local engine runs on CPU)")
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def _container_only(what: str) -> None:
    if not _cluster_container():
        raise Skip(f"{os.environ.get('PIPELINE_RUNTIME', 'venv')} runtime: {what} is checked inside the cluster "
                   "container (PIPELINE_RUNTIME=apptainer)")


def check_import_in_container(module: str) -> Callable[[], str]:
    def fn() -> str:
        _container_only(f"import {module}")

        return bridge.import_version(module)

    return fn


def check_lm_eval() -> str:
    """lm-evaluation-harness imports in the container (the overlay's pin): pipeline_eval_harness.py and upload-all
    --eval run it there."""
    _container_only("import lm_eval")
    return _import_version("lm_eval")


# megatron-core's own compile_helpers(), as Bridge's setup calls it on local rank 0 of every node (a child: it calls
# sys.exit(1) when make fails), then the helpers' import
HELPERS_PROBE = ("import megatron.core.datasets as d, os; from megatron.core.datasets.utils import compile_helpers; "
                 "compile_helpers(); from megatron.core.datasets import helpers_cpp; "
                 "print('helpers:', os.path.basename(helpers_cpp.__file__), 'in', os.path.dirname(d.__file__))")


def check_dataset_helpers() -> str:
    """Bridge's first setup step on every node: megatron-core's compile_helpers() (``make -C
    megatron/core/datasets``) succeeds with the overlay's megatron-core, and its helpers import (the wheels
    ship no Makefile: overlay.py places one)."""
    _container_only("megatron-core's dataset helpers")

    res = subprocess.run([sys.executable, "-c", HELPERS_PROBE], capture_output=True, text=True, timeout=600)
    out = (res.stdout + res.stderr).strip().splitlines()
    made = "nothing to make: the prebuilt library is up to date" if any("Nothing to be done" in ln for ln in out) \
        else "built for this Python"
    _require(res.returncode == 0, f"compile_helpers() exited {res.returncode}: "
             + " | ".join(ln for ln in out if "rror" in ln or "make" in ln)[-300:])
    return f"{next((ln for ln in out if ln.startswith('helpers:')), 'helpers imported')} ({made})"


def check_gpu_packages() -> str:
    """validate --run-training: every GPU package the shipped Bridge recipes select (Transformer Engine, mamba-ssm and
    causal-conv1d for the Mamba layers, the MoE dispatcher's backend) imports in this image; read from the recipes
    Bridge builds (pipeline.bridge.recipe_gpu_packages), each with the recipes that need it."""
    _container_only("the GPU packages of the recipes")

    try:
        packages = bridge.recipe_gpu_packages()
    except Exception as exc:  # a recipe that cannot build here (no Hugging Face config of its model): one line
        raise CheckFailed(f"Bridge's recipes {', '.join(' '.join(r) for r in bridge.SHIPPED_RECIPES)} did not "
                          f"build: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    have, missing = [], []
    for pkg in packages:
        try:
            have.append(bridge.import_gpu_package(pkg))
        except Exception as exc:
            missing.append(f"{pkg.name} ({pkg.why}: {', '.join(pkg.users)}; {type(exc).__name__})")
    _require(not missing, f"{len(missing)} of {len(packages)} missing: {'; '.join(missing)}")
    return "; ".join(have)


def check_image_packages() -> str:
    """Records what the running image really holds beside its SIF (``closure.image_record``; the closure check reads
    it there), and compares it with the repository's list (3rdparty/image-packages.txt)."""
    _container_only("the image's package set")

    actual = closure.installed_image()
    record = closure.image_record()
    if record is not None:
        closure.record_image(actual, record, os.environ.get("PIPELINE_IMAGE", "the image"))
    diff = closure.diff_lists(closure.read_freeze(closure.IMAGE_LIST), actual)
    where = f"; recorded in {record}" if record is not None else ""
    _require(not diff, f"{len(diff)} difference(s) from {closure.IMAGE_LIST.name}{where}: " + "; ".join(diff[:6])
             + (f" (+{len(diff) - 6} more)" if len(diff) > 6 else ""))
    return f"{len(actual)} packages, as {closure.IMAGE_LIST.name} lists them{where}"


def check_overlay_closure() -> str:
    """Every requirement of the overlay's packages is met by the running image + overlay, no pin is stale, and no
    overlay pin breaks an image package."""
    _container_only("the overlay's closure over the image")

    overlay_dir = os.environ.get("PIPELINE_OVERLAY", "")
    pins = closure.read_overlay(closure.OVERLAY)
    image = closure.installed_image()
    requires = closure.installed_requires([overlay_dir])
    problems = closure.check(image, pins, requires, closure.local_pins(closure.SUITE_NEEDS), platform.machine(),
                             closure.image_requires())
    _require(not problems, "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""))
    return f"{len(pins)} overlay pins close over the image's {len(image)} packages"


def check_bridge_training() -> str:
    """validate --run-training: the GPU ready check (``pipeline.env.device_check``, the checks that
    tests/gpu/device_check.sh runs): the Bridge engine with a save-and-exit and a resume on every GPU of the node,
    a tiny model's export and verification, and megatron-backend generation against Hugging Face's."""
    _container_only("the Megatron Bridge training run")
    import torch

    if not torch.cuda.is_available():
        raise Skip("no GPU on this machine: the Megatron Bridge engine needs CUDA (the quickstart runs the local "
                   "engine on CPU)")

    work = Path(tempfile.mkdtemp(prefix="device-check-", dir=os.environ.get("PIPELINE_RUNS_DIR") or None))
    passed, failed, lines = device_check.run_checks(work, gpus=torch.cuda.device_count(), say=lambda _: None)
    results = "; ".join(ln.removeprefix(device_check.PREFIX).strip() for ln in lines)
    _require(not failed, f"{failed} of {len(lines)} GPU checks failed: {results} (work {work})")
    return f"{passed} GPU checks passed: {results} (work {work})"


SMOKE_CONFIG = "configs/smoke/nemotron_nano_smoke_sft.yaml"


def check_gpu_smoke_plan() -> str:
    """validate --run-training: the project's GPU smoke run (``SMOKE_CONFIG``, 4 nodes: more than this job's node)
    planned as its header documents it, by the training launcher's dry run (the preflight) on the selected profile
    (the config's own, isambard_gh200, unless ``PIPELINE_CLUSTER`` names another); paths checked inside the cluster's
    container only, where the data and the base checkpoint it reads are bound. A process of its own: the training
    layer sits above this one."""
    argv = [sys.executable, "-m", "pipeline.cli.train", str(ROOT / SMOKE_CONFIG), "--model", "nano", "--mode", "sft",
            "--disable-ft", "--dry-run", "--nodes", "4"]
    if os.environ.get("PIPELINE_CLUSTER"):
        argv += ["--cluster", os.environ["PIPELINE_CLUSTER"]]
    if not _cluster_container():
        argv.append("--no-path-checks")
    with tempfile.TemporaryDirectory(prefix="smoke-plan-") as run_dir:  # a plan only: nothing is written there
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                           os.environ.get("PYTHONPATH")]))}
        res = subprocess.run([*argv, "--run-dir", run_dir], capture_output=True, text=True, timeout=300, env=env,
                             cwd=ROOT)
    errors = [ln.removeprefix("error: ") for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    _require(res.returncode == 0 and "== preflight: PASS ==" in res.stdout,
             f"{SMOKE_CONFIG}: " + ("; ".join(errors) or (res.stderr.strip().splitlines() or ["no plan"])[-1]))
    profile = re.search(r"^cluster profile: (\S+)", res.stdout, re.M)
    mem = re.search(r"^memory estimate: ([\d.]+ GB per GPU)", res.stdout, re.M)
    line = next((ln for ln in res.stdout.splitlines() if " isambard_sbatch " in f" {ln}"), "")
    return (f"{SMOKE_CONFIG} plans PASS on {profile.group(1) if profile else '?'} (4 nodes, "
            f"{mem.group(1) if mem else 'memory not estimated'}"
            f"{'' if _cluster_container() else ', paths not checked outside the container'}); run it with: {line}")


def check_ft_launcher() -> str:
    _container_only("ft_launcher")
    path = shutil.which("ft_launcher")
    _require(path, "ft_launcher is not on PATH (nvidia-resiliency-ext missing from the image/overlay)")
    return str(path)


def check_smollm2_package() -> str:
    _local_only("the SmolLM2 package")

    return str(smollm2_gguf_dir())


def check_base_model() -> str:
    _local_only("the SmolLM2 base model")

    return str(require_local_model(get_model("smollm2-135m")))


def check_chat_corpus() -> str:
    _local_only("the chatterbot corpus")
    import chatterbot_corpus

    d = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    n = len(list(d.glob("*.yml")))
    _require(n > 0, f"no *.yml under {d}")
    return f"{n} files in {d}"


def _writable(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path):
        pass
    return str(path)


def check_hf_cache() -> str:
    return _writable(Path(os.environ.get("HF_HOME", ROOT / ".cache" / "huggingface")))


def check_wandb_dir() -> str:
    return _writable(Path(os.environ.get("WANDB_DIR", ROOT)))


def check_wandb_offline() -> str:
    import wandb

    with tempfile.TemporaryDirectory() as d:
        run = wandb.init(project="pipeline-validate", mode="offline", dir=d, settings=wandb.Settings(silent=True))
        run.log({"check": 1.0})
        run.finish()
        runs = list(Path(d).glob("wandb/offline-run-*"))
        _require(runs, "no offline run directory written")
    return f"wandb {wandb.__version__} offline run written"


IMAGE_FIX = (f"{SETUP} --only image --force (charliecloud) / {SETUP} --only pull --force (apptainer)")
CHECKS: list[Check] = [
    Check("runtime", check_runtime, f"{ROOT}/pipeline_env_exec.sh 'python -m pipeline.env.validate'"),
    Check("container-image", check_image, IMAGE_FIX),
    Check("binds-resolvable", check_binds, "fix PIPELINE_BINDS / the paths in pipeline_env_config.env"),
    Check("python-version", check_python, f"PIPELINE_PYTHON=python3.11 {SETUP} --force"),
    Check("venv-active", check_venv, f"source {ROOT}/pipeline_env_activate.sh"),
    Check("package-pins", check_pins, f"{SETUP} --only packages --force"),
    Check("import-torch", check_torch, f"{SETUP} --only packages --force"),
    Check("import-transformers", lambda: _import_version("transformers"), f"{SETUP} --only packages --force"),
    Check("import-datasets", lambda: _import_version("datasets"), f"{SETUP} --only packages --force"),
    Check("import-pyarrow", lambda: _import_version("pyarrow"), f"{SETUP} --only packages --force"),
    Check("import-hydra", lambda: _import_version("hydra"), f"{SETUP} --only packages --force"),
    Check("import-pipeline", lambda: _import_version("pipeline"), f"source {ROOT}/pipeline_env_activate.sh"),
    Check("smollm2-package", check_smollm2_package, f"{SETUP} --only packages --force"),
    Check("base-model-smollm2", check_base_model, f"{SETUP} --only assets --force"),
    Check("chat-corpus", check_chat_corpus, f"{SETUP} --only packages --force"),
    Check("hf-cache-writable", check_hf_cache, "export HF_HOME=<a writable dir> (pipeline_env_config.env)"),
    Check("wandb-dir-writable", check_wandb_dir, "export WANDB_DIR=<a writable dir> (pipeline_env_config.env)"),
    Check("wandb-offline-run", check_wandb_offline, f"{SETUP} --only packages --force"),
    Check("gloo-allreduce", check_gloo_allreduce, f"{SETUP} --only packages --force"),
    Check("image-packages", check_image_packages,
          'the image is recorded beside the SIF ("$PIPELINE_SIF.packages.txt"): copy it over '
          "3rdparty/image-packages.txt, then python -m pipeline.env.closure (docs/decisions.md #38)"),
    Check("overlay-closure", check_overlay_closure,
          f"fix the pins of 3rdparty/requirements-container.txt as the message says; {SETUP} --only overlay --force"),
    Check("import-megatron-core", check_import_in_container("megatron.core"), f"{SETUP} --only overlay --force"),
    Check("import-megatron-bridge", check_import_in_container("megatron.bridge"), f"{SETUP} --only overlay --force"),
    Check("import-transformer-engine", check_import_in_container("transformer_engine"),
          f"use an NGC NeMo image with Transformer Engine (PIPELINE_IMAGE); {SETUP} --only pull --force"),
    Check("import-lm-eval", check_lm_eval, f"{SETUP} --only overlay --force"),
    Check("dataset-helpers", check_dataset_helpers,
          f"{SETUP} --only overlay --force (it places megatron-core's dataset-helpers Makefile; decision 90)"),
    Check("ft-launcher", check_ft_launcher, f"{SETUP} --only overlay --force"),
    Check("gpu-visible", check_gpu, f"run on a GPU node (isambard_sbatch {paths.ENV_SUBMIT} validate)"),
    Check("nccl-plugin", check_nccl_plugin, f"{SETUP} --only nccl-plugin --force"),
    Check("gpu-allreduce", check_gpu_allreduce,
          "check the node (nvidia-smi); if it is broken: isambard_sbatch --mark-bad"),
]


TRAINING_CHECKS = [
    Check("gpu-packages", check_gpu_packages,
          "use an NGC NeMo image that holds them (PIPELINE_IMAGE; the NeMo images carry TE, mamba-ssm, causal-conv1d "
          f"and DeepEP), then {SETUP} --only pull --force; or choose the recipe's alltoall dispatcher "
          "(model.moe_token_dispatcher_type=alltoall) where DeepEP is what is missing"),
    Check("bridge-training", check_bridge_training,
          "read the failing check's log (named in the message, under its work folder); check the node "
          "(nvidia-smi), the overlay and the image; bash tests/gpu/device_check.sh runs the same checks alone"),
    Check("gpu-smoke-plan", check_gpu_smoke_plan,
          f"the line names the problem; plan it alone: bash {ROOT}/pipeline_training_launch.sh {SMOKE_CONFIG} "
          "--model nano --mode sft --dry-run --nodes 4 (a missing pack: python pipeline_data_prepare.py prepare "
          f"--config {SMOKE_CONFIG})"),
]


def run_checks(checks: list[Check]) -> tuple[int, int, int]:
    passed = failed = skipped = 0
    for i, check in enumerate(checks, 1):
        try:
            detail = check.fn()
        except Skip as exc:
            skipped += 1
            print(f"[{i:2d}/{len(checks)}] SKIP {check.name}: {exc}", flush=True)
        except Exception as exc:
            failed += 1
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"[{i:2d}/{len(checks)}] FAIL {check.name}: {msg}", flush=True)
            print(f"        fix: {check.fix}", flush=True)
        else:
            passed += 1
            print(f"[{i:2d}/{len(checks)}] PASS {check.name}: {detail}", flush=True)
    print(f"validate: {passed} passed, {failed} failed, {skipped} skipped", flush=True)
    return passed, failed, skipped


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the check names and exit")
    parser.add_argument("--only", action="append", default=[], help="run only this check (repeatable)")
    parser.add_argument("--run-training", action="store_true",
                        help="add gpu-packages: the GPU packages the shipped recipes select (TE, mamba-ssm, "
                        "causal-conv1d, the MoE dispatcher backend), bridge-training: the GPU ready check "
                        "(pipeline.env.device_check: Bridge engine save-and-exit and resume, export + verification, "
                        "megatron generation), and gpu-smoke-plan: the GPU smoke config's plan (configs/smoke/)")
    args = parser.parse_args(argv)
    every = CHECKS + (TRAINING_CHECKS if args.run_training else [])
    if args.list:
        for i, c in enumerate(every, 1):
            print(f"{i:2d} {c.name}")
        return 0
    checks = [c for c in every if not args.only or c.name in args.only]
    # The GPU checks run as a GPU job does (gpu-allreduce's NCCL ranks, bridge-training's torchrun): with the
    # selected cluster profile's env (NCCL over libfabric on the cluster), set before NCCL initialises.
    apply_job_env(resolve_profile().env)
    _, failed, _ = run_checks(checks)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
