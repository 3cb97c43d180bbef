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
