"""Every top-level entry point on a login node with no pipeline venv (issue 33): --help works with nothing
installed, and a plan runs through the login node's planner, or, without one, says in one line the one command
that creates it (exit 2, never a traceback)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, run

PY_ENTRIES = ["pipeline_experiment.py", "pipeline_data_prepare.py", "pipeline_coherence_test.py"]
SH_ENTRIES = ["pipeline_checkpoint_convert.sh", "pipeline_training_launch.sh"]
EXPERIMENT = "configs/experiments/tiny_lr_batch_sweep.yaml"
PLANS = [
    ["python3", "pipeline_experiment.py", "list", EXPERIMENT],
    ["python3", "pipeline_experiment.py", "render", EXPERIMENT, "--no-configs"],
    ["python3", "pipeline_coherence_test.py", "/c", "--hf-model", "nvidia/NVIDIA-Nemotron-Nano-9B-v2", "--dry-run"],
    ["bash", "pipeline_training_launch.sh", "configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode",
     "sft", "--dry-run", "--no-path-checks"],
    ["bash", "pipeline_checkpoint_convert.sh", "import", "nano", "--dry-run"],
]


@pytest.fixture
def bare_login(tmp_path, pipeline_env):
    """A login node: python3 is a standard-library Python without the suite on its path, no pipeline venv, no
    planner (PIPELINE_PLANNER_VENV names a missing directory)."""
    bare = tmp_path / "bare"
    subprocess.run([f"python3.{sys.version_info.minor}", "-m", "venv", "--without-pip", str(bare)], check=True)
    env = {**pipeline_env, "PIPELINE_VENV": str(tmp_path / "no-venv"),
           "PIPELINE_PLANNER_VENV": str(tmp_path / "no-planner"), "PATH": f"{bare}/bin:/usr/bin:/bin"}
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "PIPELINE_ROOT"):
        env.pop(k, None)
    return env


@pytest.mark.parametrize("script", PY_ENTRIES + SH_ENTRIES)
def test_help_needs_no_environment(script, bare_login):
    """--help prints the script's header with nothing installed."""
    cmd = ["python3" if script.endswith(".py") else "bash", script, "--help"]
    res = run(cmd, env=bare_login)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert res.stdout.startswith(script + " - "), res.stdout[:300]


@pytest.mark.parametrize("cluster,fix", [
    (None, "create the pipeline venv with: bash {root}/pipeline_env_setup.sh"),
    ("isambard_gh200", "create the planner with: PIPELINE_CLUSTER=isambard_gh200 bash {root}/pipeline_env_setup.sh "
                       "--only planner"),
])
@pytest.mark.parametrize("cmd", PLANS, ids=lambda c: " ".join(c[1:3]))
def test_a_plan_without_the_planner_names_the_one_command(cmd, cluster, fix, bare_login):
    env = {**bare_login, **({"PIPELINE_CLUSTER": cluster} if cluster else {})}
    res = run(cmd, env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fix.format(root=ROOT) in lines[0], lines
    if cluster:  # where the planner goes is named, so a member who cannot write there knows what to change
        assert lines[0].endswith(f"(it is made at PIPELINE_PLANNER_VENV={env['PIPELINE_PLANNER_VENV']})"), lines


@pytest.fixture
def planner_login(bare_login, tmp_path):
    """The same login node with a planner (the test venv stands in for it: what the planner has and more)."""
    return {**bare_login, "PIPELINE_CLUSTER": "isambard_gh200", "PIPELINE_PLANNER_VENV": str(Path(sys.prefix)),
            "PIPELINE_CONTAINER_DIR": str(tmp_path / "shared")}


def test_entry_points_run_through_the_planner(planner_login):
    res = run(["python3", "pipeline_experiment.py", "list", EXPERIMENT], env=planner_login)
    assert res.returncode == 0 and "experiment tiny_lr_batch_sweep: 4 run(s)" in res.stdout, res.stderr[-2000:]
    res = run(["python3", "pipeline_experiment.py", "render", EXPERIMENT, "--no-configs"], env=planner_login)
    assert res.returncode == 0 and "isambard_sbatch" in res.stdout, res.stderr[-2000:]
    res = run(["python3", "pipeline_data_prepare.py", "--help"], env=planner_login)  # the parser's own help
    assert res.returncode == 0 and re.search(r"usage: .*prepare", res.stdout), res.stdout + res.stderr
    res = run(["python3", "pipeline_coherence_test.py", "/c", "--backend", "megatron", "--hf-model",
               "nvidia/NVIDIA-Nemotron-Nano-9B-v2", "--tp", "4", "--ep", "8", "--dry-run", "--nodes", "2"],
              env=planner_login, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert any(line.startswith("error: ep(8) * etp(1) = 8 > ") for line in res.stderr.splitlines()), res.stderr


def test_a_tokenize_across_nodes_without_the_planner_leaves_the_split_to_the_job(bare_login, tmp_path):
    """No planner to read the corpus with: the submission's checks pass and the split is said to be made when the job
    starts (the dry run prints the sbatch line; nothing is queued)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"d{i}.txt").write_text(f"document {i}")
    env = {**bare_login, "BAD_NODES_LOG": str(tmp_path / "bad_nodes.txt")}
    res = run(["./isambard_sbatch", "--dry-run", "--nodes=3", "pipeline_data_submit.sbatch", "tokenize", str(corpus),
               "smollm2-135m", "web"], env=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert f"tokenize across 3 nodes: the split of {corpus} is made when the job starts" in res.stderr, res.stderr
    assert res.stdout.startswith("sbatch --nodes=3 pipeline_data_submit.sbatch tokenize"), res.stdout


@pytest.mark.parametrize("form", ["dataset", "config"])
def test_a_chat_prepare_across_nodes_without_the_planner_leaves_the_plan_to_the_job(bare_login, tmp_path, form):
    """No planner to resolve the prepare with (its profile, model and config need the planner's packages): the
    submission's checks pass and the plan is said to be made when the job starts; the job's own step options are
    refused in one line all the same."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    env = {**bare_login, "BAD_NODES_LOG": str(tmp_path / "bad_nodes.txt")}
    args = (["--dataset", str(chat), "--seq-length", "256", "--dataset-root", str(tmp_path / "root")]
            if form == "dataset" else ["--config", "configs/quickstart/nemotron_nano_quickstart_sft.yaml"])
    res = run(["./isambard_sbatch", "--dry-run", "--nodes=2", "pipeline_data_submit.sbatch", "prepare", *args],
              env=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "prepare across 2 nodes: the export, the split of its tokenize chunks and the merge are planned when the " \
           "job starts (no login-node planner here)" in res.stderr, res.stderr
    assert res.stdout.startswith("sbatch --nodes=2 pipeline_data_submit.sbatch prepare"), res.stdout
    res = run(["./isambard_sbatch", "--dry-run", "--nodes=2", "pipeline_data_submit.sbatch", "prepare", *args,
               "--export-only"], env=env)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 2 and len(errors) == 1 and "the job's own steps" in errors[0], res.stderr
