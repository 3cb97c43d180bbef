"""Per-iteration export locks, shared by ``export`` and ``upload-all`` (one writer per ``hf/``).

    <ckpt>/in_progress_checkpoints/iter_NNNNNNN.lock   created with O_EXCL, holding pid, host and time

A lock whose process is gone (same host) is taken over at once; one from another host after ``ttl`` seconds.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from pipeline.checkpoint import layout
from pipeline.common.procs import pid_alive

log = logging.getLogger(__name__)
LOCK_DIR = "in_progress_checkpoints"


def iteration_lock_path(ckpt: Path, iteration: int) -> Path:
    return Path(ckpt) / LOCK_DIR / f"{layout.iter_dirname(iteration)}.lock"


class Lock:
    """``acquire()`` -> True when this process now holds the lock; ``holder()`` says who holds it."""

    def __init__(self, path: Path, ttl: float):
        self.path, self.ttl = path, ttl

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                stale = self._stale_content()
                if stale is None:
                    return False
                # Take over atomically: move the stale lock aside, then check it is the one judged stale (two
                # processes taking over at once: the loser moved the winner's fresh lock, and puts it back).
                aside = self.path.with_name(f"{self.path.name}.{os.getpid()}.stale")
                try:
                    os.replace(self.path, aside)
                except FileNotFoundError:
                    continue
                try:
                    moved = aside.read_text()
                except OSError:
                    moved = ""
                if moved != stale:
                    try:
                        os.link(aside, self.path)  # restore the live lock unless a newer one is already there
                    except OSError:
                        pass
                    aside.unlink(missing_ok=True)
                    return False
                aside.unlink(missing_ok=True)
                log.warning("taking over stale lock %s", self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return True
        return False

    def _stale_content(self) -> str | None:
        """The lock file's text when its owner is gone (or it is older than the TTL), else None."""
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError):
            return "" if self._stale() else None
        return text if self._stale() else None

    def _stale(self) -> bool:
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            try:
                return time.time() - self.path.stat().st_mtime > self.ttl
            except FileNotFoundError:
                return True
        alive = pid_alive(info.get("pid")) if info.get("host") == socket.gethostname() else None
        if alive is not None:  # this host's process: the lock is stale exactly when it is gone
            return not alive
        try:
            return time.time() - float(info.get("time", 0)) > self.ttl
        except (TypeError, ValueError):
            return True

    def release(self) -> None:
        """Remove the lock only while it is still ours (another host may have taken it over after the TTL)."""
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return
        if info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)

    def holder(self) -> str:
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return "an unknown process"
        return f"pid {info.get('pid')} on {info.get('host')}"

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
