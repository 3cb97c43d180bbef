"""The team-shared bad-node log: a plain text file on a parallel filesystem, one entry per line.

    2026-11-30T09:12:44Z<TAB>nid001234<TAB>alice<TAB>login01<TAB>GPU ECC (Xid 48)

Fields: UTC time, node, who, from which host, why. Entries younger than the TTL are excluded from every
submission. Writers from many login nodes take an exclusive ``flock`` on ``<log>.lock`` (a sidecar file,
so the log itself can be replaced atomically); appends and rewrites happen under it, so concurrent
``--mark-bad`` calls never lose or corrupt an entry. Node names are validated against Slurm's hostname
grammar before anything is written; user, host and reason are flattened to one line without control
characters (a tab or newline in ``$LOGNAME`` or a reason can neither forge nor lose an entry). A malformed
line is skipped with a warning, never fatal, and never reaches an ``sbatch`` command line.

The log is the team's file: ``--unmark-bad``/``--update-bad``/``--prune-bad`` rewrite only the entry lines
they change, keep ``#`` comments and lines they cannot parse byte-for-byte in place, keep the file's mode,
group (and owner when allowed), and do not touch the file at all when nothing changes. A log without write
permission is refused before anything is written. The log, its ``.lock`` and a directory made for them are created
group-writable whatever the creator's umask, so every member of the directory's group can mark, update, unmark and
prune (docs/cluster.md, "A team on one cluster").

Entries dated in the future (clock skew, a hand edit) count as active: excluding a node by mistake costs a
little capacity, while dropping a report of a faulty node costs jobs. But they could never expire, so they
are flagged (``!`` in ``--list-bad``) and warned about on every read until someone re-marks or unmarks them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import errno
import getpass
import grp
import math
import os
import pwd
import re
import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from pipeline.common import paths
from pipeline.common.errors import UserError
from pipeline.common.io import make_shared_dirs, read_regular, write_bytes
from pipeline.common.locks import open_shared, release, try_flock
from pipeline.slurm.hostlist import expand, is_hostlist, is_node_name

FMT = "%Y-%m-%dT%H:%M:%SZ"
LOG_MAX_BYTES = 64 * 2**20  # a team's log holds hundreds of lines of about 100 bytes
MAX_MARK = 512  # nodes one --mark-bad may add (a typo like nid[0-99999] must not exclude a whole machine)
FUTURE_SLACK_S = 300  # clock skew between login nodes tolerated before an entry counts as future-dated
# Control characters (C0, DEL, C1) and the Unicode line/paragraph separators str.splitlines() splits on.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


@dataclasses.dataclass
class Entry:
    time: dt.datetime
    node: str
    user: str
    host: str
    reason: str

    def line(self) -> str:
        return "\t".join([self.time.strftime(FMT), self.node, self.user, self.host, self.reason])

    def age_days(self, now: dt.datetime) -> float:
        return (now - self.time).total_seconds() / 86400


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def _clean_reason(reason: str) -> str:
    return " ".join(_CONTROL.sub(" ", reason).split())[:300] or "unspecified"


def _clean_ident(name: str) -> str:
    """A user or host name for one field: letters, digits, ``._-@`` only (anything else becomes ``_``)."""
    return re.sub(r"[^A-Za-z0-9._@-]", "_", name)[:64] or "unknown"


def printable(text: str) -> str:
    """Text for a terminal: control characters (ANSI escapes among them) shown escaped, never replayed."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def _owner(st: os.stat_result) -> str:
    """``user:group`` of a stat, by name where this host knows them."""
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


def _share_fix(path: Path, st: os.stat_result) -> str:
    """What makes ``path`` the team's: its owner gives the group write (a directory also setgid, so what is made in
    it keeps the team's group)."""
    cmd = (f"chmod g+ws {path}" if stat.S_ISDIR(st.st_mode) else f"chmod g+w {path}")
    return (f"its owner can share it with the team's group: chgrp TEAM {path} && {cmd} (docs/cluster.md, "
            "\"A team on one cluster\")")


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


def parse_line(line: str) -> Entry | None:
    parts = line.rstrip("\r\n").split("\t")
    if len(parts) != 5:
        return None
    ts, node, user, host, reason = parts
    if not is_node_name(node):
        return None
    try:
        t = dt.datetime.strptime(ts, FMT).replace(tzinfo=dt.UTC)
    except ValueError:
        return None
    return Entry(t, node, user, host, reason)


class BadNodeLog:
    def __init__(self, path: Path, ttl_days: float = 7.0):
        self.path = Path(path)
        self.ttl_days = ttl_days
        self._warned: set[int] = set()

    @property
    def target(self) -> Path:
        """The file itself: a symlinked team log (``BAD_NODES_LOG=link.log``) is read, locked beside and rewritten
        through its target, never replaced by a private copy that detaches the link from the team."""
        return Path(os.path.realpath(self.path))

    def _require_regular(self) -> None:
        """A FIFO or a device as the log would block every submission (or write into a device): refused."""
        try:
            st = os.stat(self.target)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise UserError(f"cannot read the bad-node log {self.path}: {exc.strerror or exc}") from None
        if stat.S_ISDIR(st.st_mode):  # before any lock file is made beside it (BAD_NODES_LOG=/tmp made /tmp.lock)
            example = os.path.join(self.path, "bad_nodes.log")
            raise UserError(f"the bad-node log {self.path} is a directory; point BAD_NODES_LOG (or the profile's "
                            f"bad_nodes_log) at a file, e.g. {example}")
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"the bad-node log {self.path} is not a regular file; point BAD_NODES_LOG (or the "
                            "profile's bad_nodes_log) at one")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self._require_regular()
        target = self.target
        lock = target.with_name(target.name + ".lock")
        try:
            make_shared_dirs(self.path.parent)
            fd, _ = try_flock(lock, wait=True)  # common/locks.py: writers from many login nodes wait their turn
        except OSError as exc:
            fix = ""
            if isinstance(exc, PermissionError) and target.parent.is_dir():
                fix = f" - {_share_fix(target.parent, target.parent.stat())}"
            raise UserError(f"cannot lock the bad-node log {self.path} ({lock}: {exc.strerror or exc}); "
                            f"nothing was changed{fix}") from None
        assert fd is not None  # wait=True: held, or an OSError above
        try:
            yield
        finally:
            release(fd)

    def _read(self) -> bytes:
        self._require_regular()
        try:  # bounded: a log linked to a huge file must not be read whole into memory
            return read_regular(self.target, LOG_MAX_BYTES)
        except FileNotFoundError:
            return b""
        except OSError as exc:
            if exc.errno == errno.EFBIG:
                raise UserError(f"the bad-node log {self.path} is over {LOG_MAX_BYTES >> 20} MiB, far more than a "
                                "team's bad nodes: move it aside (a new log starts empty) and mark the nodes that "
                                "are still bad again") from None
            raise UserError(f"cannot read the bad-node log {self.path}: {exc.strerror or exc}") from None

    def _lines(self, data: bytes | None = None) -> list[tuple[bytes, Entry | None]]:
        """Every line of the log with its end (byte-exact) and its entry, or None (comment, blank, malformed)."""
        data = self._read() if data is None else data
        out: list[tuple[bytes, Entry | None]] = []
        for raw in _split_lf(data):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                out.append((raw, None))
                continue
            out.append((raw, None if text.startswith("#") or not text.strip() else parse_line(text)))
        return out

    def entries(self, warn: bool = True) -> list[Entry]:
        out = []
        now = _now()
        for i, (raw, e) in enumerate(self._lines(), 1):
            if e is None:
                if warn and raw.strip() and not raw.startswith(b"#") and i not in self._warned:
                    self._warned.add(i)
                    print(f"warning: {self.path}:{i}: skipping malformed line", file=sys.stderr)
                continue
            if warn and is_future(e, now) and -i not in self._warned:
                self._warned.add(-i)
                print(f"warning: {self.path}:{i}: {e.node} is dated in the future ({e.time:%Y-%m-%d %H:%M}Z); it "
                      "stays excluded and cannot expire until re-marked (--unmark-bad, then --mark-bad)",
                      file=sys.stderr)
            out.append(e)
        return out

    def check_writable(self, rewrite: bool = False) -> None:
        """Refuse (UserError) a log this user must not change, before anything is written. A rewrite (unmark,
        update, prune) replaces the log atomically, so it also needs to write the log's directory."""
        target = self.target
        try:
            st = target.stat()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise UserError(f"cannot read the bad-node log {self.path}: {exc.strerror or exc}") from None
        if not os.access(target, os.W_OK) or not st.st_mode & 0o222:
            raise UserError(f"the bad-node log {self.path} is read-only (mode {st.st_mode & 0o777:o}, owner "
                            f"{_owner(st)}); nothing was changed - {_share_fix(target, st)}, or set BAD_NODES_LOG "
                            "to a writable log")
        if rewrite and not os.access(target.parent, os.W_OK | os.X_OK):
            dst = target.parent.stat()
            raise UserError(f"the bad-node log's directory {target.parent} is not writable by you (mode "
                            f"{dst.st_mode & 0o7777:o}, owner {_owner(dst)}), and a change replaces the log there "
                            f"atomically; nothing was changed - {_share_fix(target.parent, dst)}")

    def _rewrite_lines(self, change) -> int:
        """Under the lock, replace each entry line by ``change(entry)`` (None: drop it, an Entry: rewrite it,
        the same Entry: keep the bytes). Other lines stay byte-for-byte. Writes only when something changed;
        returns how many entries were dropped or changed."""
        self.check_writable(rewrite=True)
        with self.locked():
            data = self._read()
            out, n = [], 0
            for raw, e in self._lines(data):
                if e is None:
                    out.append(raw)
                    continue
                new = change(e)
                if new is e:
                    out.append(raw)
                    continue
                n += 1
                if new is not None:
                    end = raw[len(raw.rstrip(b"\r\n")):]
                    out.append(new.line().encode() + (end or b"\n"))
            new_data = b"".join(out)
            if n and new_data != data:
                try:
                    write_bytes(self.target, new_data, like=self.target.stat())
                except OSError as exc:
                    raise UserError(f"cannot rewrite the bad-node log {self.path}: {exc.strerror or exc}; "
                                    "it was left as it was") from None
        return n

    def active(self, now: dt.datetime | None = None) -> list[Entry]:
        """Newest entry per node, younger than the TTL."""
        now = now or _now()
        latest: dict[str, Entry] = {}
        for e in self.entries():
            if self.is_active(e, now) and (e.node not in latest or e.time >= latest[e.node].time):
                latest[e.node] = e
        return sorted(latest.values(), key=lambda e: e.node)

    def is_active(self, e: Entry, now: dt.datetime) -> bool:
        return e.age_days(now) <= self.ttl_days  # a future-dated entry has a negative age: active

    def _validate(self, nodes: str) -> list[str]:
        if not is_hostlist(nodes):
            raise UserError(f"invalid node name or hostlist {nodes!r}: expected names like nid001234 or nid[001-004]")
        names = list(dict.fromkeys(expand(nodes)))  # each node once, in order
        bad = [n for n in names if not is_node_name(n)]  # e.g. an expansion longer than a host name may be
        if bad:
            raise UserError(f"invalid node name {bad[0][:80]!r} in {nodes[:80]!r}: names are at most 63 characters of "
                            "letters, digits, '-', '_' and '.'")
        return names

    def mark(self, nodes: str, reason: str = "") -> list[str]:
        names = self._validate(nodes)
        if len(names) > MAX_MARK:
            raise UserError(f"{nodes} names {len(names)} nodes; one --mark-bad marks at most {MAX_MARK} "
                            "(split the hostlist if that many nodes really are faulty)")
        now, user, host = _now(), _clean_ident(_user()), _clean_ident(socket.gethostname().split(".")[0])
        lines = "".join(Entry(now, n, user, host, _clean_reason(reason)).line() + "\n" for n in names)
        self.check_writable()
        self._require_regular()
        with self.locked():
            try:
                fd = open_shared(self.target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            except OSError as exc:
                raise UserError(f"cannot append to the bad-node log {self.path}: {exc.strerror or exc}") from None
            try:
                data = lines.encode()
                if self.target.stat().st_size and not self._ends_with_newline():
                    data = b"\n" + data
                os.write(fd, data)
                os.fsync(fd)
            except OSError as exc:  # a full or over-quota shared filesystem
                raise UserError(f"cannot append to the bad-node log {self.path}: {exc.strerror or exc}") from None
            finally:
                os.close(fd)
        return names

    def _ends_with_newline(self) -> bool:
        with open(self.target, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def update(self, nodes: str, reason: str) -> int:
        names = set(self._validate(nodes))
        reason = _clean_reason(reason)

        def change(e: Entry) -> Entry:
            if e.node not in names or e.reason == reason:
                return e
            return dataclasses.replace(e, reason=reason)

        changed = self._rewrite_lines(change)
        if not changed and not any(e.node in names for e in self.entries(warn=False)):
            raise UserError(f"no entry for {nodes} in {self.path}")
        return changed

    def unmark(self, nodes: str) -> int:
        names = set(self._validate(nodes))
        dropped = self._rewrite_lines(lambda e: None if e.node in names else e)
        if not dropped:
            raise UserError(f"no entry for {nodes} in {self.path}")
        return dropped

    def prune(self, now: dt.datetime | None = None) -> int:
        now = now or _now()
        return self._rewrite_lines(lambda e: e if self.is_active(e, now) else None)


def is_future(e: Entry, now: dt.datetime) -> bool:
    return (e.time - now).total_seconds() > FUTURE_SLACK_S


def _split_lf(data: bytes) -> list[bytes]:
    """Split on LF only, keeping the ends (a stray CR stays inside its line, byte-exact)."""
    parts = data.split(b"\n")
    out = [p + b"\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def from_env(root: Path | None = None) -> BadNodeLog:
    path = os.environ.get("BAD_NODES_LOG") or os.environ.get("PIPELINE_BAD_NODES_LOG")
    if not path:
        root = root or paths.repo_root()
        path = str(root / ".slurm" / "bad_nodes.log")
    ttl = os.environ.get("BAD_NODES_TTL_DAYS") or os.environ.get("PIPELINE_BAD_NODES_TTL_DAYS") or "7"
    try:
        if not re.fullmatch(r"\s*[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?\s*", ttl):
            raise ValueError(ttl)  # float() also takes "7_0", "inf", "nan"
        ttl_days = float(ttl)
    except ValueError:
        raise UserError(f"BAD_NODES_TTL_DAYS={ttl!r} is not a number") from None
    if not math.isfinite(ttl_days) or ttl_days <= 0:
        raise UserError(f"BAD_NODES_TTL_DAYS={ttl!r} must be a finite number of days > 0 (default 7)")
    if "\0" in path or Path(os.path.realpath(path)).name in ("", ".", ".."):  # "/" has no name to put a .lock beside
        raise UserError(f"BAD_NODES_LOG={path[:80]!r} does not name a file; point it at one, e.g. "
                        "$HOME/bad_nodes.log")
    return BadNodeLog(Path(path), ttl_days)
