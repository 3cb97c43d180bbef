"""Lock files: ``submit`` freezes each run's fully resolved configs and commands, with the code revision.

``<experiment dir>/locks/<experiment>/<label>.lock.yaml`` holds, per phase, the resolved training config (or the
exact pipeline arguments of an export / coherence / upload-all job). Submitting a run again compares its plan
with its lock; any difference is refused with the differing keys (``pretrain:optimizer.lr``) unless the user
re-locks explicitly (``submit --relock``). The keys that differ between launches of one run by design
(``records.IDENTITY_IGNORED``: W&B's directory, the tests' fault injection) are not compared.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import yamlio
from pipeline.common.errors import UserError
from pipeline.common.io import write_text
from pipeline.experiment.plan import RunPlan, lock_dir
from pipeline.experiment.spec import Experiment
from pipeline.training.records import config_diff, git_state


def lock_path(exp: Experiment, label: str) -> Path:
    return lock_dir(exp) / f"{label}.lock.yaml"


def lock_body(exp: Experiment, rp: RunPlan) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    for job in rp.jobs:
        entry: dict[str, Any] = {"kind": job.kind, "script": job.script}
        if job.kind == "train":
            entry.update({"run_name": job.run_name, "config": job.cfg})
        else:
            entry["args"] = list(job.args)
        phases[job.phase] = entry
    return {"experiment": exp.name, "run": rp.run.label, "values": rp.run.values,
            "locked_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "git": git_state(),
            "phases": phases}


def read_lock(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        body = yamlio.read_record(path)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise UserError(f"lock file {path} is unreadable ({exc.__class__.__name__}): fix it, or re-lock with "
                        "submit --relock") from None
    if not isinstance(body, dict) or not isinstance(body.get("phases"), dict):
        raise UserError(f"lock file {path} is not a lock (no phases): re-lock with submit --relock")
    for name, entry in body["phases"].items():  # a hand-edited `phases: {train: 5}` must not crash render
        if not isinstance(entry, dict) or not isinstance(entry.get("config", {}), dict) \
                or not isinstance(entry.get("args", []), list):
            raise UserError(f"lock file {path}: phase {str(name)[:60]!r} is not a phase record (a mapping with kind "
                            "and config or args): fix it, or re-lock with submit --relock")
    return body


def lock_diff(lock: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """``{"<phase>:<key>": (locked, now)}`` for every difference between a lock and the current plan."""
    out: dict[str, tuple[Any, Any]] = {}
    old, new = lock.get("phases") or {}, current.get("phases") or {}
    for phase in sorted(set(old) | set(new)):
        a, b = old.get(phase), new.get(phase)
        if a is None or b is None:
            out[f"{phase}"] = ("(absent)" if a is None else "present", "(absent)" if b is None else "present")
            continue
        if a.get("kind") != b.get("kind"):
            out[f"{phase}:kind"] = (a.get("kind"), b.get("kind"))
        if "config" in a or "config" in b:
            for k, v in config_diff(a.get("config") or {}, b.get("config") or {}).items():
                out[f"{phase}:{k}"] = v
        elif a.get("args") != b.get("args"):
            out[f"{phase}:args"] = (a.get("args"), b.get("args"))
    return out


def check(exp: Experiment, rp: RunPlan, relock: bool) -> str | None:
    """A problem line when the run differs from its lock (and ``relock`` was not given), else None."""
    lock = read_lock(lock_path(exp, rp.run.label))
    if lock is None or relock:
        return None
    diff = lock_diff(lock, lock_body(exp, rp))
    if not diff:
        return None
    shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(diff.items())[:6])
    more = f" (+{len(diff) - 6} more)" if len(diff) > 6 else ""
    return (f"differs from its lock {lock_path(exp, rp.run.label)} ({shown}{more}): revert the change, or re-lock "
            "it with submit --relock (a changed run that already ran also needs --allow-config-change or a new name)")


def write(exp: Experiment, rp: RunPlan, force: bool = False) -> Path | None:
    """Write the run's lock when it has none (or ``force``); returns the path written, or None."""
    path = lock_path(exp, rp.run.label)
    if path.exists() and not force:
        return None
    write_text(path, "# written by pipeline_experiment.py submit; commit it with the experiment file\n"
               + yaml.safe_dump(lock_body(exp, rp), sort_keys=False))
    return path
