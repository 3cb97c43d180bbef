"""ft_launcher (nvidia-resiliency-ext) on the real local Slurm: the local engine's ranks report timed sections
(setup, step, checkpointing) to their rank monitors, so a hung rank is detected by the cluster profile's
section timeout (configs/cluster/local_cpu_ft.yaml), killed, and the worker group restarts and resumes from
the latest complete checkpoint; a rank killed outright is restarted the same way.

Versions: these tests run the local venv's ft_launcher, nvidia-resiliency-ext 0.4.1 (requirements/local.txt): the
last NVRx wheel for this machine's glibc 2.36 (0.5+ need glibc 2.39). The cluster's jobs run the NGC image's
NVRx 0.6.0 (3rdparty/image-packages.txt); the container twin (tests/twin) runs 0.6.0's ft_launcher --help and
megatron-core's import of it, not these restarts."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT, run

from .test_slurm import job_log, submit, wait_job

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SUBMIT = ["--nodes=1", "--time=10", "pipeline_training_submit.sbatch", "configs/local/tiny_moe_sft.yaml",
          "tiny-qwen3-moe", "sft", "--cluster", "local_cpu_ft"]
STEP_TIMEOUT = 30  # configs/cluster/local_cpu_ft.yaml: ft_section_timeouts step:30
# ft_launcher's agent: UNHEALTHY when a rank died while others still run, FAILED when all are gone
RESTART = r"\[default\] Worker group (?:UNHEALTHY|FAILED)\. \d+/2 attempts left; will restart worker group"


@pytest.fixture
def fenv(senv):
    run(["python", "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256",
         "--limit", "600", "--quiet"], env={**senv, "PATH": f"{ROOT}/.venv/bin:{senv['PATH']}"}, check=True)
    return senv


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "progress.ndjson").read_text().splitlines() if x.strip()]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics_summary.json").read_text())


def _seconds(hms: str) -> int:
    h, m, s = (int(x) for x in hms.split(":"))
    return h * 3600 + m * 60 + s


def worker_pids(run_dir: Path) -> list[int]:
    """The training ranks (python -m pipeline.training.run), not ft_launcher itself or its rank monitors."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "-m pipeline.training.run" in cmd and str(run_dir) in cmd and "ft_launcher" not in cmd:
            out.append(p.pid)
    return out


def test_hang_is_detected_by_the_step_timeout_and_the_group_resumes(fenv, tmp_path):
    job = submit(fenv, *SUBMIT, "train.train_iters=24", "checkpoint.save_interval=8",
                 "+pipeline.local.fault_inject_hang_step=12")
    st = wait_job(fenv, job, timeout=300)
    log = job_log("training", job)
    assert st == "COMPLETED", log[-4000:]
    assert "launching: ft_launcher" in log and f"--ft-rank_section_timeouts=setup:120,step:{STEP_TIMEOUT}," in log
    hang = re.search(r"(\d\d:\d\d:\d\d) \S+ WARNING \S+ fault injection: rank 0 hangs at step 12", log)
    assert hang, log[-4000:]
    # ft_launcher's rank monitor reports the open section that ran past its timeout, then kills the rank
    detected = re.search(r"(\d\d:\d\d:\d\d),\d+\] \[WARNING\] \[RankMonServer\S+\] Section 'step' has been open "
                         rf"for ([\d.]+) seconds\. Timeout is {STEP_TIMEOUT}\.00 seconds\.", log)
    assert detected, log[-4000:]
    assert float(detected.group(2)) >= STEP_TIMEOUT
    waited = (_seconds(detected.group(1)) - _seconds(hang.group(1))) % 86400
    assert STEP_TIMEOUT <= waited <= STEP_TIMEOUT + 20  # the timeout, not something else, ended the hang
    assert "FT timeout elapsed." in log
    assert re.search(RESTART, log)
    assert re.search(r"resuming from \S+/checkpoints/iter_0000008\b", log)
    assert "[after training is done]" in log
    run_dir = tmp_path / "runs" / "tiny_moe_sft"
    summary = _summary(run_dir)
    assert summary["status"] == "completed" and summary["final_step"] == 24
    steps = _steps(run_dir)
    # steps 1-11 ran, the hang lost step 12, the restarted group redid 9-11 from iter 8 (not from step 1)
    assert steps[-1] == 24 and set(steps) == set(range(1, 25)) and steps.count(1) == 1


def test_sigkilled_rank_is_restarted_by_ft_launcher(fenv, tmp_path):
    job = submit(fenv, *SUBMIT, "train.train_iters=40", "checkpoint.save_interval=10")
    run_dir = tmp_path / "runs" / "tiny_moe_sft"
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 240
    while not (tracker.exists() and int(tracker.read_text() or 0) >= 10):
        assert time.time() < deadline, "no checkpoint before the kill"
        time.sleep(0.2)
    pids = worker_pids(run_dir)
    assert len(pids) == 2, pids  # local_cpu_ft: two ranks on the node
    killed_at = int(tracker.read_text())
    psutil.Process(pids[-1]).send_signal(signal.SIGKILL)
    st = wait_job(fenv, job, timeout=300)
    log = job_log("training", job)
    assert st == "COMPLETED", log[-4000:]
    assert re.search(r"failed \(exitcode: -9\) local_rank: \d", log)
    assert re.search(RESTART, log)
    resumed = re.search(r"resuming from \S+/checkpoints/iter_(\d+)", log)
    assert resumed and int(resumed.group(1)) >= killed_at
    assert "[after training is done]" in log
    summary = _summary(run_dir)
    assert summary["status"] == "completed" and summary["final_step"] == 40
    steps = _steps(run_dir)
    assert steps[-1] == 40 and set(steps) == set(range(1, 41)) and steps.count(1) == 1
