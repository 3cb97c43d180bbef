"""Fault tolerance on the local engine: SIGKILL mid-run -> torchrun restarts the worker, which resumes from
the latest complete checkpoint and reaches the same final step and loss; a NaN stops the run for good."""

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT, run

pytestmark = pytest.mark.slow
ARGS = ["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--disable-ft",
        "train.train_iters=60", "checkpoint.save_interval=10"]


@pytest.fixture
def data(pipeline_env):
    run([str(ROOT / ".venv/bin/python"), "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus",
         "--seq-length", "256", "--limit", "600", "--quiet"], env=pipeline_env, check=True)
    return pipeline_env


def worker_pids(run_dir: Path) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "pipeline.training.run" in cmd and str(run_dir) in cmd and "torchrun" not in cmd:
            out.append(p.pid)
    return out


def final(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics_summary.json").read_text())


def test_sigkill_restarts_and_resumes(data, tmp_path):
    ref_dir, ft_dir = tmp_path / "ref", tmp_path / "ft"
    run(["bash", "pipeline_training_launch.sh", *ARGS, "--run-dir", str(ref_dir)], env=data, check=True)

    proc = subprocess.Popen(["bash", "pipeline_training_launch.sh", *ARGS, "--run-dir", str(ft_dir),
                             "--max-restarts", "2"], cwd=ROOT, env=data, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    tracker = ft_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 300
    while not (tracker.exists() and int(tracker.read_text()) >= 20):
        assert time.time() < deadline and proc.poll() is None, "training ended before the kill"
        time.sleep(0.2)
    pids = worker_pids(ft_dir)
    assert len(pids) == 1
    killed_at = int(tracker.read_text())
    psutil.Process(pids[0]).send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "resuming from" in out and f"iter_{killed_at:07d}" in out
    a, b = final(ft_dir), final(ref_dir)
    assert a["final_step"] == b["final_step"] == 60
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=0.02)  # within noise of the uninterrupted run
    steps = [json.loads(x)["step"] for x in (ft_dir / "progress.ndjson").read_text().splitlines()]
    # the steps the killed attempt logged past its checkpoint were redone: each appears exactly once
    assert steps == list(range(1, 61)), steps
    assert a["logged_steps"] == 60


def test_nan_stops_the_run_without_retrying(data, tmp_path):
    run_dir = tmp_path / "nan"
    res = run(["bash", "pipeline_training_launch.sh", *ARGS, "--run-dir", str(run_dir), "--max-restarts", "2",
               "+pipeline.local.fault_inject_nan_step=4"], env=data)
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "became nan at step" in out
    assert (run_dir / "FAILED_NAN").exists()
    assert "this run stopped on a NaN" in out  # the restarted worker refuses to burn more time
    assert final(run_dir)["status"] == "failed_nan"


def test_one_training_per_run_directory_and_the_trainer_dies_with_its_launcher(data, tmp_path):
    """A relaunch on a live run "resumed" and both wrote; killing the launcher's process group left the trainer
    running (torchrun starts ranks in their own session). Issue 22, item 7."""
    import fcntl
    import os

    run_dir = tmp_path / "live"
    first = subprocess.Popen(["bash", "pipeline_training_launch.sh", *ARGS[:-2], "train.train_iters=2000",
                              "checkpoint.save_interval=1000", "--run-dir", str(run_dir)], cwd=ROOT, env=data,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        progress = run_dir / "progress.ndjson"
        deadline = time.time() + 300
        while not (progress.exists() and progress.read_text().strip()):
            assert time.time() < deadline and first.poll() is None, "the first training did not start"
            time.sleep(0.2)
        second = run(["bash", "pipeline_training_launch.sh", *ARGS[:-2], "train.train_iters=2000",
                      "checkpoint.save_interval=1000", "--run-dir", str(run_dir)], env=data, timeout=300)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        line = second.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: run directory {run_dir} is being written by pid ") and "one training per run " \
            "directory" in line, line
        assert len(worker_pids(run_dir)) == 1
        os.killpg(first.pid, signal.SIGKILL)  # the launcher's whole process group, as a user's kill would
        first.wait(timeout=60)
        deadline = time.time() + 60
        while worker_pids(run_dir):
            assert time.time() < deadline, f"the trainer outlived its launcher: {worker_pids(run_dir)}"
            time.sleep(0.5)
        with open(run_dir / ".writer.lock", "rb+") as f:  # released: the next launch may write
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        for pid in worker_pids(run_dir):
            psutil.Process(pid).kill()
