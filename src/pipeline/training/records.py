"""Run records, as the SilentSwarm artifact set: one run directory holds

  config.yaml           the fully resolved config (recipe defaults < YAML < overrides)
  launch.json           model, mode, peft, cluster profile: what the engine needs to start
  manifest.json         git commit and dirty flag, exact command, node list, package versions, image,
                        one entry per launch (a requeued or restarted run appends)
  preflight.json        the plan the preflight computed
  view.json             the typed view the engines read (training/views.py): parallel layout, batch, data paths
  progress.ndjson       one line per logged step (loss, grad norm, learning rate, tokens, time)
  events.ndjson         the run's timeline: launches, attempts, steps, saves, ends (training/goodput.py), and
                        each profiler capture (``profile``: rank, steps, trace path; training/profiling.py)
  metrics_summary.json  first/final/best loss, steps, time, throughput, status, where the time went (goodput),
                        and the profiler traces (``profile``)
  torch_profile/        rank-N.json.gz: torch.profiler traces of the profiling window (both engines)
  TRAINING_DONE         completion marker (also written beside checkpoint.save, where upload-all --poll looks)
  FAILED_NAN            the run stopped on a NaN; restarts refuse to run
  SAVE_AND_EXIT         a request file: checkpoint at the next step boundary and exit (for a requeue)
  checkpoints/          iter_NNNNNNN/ + latest_checkpointed_iteration.txt (written last)

This module is the only writer of these files; both engines (local, Megatron Bridge) write them through it,
so they share one schema.
"""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import importlib.metadata
import json
import math
import os
import secrets
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import layout, paths, yamlio
from pipeline.common.errors import UserError
from pipeline.common.io import append_line, read_json, read_regular, write_json, write_text
from pipeline.common.locks import release, try_flock, write_holder
from pipeline.common.mappings import flatten
from pipeline.common.procs import pid_alive
from pipeline.config.schema import TrainingConfig
from pipeline.training import goodput
from pipeline.training.preflight import continues_from
from pipeline.training.views import write_view

ROOT = paths.repo_root()  # evaluated at import: PIPELINE_ROOT of the process
PACKAGES = ("torch", "transformers", "accelerate", "datasets", "pyarrow", "wandb", "hydra-core",
            "megatron-core", "megatron-bridge", "nvidia-resiliency-ext", "transformer-engine")
DONE_MARKER = layout.TRAINING_DONE
NAN_MARKER = "FAILED_NAN"
SAVE_AND_EXIT = "SAVE_AND_EXIT"
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
                         launch_cmd, view=None) -> None:
    runtime = os.environ.get("PIPELINE_RUNTIME", "venv")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    write_json(run_dir / "launch.json", {"model": spec.name, "engine": spec.engine, "mode": mode, "peft": peft,
                                         "cluster": cluster.name, "nodes": nodes})
    write_json(run_dir / "preflight.json", plan.as_dict())
    if view is not None:
        write_view(run_dir, view)
    manifest_path = run_dir / "manifest.json"
    manifest: dict[str, Any] = read_json(manifest_path) if manifest_path.exists() else {"run_dir": str(run_dir),
                                                                                          "launches": []}
    manifest["launches"].append({
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
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
        "container_image": os.environ.get("PIPELINE_IMAGE") if runtime != "venv" else None,
        "runtime": runtime,
    })
    write_json(manifest_path, manifest)
    goodput.record_job(run_dir, alloc.job_id, alloc.restart_count)
    claim_save(cfg.checkpoint.save, run_dir, cfg)  # after the owner check of plan_launch


# ---- run identity: one run directory, one resolved config ----------------------------------------------
# Keys that legitimately differ between launches of the same run (a requeue, an auto-requeue successor, a
# continuation from another shell): where W&B writes its files ($WANDB_DIR), the tests' fault injection, and the
# profiler's settings (which steps of this launch to trace: they change no result), which describe an attempt, not
# the run. Everything else is the run's identity.
IDENTITY_IGNORED = ("logger.wandb_save_dir", "pipeline.local.fault_inject_", "profiling.")


def config_diff(old: dict, new: dict, ignore: tuple[str, ...] = IDENTITY_IGNORED) -> dict[str, tuple[Any, Any]]:
    """The dotted keys whose values differ (``{key: (old, new)}``), both configs normalised through YAML (as
    ``config.yaml`` stores them); keys starting with an ``ignore`` prefix are left out."""
    a = flatten(yaml.safe_load(yaml.safe_dump(old)) or {})
    b = flatten(yaml.safe_load(yaml.safe_dump(new)) or {})
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not k.startswith(ignore)}


LAUNCH_IDENTITY = ("model", "mode", "peft")  # launch.json's part of the identity: what the config does not say


def check_run_identity(run_dir: Path, cfg: TrainingConfig, allow_change: bool = False,
                       launch: dict[str, Any] | None = None) -> dict[str, tuple[Any, Any]]:
    """Refuse (UserError, exit 2) to resume, or to call finished, a run directory whose recorded ``config.yaml``
    differs from ``cfg``: a relaunch with other overrides under the same run name is another run. ``launch`` (the
    ``model``, ``mode`` and ``peft`` of this launch) is compared with the recorded ``launch.json`` as well, as
    ``launch.model`` and so on: a finished qwen3 run relaunched as another model said "already finished" and
    rewrote launch.json, and an unfinished one loaded its weights into the other architecture. Another model is
    refused even with ``allow_change`` (no weights carry over); another mode or peft passes with it. Returns the
    differing keys (empty when the config is the same or the directory is new); ``allow_change`` lets them pass."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    try:
        old = yamlio.read_record(path)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise UserError(f"{path} is unreadable ({exc.__class__.__name__}): the run directory's recorded config is "
                        "corrupt; use a new run name (logger.wandb_exp_name=NEW) or remove the directory") from None
    diff = config_diff(old if isinstance(old, dict) else {}, cfg.to_dict())
    recorded = _recorded_launch(Path(run_dir)) if launch is not None else None
    if recorded is not None and launch is not None:
        for key in LAUNCH_IDENTITY:
            if recorded.get(key) != launch.get(key):
                diff[f"launch.{key}"] = (recorded.get(key), launch.get(key))
    if "launch.model" in diff:
        a, b = diff["launch.model"]
        raise UserError(f"run directory {run_dir} holds a run of model {a!r}, not {b!r}: its checkpoints and records "
                        f"are that model's; give this run a new name (logger.wandb_exp_name=NEW or --run-dir)")
    if diff and not allow_change:
        shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(diff.items())[:8])
        more = f" (+{len(diff) - 8} more)" if len(diff) > 8 else ""
        raise UserError(f"run directory {run_dir} holds a run with a different config ({shown}{more}); it is not "
                        "resumed or finished with this one: give this run a new name (logger.wandb_exp_name=NEW) or "
                        "pass --allow-config-change to continue it with the new config")
    return diff


def _recorded_launch(run_dir: Path) -> dict[str, Any] | None:
    """launch.json as recorded, or None when there is none (a directory from before launch records); a record that
    is not a JSON object is corrupt (UserError)."""
    path = run_dir / "launch.json"
    if not path.is_file():
        return None
    try:
        rec = read_json(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is unreadable ({exc.__class__.__name__}): the run directory's launch record is "
                        "corrupt; use a new run name (logger.wandb_exp_name=NEW) or remove the directory") from None
    if not isinstance(rec, dict):
        raise UserError(f"{path} is not a JSON object: the run directory's launch record is corrupt; use a new run "
                        "name (logger.wandb_exp_name=NEW) or remove the directory")
    return rec


# ---- checkpoint ownership: one run per checkpoint.save ----------------------------------------------------
# A run records itself in its checkpoint.save (OWNER_FILE: its run directory and config identity, written
# atomically at launch); another run pointing its save there is refused before launch and at experiment render.
# Without the record, two runs sharing a save overwrote each other's iterations, and a new run resumed from another
# run's weights (exit 0). Starting from another run's weights is checkpoint.load / pretrained_checkpoint.
OWNER_FILE, OWNER_LOCK = layout.OWNER_FILE, layout.OWNER_LOCK  # the save folder's format is the layout's


def config_identity(cfg: TrainingConfig) -> str:
    """A digest of the run's identity: its resolved config less the keys that may differ between launches
    (:data:`IDENTITY_IGNORED`), normalised through YAML as ``config.yaml`` stores it."""
    flat = flatten(yaml.safe_load(yaml.safe_dump(cfg.to_dict())) or {})
    kept = {k: v for k, v in flat.items() if not k.startswith(IDENTITY_IGNORED)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_save_owner(save: str | Path | None, run_dir: Path, cfg: TrainingConfig, allow_change: bool = False) -> None:
    """Refuse (UserError, one line naming the owner) a ``checkpoint.save`` that belongs to another run: its owner
    record names another run directory, or this run directory with another config identity (unless
    ``allow_change``: --allow-config-change continues it). A save that holds checkpoints and no owner record (written
    before ownership was recorded, or by hand) is accepted only when this run directory's recorded config.yaml
    names it as its checkpoint.save (its own earlier launches); otherwise refused. The same run relaunching (a
    requeue, a restart) is accepted."""
    if not save:
        return
    save, run_dir = Path(str(save)).resolve(), Path(run_dir).resolve()
    owner_file = save / OWNER_FILE
    use = ("give this run its own checkpoint.save (or another run name); to start from that run's weights set "
           "checkpoint.load or checkpoint.pretrained_checkpoint to it")
    if (owner_file.exists() or owner_file.is_symlink()) and not owner_file.is_file():
        # a FIFO there would block the launch for ever after its preflight
        raise UserError(f"checkpoint.save {save} has an owner record {owner_file} that is not a regular file: remove "
                        f"it (this suite writes it), or {use}")
    if owner_file.is_file():
        try:
            owner = read_json(owner_file)
        except (OSError, ValueError) as exc:
            raise UserError(f"checkpoint.save {save} has an unreadable owner record {owner_file} "
                            f"({exc.__class__.__name__}): {use}") from None
        owner = owner if isinstance(owner, dict) else {}
        if str(owner.get("run_dir")) != str(run_dir):
            raise UserError(f"checkpoint.save {save} belongs to run {owner.get('run_dir')} (owner record "
                            f"{owner_file}, since {owner.get('since', '?')}), not to this run {run_dir}: {use}")
        if owner.get("identity") != config_identity(cfg) and not allow_change:
            raise UserError(f"checkpoint.save {save} belongs to run {run_dir} with another config (identity "
                            f"{owner.get('identity')} != {config_identity(cfg)}): {use}, or pass "
                            "--allow-config-change to continue it with the new config")
        return
    if not save.is_dir() or not layout.holds_iterations(save):
        return
    recorded = None
    try:
        old = yamlio.read_record(run_dir / "config.yaml")
        recorded = ((old or {}).get("checkpoint") or {}).get("save")
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        pass
    if recorded and Path(str(recorded)).resolve() == save:
        return  # this run's own checkpoints, written before owner records existed
    raise UserError(f"checkpoint.save {save} holds checkpoints but no owner record ({OWNER_FILE}) and run "
                    f"directory {run_dir} does not name it: written by another run or by hand; {use} (or, if it "
                    f"is this run's, write {owner_file} with this run's run_dir)")


def claim_save(save: str | Path | None, run_dir: Path, cfg: TrainingConfig) -> Path | None:
    """Record this run as the owner of its ``checkpoint.save`` (atomically; rewritten on every launch, keeping the
    first ``since``). Call after :func:`check_save_owner`. The claim is one atomic step: the owner record is read
    again and written under an exclusive ``flock`` of :data:`OWNER_LOCK` in the save, and the first record is
    published with ``os.link`` (which fails when the name exists: exclusive on a shared file system where a flock may
    not reach another host), so of two trainings launched at the same moment on one save (both passed
    :func:`check_save_owner` before either had written) exactly one claims it and the other is refused in one line
    naming the winner."""
    if not save:
        return None
    save, run_dir = Path(str(save)).resolve(), Path(run_dir).resolve()
    path = save / OWNER_FILE
    save.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    fd, _ = try_flock(save / OWNER_LOCK, wait=True)
    assert fd is not None  # wait=True blocks until this process holds it
    try:
        for _ in range(3):
            if not path.exists():  # the first claim: published only if no other claim got there first
                tmp = write_json(save / f"{OWNER_FILE}.{socket.gethostname()}~{os.getpid()}~{secrets.token_hex(4)}.tmp",
                                 {"run_dir": str(run_dir), "identity": config_identity(cfg), "since": now})
                try:
                    os.link(tmp, path)
                    return path
                except FileExistsError:
                    continue  # another host's claim won the race: read it
                except OSError as exc:  # a file system without hard links: the flock alone (one host's launches)
                    if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                        raise
                    os.replace(tmp, path)
                    return path
                finally:
                    tmp.unlink(missing_ok=True)
            try:
                owner = read_json(path)
            except (OSError, ValueError):
                owner = None  # unreadable: the launch's check refused it unless it is this run's to rewrite
            if isinstance(owner, dict) and str(owner.get("run_dir")) != str(run_dir):
                raise UserError(f"checkpoint.save {save} belongs to run {owner.get('run_dir')} (owner record {path}, "
                                f"since {owner.get('since', '?')}; claimed while this run was starting), not to this "
                                f"run {run_dir}: give this run its own checkpoint.save (or another run name)")
            since = owner.get("since") if isinstance(owner, dict) else None
            write_json(path, {"run_dir": str(run_dir), "identity": config_identity(cfg), "since": since or now})
            return path
        raise UserError(f"checkpoint.save {save}: could not claim its owner record {path} (other launches kept "
                        "replacing it): launch one training per checkpoint.save")
    finally:
        release(fd)


WRITER_LOCK = ".writer.lock"


def _writer_record() -> dict[str, Any]:
    env = os.environ
    return {"slurm_job_id": env.get("SLURM_JOB_ID"), "slurm_step_id": env.get("SLURM_STEP_ID"),
            "slurm_node_id": env.get("SLURM_NODEID"), "slurm_restart_count": env.get("SLURM_RESTART_COUNT") or "0",
            "host": env.get("SLURMD_NODENAME") or socket.gethostname(), "pid": os.getpid(),
            "started": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


def same_writer(holder: dict, me: dict) -> bool:
    """Whether the launch ``me`` belongs to the training that holds the run directory's lock (``holder``; both as
    :func:`_writer_record` writes them). The same Slurm job is not enough: a second launch inside one ``salloc``
    shares the job id. The same writer is a later incarnation of the job (a requeue keeps the id and counts
    ``SLURM_RESTART_COUNT`` up; the killed incarnation's lock can outlive it on a shared file system), or another
    node's launcher of the same job step (same step id, another node id). Anything else - no step, another step,
    the same node of the same step - is a second training."""
    job = me.get("slurm_job_id")
    if not job or str(holder.get("slurm_job_id")) != str(job):
        return False
    if str(holder.get("slurm_restart_count") or "0") != str(me.get("slurm_restart_count") or "0"):
        return True
    step = me.get("slurm_step_id")
    node = holder.get("slurm_node_id")
    return (step is not None and str(holder.get("slurm_step_id")) == str(step)
            and node is not None and str(node) != str(me.get("slurm_node_id")))


def claim_run_dir(run_dir: Path) -> int | None:
    """One writer per run directory. Takes an exclusive ``flock`` on ``<run_dir>/.writer.lock`` and returns its file
    descriptor, inheritable, so the lock lives on in torchrun / ft_launcher after the launcher execs into it (and
    with it, torchrun's restarts of the ranks); it ends when that process tree ends. A second launch while the lock
    is held is refused (UserError naming the holder: its Slurm job and step, host and pid); the launchers of the same
    training (:func:`same_writer`: the other nodes of one job step, a requeued job's next incarnation) return None.
    Before this, a relaunch on a live run "resumed" and both wrote (progress.ndjson read 8, 10, 11, 9, 12, ...); and
    before the step was part of the rule, a second launch inside the same ``salloc`` rewrote the live run's records."""
    run_dir.mkdir(parents=True, exist_ok=True)
    me = _writer_record()
    fd, raw = try_flock(run_dir / WRITER_LOCK)  # common/locks.py
    if fd is None:
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = {}
        holder = holder if isinstance(holder, dict) else {}
        if same_writer(holder, me):
            return None  # this training's own writer (another node's launcher, or a requeue's previous incarnation)
        pid = holder.get("pid", "?")
        alive = " (alive)" if holder.get("host") == me["host"] and pid_alive(pid) else ""
        where = f"pid {pid}{alive} on host {holder.get('host', '?')}"
        who = (f"Slurm job {holder['slurm_job_id']} step {holder.get('slurm_step_id') or '(none)'} ({where})"
               if holder.get("slurm_job_id") else where)
        raise UserError(f"run directory {run_dir} is being written by {who}, started {holder.get('started', '?')}: "
                        "one training per run directory; wait for it (or cancel it), or use another run "
                        "(logger.wandb_exp_name / --run-dir)") from None
    write_holder(fd, json.dumps(me))
    os.set_inheritable(fd, True)
    return fd


def wait_for_records(run_dir: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not (run_dir / "launch.json").exists():
        if time.time() > deadline:
            raise RuntimeError(f"node 0 did not write {run_dir}/launch.json within {timeout}s")
        time.sleep(1)


def load_run(run_dir: Path) -> tuple[TrainingConfig, dict]:
    """The run's resolved config (typed: the ranks read attributes) and its launch record."""
    cfg = TrainingConfig.from_dict(yamlio.read_record(run_dir / "config.yaml") or {})
    return cfg, read_json(run_dir / "launch.json")


class ProgressLog:
    """progress.ndjson + metrics_summary.json, written by one rank.

    A run resumed from iteration R (an in-job restart or a requeue) redoes the steps after R, so the lines past R
    that the interrupted attempt logged are superseded: ``start(R)`` drops them (one atomic rewrite) before the
    first new line, and ``records()`` keeps the last line per step. Each step then appears once and the
    summary's counts agree with the file."""

    def __init__(self, run_dir: Path, tokens_per_step: int, writer: bool = True, origin: int = 0):
        self.run_dir = run_dir
        self.path = run_dir / "progress.ndjson"
        self.tokens_per_step = tokens_per_step
        self.origin = origin  # a run continuing another's iteration N counts its steps on from N (StartPoint)
        self.t0 = time.time()
        self.clock = goodput.Clock(run_dir, writer)  # the run's timeline (events.ndjson), on the writing rank

    def start(self, resume_step: int) -> int:
        """Supersede the lines past ``resume_step``; returns how many were dropped."""
        if not self.path.exists():
            return 0
        lines = self.path.read_text(errors="replace").splitlines()
        keep = []
        for line in lines:
            try:
                step = json.loads(line).get("step")
            except (ValueError, RecursionError, AttributeError):  # cut by a kill mid-write, or junk: not a step
                continue
            if isinstance(step, int) and step <= resume_step:
                keep.append(line)
        if len(keep) != len(lines):
            write_text(self.path, "".join(x + "\n" for x in keep))
        return len(lines) - len(keep)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        rec = {"step": step, "time": round(time.time() - self.t0, 3),
               "tokens": step * self.tokens_per_step, **{k: _num(v) for k, v in metrics.items()}}
        append_line(self.path, json.dumps(rec))

    def records(self) -> list[dict]:
        return read_progress(self.run_dir)

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
            "tokens": (final_step - self.origin) * self.tokens_per_step,  # this run's own
        }
        if self.origin:
            summary["start_step"] = self.origin  # it continued another run's iteration start_step
        if train_seconds:
            summary["train_seconds"] = round(train_seconds, 2)
        # Throughput from consecutive lines of the same attempt (``time`` restarts at 0 in a resumed or requeued
        # attempt, so a pair whose time goes back spans a restart and is left out).
        span = steps = 0.0
        timed = [r for r in recs if "time" in r]
        for a, b in zip(timed, timed[1:]):
            dt, ds = b["time"] - a["time"], b["step"] - a["step"]
            if isinstance(dt, (int, float)) and dt > 0 and ds > 0:
                span += dt
                steps += ds
        if span > 0 and steps > 0:
            summary["seconds_per_step"] = round(span / steps, 3)
            summary["tokens_per_second"] = round(steps * self.tokens_per_step / span, 1)
        try:
            events = goodput.read_events(self.run_dir)
        except UserError:  # its own timeline, replaced by something unreadable: the summary without it
            events = []
        split = goodput.split(events)
        if split is not None:
            summary["goodput"] = split
        traces = profile_records(events)
        if traces:
            summary["profile"] = traces
        write_json(self.run_dir / "metrics_summary.json", summary)
        return summary


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def progress_ok(rec: Any) -> bool:
    """A progress.ndjson line with the field types :meth:`ProgressLog.log` writes: ``step`` an integer >= 0 (required),
    ``tokens`` an integer >= 0, ``time`` a finite number >= 0, ``loss`` a number or the text of a non-finite one. A
    line with a field of the wrong type is skipped, as a line cut by a kill is (junk types crashed ``experiment
    status`` and ``csv``); a missing ``time`` or ``tokens`` leaves the line out of the throughput only (one line
    without ``time`` crashed the end-of-run summary, so training exited 0 without TRAINING_DONE)."""
    if not isinstance(rec, dict):
        return False
    step, tokens, t, loss = rec.get("step"), rec.get("tokens", 0), rec.get("time", 0), rec.get("loss")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return False
    if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0):
        return False
    if not (_number(t) and t >= 0):
        return False
    return loss is None or _number(loss) or loss in ("nan", "inf", "-inf")


PROGRESS_MAX_BYTES = 2**30  # ~5M logged steps of ~200 bytes


def read_progress(run_dir: Path | None) -> list[dict]:
    """progress.ndjson, one record per step (a later line for a step supersedes an earlier one: a redone step), lines
    that are not JSON or fail :func:`progress_ok` skipped. The one reader of the file (the run's summary, the
    experiment board and its CSV)."""
    path = Path(run_dir) / "progress.ndjson" if run_dir is not None else None
    if path is None or not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    # a regular file, read up to PROGRESS_MAX_BYTES (a FIFO swapped in after the check never blocks the reader)
    for line in read_regular(path, PROGRESS_MAX_BYTES).decode("utf-8", "replace").splitlines():
        if not line.startswith("{"):  # a record is an object: blank lines and junk skipped without a parse (a file
            continue                  # of blank lines would take 20 s per 4 MiB)
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # a line cut by a kill mid-write; an int past 4300 digits; too deep
            continue
        if progress_ok(rec):
            by_step[rec["step"]] = rec
    return [by_step[k] for k in sorted(by_step)]


# metrics_summary.json's fields and their types (``num``: a finite number); others are kept as they are
_SUMMARY_TYPES = {"status": "str", "final_step": "int", "first_loss": "num", "final_loss": "num", "best_loss": "num",
                  "loss_decreased": "bool", "logged_steps": "int", "tokens": "int", "train_seconds": "num",
                  "seconds_per_step": "num", "tokens_per_second": "num", "goodput": "dict"}


def _typed(v: Any, kind: str) -> bool:
    if kind == "str":
        return isinstance(v, str)
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "num":
        return _number(v)
    return isinstance(v, dict)


MAX_SUMMARY_BYTES = 16 << 20  # a summary is a few kB


def read_summary(run_dir: Path | None) -> dict:
    """metrics_summary.json, or {} when it is absent or unreadable; a field of a wrong type is left out (as if it
    were not written), and so is a goodput part that is not a finite number (``goodput.split``'s own fields)."""
    path = Path(run_dir) / "metrics_summary.json" if run_dir is not None else None
    try:  # a regular file of a summary's size: a link to /dev/zero was a MemoryError
        if path is None or not path.is_file() or path.stat().st_size > MAX_SUMMARY_BYTES:
            return {}
        s = read_json(path)
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(s, dict):
        return {}
    out = {k: v for k, v in s.items() if k not in _SUMMARY_TYPES or v is None or _typed(v, _SUMMARY_TYPES[k])}
    if isinstance(out.get("goodput"), dict):
        g = out["goodput"]
        bad = [k for k, v in g.items() if k not in ("jobs", "submitted", "ended") and v is not None and not _number(v)]
        jobs_ok = isinstance(g.get("jobs", []), list)
        out["goodput"] = None if bad or not jobs_ok else g
    return out


PROFILE_EVENT = "profile"


def record_profile(run_dir: Path, capture: dict[str, Any]) -> None:
    """A profiler capture (``training/profiling.py``: rank, steps, trace path, memory) as a ``profile`` event in
    events.ndjson; any rank writes its own (one line, appended)."""
    append_line(Path(run_dir) / goodput.EVENTS, json.dumps({"event": PROFILE_EVENT, "t": round(time.time(), 3),
                                                            **capture}))


def profile_records(events: list[dict]) -> list[dict]:
    """The captures of a run's events, the latest per rank (a restart that records the window again replaces it)."""
    by_rank: dict[Any, dict] = {}
    for ev in events:
        if ev.get("event") == PROFILE_EVENT and isinstance(ev.get("trace"), str):
            by_rank[ev.get("rank")] = {k: v for k, v in ev.items() if k not in ("event", "t")}
    return [by_rank[k] for k in sorted(by_rank, key=lambda r: (not isinstance(r, int), r if isinstance(r, int) else 0))]


def _num(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return v


# ---- where a run starts (both engines) --------------------------------------------------------------------
@dataclass(frozen=True)
class StartPoint:
    """Where this attempt of a run starts, decided at job start from the disk (both engines, one rule):

      resume    this run's own save holds a complete checkpoint: go on from its latest (a requeue, a restart)
      continue  ``checkpoint.load`` is another run's save (a phase continuing the one before, as a WSD cooldown
                does): weights, optimizer, scheduler, RNG and iteration of its ``ckpt_step`` (or latest); the
                iteration count goes on from there, checkpoints go to this run's own save
      init      from ``pretrained_checkpoint``'s weights, or from scratch: iteration 0, a fresh optimizer

    ``origin`` is the iteration the run counts on from (the continued iteration; 0 otherwise), ``iteration`` the one
    this attempt starts after, ``path`` the iteration directory it loads (None for init)."""

    kind: str
    iteration: int = 0
    origin: int = 0
    path: Path | None = None


def start_point(cfg: TrainingConfig) -> StartPoint:
    """This attempt's :class:`StartPoint`; a continued checkpoint that is missing or incomplete is a UserError."""
    save = Path(str(cfg.checkpoint.save)) if cfg.checkpoint.save else None

    src = continues_from(cfg)
    origin = 0
    if src is not None:
        step = cfg.checkpoint.ckpt_step
        it = step if step is not None else layout.latest_complete(src)
        if it is None or it not in layout.complete_iterations(src):
            what = f"iteration {step}" if step is not None else "complete checkpoint"
            raise UserError(f"checkpoint.load {src} holds no {what} to continue from (complete: "
                            f"{', '.join(map(str, layout.complete_iterations(src))) or 'none'}): run the phase it "
                            "continues first, or fix checkpoint.load / checkpoint.ckpt_step")
        origin = it
    latest = layout.latest_complete(save) if save is not None else None
    if save is not None and latest is not None:
        return StartPoint("resume", latest, origin, layout.iter_dir(save, latest))
    if src is not None:
        return StartPoint("continue", origin, origin, layout.iter_dir(src, origin))
    return StartPoint("init")


# ---- run markers and the end of a run (both engines) -----------------------------------------------------
def save_request_files(run_dir: Path) -> list[Path]:
    """Files whose existence asks the run to checkpoint at the next step and exit: ``<run_dir>/SAVE_AND_EXIT``
    and the per-job file the batch script touches on the pre-limit signal (``$PIPELINE_SAVE_REQUEST_FILE``)."""
    files = [run_dir / SAVE_AND_EXIT]
    if os.environ.get("PIPELINE_SAVE_REQUEST_FILE"):
        files.append(Path(os.environ["PIPELINE_SAVE_REQUEST_FILE"]))
    return files


def already_finished(run_dir: Path, save: str | Path | None, iters: int) -> bool:
    latest = layout.latest_complete(Path(save)) if save else None
    return (run_dir / DONE_MARKER).exists() or (latest is not None and latest >= iters)


def print_already_finished(iters: int, save: str | Path | None) -> None:
    where = f"checkpoint {layout.iter_dir(Path(save), iters)}" if save else "no checkpoint (checkpoint.save is null)"
    print(f"training already finished: {iters} iterations, {where}")
    print(COMPLETION_LINE.format(now=time.strftime("%Y-%m-%d %H:%M:%S")), flush=True)


def mark_done(run_dir: Path, save: str | Path | None, step: int) -> None:
    """``TRAINING_DONE`` in the run directory and beside ``checkpoint.save`` (the poller's place)."""
    write_text(run_dir / DONE_MARKER, f"{step}\n")
    if save and Path(save).resolve() != run_dir.resolve():
        write_text(Path(save) / DONE_MARKER, f"{step}\n")


def mark_nan(run_dir: Path, progress: ProgressLog, step: int, message: str) -> Path:
    """``FAILED_NAN``: the run stopped on a non-finite loss or gradient norm; restarts refuse to run. Any rank may
    write the marker (the rank that saw the NaN); the timeline and the summary are the writing rank's."""
    write_text(run_dir / NAN_MARKER, message + "\n")
    progress.clock.end("failed_nan", step)
    if progress.clock.writer:
        progress.summarize("failed_nan", step)
    return run_dir / NAN_MARKER


def finish_preempted(run_dir: Path, progress: ProgressLog, step: int, iters: int, seconds: float) -> None:
    """A save-and-exit request was honoured: record it, tell the batch script the checkpoint is saved."""
    (run_dir / SAVE_AND_EXIT).unlink(missing_ok=True)
    if os.environ.get("PIPELINE_SAVE_REQUEST_FILE"):
        write_text(os.environ["PIPELINE_SAVE_REQUEST_FILE"] + ".saved", f"{step}\n")
    progress.clock.end("preempted", step)
    summary = progress.summarize("preempted", step, seconds)
    print(goodput.line(summary.get("goodput")) + " (so far)", flush=True)
    print(f"saved checkpoint at iteration {step} of {iters} and exited for requeue", flush=True)


def finish_completed(run_dir: Path, save: str | Path | None, progress: ProgressLog, step: int,
                     seconds: float) -> dict:
    progress.clock.end("completed", step)
    mark_done(run_dir, save, step)  # first: the run's completion never waits on reading its own records
    summary = progress.summarize("completed", step, seconds)
    print(f"training finished: {step} iterations; loss {summary['first_loss']} -> {summary['final_loss']}; "
          f"checkpoints in {save}; records in {run_dir}", flush=True)
    print(goodput.line(summary.get("goodput")), flush=True)
    print(COMPLETION_LINE.format(now=time.strftime("%Y-%m-%d %H:%M:%S")), flush=True)
    return summary
