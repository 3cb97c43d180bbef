"""The login node as a cluster user has it (issue 49, item 1): the planner alone on the path (the env setup's planner
step builds it: no venv, no torch), the reference's packed data and base checkpoint present on the reference's
paths (under a temporary root standing for /projects/a5k/public, bound into the container by PIPELINE_BINDS), and
no --no-path-checks: the planner reads the packed Parquet and its metadata, as the preflight does on the cluster.
Before this, the planner had neither pyarrow nor orjson, and once the data existed every such plan was refused
("create the planner with ...") or ended in a traceback (ModuleNotFoundError: orjson)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pipeline.data import packed_parquet
from tests.helpers import image_record, run
from tests.unit.test_preflight_packed import write_packs  # the data pipeline's own writer, as the preflight reads it

pytestmark = pytest.mark.slow

CONFIG = "configs/quickstart/nemotron_nano_quickstart_sft.yaml"
TOK = "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
DATASET = "geodesic-research/pa-warm-start-1B-sft-mix"
SEQ, PAD, ROWS = 32768, 16, 128  # test_preflight_packed.write_packs: a global batch (128) of packs of 32K, pad 16


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    """The planner, made by the env setup's own step (pip from the registries, pinned by requirements/planner.txt)."""
    base = tmp_path_factory.mktemp("login")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(base), "PIPELINE_CLUSTER": "isambard_gh200",
           "PIPELINE_PLANNER_PYTHON": f"python3.{sys.version_info.minor}",
           "PIPELINE_PLANNER_VENV": str(base / "planner"), "PIPELINE_CONTAINER_DIR": str(base / "shared")}
    made = run(["bash", "pipeline_env_setup.sh", "--only", "planner"], env=env, timeout=900)
    assert made.returncode == 0, made.stderr[-3000:]
    assert not list((base / "planner").glob("lib/python*/site-packages/torch"))
    return base, env


@pytest.fixture
def login(planner, tmp_path):
    """The reference's shared folders under a temporary root: the packed data of Step 1 and the imported base of
    Step 2 where the quickstart config reads them; the root is bound into the container (PIPELINE_BINDS)."""
    base, env = planner
    public = tmp_path / "projects" / "a5k" / "public"
    data = public / "data" / DATASET.replace("/", "__")
    base_ckpt = public / "checkpoints" / "megatron_bridges" / "models" / "NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16"
    (base_ckpt / "iter_0000000").mkdir(parents=True)
    (base_ckpt / "iter_0000000" / "common.pt").write_bytes(b"x")
    (base_ckpt / "latest_checkpointed_iteration.txt").write_text("0")
    write_packs(data)
    sif = public / "containers" / "nemo-26.06.sif"
    image_record(sif)  # validate's record of the image (the env pipeline's step before training)
    env = {**env, "PIPELINE_BINDS": str(tmp_path / "projects"), "PIPELINE_VENV": str(base / "no-venv"),
           "PIPELINE_SIF": str(sif),
           "PIPELINE_RUNS_DIR": str(tmp_path / "runs"), "PIPELINE_LOG_DIR": str(tmp_path / "logs")}
    paths = [f"dataset.dataset_root={data}", f"checkpoint.pretrained_checkpoint={base_ckpt}",
             f"checkpoint.save={public / 'checkpoints' / 'megatron' / 'nemotron_nano_quickstart_sft'}",
             f"logger.wandb_save_dir={public / 'logs' / 'wandb'}"]
    return env, paths, data


def no_venv_python(env) -> None:
    """Nothing of the test venv is reachable: python3 is the machine's, and it cannot import the suite's needs."""
    probe = subprocess.run(["python3", "-c", "import pyarrow"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0, "the machine's python3 has pyarrow: this would not be the login node"


def test_the_quickstart_plans_on_the_planner_alone_with_the_data_present(login):
    env, paths, _ = login
    no_venv_python(env)
    res = run(["bash", "pipeline_training_launch.sh", CONFIG, "--model", "nano", "--mode", "sft", "--dry-run",
               "--nodes", "16", *paths], env=env, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "create the planner" not in out
    assert f"data: {ROWS} packs of {SEQ} tokens" in out, out[-3000:]
    assert "== preflight: PASS ==" in out and "path checks skipped" not in out


def test_a_truncated_pack_is_refused_in_one_line_by_the_planner(login):
    """The planner reads the packed file the config names: a truncated one is refused at plan time, in one line."""
    env, paths, data = login
    (packed_parquet.packed_paths(data, TOK, PAD, SEQ)["train"]).write_bytes(b"PAR1")
    res = run(["bash", "pipeline_training_launch.sh", CONFIG, "--model", "nano", "--mode", "sft", "--dry-run",
               "--nodes", "16", *paths], env=env, timeout=300)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(errors) == 1 and f"training_{SEQ}.idx.parquet" in errors[0], errors


def test_the_data_prepare_plan_runs_on_the_planner(login):
    """Step 1's dry run (the packed path the quickstart config reads) on the planner: a plan, not a traceback."""
    env, _, data = login
    res = run(["python3", "pipeline_data_prepare.py", "prepare", "--dataset", DATASET, "--seq-length", str(SEQ),
               "--model", "nano", "--dry-run", "--dataset-root", str(data)], env=env, timeout=300)
    out = res.stdout + res.stderr
    assert "Traceback" not in out and "ModuleNotFoundError" not in out, out[-3000:]
    assert res.returncode == 0, out[-3000:]
    assert re.search(rf"packed/{TOK}_pad_seq_to_mult{PAD}/training_{SEQ}\.idx\.parquet", out), out[-3000:]
