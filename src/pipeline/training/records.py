"""Run records, as the SilentSwarm artifact set: one run directory holds

  config.yaml           the fully resolved config (recipe defaults < YAML < overrides)
  launch.json           model, mode, peft, cluster profile: what the engine needs to start
  manifest.json         git commit and dirty flag, exact command, node list, package versions, image,
                        one entry per launch (a requeued or restarted run appends)
  preflight.json        the plan the preflight computed
  progress.ndjson       one line per logged step (loss, grad norm, learning rate, tokens, time)
  metrics_summary.json  first/final/best loss, steps, time, throughput, status
  checkpoints/          iter_NNNNNNN/ + latest_checkpointed_iteration.txt (written last)

This module is the only writer of these files.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import math
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from pipeline.common.io import append_line, read_json, write_json, write_text

ROOT = Path(os.environ.get("PIPELINE_ROOT") or Path(__file__).resolve().parents[3])
PACKAGES = ("torch", "transformers", "accelerate", "datasets", "pyarrow", "wandb", "hydra-core",
            "megatron-core", "megatron-bridge", "nvidia-resiliency-ext", "transformer-engine")
DONE_MARKER = "TRAINING_DONE"
NAN_MARKER = "FAILED_NAN"
# Megatron's normal-completion line; the auto-requeue chain stops when it appears in the job log.
COMPLETION_LINE = "[after training is done] datetime: {now}"


def git_state() -> dict[str, Any]:
    def run(*a):
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, timeout=30)

    try:
        commit = run("rev-parse", "HEAD").stdout.strip() or None
        dirty = bool(run("status", "--porcelain", "--untracked-files=no").stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"commit": commit, "dirty": dirty}


def package_versions() -> dict[str, str]:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def write_launch_records(run_dir: Path, *, cfg, spec, mode, peft, cluster, alloc, nodes, plan, command,
                         launch_cmd) -> None:
    from pipeline.training.preflight import plan_dict

    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / "config.yaml", yaml.safe_dump(cfg, sort_keys=False))
    write_json(run_dir / "launch.json", {"model": spec.name, "engine": spec.engine, "mode": mode, "peft": peft,
                                         "cluster": cluster.name, "nodes": nodes})
    write_json(run_dir / "preflight.json", plan_dict(plan))
    manifest_path = run_dir / "manifest.json"
    manifest = read_json(manifest_path) if manifest_path.exists() else {"run_dir": str(run_dir), "launches": []}
    manifest["launches"].append({
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "launch_command": launch_cmd,
        "git": git_state(),
        "host": socket.gethostname(),
        "slurm_job_id": alloc.job_id,
        "slurm_restart_count": alloc.restart_count,
        "node_list": alloc.node_list,
        "nodes": nodes,
        "cluster": cluster.name,
        "packages": package_versions(),
        "container_image": os.environ.get("PIPELINE_IMAGE") if os.environ.get("PIPELINE_RUNTIME", "venv") != "venv" else None,
        "runtime": os.environ.get("PIPELINE_RUNTIME", "venv"),
    })
    write_json(manifest_path, manifest)


def wait_for_records(run_dir: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not (run_dir / "launch.json").exists():
        if time.time() > deadline:
            raise RuntimeError(f"node 0 did not write {run_dir}/launch.json within {timeout}s")
        time.sleep(1)


def load_run(run_dir: Path) -> tuple[dict, dict]:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return cfg, read_json(run_dir / "launch.json")


class ProgressLog:
    """progress.ndjson + metrics_summary.json, written by rank 0."""

    def __init__(self, run_dir: Path, tokens_per_step: int):
        self.run_dir = run_dir
        self.path = run_dir / "progress.ndjson"
        self.tokens_per_step = tokens_per_step
        self.t0 = time.time()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        rec = {"step": step, "time": round(time.time() - self.t0, 3),
               "tokens": step * self.tokens_per_step, **{k: _num(v) for k, v in metrics.items()}}
        append_line(self.path, json.dumps(rec))

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill mid-write
        return out

    def summarize(self, status: str, final_step: int, train_seconds: float | None = None) -> dict:
        recs = [r for r in self.records() if isinstance(r.get("loss"), (int, float))]
        losses = [r["loss"] for r in recs]
        summary = {
            "status": status,
            "final_step": final_step,
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "best_loss": min(losses) if losses else None,
            "loss_decreased": (losses[-1] < losses[0]) if len(losses) >= 2 else None,
            "logged_steps": len(recs),
            "tokens": final_step * self.tokens_per_step,
        }
        if train_seconds:
            summary["train_seconds"] = round(train_seconds, 2)
        if recs:
            span = recs[-1]["time"] - recs[0]["time"]
            steps = recs[-1]["step"] - recs[0]["step"]
            if span > 0 and steps > 0:
                summary["seconds_per_step"] = round(span / steps, 3)
                summary["tokens_per_second"] = round(steps * self.tokens_per_step / span, 1)
        write_json(self.run_dir / "metrics_summary.json", summary)
        return summary


def _num(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return v
