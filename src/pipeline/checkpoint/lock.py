"""Per-iteration export locks, shared by ``export`` and ``upload-all`` (one writer per ``hf/``).

    <ckpt>/in_progress_checkpoints/iter_NNNNNNN.lock   created with O_EXCL, holding pid, host and time

A lock whose process is gone (same host) is taken over at once; one from another host after ``ttl`` seconds
(``common/locks.py``'s ExpiringLock: every lock of the suite is there).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.common import layout
from pipeline.common.locks import ExpiringLock as Lock

__all__ = ["LOCK_DIR", "Lock", "iteration_lock_path"]
LOCK_DIR = "in_progress_checkpoints"


def iteration_lock_path(ckpt: Path, iteration: int) -> Path:
    return Path(ckpt) / LOCK_DIR / f"{layout.iter_dirname(iteration)}.lock"
