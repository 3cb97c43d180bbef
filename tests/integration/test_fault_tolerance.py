"""Fault tolerance on the local engine: SIGKILL mid-run -> torchrun restarts the worker, which resumes from
the latest complete checkpoint and is the uninterrupted run, step for step (bit-identical losses and grad norms on
CPU; a resume that reads the data one batch off is caught); a NaN stops the run for good."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT, run

pytestmark = pytest.mark.slow
ARGS = ["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--disable-ft",
        "train.train_iters=40", "checkpoint.save_interval=10"]
ITERS = 40


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The packed chat data, prepared once for the module: every run here only reads it (prepare is deterministic,
    so this is the data each test prepared for itself before)."""
    base = tmp_path_factory.mktemp("prepared")
    run([str(ROOT / ".venv/bin/python"), "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus",
         "--seq-length", "256", "--limit", "600", "--quiet"],
        env={**os.environ, "PIPELINE_ROOT": str(ROOT), "PIPELINE_DATA_ROOT": str(base / "data")}, check=True)
    return base / "data"


@pytest.fixture
def data(pipeline_env, prepared, monkeypatch):
    monkeypatch.setenv("PIPELINE_DATA_ROOT", str(prepared))
    return {**pipeline_env, "PIPELINE_DATA_ROOT": str(prepared)}


def worker_pids(run_dir: Path) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "pipeline.training.run" in cmd and str(run_dir) in cmd and "torchrun" not in cmd:
            out.append(p.pid)
    return out


def final(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics_summary.json").read_text())


def per_step(run_dir: Path) -> list[tuple]:
    recs = [json.loads(x) for x in (run_dir / "progress.ndjson").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("learning_rate")) for r in recs]


def kill_and_resume(data, ft_dir: Path, *extra: str) -> tuple[str, int]:
    """Train, SIGKILL the training rank once a checkpoint past step 10 exists, let torchrun restart it."""
    proc = subprocess.Popen(["bash", "pipeline_training_launch.sh", *ARGS, "--run-dir", str(ft_dir),
                             "--max-restarts", "2", *extra], cwd=ROOT, env=data, stdout=subprocess.PIPE,
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
    return out, killed_at


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prepared):
    """The uninterrupted run, once for the module, on the module's prepared data."""
    base = tmp_path_factory.mktemp("reference")
    env = {**os.environ, "PIPELINE_ROOT": str(ROOT), "PIPELINE_DATA_ROOT": str(prepared),
           "PIPELINE_RUNS_DIR": str(base / "runs"), "WANDB_DIR": str(base / "wandb"), "WANDB_MODE": "offline",
           "HF_HUB_OFFLINE": "1", "PIPELINE_BAD_NODES_LOG": str(base / "bad_nodes.log")}
    run(["bash", "pipeline_training_launch.sh", *ARGS, "--run-dir", str(base / "ref")], env=env, check=True)
    return base / "ref"


def test_sigkill_restarts_and_resumes_as_the_uninterrupted_run(data, tmp_path, reference):
    """Bit-identical on CPU, every step: the resumed run restores the weights through transformers' loader (Trainer's
    own resume left an MoE's fused experts at their initial values, so every step after a resume differed)."""
    ft_dir = tmp_path / "ft"
    _, killed_at = kill_and_resume(data, ft_dir)
    a, b = final(ft_dir), final(reference)
    assert a["final_step"] == b["final_step"] == ITERS and a["logged_steps"] == ITERS
    # the steps the killed attempt logged past its checkpoint were redone: each appears exactly once, and each is
    # the uninterrupted run's step: same loss, grad norm and learning rate, to the last bit
    assert [s[0] for s in per_step(ft_dir)] == list(range(1, ITERS + 1))
    assert per_step(ft_dir) == per_step(reference)
    assert a["final_loss"] == b["final_loss"]
    # Where the time went: two attempts; the steps the killed one ran past its checkpoint were redone
    events = [json.loads(x) for x in (ft_dir / "events.ndjson").read_text().splitlines()]
    runs = [e["step"] for e in events if e["event"] == "step"]
    g = a["goodput"]
    assert (g["attempts"], g["requeues"], g["kept_steps"]) == (2, 0, ITERS)
    assert g["redone_steps"] == len(runs) - ITERS == len([s for s in runs if s > killed_at]) - (ITERS - killed_at)
    assert (g["redone_seconds"] > 0) == (g["redone_steps"] > 0)
    assert g["restart_seconds"] > 0 and abs(g["other_seconds"]) <= 2
    assert b["goodput"]["redone_steps"] == 0 and b["goodput"]["restart_seconds"] == 0


def test_a_resume_that_reads_the_data_one_batch_off_is_caught(data, tmp_path, reference):
    ft_dir = tmp_path / "shifted"
    _, killed_at = kill_and_resume(data, ft_dir, "+pipeline.local.fault_inject_resume_shift=1")
    got, want = per_step(ft_dir), per_step(reference)
    assert got[:killed_at] == want[:killed_at]  # before the kill: the same run
    assert got[killed_at] != want[killed_at]  # the first resumed step already differs


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
