"""Every lock of the suite, in one module.

Two mechanisms, chosen by what the filesystem and the holder need:

- **flock** (:func:`try_flock`), where one host's processes share a local or flock-capable filesystem: the kernel
  releases the lock when its holder dies, so there is never a stale lock to judge. Three users:
  :func:`exclusive_lock` (an output one writer owns for a whole run: a data root, a tokenize output, an
  experiment's submit; a second writer is refused at once, naming the holder), the bad-node log
  (``slurm/badnodes.py``: writers from many login nodes wait their turn, ``wait=True``) and
  ``training.records.claim_run_dir`` (one training per run directory: its descriptor is inherited through the exec
  into torchrun, so the lock lives as long as the training).
- **an O_EXCL file with a TTL** (:class:`ExpiringLock`), for locks that other hosts must see on a shared
  filesystem where flock may not reach across hosts (the checkpoint iteration locks on Lustre/NFS): the file
  names its holder's pid, host and time; a same-host holder that is gone is taken over at once, another host's
  after the TTL.

Why not ``filelock`` (installed with the local engine): the planner (the login node's isambard_sbatch, which writes
the bad-node log) does not install it; its lock file cannot carry a holder record that the refusal names without
its private descriptor; its descriptor is not inheritable (the run-directory claim must survive the exec into
torchrun); and its soft fallback has no TTL takeover for another host's dead holder. Decision 84.

(``experiment/locks.py`` is no lock: it is the experiment's config snapshot, as a package manager's lock file.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.common.errors import UserError
from pipeline.common.io import ConcurrentWriteError, check_parent, read_regular, shared_mode
from pipeline.common.procs import pid_alive

log = logging.getLogger(__name__)


HOLDER_GRACE_S = 5.0


def open_shared(path: str | os.PathLike, flags: int) -> int:
    """``os.open(path, flags | O_CREAT)`` for a file the team shares: one this call creates is made group-writable
    whatever the umask (:func:`pipeline.common.io.shared_mode`), so a teammate under umask 022 can write and lock it
    too; an existing file keeps its mode."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _open_regular(path, flags)
    try:
        os.fchmod(fd, shared_mode())
    except OSError:
        pass  # a filesystem without modes (some FUSE mounts): the open itself is what matters
    return fd


def _open_regular(path: str | os.PathLike, flags: int) -> int:
    """``os.open`` of an existing file that must be a regular one: opened without blocking (a FIFO in a lock's
    place would block --mark-bad, the export and the training launch for ever), refused in one
    line otherwise."""
    why = (f"{path} is not a regular file (a FIFO, device or folder where this suite keeps a lock or log): remove "
           "it, and it is made again")
    try:
        fd = os.open(path, flags | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO opened for writing with no reader; a folder
            raise UserError(why) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(why)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_flock(path: str | os.PathLike, *, wait: bool = False) -> tuple[int | None, str]:
    """Open ``path`` (created group-writable: :func:`open_shared`) and take an exclusive ``flock`` on it.

    ``(fd, "")`` when this process holds it (:func:`release` unlocks and closes it); ``(None,
    holder)`` when another does and ``wait`` is False, ``holder`` being the text its holder wrote into the file
    (:func:`write_holder`). With ``wait`` it blocks until the lock is free (and opens the file write-only: a
    shared lock file needs no read permission then). A lock file this user may not write (a teammate's, made
    before lock files were group-writable) is opened read-only: ``flock`` needs no write permission, only the
    holder text is then not written."""
    try:
        fd = open_shared(path, os.O_WRONLY if wait else os.O_RDWR)
    except PermissionError:
        if not os.path.isfile(path):
            raise
        fd = _open_regular(path, os.O_RDONLY)
    try:
        if wait:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return fd, ""
        # The holder writes its text just after it takes the lock: a lock held with no text yet is re-read (and
        # re-tried) until the text is there, or the lock is free. Two nodes' launchers of one job read an empty
        # holder in that gap and refused each other. A holder that never writes (it opened a teammate's old lock
        # file read-only) is reported as it is after HOLDER_GRACE_S.
        deadline = time.monotonic() + HOLDER_GRACE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd, ""
            except BlockingIOError:
                holder = os.pread(fd, 1000, 0).decode("utf-8", "replace").strip()
            if holder or time.monotonic() >= deadline:
                os.close(fd)
                return None, holder
            time.sleep(0.02)
    except BaseException:
        os.close(fd)
        raise


def release(fd: int) -> None:
    """Unlock and close (unlocked first: a copy of ``fd`` in a forked child does not keep the lock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def write_holder(fd: int, text: str) -> None:
    """Say who holds the lock of ``fd`` (what a refused second writer reads); nothing on a read-only descriptor."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (text.rstrip("\n") + "\n").encode(), 0)
    except OSError as exc:
        if exc.errno not in (errno.EBADF, errno.EINVAL):
            raise


@contextlib.contextmanager
def exclusive_lock(lock_path: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` or refuse at once (ConcurrentWriteError naming the holder).

    For outputs one writer must own for a whole run (a data root): a second run is refused with one line
    instead of interleaving its writes with the first one's.
    """
    lock_path = Path(lock_path)
    check_parent(lock_path)
    fd, holder = try_flock(lock_path)
    if fd is None:
        raise ConcurrentWriteError(f"{what} is in use by {holder or 'another process'} (lock {lock_path}); wait for "
                                   "it to finish or use another output directory")
    try:
        write_holder(fd, f"pid {os.getpid()} on {socket.gethostname()}")
        yield
    finally:
        release(fd)


def _text(path: Path) -> str:
    """A lock file's text: a regular file of at most 64 KiB (a FIFO there would block the export for ever); an
    OSError otherwise."""
    return read_regular(path, 1 << 16).decode("utf-8", "replace")


def _info(path: Path) -> dict:
    """A lock file's JSON object; {} for other JSON (a holder of ``[1]`` raised AttributeError); ValueError when it
    is not JSON."""
    info = json.loads(_text(path) or "{}")
    return info if isinstance(info, dict) else {}


class ExpiringLock:
    """A lock file created with O_EXCL holding ``{"pid", "host", "time"}``: ``acquire()`` -> True when this process
    now holds it; ``holder()`` says who does. A holder on this host that is gone is taken over at once, one on
    another host after ``ttl`` seconds (its process cannot be asked)."""

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
                    moved = _text(aside)
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
            text = _text(self.path)
        except OSError:
            return "" if self._stale() else None
        return text if self._stale() else None

    def _stale(self) -> bool:
        try:
            info = _info(self.path)
        except (OSError, ValueError):
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
            info = _info(self.path)
        except (OSError, ValueError):
            return
        if info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)

    def holder(self) -> str:
        try:
            info = _info(self.path)
        except (OSError, ValueError):
            return "an unknown process"
        return f"pid {info.get('pid')} on {info.get('host')}"

    def __enter__(self) -> ExpiringLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
