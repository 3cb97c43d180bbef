"""The container twin: the overlay first on the path of a CPython 3.12 stand-in of the NGC image, as a job sees it.

tests/twin/setup_env.sh builds it (its header names every stand-in): the recorded image packages
(3rdparty/image-packages.txt) in a 3.12 venv with PyPI's torch for NVIDIA's and NVRx 0.6.0's pure-Python parts, and
3rdparty/requirements-container.txt installed exactly as the env setup's overlay step does. The overlay and src/ go
on PYTHONPATH by pipeline_env_activate.sh itself (PIPELINE_IN_CONTAINER=apptainer), so the path is the job's.

Stand-ins, named: torch (PyPI's CUDA build on CPU, for NVIDIA's), NVRx's C extension (absent: glibc 2.36 here),
Transformer Engine (absent; for the one Bridge module that imports it unguarded, megatron.bridge.peft.lora_layers,
the Bridge harness's scoped stand-in, PIPELINE_SHIM_ONLY=transformer_engine), apex and the CUDA kernel packages
(absent). What only the cluster proves (kernels, NCCL over Slingshot) is in docs/decisions.md #38.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, offline_hf_home
from tests.tiers import tier_unavailable

pytestmark = [pytest.mark.twin, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
VENV = ROOT / ".cache" / "twin-venv"
OVERLAY = ROOT / ".cache" / "twin-overlay"
UNREACHABLE = ("No matching distribution", "Could not find a version", "NewConnectionError", "Network is unreachable")


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(HERE / "setup_env.sh")], capture_output=True, text=True, timeout=3000)
    print(r.stdout, r.stderr[-3000:], f"tests/twin/setup_env.sh: {time.monotonic() - t0:.0f} s", sep="\n")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["?"])[-1]
        if any(u in r.stderr for u in UNREACHABLE) or "no CPython 3.12 found" in r.stdout + r.stderr:
            tier_unavailable("twin", f"tests/twin/setup_env.sh: {last}")
        pytest.fail(f"tests/twin/setup_env.sh failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    # the flagship configs as an offline hub cache, as the Bridge harness has it
    return {"hf_home": offline_hf_home(tmp_path_factory.mktemp("hf_home"))}


def in_twin(twin, code: str | list[str], overlay: Path = OVERLAY, extra_path: str = "", stdin: str | None = None,
            shim: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run python in the twin with the job's path: pipeline_env_activate.sh in the container posture sets it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIPELINE_"))}
    env.update(PIPELINE_ROOT=str(ROOT), PIPELINE_IN_CONTAINER="apptainer", PIPELINE_PROFILE_FILLED="1",
               PIPELINE_RUNTIME="apptainer", PIPELINE_OVERLAY=str(overlay), PATH=f"{VENV}/bin:{env['PATH']}",
               HF_HOME=str(twin["hf_home"]), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="2", WANDB_MODE="disabled", PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=extra_path)
    if shim:
        env.update(PIPELINE_SHIM_ONLY="transformer_engine")
    args = code if isinstance(code, list) else ["-c", code]
    prefix = f"{HERE.parent / 'bridge' / 'shim'}:" if shim else ""
    line = f'source {ROOT}/pipeline_env_activate.sh && PYTHONPATH="{prefix}$PYTHONPATH" exec python "$@"'
    return subprocess.run(["bash", "-c", line, "twin", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, input=stdin, cwd=ROOT)


def test_a_fresh_clone_links_the_machines_twin_in_seconds(twin, tmp_path):
    """The image stand-in is built once per machine (tests/machine_cache.sh), keyed by the lock files' hash: a
    second checkout with the same locks links it, never installs torch and the image's packages again."""
    clone = tmp_path / "clone"
    (clone / "3rdparty").mkdir(parents=True)
    # what decides the build besides the scripts: the lock files, the helpers' Makefile and the overlay's installer
    for rel in ("3rdparty/image-packages.txt", "3rdparty/requirements-container.txt",
                "3rdparty/megatron-core-datasets.mk", "src/pipeline/env/overlay.py"):
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, clone / rel)
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(HERE / "setup_env.sh")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PIPELINE_ROOT": str(clone)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "is reused" in r.stdout and "building" not in r.stdout, r.stdout
    assert time.monotonic() - t0 < 60
    for name in ("twin-venv", "twin-overlay"):
        link = clone / ".cache" / name
        assert link.is_symlink() and link.resolve() == (ROOT / ".cache" / name).resolve(), name


def test_megatron_imports_with_the_overlay_first(twin):
    """import megatron.core and megatron.bridge with the overlay first: the overlay's Bridge, megatron-core and
    transformers 5.12.1 shadow the image's, the image's NVRx 0.6.0 is the one megatron-core checks."""
    code = ("import json, megatron.core, megatron.bridge, transformers, nvidia_resiliency_ext as nvrx, torch; "
            "print(json.dumps({'core': megatron.core.__file__, 'bridge': megatron.bridge.__file__, "
            "'transformers': [transformers.__version__, transformers.__file__], 'nvrx': [nvrx.__version__, "
            "nvrx.__file__], 'torch': torch.__version__}))")
    r = in_twin(twin, code)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["core"].startswith(str(OVERLAY)) and got["bridge"].startswith(str(OVERLAY)), got
    assert got["transformers"][0] == "5.12.1" and got["transformers"][1].startswith(str(OVERLAY)), got
    assert got["nvrx"][0] == "0.6.0" and got["nvrx"][1].startswith(str(VENV)), got


def test_the_old_nvrx_pin_crashes_megatron_core(twin, tmp_path):
    """Before issue 20 the overlay pinned nvidia-resiliency-ext 0.4.1: installed as the overlay step installs it, first
    on the path, it shadows the image's 0.6.0 and megatron-core's NVRx check fails at import."""
    old = tmp_path / "old-overlay"
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
           "--target", str(old), "nvidia-resiliency-ext==0.4.1"]
    res = subprocess.run(pip, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    r = in_twin(twin, "import megatron.core.dist_checkpointing.strategies.nvrx", overlay=old,
                extra_path=str(OVERLAY))  # old overlay first, then today's (Bridge, megatron-core)
    assert r.returncode != 0
    # megatron-core's is_nvrx_min_version: 0.4.1 is older than the 0.6.0 it asserts (or, where a 0.4.1 build has
    # no __version__, the AttributeError of issue 20's reproduction)
    assert ("AssertionError: Minimum required nvidia-resiliency-ext package version is 0.6.0" in r.stderr
            or "AttributeError: module 'nvidia_resiliency_ext' has no attribute '__version__'" in r.stderr), \
        r.stderr[-3000:]
    ok = in_twin(twin, "import megatron.core.dist_checkpointing.strategies.nvrx")
    assert ok.returncode == 0, ok.stderr[-3000:]


def test_ft_launcher_runs(twin):
    """The image's ft_launcher entry point (NVRx 0.6.0), under the job's path."""
    code = ("import sys; from importlib.metadata import entry_points; "
            "ep = next(e for e in entry_points(group='console_scripts') if e.name == 'ft_launcher'); "
            "sys.argv = ['ft_launcher', '--help']; sys.exit(ep.load()())")
    r = in_twin(twin, code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--ft-rank_section_timeouts" in r.stdout or "--ft-" in r.stdout, r.stdout[-2000:]


def test_the_closure_holds_over_the_installed_twin(twin):
    """The closure check over the installed image stand-in, its packages' own requirements included; what the
    recorded image has and the twin lacks are NVIDIA's builds only (the stand-ins), counted as present."""
    from pipeline.env import closure

    r = in_twin(twin, ["-c", "import json; from pipeline.env import closure; "
                             "print(json.dumps(sorted(closure.installed_image())))"])
    assert r.returncode == 0, r.stderr[-3000:]
    absent = sorted(set(closure.read_freeze(closure.IMAGE_LIST)) - set(json.loads(r.stdout.strip().splitlines()[-1])))
    assert absent and set(absent) <= closure.NVIDIA_PROVIDED, absent
    r = in_twin(twin, ["-m", "pipeline.env.closure", "--installed", "--provided", ",".join(absent)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "closure of requirements-container.txt over the running image" in r.stdout and ": OK" in r.stdout


def test_bridge_config_build_for_nano_and_super(twin):
    """The Bridge harness's config build (our resolved config -> Bridge's real recipe + override code) for the Nano
    and Super quickstart, in the twin: the image's real packages, only Transformer Engine stood in for."""
    from tests.bridge.test_bridge_harness import SUPER_OVERRIDES, our_config

    ops = [{"op": "build_config", "id": m, "cfg": our_config(m, "sft", None, overrides=SUPER_OVERRIDES if m == "super"
                                                               else ()), "model": m, "mode": "sft", "peft": None}
           for m in ("nano", "super")]
    r = in_twin(twin, [str(HERE.parent / "bridge" / "driver.py")], stdin=json.dumps({"ops": ops}), shim=True)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-6000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])["results"]
    for res in results:
        assert "error" not in res, f"{res['id']}: {res['error']} at {res['where']}"
        assert res["recipe"] == "ConfigContainer" and not res["mismatches"], res["mismatches"]
        assert res["container_types"]["model"] == "HybridModelProvider"
        assert "train.train_iters" in res["checked"] and "model.expert_model_parallel_size" in res["checked"]


def test_the_bridge_smoke_run_config_builds(twin, tmp_path):
    """validate --run-training's Bridge run (4 iterations of Bridge's GPT recipe on the node's GPUs) cannot train
    here; its ConfigContainer, built by Bridge's own recipe and override code, can."""
    code = ("import json, sys; from pathlib import Path; from pipeline import bridge; "
            f"c = bridge.smoke_config(Path('{tmp_path}'), world=4, tp=2, iters=4); "
            "print(json.dumps({'layers': c.model.num_layers, 'tp': c.model.tensor_model_parallel_size, "
            "'iters': c.train.train_iters, 'gbs': c.train.global_batch_size, "
            "'mock': c.dataset.blend is None and c.dataset.blend_per_split is None, "
            "'save': c.checkpoint.save, 'seq': c.dataset.seq_length}))")
    r = in_twin(twin, code, shim=True)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"layers": 2, "tp": 2, "iters": 4, "gbs": 4, "mock": True, "save": str(tmp_path / "checkpoints"),
                   "seq": 256}, got


def test_validate_runs_compile_helpers_and_imports_lm_eval_in_the_container(twin, tmp_path):
    """Bridge's setup calls megatron-core's own compile_helpers() (``make -C megatron/core/datasets``, sys.exit(1) when
    make fails) on local rank 0 of every node. validate's dataset-helpers runs exactly that in the container, with
    the overlay's megatron-core as the env setup installs it (with the Makefile src/pipeline/env/overlay.py places):
    it returns, make finds the wheel's prebuilt CPython 3.12 helpers up to date and writes nothing, and the helpers
    import. The wheel alone has no Makefile: the same make fails, which was every Bridge training's first minute.
    lm-eval (the overlay's pin) imports for pipeline_eval_harness.py."""
    datasets = OVERLAY / "megatron" / "core" / "datasets"
    before = sorted((p.name, p.stat().st_mtime_ns) for p in datasets.iterdir())
    r = in_twin(twin, ["-m", "pipeline.env.validate", "--only", "import-lm-eval", "--only", "dataset-helpers"])
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    assert "PASS import-lm-eval: lm_eval 0.4.13" in out, out
    assert ("PASS dataset-helpers: helpers: helpers_cpp.cpython-312-" in out
            and f"in {datasets} (nothing to make: the prebuilt library is up to date)" in out), out
    assert "validate: 2 passed, 0 failed, 0 skipped" in out
    assert sorted((p.name, p.stat().st_mtime_ns) for p in datasets.iterdir()) == before  # nothing written
    bare = tmp_path / "datasets"  # the wheel's folder as pip installs it: no Makefile
    shutil.copytree(datasets, bare, ignore=shutil.ignore_patterns("Makefile"))
    make = subprocess.run(["make", "-C", str(bare)], capture_output=True, text=True)  # compile_helpers' own command
    assert make.returncode != 0 and "No targets specified and no makefile found" in make.stderr, make.stderr


def test_validate_gpu_packages_names_what_the_recipes_need_and_the_image_lacks(twin):
    """validate --run-training's gpu-packages, in the twin (no Transformer Engine, mamba-ssm, causal-conv1d or DeepEP:
    the image stand-in lacks NVIDIA's builds): Bridge's own Nano and Super recipes are built, the packages their
    models select are read from them, and the one FAIL line names each missing one with the recipes that need it
    and why, then the fix."""
    r = in_twin(twin, ["-m", "pipeline.env.validate", "--run-training", "--only", "gpu-packages"])
    out = r.stdout
    assert r.returncode == 1, out[-3000:] + r.stderr[-3000:]
    line = next(ln for ln in out.splitlines() if "gpu-packages" in ln)
    assert line.startswith("[ 1/1] FAIL gpu-packages: "), out
    for needle in ("6 of 6 missing: transformer_engine (the recipes' layer specs (attention, MLP, norms): nano "
                   "pretrain, nano sft, super sft; ModuleNotFoundError)",
                   "mamba_ssm (Mamba layers (selective scan, gated RMSNorm): nano pretrain, nano sft, super sft",
                   "causal_conv1d (Mamba layers' causal convolution:",
                   "transformer_engine.pytorch.GroupedLinear (MoE experts' grouped GEMM:",
                   "deep_ep.HybridEPBuffer (the flex MoE token dispatcher (hybridep): nano pretrain;",
                   "deep_ep.Buffer (the flex MoE token dispatcher (deepep): nano sft;"):
        assert needle in line, line
    assert "fix: use an NGC NeMo image that holds them" in out
