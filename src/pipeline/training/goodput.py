"""Where a run's time went (goodput): ``<run_dir>/events.ndjson`` and its split.

The run's own events, appended as they happen and never rewritten (a kill loses at most the line being written):

  job      the launcher on node 0, once per launch (a requeued job launches again under the same id), with Slurm's
           submit, eligible and start times for a batch job; outside Slurm all three are the launcher's start
  attempt  the training rank that writes the records, at its process start (torchrun's in-job restarts make more)
  ready    that rank, as its first step begins (model built, checkpoint restored, data positioned)
  step     each optimizer step's end, with ``seconds`` since the previous boundary (step or save end, or ready)
  save     a checkpoint save's end, with its ``seconds``
  end      the attempt's end: ``completed``, ``preempted`` (saved for a requeue) or ``failed_nan``

:func:`split` turns them into the time from first submission to the end, in parts:

  queue_seconds       waiting for nodes: Slurm's start - submit, and after a requeue start - eligible
  startup_seconds     the first start to the first step (launcher, container, torchrun, imports, model, data)
  step_seconds        the steps that were kept: the last execution of each step
  checkpoint_seconds  checkpoint saves
  redone_seconds      steps run again after a restart (their first run was past the last checkpoint)
  restart_seconds     an attempt's last record to the next attempt's first step, less its queue wait: the kill or
                      save-and-exit, the requeue and Slurm's hold, the new start-up, and the step the kill cut short
  other_seconds       what is left: logging and evaluation between steps, the end of the run; small (a test holds
                      it within a second per attempt)

and ``goodput``: the fraction of the allocated time (jobs running, not queued or held) that produced kept steps.
Steps and saves are measured inside the rank, the rest from wall-clock boundaries, so ``other_seconds`` is a check
that nothing was missed or counted twice, not a remainder by construction. Standard library only.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.common.errors import UserError
from pipeline.common.io import append_line, read_regular
from pipeline.slurm.allocation import job_times

EVENTS = "events.ndjson"
EVENTS_MAX_BYTES = 2**30  # ~5M events of ~200 bytes
PARTS = ("queue_seconds", "startup_seconds", "step_seconds", "checkpoint_seconds", "redone_seconds",
         "restart_seconds", "other_seconds")


def process_start_time() -> float:
    """This process's start, seconds since the epoch (Linux: /proc; elsewhere: now)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def record_job(run_dir: Path, job_id: str | None, restart_count: int) -> None:
    """The ``job`` event (node 0's launcher): Slurm's times for a batch job, else this launcher's start."""
    t = time.time()
    times = job_times(job_id)
    if times is not None and times.batch:
        submit, eligible, start = times.submit, times.eligible, times.start
    else:
        submit = eligible = start = round(process_start_time(), 3)
    append_line(Path(run_dir) / EVENTS, json.dumps({"event": "job", "t": round(t, 3), "job": job_id,
                                                    "restart": restart_count, "submit": submit,
                                                    "eligible": eligible, "start": start}))


class Clock:
    """The writing rank's events (``writer`` False: every method is a no-op, for the other ranks)."""

    def __init__(self, run_dir: Path, writer: bool = True):
        self.path = Path(run_dir) / EVENTS
        self.writer = writer
        self._mark: float | None = None  # perf_counter at the previous boundary
        self._save_began: float | None = None

    def _emit(self, event: str, **fields: Any) -> None:
        if self.writer:
            append_line(self.path, json.dumps({"event": event, "t": round(time.time(), 3), **fields}))

    def attempt(self) -> None:
        if self.writer:
            started = process_start_time()
            append_line(self.path, json.dumps({"event": "attempt", "t": round(started, 3), "pid": os.getpid(),
                                               "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}))

    def ready(self) -> None:
        """The first step begins (called at every step begin; only the first one counts)."""
        if self._mark is None:
            self._mark = time.perf_counter()
            self._emit("ready")

    def step(self, step: int) -> None:
        now = time.perf_counter()
        seconds = now - (self._mark if self._mark is not None else now)
        self._mark = now
        self._emit("step", step=step, seconds=round(seconds, 4))

    def save_begin(self) -> None:
        self._save_began = time.perf_counter()

    def save_end(self, step: int) -> None:
        """A save ended; without :meth:`save_begin` (a hook only after the save) it is timed from the last boundary."""
        now = time.perf_counter()
        began = self._save_began if self._save_began is not None else (self._mark or now)
        self._save_began, self._mark = None, now
        self._emit("save", step=step, seconds=round(now - began, 4))

    def end(self, status: str, step: int) -> None:
        self._emit("end", status=status, step=step)


# ---- the split ----------------------------------------------------------------------------------------------
def read_events(run_dir: Path) -> list[dict]:
    """The run's timeline, lines that are not an event skipped. A file that is not a regular one, past
    EVENTS_MAX_BYTES or unreadable is a UserError (one line): it is never read whole into memory, nor blocks on a
    FIFO."""
    path = Path(run_dir) / EVENTS
    if not os.path.lexists(path):
        return []
    try:
        data = read_regular(path, EVENTS_MAX_BYTES)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # a line cut by a kill mid-write; an int past 4300 digits; too deep
            continue
        if event_ok(rec):
            out.append(rec)
    return out


MAX_T = 1e11  # seconds since the epoch (the year 5138): a later or non-finite time is not one this clock wrote


def _time(v: Any, optional: bool = False) -> bool:
    if v is None:
        return optional
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < MAX_T


def event_ok(rec: Any) -> bool:
    """An events.ndjson line with the field types this module writes. Lines with a wrong type are skipped, as a
    line cut by a kill is: a ``t`` of ``"x"``, ``1e308`` or NaN, a step's ``seconds`` of ``"abc"``, a ``step`` that
    is no integer crashed ``experiment status`` and the run's own summary."""
    if not isinstance(rec, dict) or not isinstance(rec.get("event"), str) or not _time(rec.get("t")):
        return False
    if any(k in rec and not _time(rec[k], optional=True) for k in ("submit", "eligible", "start", "seconds")):
        return False
    if "step" in rec and (not isinstance(rec["step"], int) or isinstance(rec["step"], bool)):
        return False
    return "status" not in rec or isinstance(rec["status"], str)


@dataclass
class _Attempt:
    start: float
    ready: float | None = None
    last: float = 0.0
    steps: list[tuple[int, float]] = field(default_factory=list)
    saves: float = 0.0
    end: str | None = None


@dataclass
class _Job:
    ev: dict
    attempts: list[_Attempt] = field(default_factory=list)


def _jobs(events: list[dict]) -> list[_Job]:
    jobs: list[_Job] = []
    for ev in events:
        kind = ev["event"]
        if kind == "job":
            jobs.append(_Job(ev))
            continue
        if not jobs:  # events before any launch record: a run started before this file existed
            jobs.append(_Job({"t": ev["t"], "submit": ev["t"], "eligible": ev["t"], "start": ev["t"]}))
        if kind == "attempt" or not jobs[-1].attempts:
            jobs[-1].attempts.append(_Attempt(start=ev["t"], last=ev["t"]))
            if kind == "attempt":
                continue
        a = jobs[-1].attempts[-1]
        a.last = max(a.last, ev["t"])
        if kind == "ready" and a.ready is None:
            a.ready = ev["t"]
        elif kind == "step" and isinstance(ev.get("step"), int):
            a.steps.append((ev["step"], float(ev.get("seconds") or 0.0)))
        elif kind == "save":
            a.saves += float(ev.get("seconds") or 0.0)
        elif kind == "end":
            a.end = str(ev.get("status"))
    return [j for j in jobs if j.attempts]  # a launch whose rank never started (an already finished run) adds nothing


def split(events: list[dict]) -> dict[str, Any] | None:
    """The run's time from first submission to its last event, in parts (seconds, rounded to 0.01); None before any
    attempt. Events after the run completed (a launch that found it finished) are left out."""
    last_done = max((i for i, e in enumerate(events) if e["event"] == "end" and e.get("status") == "completed"),
                    default=None)
    if last_done is not None:
        events = events[:last_done + 1]
    jobs = _jobs(events)
    if not jobs:
        return None

    def num(ev: dict, key: str) -> float:
        v = ev.get(key)
        return float(v) if isinstance(v, (int, float)) else float(ev["t"])

    parts = dict.fromkeys(PARTS, 0.0)
    first = jobs[0].ev
    begin = num(first, "submit")
    cursor = begin  # the end of the time accounted so far
    allocated = 0.0
    executions: list[tuple[int, float]] = []
    first_attempt = True
    for k, job in enumerate(jobs):
        start = max(num(job.ev, "start"), cursor)
        if k == 0:
            parts["queue_seconds"] += start - begin
        else:  # after a requeue (or a chain's next job): Slurm's hold, then the queue
            eligible = min(max(num(job.ev, "eligible"), cursor), start)
            parts["restart_seconds"] += eligible - cursor
            parts["queue_seconds"] += start - eligible
        cursor = start
        for a in job.attempts:
            if a.ready is not None:
                parts["startup_seconds" if first_attempt else "restart_seconds"] += max(a.ready - cursor, 0.0)
                cursor = max(cursor, a.ready)
                for s, sec in a.steps:
                    executions.append((s, sec))
                parts["checkpoint_seconds"] += a.saves
                parts["other_seconds"] += max(a.last - cursor, 0.0) - sum(sec for _, sec in a.steps) - a.saves
                cursor = max(cursor, a.last)
            first_attempt = False
        allocated += cursor - start
    # The kept execution of a step is its last one; earlier ones were redone.
    last_of: dict[int, int] = {s: i for i, (s, _) in enumerate(executions)}
    kept = sum(sec for i, (s, sec) in enumerate(executions) if last_of[s] == i)
    parts["step_seconds"] = kept
    parts["redone_seconds"] = sum(sec for _, sec in executions) - kept
    total = cursor - begin
    attempts = sum(len(j.attempts) for j in jobs)
    out: dict[str, Any] = {
        "total_seconds": round(total, 2),
        **{k: round(v, 2) for k, v in parts.items()},
        "allocated_seconds": round(allocated, 2),
        "goodput": round(kept / allocated, 4) if allocated > 0 else None,
        "attempts": attempts,
        "jobs": sorted({str(j.ev.get("job")) for j in jobs if j.ev.get("job")}),
        "requeues": max(0, len(jobs) - 1),
        "kept_steps": len(last_of),
        "redone_steps": len(executions) - len(last_of),
        "submitted": _iso(begin),
        "ended": _iso(cursor),
    }
    return out


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def line(g: dict[str, Any] | None) -> str:
    """One line for logs and the status board."""
    if not g:
        return "-"
    pct = f"{100 * g['goodput']:.0f}%" if isinstance(g.get("goodput"), (int, float)) else "-"
    return (f"goodput {pct} of {g['allocated_seconds']:.0f}s allocated; {g['total_seconds']:.0f}s from submission: "
            f"queue {g['queue_seconds']:.0f}s, start-up {g['startup_seconds']:.0f}s, steps {g['step_seconds']:.0f}s, "
            f"checkpoints {g['checkpoint_seconds']:.0f}s, redone {g['redone_seconds']:.0f}s "
            f"({g['redone_steps']} steps), restarts {g['restart_seconds']:.0f}s ({g['attempts'] - 1}), "
            f"other {g['other_seconds']:.0f}s")
