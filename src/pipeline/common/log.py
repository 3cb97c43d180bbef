"""Logging set-up shared by every entry point: one format, tagged with host and rank."""

from __future__ import annotations

import logging
import os
import socket
import sys


def setup_logging(name: str = "pipeline", quiet: bool = False) -> logging.Logger:
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    fmt = f"%(asctime)s [{host}:r{rank}] %(levelname)s %(name)s: %(message)s"
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(logging.WARNING if quiet else logging.INFO)
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(name)


def progress_disabled(quiet: bool = False) -> bool:
    """Progress bars only on a TTY and when not quiet."""
    return quiet or not sys.stderr.isatty()
