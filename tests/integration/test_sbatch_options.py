"""isambard_sbatch against the real local Slurm: every sbatch option reaches sbatch intact (the option table
comes from the installed sbatch), unknown options are refused, a login node without the pipeline
environment submits a training job without a traceback, and the job id and log path are printed."""

import re
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


def test_training_submission_without_the_environment(senv, tmp_path):
    """A login node in the container posture: only the system Python, no hydra/torch. The preflight is skipped
    with one line (it runs inside the job) and the job is submitted."""
    bare = tmp_path / "bare"  # a Python with the standard library only
    subprocess.run(["python3.11", "-m", "venv", "--without-pip", str(bare)], check=True)
    env = {**senv, "PIPELINE_VENV": str(tmp_path / "no-venv"), "PATH": f"{bare}/bin:/usr/bin:/bin",
           "SLURM_CONF": senv["SLURM_CONF"]}
    res = run([str(ROOT / "isambard_sbatch"), "--test-only", "--nodes=1", "pipeline_training_submit.sbatch",
               "configs/local/tiny_moe_sft.yaml", "tiny-qwen3-moe", "sft"], env=env)
    assert "Traceback" not in res.stderr, res.stderr
    assert "warning: preflight skipped: the pipeline environment is not available here" in res.stderr
    assert re.search(r"Job \d+ to start", res.stderr), res.stderr


def test_options_shown_optional_but_required_by_sbatch(senv):
    """--help shows '--wrap[=command string]' and '--export[=names]', yet sbatch takes their value after a space:
    isambard_sbatch must pass the value along, not mistake it for the script."""
    res = run([str(ROOT / "isambard_sbatch"), "--test-only", "--export", "ALL", "-o", "/dev/null", "--wrap",
               "echo hi"], env=senv)
    assert res.returncode == 0 and re.search(r"Job \d+ to start", res.stderr), res.stderr
