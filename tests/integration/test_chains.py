"""Auto-requeue chains are per run: two runs' chains side by side on the local Slurm. The singleton key is the
job name, which isambard_sbatch derives from the run's name (training-<logger.wandb_exp_name>), so the successor
of one run starts while the other run is still training (with one shared name it would wait for it)."""

import json
import re
import time

import pytest

from tests.helpers import ROOT, run

from .test_slurm import _wait_for_step, job_log, job_state, submit, wait_job

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
def prepare_chat(env) -> None:
    run(["python", "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256",
         "--limit", "600", "--quiet"], env={**env, "PATH": f"{ROOT}/.venv/bin:{env['PATH']}"}, check=True)


TRAIN = ["pipeline_training_submit.sbatch", "configs/local/tiny_moe_sft.yaml", "tiny-qwen3-moe", "sft", "--disable-ft",
         "checkpoint.save_interval=1000"]


@pytest.mark.timeout(1800)  # a loaded machine (load 12 on 2 cores: ~14 s a step) slows it, never changes it
def test_two_runs_auto_requeue_chains_side_by_side(senv, tmp_path):
    """Each chain ends itself: run A's first link, preempted, saves and its successor resumes and finishes; the
    link that finishes a run cancels its own successor and leaves nothing queued under the run's job name. Run B
    writes its log where --output puts it, a path with a space (cut at the space, the stop line was never found
    and the finished run's successor ran on). The limit is 30 minutes so that the sbatch's time-limit warning
    (USR1 300 s before it) never meets a run on a loaded machine: only the scancel here preempts (the real
    warning has its own test, test_slurm.py::test_real_time_limit_checkpoints_requeues_and_finishes)."""
    prepare_chat(senv)
    env = {**senv, "PIPELINE_AUTO_REQUEUE": "1"}
    logs_b = tmp_path / "team logs"
    logs_b.mkdir()
    a1 = submit(env, "--nodes=1", "--time=30", *TRAIN, "train.train_iters=30", "logger.wandb_exp_name=chain_a",
                "+pipeline.local.fault_inject_step_sleep=0.3")
    b1 = submit(env, "--nodes=1", "--time=30", f"--output={logs_b}/training-%j.out", *TRAIN, "train.train_iters=60",
                "logger.wandb_exp_name=chain_b", "+pipeline.local.fault_inject_step_sleep=0.8")
    for job, name in ((a1, "chain_a"), (b1, "chain_b")):
        assert f"JobName=training-{name}" in run(["scontrol", "show", "job", job, "-o"], env=env).stdout
    _wait_for_step(tmp_path / "runs" / "chain_a", 5)
    run(["scancel", "--batch", "--signal=USR1", a1], env=env, check=True)  # preempt run A's first link
    assert wait_job(env, a1) == "COMPLETED"
    a2 = re.search(r"successor job (\d+)", job_log("training", a1)).group(1)
    # run A's successor runs while run B's first job is still training: the chains do not block each other
    deadline, overlap = time.time() + 240, False
    while time.time() < deadline and not overlap:
        overlap = job_state(env, a2) == "RUNNING" and job_state(env, b1) == "RUNNING"
        if job_state(env, a2) in ("COMPLETED", "FAILED") or job_state(env, b1) in ("COMPLETED", "FAILED"):
            break
        time.sleep(1)
    assert overlap, (job_state(env, a2), job_state(env, b1))
    assert wait_job(env, a2, timeout=1500) == "COMPLETED" and wait_job(env, b1, timeout=1500) == "COMPLETED"
    logs = {"chain_a": job_log("training", a2), "chain_b": (logs_b / f"training-{b1}.out").read_text()}
    assert "time-limit warning" not in logs["chain_b"], logs["chain_b"][-2000:]  # B finished in its first link
    for name, iters in (("chain_a", 30), ("chain_b", 60)):
        log = logs[name]
        assert "[after training is done]" in log and "cancelling successor" in log, log[-2000:]
        nxt = re.search(r"successor job (\d+)", log).group(1)
        assert wait_job(env, nxt) == "CANCELLED"
        assert json.loads((tmp_path / "runs" / name / "metrics_summary.json").read_text())["final_step"] == iters
    assert "resuming from" in logs["chain_a"]
    time.sleep(3)
    for name in ("chain_a", "chain_b"):  # the chain is over: no link of either run left in the queue
        assert run(["squeue", "-h", "-n", f"training-{name}"], env=env).stdout.strip() == ""


def test_spent_requeue_budget_ends_failed_and_says_how_to_continue(senv, tmp_path):
    prepare_chat(senv)
    env = {**senv, "PIPELINE_MAX_REQUEUES": "0"}
    job = submit(env, "--nodes=1", "--time=10", *TRAIN, "train.train_iters=200", "logger.wandb_exp_name=budget",
                 "+pipeline.local.fault_inject_step_sleep=0.3")
    _wait_for_step(tmp_path / "runs" / "budget", 5)
    run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True)
    assert wait_job(env, job) == "FAILED"  # not COMPLETED: the run is unfinished
    log = job_log("training", job)
    assert "PIPELINE_MAX_REQUEUES=0 is used up" in log
    assert "isambard_sbatch --nodes=1 pipeline_training_submit.sbatch configs/local/tiny_moe_sft.yaml" in log
    summary = json.loads((tmp_path / "runs" / "budget" / "metrics_summary.json").read_text())
    assert summary["status"] == "preempted" and summary["final_step"] < 200
