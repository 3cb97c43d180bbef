"""The Slurm layer on a real local Slurm cluster (tests/slurm/local_slurm.sh): four virtual nodes, fake GPUs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.slurm.allocation import _slurm_time
from tests.helpers import ROOT, run

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def submit(env, *args) -> str:
    res = run([str(ROOT / "isambard_sbatch"), "--parsable", *args], env=env, check=True)
    return res.stdout.strip().split(";")[0]


def job_state(env, job: str) -> str:
    out = run(["scontrol", "show", "job", job, "-o"], env=env).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else "UNKNOWN"


def wait_job(env, job: str, timeout: float = 600, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = job_state(env, job)
        if st in states:
            return st
        time.sleep(1)
    raise AssertionError(f"job {job} still {job_state(env, job)} after {timeout}s")


def job_log(pipeline: str, job: str) -> str:
    """The job's log where its script's --output puts it (the training job's is train-<jobid>.out, as the reference
    tails it; every other pipeline's is <pipeline>-<jobid>.out)."""
    name = "train" if pipeline == "training" else pipeline
    return (ROOT / "logs" / "slurm" / f"{name}-{job}.out").read_text()


def test_submissions_never_land_on_bad_nodes(senv):
    run([str(ROOT / "isambard_sbatch"), "--mark-bad", "node1", "test: bad GPU"], env=senv, check=True)
    run([str(ROOT / "isambard_sbatch"), "--mark-bad", "node2", "test: NCCL"], env=senv, check=True)
    jobs = [submit(senv, "-N1", "-o", "logs/slurm/wrap-%j.out", "--wrap", "echo NODE=$SLURMD_NODENAME")
            for _ in range(4)]
    jobs.append(submit(senv, "-N2", "-o", "logs/slurm/wrap-%j.out", "--wrap", "srun bash -c 'echo NODE=$SLURMD_NODENAME'"))
    nodes = set()
    for j in jobs:
        assert wait_job(senv, j) == "COMPLETED"
        nodes |= set(re.findall(r"NODE=(\S+)", job_log("wrap", j)))
    assert nodes and nodes <= {"node3", "node4"}
    res = run([str(ROOT / "isambard_sbatch"), "--exclude=node1;touch /tmp/pwned", "--wrap", "true"], env=senv)
    assert res.returncode == 2 and not Path("/tmp/pwned").exists()


def test_five_submit_scripts_on_the_tiny_model(senv, tmp_path):
    data = submit(senv, "pipeline_data_submit.sbatch", "prepare", "--dataset", "chatterbot-corpus", "--seq-length",
                  "256", "--limit", "600")
    assert wait_job(senv, data) == "COMPLETED", job_log("data", data)
    assert "== data prepare summary ==" in job_log("data", data)

    train = submit(senv, "--nodes=2", "pipeline_training_submit.sbatch", "configs/local/tiny_moe_sft.yaml",
                   "tiny-qwen3-moe", "sft", "--disable-ft", "train.train_iters=10", "checkpoint.save_interval=5")
    assert wait_job(senv, train) == "COMPLETED", job_log("training", train)
    log = job_log("training", train)
    assert "world 2" in log and "--nnodes=2" in log and "[after training is done]" in log
    run_dir = tmp_path / "runs" / "tiny_moe_sft"
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["launches"][-1]["node_list"] == ["node1", "node2"] or len(manifest["launches"][-1]["node_list"]) == 2

    ckpt = submit(senv, "pipeline_checkpoint_submit.sbatch", "export", str(run_dir / "checkpoints"), "--hf-model",
                  "pipeline/tiny-qwen3-moe", "--no-reasoning", "--atol", "1e-3")
    st = wait_job(senv, ckpt)
    # a 10-step tiny model may be too untrained for the reference-loss check: either verdict is a real outcome
    log = job_log("checkpoint", ckpt)
    assert ("exported:" in log and st == "COMPLETED") or ("FAILED verification" in log and st == "FAILED"), log
    hf = run_dir / "checkpoints" / "iter_0000010" / "hf"
    if st == "FAILED":
        assert not hf.exists()
        hf = run_dir / "checkpoints" / "iter_0000010"  # the trainer checkpoint is itself an HF directory
    coh = submit(senv, "--gpus-per-node=1", "pipeline_coherence_submit.sbatch", str(hf), "--max-tokens", "8",
                 "--allow-empty", "--output-dir", str(tmp_path / "coh"))
    assert wait_job(senv, coh) == "COMPLETED", job_log("coherence", coh)
    assert len(json.loads((tmp_path / "coh" / "coherence_hf.json").read_text())["results"][0]["rows"]) == 8

    env_job = submit(senv, "pipeline_env_submit.sbatch", "validate")
    assert wait_job(senv, env_job) == "COMPLETED", job_log("env", env_job)
    assert re.search(r"validate: \d+ passed, 0 failed", job_log("env", env_job))


def _wait_for_step(run_dir: Path, step: int, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        p = run_dir / "progress.ndjson"
        if p.exists():
            lines = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
            if lines and lines[-1]["step"] >= step:
                return
        time.sleep(0.5)
    raise AssertionError(f"training never reached step {step}")


def _kill_group(proc: subprocess.Popen, log) -> None:
    """Stop a process started with its own session, and whatever it started, if it is still running."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


def wait_while_it_progresses(env, job: str, run_dir: Path, stall: float = 300) -> None:
    """Until the job ends (its run done), for as long as it makes progress: a step logged, a requeue, a state
    change. A busy machine slows the steps and adds requeues, and only a job that does nothing for ``stall``
    seconds is given up on (a deadline from the work waited for, not a fixed number)."""
    last, since = None, time.time()
    while time.time() - since < stall:
        state = job_state(env, job)
        if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") or (
                state == "COMPLETED" and (run_dir / "TRAINING_DONE").exists()):
            return
        progress = run_dir / "progress.ndjson"
        steps = progress.read_text().count("\n") if progress.exists() else 0
        restarts = re.search(r"Restarts=(\d+)", run(["scontrol", "show", "job", job, "-o"], env=env).stdout)
        mark = (state, steps, restarts.group(1) if restarts else None)
        if mark != last:
            last, since = mark, time.time()
        time.sleep(2)


def test_real_time_limit_checkpoints_requeues_and_finishes(senv, tmp_path, request):
    """A real Slurm time limit, no scancel: --signal=B:USR1@90 on a 3-minute job. slurmctld checks limits every
    30 s and sends the warning early rather than late, so USR1 reaches the batch shell 90-120 s before the limit
    (60-90 s into the job). The training saves at the next step and the job requeues itself (~11 s here,
    cred_expire=10); the requeued job, with the same limit, resumes and finishes (or is warned again and
    requeues once more). The tiny model's compute varies several-fold with this shared machine's load, so each
    step gets a fixed 1.5 s sleep (pipeline.local.fault_inject_step_sleep): 48 steps take ~90-140 s, more than
    one job's ~80 s before its warning, and within two or three jobs."""
    run(["python", "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256",
         "--limit", "600", "--quiet"], env={**senv, "PATH": f"{ROOT}/.venv/bin:{senv['PATH']}"}, check=True)
    iters = 48
    job = submit(senv, "--nodes=1", "--time=3", "--signal=B:USR1@90", "pipeline_training_submit.sbatch",
                 "configs/local/tiny_moe_sft.yaml", "tiny-qwen3-moe", "sft", "--disable-ft",
                 f"train.train_iters={iters}", "checkpoint.save_interval=1000",
                 "+pipeline.local.fault_inject_step_sleep=1.5")
    # Slurm's first SubmitTime, read now: a requeue resets it to the requeue's time
    submitted = _slurm_time(re.search(r"SubmitTime=(\S+)", run(["scontrol", "show", "job", "-o", job],
                                                                env=senv).stdout).group(1))
    # The uninterrupted reference trains beside the Slurm job (which mostly sleeps): it needs nothing from the job
    ref = tmp_path / "uninterrupted"
    ref_log = (tmp_path / "uninterrupted.log").open("w")
    ref_proc = subprocess.Popen(
        ["bash", "pipeline_training_launch.sh", "configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe",
         "--mode", "sft", "--disable-ft", f"train.train_iters={iters}", "checkpoint.save_interval=1000",
         "--run-dir", str(ref)], env={**senv, "PATH": f"{ROOT}/.venv/bin:{senv['PATH']}"}, cwd=ROOT,
        stdout=ref_log, stderr=subprocess.STDOUT, start_new_session=True)
    request.addfinalizer(lambda: _kill_group(ref_proc, ref_log))
    run_dir = tmp_path / "runs" / "tiny_moe_sft"
    wait_while_it_progresses(senv, job, run_dir)
    log = job_log("training", job)
    assert job_state(senv, job) == "COMPLETED", log[-4000:]  # never TIMEOUT: every attempt left in time
    assert "time-limit warning (USR1)" in log
    saved = [int(x) for x in re.findall(rf"saved checkpoint at iteration (\d+) of {iters} and exited for requeue", log)]
    resumed = [int(x) for x in re.findall(r"resuming from \S+/checkpoints/iter_(\d+)", log)]
    assert saved and 0 < saved[0] < iters, log[-4000:]
    assert resumed == saved  # each requeued job resumed exactly where the previous one saved
    assert len(re.findall(r"requeueing job", log)) == len(saved)
    restarts = re.search(r"Restarts=(\d+)", run(["scontrol", "show", "job", job, "-o"], env=senv).stdout)
    assert restarts and int(restarts.group(1)) == len(saved)
    summary = json.loads((run_dir / "metrics_summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == iters
    steps = [json.loads(x)["step"] for x in (run_dir / "progress.ndjson").read_text().splitlines() if x.strip()]
    assert steps == list(range(1, iters + 1))  # every step exactly once, in order: resumed, never redone
    # Where the time went: one attempt per Slurm start, the parts add up to Slurm's submission -> the run's end
    g = summary["goodput"]
    attempts = len(saved) + 1
    assert (g["attempts"], g["requeues"], g["jobs"]) == (attempts, len(saved), [job])
    assert g["kept_steps"] == iters and g["redone_steps"] == 0  # each attempt saved before it stopped
    assert all(g[k] >= 0 for k in ("queue_seconds", "startup_seconds", "checkpoint_seconds", "restart_seconds"))
    assert g["step_seconds"] >= 1.5 * iters and g["restart_seconds"] > 10  # Slurm's requeue hold (cred_expire)
    assert abs(g["other_seconds"]) <= attempts  # what no step, save, start-up or restart covers
    parts = sum(g[k] for k in ("queue_seconds", "startup_seconds", "step_seconds", "checkpoint_seconds",
                               "redone_seconds", "restart_seconds", "other_seconds"))
    end = (run_dir / "TRAINING_DONE").stat().st_mtime
    assert abs(parts - (end - submitted)) <= attempts, (parts, end - submitted, g)
    assert 0 < g["goodput"] < 1 and g["allocated_seconds"] < g["total_seconds"]
    # and the requeued run is the uninterrupted one, step for step, to the last bit (the sleep changes no number)
    rc = ref_proc.wait(timeout=600)
    assert rc == 0, (tmp_path / "uninterrupted.log").read_text()[-4000:]

    def per_step(d: Path) -> list[tuple]:
        recs = [json.loads(x) for x in (d / "progress.ndjson").read_text().splitlines() if x.strip()]
        return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("learning_rate")) for r in recs]

    assert per_step(run_dir) == per_step(ref)
