"""isambard_sbatch against the real local Slurm: every sbatch option reaches sbatch intact (the option table
comes from the installed sbatch), unknown options are refused, a login node without the pipeline
environment refuses a training job it cannot check (the planner on the cluster's login node checks it), and the job id and log path are printed."""

import re
import shutil
import subprocess

import pytest

from tests.helpers import ROOT, run

pytestmark = [pytest.mark.slurm]


@pytest.fixture
def senv(slurm, pipeline_env, tmp_path):
    return {**pipeline_env, "SLURM_CONF": slurm["SLURM_CONF"], "BAD_NODES_LOG": str(tmp_path / "bad.log")}


def show(env, job: str) -> str:
    return run(["scontrol", "show", "job", job, "-o"], env=env).stdout


def test_value_options_reach_sbatch_intact(senv, tmp_path):
    opts = ["--hold", "--comment", "hello world", "-J", "myjob", "-t", "5", "--mem", "100", "-c", "1",
            "--gpus-per-node", "1", "--open-mode", "append", "--hint", "nomultithread", "--signal", "B:USR1@60",
            "--wckey", "wk", "-N", "1", "-n", "1", "-p", "debug", "-D", str(tmp_path), "--nice=5",
            "--begin", "now+1hour", "-o", str(tmp_path / "o-%j.out")]
    res = run([str(ROOT / "isambard_sbatch"), "--parsable", *opts, "--wrap", "true"], env=senv)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    try:
        out = show(senv, job)
        for needle in ("JobName=myjob", "Comment=hello world", "TimeLimit=00:05:00", "MinMemoryNode=100M",
                       "TresPerNode=gres:gpu:1", f"WorkDir={tmp_path}", "Partition=debug", "Nice=5",
                       "NumNodes=1-1", "ReqB:S:C:T=0:0:*:1", f"StdOut={tmp_path}/o-{job}.out"):
            assert needle in out, (needle, out)
        assert f"job {job}: log {tmp_path}/o-{job}.out" in res.stderr
    finally:
        run(["scancel", job], env=senv)
    # options sbatch itself then judges: the value reached it (its own error names it)
    res = run([str(ROOT / "isambard_sbatch"), "-M", "c1", "--wrap", "true"], env=senv)
    assert res.returncode != 0 and "'c1' can't be reached" in res.stderr
    res = run([str(ROOT / "isambard_sbatch"), "--tmp", "10G", "--test-only", "--wrap", "true"], env=senv)
    assert "Requested node configuration is not available" in res.stderr  # 10G of TmpDisk, which no node has


def test_unknown_option_is_refused_before_sbatch(senv):
    res = run([str(ROOT / "isambard_sbatch"), "--nodez=2", "--wrap", "true"], env=senv)
    assert res.returncode == 2 and res.stderr.strip().endswith(
        "error: unknown sbatch option '--nodez=2' (not in this Slurm's sbatch --help); check the spelling")


@pytest.fixture
def login_node(senv, tmp_path):
    """A login node in the container posture: only a standard-library Python (no hydra/numpy/torch) on PATH, no
    pipeline venv, and an sbatch that records every submission (its --help/--usage reads are not submissions)."""
    bare = tmp_path / "bare"
    subprocess.run(["python3.11", "-m", "venv", "--without-pip", str(bare)], check=True)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    record = tmp_path / "submitted.txt"
    real = shutil.which("sbatch")
    (bin_ / "sbatch").write_text(f'#!/bin/bash\ncase "$1" in --help|--usage) ;; *) echo "$*" >> {record} ;; esac\n'
                                 f'exec {real} "$@"\n')
    (bin_ / "sbatch").chmod(0o755)
    env = {**senv, "PIPELINE_VENV": str(tmp_path / "no-venv"), "PIPELINE_PLANNER_VENV": str(tmp_path / "no-planner"),
           "PATH": f"{bin_}:{bare}/bin:/usr/bin:/bin"}
    env.pop("VIRTUAL_ENV", None)
    return env, record


TINY = ["pipeline_training_submit.sbatch", "configs/local/tiny_moe_sft.yaml", "tiny-qwen3-moe", "sft"]


def test_training_submission_without_the_environment_is_refused(login_node):
    """Without the venv or the planner the preflight cannot run: the submission is refused in one line naming the
    command that creates the planner, nothing is queued; --no-preflight queues anyway, saying so."""
    env, record = login_node
    res = run([str(ROOT / "isambard_sbatch"), "--test-only", "--nodes=1", *TINY], env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"error: the training preflight cannot run here: no pipeline venv or login-node planner \(No module named "
        r"'\w+'\); create the pipeline venv with: bash pipeline_env_setup.sh \(or pass --no-preflight to queue "
        r"without the checks\); nothing was submitted", lines[0]), lines
    assert not record.exists()
    res = run([str(ROOT / "isambard_sbatch"), "--no-preflight", "--test-only", "--nodes=1", *TINY], env=env)
    assert "warning: preflight skipped (--no-preflight)" in res.stderr, res.stderr
    assert re.search(r"Job \d+ to start", res.stderr), res.stderr
    assert "--no-preflight" not in record.read_text() and "--test-only" in record.read_text()


@pytest.mark.slow
def test_cluster_login_node_plans_before_anything_is_queued(login_node, tmp_path):
    """The cluster's runtime (PIPELINE_CLUSTER=isambard_gh200: apptainer, no venv on the login node): the env
    setup's planner step makes the login node's planner, and the broken Nano submission of issue 20 (tp 4 x ep 8
    on 4-GPU nodes, a misspelled key) exits 2 with each problem before sbatch is called."""
    env, record = login_node
    env = {**env, "PIPELINE_CLUSTER": "isambard_gh200", "PIPELINE_PLANNER_PYTHON": "python3.11",
           "PIPELINE_PLANNER_VENV": str(tmp_path / "planner"), "PIPELINE_CONTAINER_DIR": str(tmp_path / "shared")}
    made = run(["bash", "pipeline_env_setup.sh", "--only", "planner"], env=env, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    assert "planner: a venv of python3.11 (Python 3.11" in made.stderr and "no torch" in made.stderr
    assert not list((tmp_path / "planner").glob("lib/python*/site-packages/torch"))
    nano = ["--nodes=16", "pipeline_training_submit.sbatch", "configs/quickstart/nemotron_nano_quickstart_sft.yaml",
            "nano", "sft", "model.tensor_model_parallel_size=4", "model.expert_model_parallel_size=8"]
    typo = run([str(ROOT / "isambard_sbatch"), *nano, "train.trian_iters=5"], env=env)
    assert typo.returncode == 2, typo.stderr
    assert "unknown key 'train.trian_iters' (did you mean 'train.train_iters'?)" in typo.stderr
    bare = run([str(ROOT / "isambard_sbatch"), *nano], env={**env, "PIPELINE_PLANNER_VENV": str(tmp_path / "none")})
    assert bare.returncode == 2 and "create the planner with: PIPELINE_CLUSTER=isambard_gh200 bash " \
        f"pipeline_env_setup.sh --only planner (it is made at PIPELINE_PLANNER_VENV={tmp_path / 'none'}) (or pass " \
        "--no-preflight" in bare.stderr, bare.stderr
    layout = run([str(ROOT / "isambard_sbatch"), *nano], env=env)
    assert layout.returncode == 2, layout.stderr
    assert "error: ep(8) * etp(1) = 8 > gpus_per_node(4) on 'isambard_gh200'" in layout.stderr
    assert re.search(r"preflight: \d+ problem\(s\); nothing was submitted", layout.stderr)
    assert not record.exists(), record.read_text()
    # The login node's dry run plans in the planner too (the container's pieces are not there).
    dry = run(["bash", "pipeline_training_launch.sh", nano[2], "--model", "nano", "--mode", "sft", "--disable-ft",
               "--dry-run", "--nodes", "16", "--no-path-checks"], env=env)
    assert dry.returncode == 0 and "== launch command (per node) ==" in dry.stdout + dry.stderr, dry.stderr[-2000:]
    again = run(["bash", "pipeline_env_setup.sh", "--only", "planner"], env=env)
    assert again.returncode == 0 and "step planner: already done, skipping" in again.stderr


def test_options_shown_optional_but_required_by_sbatch(senv):
    """--help shows '--wrap[=command string]' and '--export[=names]', yet sbatch takes their value after a space:
    isambard_sbatch must pass the value along, not mistake it for the script."""
    res = run([str(ROOT / "isambard_sbatch"), "--test-only", "--export", "ALL", "-o", "/dev/null", "--wrap",
               "echo hi"], env=senv)
    assert res.returncode == 0 and re.search(r"Job \d+ to start", res.stderr), res.stderr
