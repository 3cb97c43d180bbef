"""Logging set-up shared by every entry point: one format, tagged with host and rank."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import time

from pipeline.common.errors import UserError
from pipeline.common.shell import terminal_lines


class TerminalSafeFormatter(logging.Formatter):
    """A log line's control characters escaped (newlines and tabs kept): a folder name or a file's text in a message
    shows its ESC sequences and CRs rather than obeying them."""

    def format(self, record: logging.LogRecord) -> str:
        return terminal_lines(super().format(record))


def setup_logging(name: str = "pipeline", quiet: bool = False) -> logging.Logger:
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    fmt = f"%(asctime)s [{host}:r{rank}] %(levelname)s %(name)s: %(message)s"
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(TerminalSafeFormatter(fmt, datefmt="%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(logging.WARNING if quiet else logging.INFO)
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(name)


def progress_interval() -> float:
    """PIPELINE_PROGRESS_INTERVAL in seconds (default 30); a value that is not a finite number >= 0 is one line."""
    raw = os.environ.get("PIPELINE_PROGRESS_INTERVAL", "30")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise UserError(f"PIPELINE_PROGRESS_INTERVAL={raw!r} is not a number of seconds >= 0")
    return value


class Progress:
    """Progress for long loops that works in a Slurm log: a tqdm bar on a terminal, and otherwise a plain line
    every ``interval`` seconds (``PIPELINE_PROGRESS_INTERVAL``, default 30): done / total, rate, ETA, extras.

        with Progress("tokenize train", total=n, unit="chunk") as p:
            for ...: p.update(1)                      # or p.update(1, loss=2.31)
    """

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", quiet: bool = False,
                 interval: float | None = None, logger: logging.Logger | None = None):
        self.desc, self.total, self.unit, self.quiet = desc, total, unit, quiet
        self.interval = progress_interval() if interval is None else interval
        self.log = logger or logging.getLogger("pipeline.progress")
        self.n = self.n0 = 0  # n0: where this process started (a resumed run), for the rate
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit)

    def update(self, k: int = 1, **extra) -> None:
        self.n += k
        if self.bar is not None:
            self.bar.update(k)
            if extra:
                self.bar.set_postfix(extra, refresh=False)
            return
        now = time.monotonic()
        if not self.quiet and now - self.last >= self.interval:
            self.last = now
            self.log.info("%s", self.line(now, extra))

    def line(self, now: float, extra: dict | None = None) -> str:
        elapsed = max(now - self.t0, 1e-9)
        rate = (self.n - self.n0) / elapsed
        parts = [f"{self.desc}: {self.n}" + (f"/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else "")
                 + f" {self.unit}", f"{rate:.3g} {self.unit}/s"]
        if self.total and rate > 0:
            parts.append(f"ETA {max(0.0, (self.total - self.n) / rate):.0f} s")
        parts += [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in (extra or {}).items()]
        return ", ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif not self.quiet and self.n:
            self.log.info("%s (done in %.0f s)", self.line(time.monotonic()), time.monotonic() - self.t0)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
