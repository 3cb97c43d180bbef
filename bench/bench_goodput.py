"""Goodput on the local Slurm: where a run's time goes when it is requeued at a time limit or killed mid-run.

    python bench/bench_goodput.py [--trials reference time_limit kill] [--iters 48] [--step-sleep 1.5]

Starts a local Slurm (``tests/slurm/local_slurm.sh``; or uses the one ``SLURM_CONF`` names), prepares the chatterbot
data into a temporary root and submits the tiny Qwen3-MoE SFT through ``isambard_sbatch`` once per trial:

  reference   uninterrupted, one checkpoint at the end
  time_limit  a real 3-minute limit with ``--signal=B:USR1@90``: the run saves at the warning and requeues itself
              (possibly twice) until it finishes
  kill        checkpoints every 10 steps; the training rank is SIGKILLed once it is past the checkpoint at step 20,
              torchrun restarts it inside the job and it redoes the steps after that checkpoint

Each step gets a fixed sleep (``pipeline.local.fault_inject_step_sleep``) so the step time does not swing with the
machine's load. Prints one Markdown table row per trial from the run's own ``metrics_summary.json`` goodput split,
and checks that what the split cannot place (``other``: the wall time inside attempts that no measured step or save
covers) is within a second per attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv/bin/python")


def sh(cmd: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, **kw)


def state(env: dict, job: str) -> str:
    out = sh(["scontrol", "show", "job", "-o", job], env).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else "GONE"


def wait_done(env: dict, job: str, run_dir: Path, timeout: float = 900) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = state(env, job)
        if s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and not (s == "COMPLETED" and not (
                run_dir / "TRAINING_DONE").exists()):
            return s
        time.sleep(2)
    raise SystemExit(f"job {job} did not finish in {timeout:.0f}s")


def trial(name: str, env: dict, base: Path, iters: int, sleep: float) -> dict:
    run_dir = base / "runs" / name
    over = [f"train.train_iters={iters}", f"+pipeline.local.fault_inject_step_sleep={sleep}",
            f"logger.wandb_exp_name={name}"]
    sb = ["--nodes=1", f"--job-name=gp-{name}"]
    if name == "time_limit":
        sb += ["--time=3", "--signal=B:USR1@90"]
        over += ["checkpoint.save_interval=1000"]
    elif name == "kill":
        sb += ["--time=15"]
        over += ["checkpoint.save_interval=10"]
    else:
        sb += ["--time=15"]
        over += ["checkpoint.save_interval=1000"]
    flags = ["--disable-ft"] + (["--max-restarts", "2"] if name == "kill" else [])
    sub = sh(["./isambard_sbatch", "--parsable", *sb, "pipeline_training_submit.sbatch",
              "configs/local/tiny_moe_sft.yaml", "tiny-qwen3-moe", "sft", *flags, *over], env)
    if sub.returncode != 0:
        raise SystemExit(f"submission failed: {sub.stderr[-2000:]}")
    job = sub.stdout.strip().split(";")[0]
    if name == "kill":
        tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
        deadline = time.time() + 600
        while not (tracker.exists() and int(tracker.read_text() or 0) >= 20):
            if time.time() > deadline:
                raise SystemExit("the kill trial never reached its checkpoint at step 20")
            time.sleep(0.5)
        time.sleep(2.5 * sleep)  # a couple of steps past the checkpoint: work the restart redoes
        out = subprocess.run(["pgrep", "-f", f"pipeline.training.run --run-dir {run_dir}"], text=True,
                             capture_output=True).stdout.split()
        pids = [int(p) for p in out if "torchrun" not in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        os.kill(min(pids), signal.SIGKILL)
    final = wait_done(env, job, run_dir)
    summary = json.loads((run_dir / "metrics_summary.json").read_text())
    g = summary.get("goodput") or {}
    return {"trial": name, "job": job, "state": final, "status": summary.get("status"), **g}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", nargs="+", default=["reference", "time_limit", "kill"],
                   choices=["reference", "time_limit", "kill"])
    p.add_argument("--iters", type=int, default=48)
    p.add_argument("--step-sleep", type=float, default=1.5)
    a = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-goodput."))
    env = {**os.environ, "PIPELINE_ROOT": str(ROOT), "PIPELINE_DATA_ROOT": str(base / "data"),
           "PIPELINE_RUNS_DIR": str(base / "runs"), "WANDB_DIR": str(base / "wandb"), "WANDB_MODE": "offline",
           "HF_HUB_OFFLINE": "1", "PIPELINE_CLUSTER": "local_cpu", "BAD_NODES_LOG": str(base / "bad.log"),
           "PIPELINE_LOG_DIR": str(base / "logs"), "PATH": f"{ROOT}/.venv/bin:{os.environ['PATH']}"}
    started = False
    if not env.get("SLURM_CONF"):
        env["PIPELINE_SLURM_BASE"] = str(base / "slurm")
        subprocess.run(["bash", "tests/slurm/local_slurm.sh", "start"], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        started = True
        out = sh(["bash", "tests/slurm/local_slurm.sh", "env"], env).stdout
        env.update(dict(re.findall(r"export (\w+)=['\"]?([^'\"\n]*)", out)))
    try:
        sh([PY, "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256",
            "--limit", "600", "--quiet"], env, check=True)
        rows = [trial(t, env, base, a.iters, a.step_sleep) for t in a.trials]
    finally:
        if started:
            subprocess.run(["bash", "tests/slurm/local_slurm.sh", "stop"], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"{a.iters} steps of tiny-qwen3-moe SFT, {a.step_sleep} s sleep per step, 2-core machine, local Slurm")
    print("| trial | attempts | requeues | total s | queue | start-up | kept steps | checkpoints | redone (steps) "
          "| restarts | other | goodput |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for r in rows:
        ok &= abs(r["other_seconds"]) <= r["attempts"] and r["state"] == "COMPLETED"
        print(f"| {r['trial']} | {r['attempts']} | {r['requeues']} | {r['total_seconds']:.1f} | "
              f"{r['queue_seconds']:.1f} | {r['startup_seconds']:.1f} | {r['step_seconds']:.1f} | "
              f"{r['checkpoint_seconds']:.1f} | {r['redone_seconds']:.1f} ({r['redone_steps']}) | "
              f"{r['restart_seconds']:.1f} | {r['other_seconds']:.2f} | {100 * r['goodput']:.0f}% |")
    print("parts add up within a second per attempt:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
