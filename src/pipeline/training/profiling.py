"""Profiling a training run: the step window both engines record, the local engine's capture, and the
reading of a trace (``pipeline_training_profile.py``; the guide is docs/profiling.md).

The config is Megatron Bridge 0.6.2's ``ProfilingConfig`` (``profiling.*``, typed in config/schema.py). Its
torch-profiler schedule (megatron/bridge/training/profiling.py: ``wait=start-1, warmup=1, active=end-start``,
``prof.step()`` at each step's start) records the steps ``max(start, 1) .. end-1``, counted 1-based as
progress.ndjson and iter_* count them; :func:`window` is that rule, and the Bridge harness checks it against Bridge's
own scheduler (tests/bridge). The local engine records exactly those steps with ``torch.profiler``: the profiler
is created at the window's first step and stopped at its last, so outside the window no profiler exists (nothing
is recorded, nothing is paid). Each recorded step is a ``ProfilerStep#N`` range (torch's own name, N the run's step)
holding ``forward``, ``backward`` and ``optimizer`` ranges, which the summary splits the step time by.

Memory: CUDA's allocator history (``torch.cuda.memory._record_memory_history``, dumped as a snapshot pickle at the
window's end, as Bridge does at ``profile_step_end``) exists only on CUDA; on CPU the profiler's ``profile_memory``
records every allocation in the trace (``[memory]`` events), which the summary reads for the peak and the plot.

Traces are Chrome-trace JSON (gzip), where Bridge writes its own: ``<run_dir>/torch_profile/rank-N.json.gz`` (the
Bridge engine points ``logger.tensorboard_dir`` at ``<run_dir>/tb`` when it is unset, and Bridge writes to
``<tensorboard_dir>/../torch_profile``). Each capture is a ``profile`` event in events.ndjson and is listed under
``profile`` in metrics_summary.json (training/records.py).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import json
import math
import os
import pickle
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.common.errors import UserError
from pipeline.common.io import read_regular, write_output_bytes
from pipeline.config.schema import ProfilingConfig, TrainingConfig

TRACE_DIR = "torch_profile"
TRACE_MAX_BYTES = 2**30  # a trace of a few steps of a large model is tens to hundreds of MiB
# Bridge 0.6.2's defaults for the fields our schema leaves unset (megatron/bridge/training/config.py).
BRIDGE_DEFAULTS: dict[str, Any] = {"profile_step_start": 10, "profile_step_end": 12, "profile_ranks": [0]}
SPLIT = ("forward", "backward", "optimizer")


def window(start: int, end: int) -> tuple[int, int] | None:
    """The steps (first, last; 1-based, inclusive) Bridge's torch profiler records for ``profile_step_start`` /
    ``profile_step_end``; None when it records none."""
    first, last = max(start, 1), end - 1
    return (first, last) if last >= first else None


def trace_path(run_dir: Path, rank: int) -> Path:
    """Where a rank's trace is written, on both engines."""
    return Path(run_dir) / TRACE_DIR / f"rank-{rank}.json.gz"


def _value(p: ProfilingConfig, name: str) -> Any:
    v = getattr(p, name)
    return BRIDGE_DEFAULTS.get(name) if v is None else v


def enabled(p: ProfilingConfig) -> bool:
    """Whether anything is captured by torch (the profiler, or memory history)."""
    return bool(p.use_pytorch_profiler or p.record_memory_history)


def check(cfg: TrainingConfig, *, train_iters: int, world: int, local: bool) -> tuple[list[str], list[str]]:
    """The profiling settings' problems (one line each, refused before launch) and warnings. Bridge 0.6.2's own
    ``ProfilingConfig.finalize`` asserts the first three on the GPU node, after the queue."""
    p = cfg.profiling
    problems: list[str] = []
    warnings: list[str] = []
    start, end = _value(p, "profile_step_start"), _value(p, "profile_step_end")
    if p.use_pytorch_profiler and p.use_nsys_profiler:
        problems.append("profiling.use_pytorch_profiler and profiling.use_nsys_profiler are both true: Megatron "
                        "Bridge allows one profiler at a time; pick one")
    if start >= 0 and end >= 0 and end < start:  # each bound of its own: the schema's (a negative one is unset here)
        problems.append(f"profiling.profile_step_end({end}) must be >= profiling.profile_step_start({start})")
    if p.use_nsys_profiler and local:
        problems.append("profiling.use_nsys_profiler is for Megatron Bridge under nsys on GPUs; the local engine "
                        "records with torch.profiler: set profiling.use_pytorch_profiler=true instead")
    if problems or not enabled(p):
        return problems, warnings
    steps = window(start, end)
    if steps is None:
        problems.append(f"profiling.profile_step_start({start}) .. profile_step_end({end}) records no step: the "
                        f"torch profiler records steps start .. end-1 (e.g. profile_step_start={max(start, 1)} "
                        f"profile_step_end={max(start, 1) + 2} for two steps)")
        return problems, warnings
    if train_iters and steps[0] > train_iters:
        problems.append(f"profiling records steps {steps[0]}-{steps[1]} but train.train_iters is {train_iters}: no "
                        f"step would be recorded; set profiling.profile_step_start / profile_step_end within the run")
    elif train_iters and steps[1] > train_iters:
        warnings.append(f"profiling window steps {steps[0]}-{steps[1]} runs past train.train_iters({train_iters}): "
                        f"steps {steps[0]}-{train_iters} are recorded and the trace is written at the run's end")
    ranks = _value(p, "profile_ranks")
    bad = [r for r in ranks if r < 0 or r >= world]
    if bad:
        problems.append(f"profiling.profile_ranks {bad} are not ranks of this run (world size {world}: ranks 0.."
                        f"{world - 1}); [] records every rank")
    return problems, warnings


@dataclass(frozen=True)
class Capture:
    """What one rank of the local engine records: built from the config by :meth:`for_rank` (None: nothing)."""

    first: int
    last: int
    rank: int
    trace: Path
    memory: bool
    shapes: bool
    stack: bool
    snapshot: Path | None  # CUDA only: the allocator-history pickle

    @classmethod
    def for_rank(cls, p: ProfilingConfig, rank: int, run_dir: Path, cuda: bool) -> Capture | None:
        if not enabled(p):
            return None
        steps = window(_value(p, "profile_step_start"), _value(p, "profile_step_end"))
        ranks = _value(p, "profile_ranks")
        if steps is None or (ranks and rank not in ranks):
            return None
        snapshot = None
        if p.record_memory_history and cuda:
            base = Path(p.memory_snapshot_path or Path(run_dir) / TRACE_DIR / "memory_snapshot.pickle")
            snapshot = base.with_name(f"{base.stem}_{rank}{base.suffix}")  # Bridge's _{rank} before the extension
        return cls(first=steps[0], last=steps[1], rank=rank, trace=trace_path(run_dir, rank),
                   memory=bool(p.record_memory_history), shapes=bool(p.pytorch_profiler_collect_shapes),
                   stack=bool(p.pytorch_profiler_collect_callstack), snapshot=snapshot)


@dataclass
class Recorder:
    """The local engine's torch.profiler over :class:`Capture`'s steps: ``begin(step)`` / ``end(step)`` at each
    optimizer step's start and end, ``span(name)`` around its parts. The profiler exists only inside the window."""

    capture: Capture
    cuda: bool = False
    prof: Any = None
    done: bool = False
    _step: Any = None
    _open: dict[str, Any] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)

    def begin(self, step: int) -> None:
        import torch

        c = self.capture
        if self.prof is None and not self.done and c.first <= step <= c.last:  # a resume inside the window: from here
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            if c.snapshot is not None:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.prof = profile(activities=acts, profile_memory=c.memory, record_shapes=c.shapes, with_stack=c.stack)
            self.prof.start()
        if self.prof is not None:
            self._step = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._step.__enter__()
            self.steps.append(step)

    def end(self, step: int, final: bool = False) -> dict | None:
        """Close the step's range; at the window's last step (or the run's last, ``final``) stop and write the trace.
        Returns the capture's record (for events.ndjson) when it wrote one."""
        if self.prof is None:
            return None
        self.close_open()
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if step < self.capture.last and not final:
            return None
        return self.finish()

    def finish(self) -> dict | None:
        if self.prof is None:
            return None
        import torch

        c, t0 = self.capture, time.perf_counter()
        self.close_open()
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        self.prof.stop()
        c.trace.parent.mkdir(parents=True, exist_ok=True)
        tmp = c.trace.with_name(f".{c.trace.name}.{os.getpid()}.json.gz")
        self.prof.export_chrome_trace(str(tmp))
        os.replace(tmp, c.trace)
        self.prof, self.done = None, True
        rec: dict[str, Any] = {"rank": c.rank, "steps": [self.steps[0], self.steps[-1]], "trace": str(c.trace),
                               "memory": "profile_memory" if c.memory else None}
        if c.snapshot is not None:
            c.snapshot.parent.mkdir(parents=True, exist_ok=True)
            with open(c.snapshot, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
            torch.cuda.memory._record_memory_history(enabled=None)
            rec.update(memory="cuda_memory_history", snapshot=str(c.snapshot))
        rec["export_seconds"] = round(time.perf_counter() - t0, 3)
        return rec

    def span(self, name: str):
        """A ``record_function`` range while the profiler runs; nothing outside the window."""
        if self.prof is None:
            return contextlib.nullcontext()
        import torch

        return torch.profiler.record_function(name)

    def open(self, name: str) -> None:
        """Open a range closed by :meth:`close` (for a part that begins and ends in two callbacks)."""
        if self.prof is not None and name not in self._open:
            self._open[name] = self.span(name)
            self._open[name].__enter__()

    def close(self, name: str) -> None:
        rf = self._open.pop(name, None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def close_open(self) -> None:
        for name in list(self._open):
            self.close(name)


# ---- reading a trace ------------------------------------------------------------------------------------------
@dataclass
class Trace:
    path: Path
    events: list[dict]
    meta: dict[str, Any]


def load_trace(path: Path) -> Trace:
    """A Chrome-trace JSON file as torch.profiler writes it (``export_chrome_trace``; gzip when it ends in .gz).
    torch has no public loader for these (its ``_trace_validator`` reads them the same way)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"trace {path} does not exist")
    try:  # bounded, compressed or not: a gzip bomb must not be inflated whole into memory
        raw = read_regular(path, TRACE_MAX_BYTES)
        if path.suffix == ".gz":
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as gz:
                raw = gz.read(TRACE_MAX_BYTES + 1)
            if len(raw) > TRACE_MAX_BYTES:
                raise OSError(errno.EFBIG, f"inflates past {TRACE_MAX_BYTES >> 20} MiB")
        data = json.loads(raw.decode("utf-8"))
    except (OSError, EOFError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # nested past the limit too
        why = str(exc).splitlines()[0][:120] if str(exc) else ""
        raise UserError(f"{path} is not a torch.profiler trace (Chrome-trace JSON, gzip when .gz): "
                        f"{type(exc).__name__}: {why}") from None
    events = data if isinstance(data, list) else data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise UserError(f"{path} is JSON but not a Chrome trace (no traceEvents list)")
    meta = {k: v for k, v in data.items() if k != "traceEvents"} if isinstance(data, dict) else {}
    return Trace(path, [e for e in events if isinstance(e, dict)], meta)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _complete(ev: dict) -> bool:
    """A complete event ("X") with a name, a start and a duration (a trace's other events are skipped, as any trace
    reader skips what it cannot place: an event without a name, or a list as its name, was a traceback)."""
    return ev.get("ph") == "X" and isinstance(ev.get("name"), str) and _finite(ev.get("ts")) and _finite(ev.get("dur"))


def _self_times(events: list[dict]) -> dict[str, list[float]]:
    """Per CPU operator name: [self microseconds, calls]; self = duration less its direct children's (same thread)."""
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        if _complete(e) and e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out: dict[str, list[float]] = {}
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, its children's time]
        for e in evs:
            _pop_ended(stack, e["ts"], out)
            stack.append([e, 0.0])
        _pop_ended(stack, None, out)
    return out


def _pop_ended(stack: list[list], until: float | None, out: dict[str, list[float]]) -> None:
    """Close the open events that ended by ``until`` (all with None), adding their self time to ``out``."""
    while stack and (until is None or stack[-1][0]["ts"] + stack[-1][0]["dur"] <= until):
        ev, kids = stack.pop()
        if stack:
            stack[-1][1] += ev["dur"]
        if ev.get("cat") == "cpu_op":
            acc = out.setdefault(ev["name"], [0.0, 0])
            acc[0] += max(0.0, ev["dur"] - kids)
            acc[1] += 1


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _category(name: str) -> str | None:
    if name in SPLIT:
        return name
    if name.startswith("Optimizer.step#"):  # torch.optim's own range (a trace without the suite's ranges)
        return "optimizer"
    return None


COLLECTIVE = re.compile(r"all_?to_?all|all_?reduce|all_?gather|reduce_?scatter|broadcast|send_?recv", re.I)


def summarize(trace: Trace, top: int = 10) -> dict[str, Any]:
    """Top operators by self time, the step time split, collectives, and memory of one trace."""
    evs = trace.events
    steps = []
    for e in evs:
        m = re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name", "")))
        if m and _complete(e):
            steps.append((int(m.group(1)), e))
    steps.sort(key=lambda s: s[0])
    ranges = [e for e in evs if _complete(e) and e.get("cat") == "user_annotation" and _category(str(e["name"]))]
    step_rows = []
    for n, s in steps:
        a, b = s["ts"], s["ts"] + s["dur"]
        parts = {}
        for cat in SPLIT:
            iv = [(max(a, e["ts"]), min(b, e["ts"] + e["dur"])) for e in ranges if _category(e["name"]) == cat
                  and e.get("pid") == s.get("pid") and e.get("tid") == s.get("tid") and e["ts"] < b
                  and e["ts"] + e["dur"] > a]
            parts[cat] = _union(iv) / 1000
        parts["other"] = max(0.0, s["dur"] / 1000 - sum(parts.values()))
        step_rows.append({"step": n, "ms": s["dur"] / 1000, **{f"{k}_ms": v for k, v in parts.items()}})
    selfs = _self_times(evs)
    total_self = sum(v[0] for v in selfs.values()) or 1.0
    ops = [{"name": k, "self_ms": v[0] / 1000, "calls": int(v[1]), "percent": 100 * v[0] / total_self}
           for k, v in sorted(selfs.items(), key=lambda kv: -kv[1][0])[:top]]
    kernels: dict[str, list[float]] = {}
    for e in evs:
        if _complete(e) and e.get("cat") == "kernel":
            acc = kernels.setdefault(str(e["name"]), [0.0, 0])
            acc[0] += e["dur"]
            acc[1] += 1
    comm: dict[str, float] = {}
    on_gpu = any(e.get("cat") == "kernel" for e in evs)
    for e in evs:  # the collectives' outermost record: NCCL kernels on a GPU, c10d's ops on CPU (gloo)
        name = str(e.get("name", ""))
        if _complete(e) and ((on_gpu and e.get("cat") == "kernel" and "nccl" in name.lower())
                             or (not on_gpu and e.get("cat") == "cpu_op" and name.startswith("c10d::"))):
            m = COLLECTIVE.search(name)
            if m:
                kind = m.group(0).lower().replace("_", "")
                comm[kind] = comm.get(kind, 0.0) + e["dur"] / 1000
    memory = memory_series(trace)
    return {
        "trace": str(trace.path),
        "steps": step_rows,
        "top_operators": ops,
        "top_kernels": [{"name": k, "ms": v[0] / 1000, "calls": int(v[1])}
                        for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
        "collectives_ms": comm,
        "peak_memory_bytes": {dev: max(v for _, v in series) for dev, series in memory.items()},
    }


def memory_series(trace: Trace) -> dict[str, list[tuple[float, int]]]:
    """Allocated bytes over time per device (``[memory]`` events of profile_memory): {"cpu": [(ms, bytes), ...]}."""
    out: dict[str, list[tuple[float, int]]] = {}
    t0 = min((e["ts"] for e in trace.events if _finite(e.get("ts"))), default=0.0)
    for e in trace.events:
        if e.get("name") != "[memory]" or not isinstance(e.get("args"), dict):
            continue
        a = e["args"]
        total = a.get("Total Allocated")
        if not _finite(total) or not _finite(e.get("ts")):  # NaN / Infinity (JSON's extension) is no amount
            continue
        dev = "cpu" if a.get("Device Type", 0) == 0 else f"cuda:{a.get('Device Id', 0)}"
        out.setdefault(dev, []).append(((e["ts"] - t0) / 1000, int(total)))
    for series in out.values():
        series.sort()
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_summary(s: dict[str, Any], rank_steps: str = "") -> str:
    lines = [f"trace: {s['trace']}{rank_steps}"]
    rows = s["steps"]
    if rows:
        mean = sum(r["ms"] for r in rows) / len(rows)
        lines.append(f"step time: {len(rows)} step(s) recorded, mean {mean:.1f} ms ("
                     + ", ".join(f"step {r['step']}: {r['ms']:.1f} ms" for r in rows) + ")")
        for part in (*SPLIT, "other"):
            ms = sum(r[f"{part}_ms"] for r in rows) / len(rows)
            lines.append(f"  {part:<10} {ms:9.1f} ms  {100 * ms / mean if mean else 0:5.1f}%")
    else:
        lines.append("step time: the trace has no ProfilerStep#N ranges (not a training-step trace)")
    lines.append(f"top {len(s['top_operators'])} operators by self time (CPU):")
    lines.append(f"  {'self ms':>9} {'%':>6} {'calls':>6}  name")
    for op in s["top_operators"]:
        lines.append(f"  {op['self_ms']:9.2f} {op['percent']:5.1f}% {op['calls']:6d}  {op['name']}")
    if s["top_kernels"]:
        lines.append(f"top {len(s['top_kernels'])} GPU kernels by time:")
        for k in s["top_kernels"]:
            lines.append(f"  {k['ms']:9.2f} ms {k['calls']:6d}  {k['name'][:100]}")
    if s["collectives_ms"]:
        lines.append("collectives: " + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(s["collectives_ms"].items())))
    if s["peak_memory_bytes"]:
        lines.append("peak memory: " + ", ".join(f"{d} {_mib(b)} allocated" for d, b in s["peak_memory_bytes"].items()))
    else:
        lines.append("peak memory: not recorded (profiling.record_memory_history=true records it)")
    return "\n".join(lines)


def plot_memory(trace: Trace, out: Path) -> Path | None:
    """Allocated memory over the trace's time, one line per device, with the recorded steps shaded; None when the
    trace holds no memory events."""
    series = memory_series(trace)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if out.is_dir():
        raise UserError(f"--plot {out} is a folder: name the PNG file to write")
    t0 = min((e["ts"] for e in trace.events if _finite(e.get("ts"))), default=0.0)
    fig, ax = plt.subplots(figsize=(9, 4))
    for dev, pts in series.items():
        ax.step([t for t, _ in pts], [b / 2**20 for _, b in pts], where="post", label=dev)
    for e in trace.events:
        m = re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name", "")))
        if m and _complete(e):
            a = (e["ts"] - t0) / 1000
            ax.axvspan(a, a + e["dur"] / 1000, alpha=0.08, color="grey")
            ax.text(a, 0, f" step {m.group(1)}", fontsize=7, va="bottom")
    ax.set_xlabel("time in trace (ms)")
    ax.set_ylabel("allocated (MiB)")
    ax.set_title(f"memory: {trace.path.name}")
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=100, format="png")
    plt.close(fig)
    # atomic; a FIFO, a device or a folder there, or a place that cannot be written, is one line
    return write_output_bytes(out, png.getvalue())
