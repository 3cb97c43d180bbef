"""Atomic writes: a file or directory is either absent or complete, never half-written.

One writer per output: every temporary is a sibling named ``.<name>.<host>~<pid>~<random>.tmp``, so it
names its owner. A temporary is removed as stale only when its owner is provably dead (same host, and no
process with that pid); a live writer's temporary, or one from another host, is left alone. A writer whose
temporary vanished (someone removed it) fails with :class:`ConcurrentWriteError` instead of recreating it.

Modes: what is published gets the mode an ordinary write under the user's umask gives (``0o666 & ~umask``
for files, ``0o777 & ~umask`` for directories), not the 0600/0700 of ``tempfile.mkstemp``/``mkdtemp``, so
outputs on a team's group-shared directory stay readable by the team. The team's shared files (the bad-node
log, the lock files beside it and beside the container directory's setup, the image record) are created
group-writable whatever the creator's umask (:func:`shared_mode`, :func:`make_shared_dirs`): a teammate under the
default umask 022 must be able to change what another created.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.common.errors import UserError
from pipeline.common.procs import pid_alive

_TMP_MIDDLE = re.compile(r"(?P<host>[A-Za-z0-9_-]{1,64})~(?P<pid>[0-9]{1,10})~(?P<rand>[a-z0-9]{1,16})")


class ConcurrentWriteError(UserError):
    """Another writer removed or replaced this writer's temporary: the output was not published."""


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname().split(".")[0])[:64] or "host"


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{_host()}~{os.getpid()}~{secrets.token_hex(4)}.tmp")


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (/proc), else via os.umask."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shared_mode(umask: int | None = None, *, directory: bool = False) -> int:
    """The mode of a team-shared file (directory): the umask's ordinary mode plus group read and write (and, for
    a directory, group search), whatever the umask takes away from the group. Others keep what the umask gives."""
    umask = current_umask() if umask is None else umask
    return ((0o777 if directory else 0o666) & ~umask) | (0o070 if directory else 0o060)


def make_shared_dirs(directory: str | os.PathLike) -> None:
    """``mkdir -p`` whose new directories are group-writable (:func:`shared_mode`); a new directory inside a setgid
    one inherits the group and the setgid bit from the kernel. Existing directories are left as they are."""
    directory = Path(directory)
    missing = []
    for d in [directory, *directory.parents]:
        if d.is_dir():
            break
        missing.append(d)
    directory.mkdir(parents=True, exist_ok=True)
    for d in reversed(missing):
        with contextlib.suppress(OSError):  # made by another process between the two lines: theirs, not ours
            if d.stat().st_uid == os.geteuid():
                os.chmod(d, shared_mode(directory=True) | (d.stat().st_mode & 0o2000))


def _file_mode(st_mode: int, umask: int) -> int:
    exe = 0o111 if st_mode & 0o100 else 0
    return (0o666 | exe) & ~umask


def apply_umask_modes(path: str | os.PathLike, recursive: bool = True) -> None:
    """Give ``path`` (and, for a directory, everything under it) the modes an ordinary write would."""
    umask = current_umask()
    path = Path(path)
    if path.is_symlink():
        return
    if path.is_dir():
        os.chmod(path, 0o777 & ~umask)
        if recursive:
            for dirpath, dirnames, filenames in os.walk(path):
                for d in dirnames:
                    p = os.path.join(dirpath, d)
                    if not os.path.islink(p):
                        os.chmod(p, 0o777 & ~umask)
                for fn in filenames:
                    p = os.path.join(dirpath, fn)
                    if not os.path.islink(p):
                        os.chmod(p, _file_mode(os.lstat(p).st_mode, umask))
    elif path.exists():
        os.chmod(path, _file_mode(path.stat().st_mode, umask))


def tmp_owner(tmp: Path, name: str) -> tuple[str, int] | None:
    """(host, pid) of a temporary of output ``name``, or None when it is not one of ours."""
    prefix, suffix = f".{name}.", ".tmp"
    n = tmp.name
    if not (n.startswith(prefix) and n.endswith(suffix)):
        return None
    m = _TMP_MIDDLE.fullmatch(n[len(prefix):-len(suffix)])
    return (m.group("host"), int(m.group("pid"))) if m else None


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove temporaries of ``path`` whose owner is provably dead (same host, pid gone); return them."""
    path = Path(path)
    removed = []
    host = _host()
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        owner = tmp_owner(tmp, path.name)
        # not a real pid (None): never claim it is dead
        if owner is None or owner[0] != host or owner[1] == os.getpid() or pid_alive(owner[1]) is not False:
            continue
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        removed.append(tmp)
    return removed


_TMP_DIR_NAME = re.compile(r"\..+\.[A-Za-z0-9_-]{1,64}~[0-9]{1,10}~[a-z0-9]{1,16}\.tmp")


def _vanished(tmp: Path, path: Path) -> ConcurrentWriteError:
    return ConcurrentWriteError(f"temporary {tmp} vanished while writing {path}: another writer removed it; "
                                "run one writer per output (nothing was published)")


KERNEL_FILESYSTEMS = ("/proc", "/sys", "/dev")  # /dev/shm aside: a real (memory) filesystem


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why a job could not create or write the folder ``path``, found before it is queued (nothing is created): a
    file where the folder or one above it must be, or a nearest existing folder this user may not write (the file
    system's root aside: on a machine where none of the path exists, such as a laptop planning a cluster's job,
    that says nothing about the cluster). An evaluation into a file as --output-dir, an import into <file>/sub,
    would plan OK and fail after the model had loaded."""
    p = Path(os.path.abspath(path))
    real = Path(os.path.realpath(p))
    kernel = next((k for k in KERNEL_FILESYSTEMS if real == Path(k) or Path(k) in real.parents), None)
    if kernel is not None and not (real == Path("/dev/shm") or Path("/dev/shm") in real.parents):
        # root may "write" there by the permission bits, and nothing can be created
        return f"{p} is in {kernel}, a kernel filesystem, not a place for outputs"
    for anc in [p, *p.parents]:
        if anc.is_symlink() and not anc.exists():
            return f"{anc} is a dangling link"
        if not anc.exists():
            continue
        if not anc.is_dir():
            return f"{anc} is a file, not a folder" if anc == p else f"{anc} is a file, so {p} cannot be created"
        if anc != Path(anc.anchor) and not os.access(anc, os.W_OK | os.X_OK):
            return (f"{anc} is not writable by you" if anc == p
                    else f"{p} cannot be created: {anc} is not writable by you")
        return None
    return None


def check_parent(path: Path) -> None:
    """Create ``path``'s parent, but never recreate a vanished temporary directory of an atomic_path."""
    for anc in [path.parent, *path.parent.parents]:
        if _TMP_DIR_NAME.fullmatch(anc.name) and not anc.is_dir():
            raise _vanished(anc, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where a directory must be, no permission, read-only file system
        raise UserError(f"cannot create directory {path.parent}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling path; on success it is renamed onto ``path`` (file or directory)."""
    path = Path(path)
    check_parent(path)
    remove_stale_temporaries(path)
    tmp = _tmp_name(path)
    os.mkdir(tmp, 0o777)  # ordinary mode under the umask (mkdtemp would make it 0700)
    target = tmp / path.name
    try:
        yield target
        if not tmp.is_dir():
            raise _vanished(tmp, path)
        if not target.exists() and not target.is_symlink():
            raise ConcurrentWriteError(f"{target} vanished before it could be published as {path}")
        apply_umask_modes(target)
        _publish(target, path, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(target: Path, path: Path, tmp: Path) -> None:
    """os.replace ``target`` onto ``path``; an existing directory is moved aside first (then removed)."""
    for _ in range(10):
        if path.is_dir() and not path.is_symlink():
            aside = tmp / ".replaced"
            try:
                os.replace(path, aside)
            except FileNotFoundError:
                pass  # another writer moved it away first
        try:
            os.replace(target, path)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR):
                raise
            # another writer published a directory between our move-aside and our rename: go again
            if (tmp / ".replaced").exists():
                shutil.rmtree(tmp / ".replaced", ignore_errors=True)
    raise ConcurrentWriteError(f"could not publish {path}: other writers kept replacing it")


def write_bytes(path: str | os.PathLike, data: bytes, *, like: os.stat_result | None = None,
                shared: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename).

    The result has the umask's ordinary mode (group-writable with ``shared``: :func:`shared_mode`), or, with
    ``like``, that stat's mode, group and (when this user may) owner - for rewriting a shared file in place.
    """
    path = Path(path)
    check_parent(path)
    remove_stale_temporaries(path)
    tmp = _tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileNotFoundError:
        check_parent(path)
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if like is not None:
            os.chmod(tmp, like.st_mode & 0o7777)
            for uid, gid in ((like.st_uid, like.st_gid), (-1, like.st_gid)):
                try:
                    os.chown(tmp, uid, gid)
                    break
                except OSError:
                    continue
            os.chmod(tmp, like.st_mode & 0o7777)  # chown may clear setuid/setgid bits
        elif shared:
            os.chmod(tmp, shared_mode())
        else:
            apply_umask_modes(tmp)
        try:
            os.replace(tmp, path)
        except FileNotFoundError:
            raise _vanished(tmp, path) from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_text(path: str | os.PathLike, text: str, *, shared: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (temp file + fsync + rename); ``shared``: group-writable."""
    return write_bytes(path, text.encode("utf-8"), shared=shared)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


JSON_MAX_BYTES = 64 * 2**20  # a record of ours is KBs; an HF tokenizer.json tens of MB


class NotRegularFile(OSError):
    """A record's path is a FIFO, a device, a socket or a folder: never read (a FIFO blocks the reader for ever,
    /dev/zero never ends)."""


def read_regular(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``max_bytes``; else an OSError (NotRegularFile, or
    EFBIG) that every reader of records already handles as unreadable. The open does not block on a FIFO
    (O_NONBLOCK), and nothing past ``max_bytes`` is read (a FIFO config.yaml or owner record would hang `runs` or a
    training launch, and a manifest linked to /dev/zero would be read into memory)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
        if st.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"over {max_bytes} bytes", str(path))
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:  # grew while read
            raise OSError(errno.EFBIG, f"over {max_bytes} bytes", str(path))
        return data
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """JSON from a regular file of at most ``max_bytes`` (:func:`read_regular`); OSError or ValueError otherwise."""
    try:
        return json.loads(read_regular(path, max_bytes))
    except RecursionError:  # nested past the interpreter's limit: as malformed as any other bad JSON
        raise ValueError(f"{path}: JSON nested too deeply") from None


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line (for NDJSON progress logs); a line is written with a single write call."""
    path = Path(path)
    check_parent(path)
    with open(path, "a") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()


DIRECT_OUTPUTS = ("/dev/null", "/dev/stdout", "/dev/stderr")


def write_output_text(path: str | os.PathLike, text: str) -> Path:
    """A user-named output file: written atomically like every output, except the streams of DIRECT_OUTPUTS, which
    are written to directly. A directory, a FIFO, a device or a socket is refused in one line (an atomic replace
    would have turned a FIFO or /dev/full into a regular file), and so is a place that cannot be written."""
    return write_output_bytes(path, text.encode())


def write_output_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """:func:`write_output_text` for bytes (the profile's memory PNG must not replace a FIFO, nor /dev/full)."""
    p = Path(path)
    if str(p) in DIRECT_OUTPUTS:
        with open(p, "wb") as f:
            f.write(data)
        return p
    try:
        st = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        st = None  # (a file where a folder must be: the write says "cannot create directory")
    except OSError as exc:
        raise UserError(f"cannot write {p}: {exc.strerror or exc}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UserError(f"{p} is a directory: name a file to write (e.g. {p / 'results.csv'})")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UserError(f"{p} is not a regular file (a FIFO, device or socket): name a regular file, or /dev/stdout")
    try:
        return write_bytes(p, data)
    except OSError as exc:  # a read-only folder, /proc: one line, not a traceback
        raise UserError(f"cannot write {p}: {exc.strerror or exc}") from None
