"""The team-shared bad-node log: a plain text file on a parallel filesystem, one entry per line.

    2026-11-30T09:12:44Z<TAB>nid001234<TAB>alice<TAB>login01<TAB>GPU ECC (Xid 48)

Fields: UTC time, node, who, from which host, why. Entries younger than the TTL are excluded from every
submission. Writers from many login nodes take an exclusive ``flock`` on ``<log>.lock`` (a sidecar file,
so the log itself can be replaced atomically); appends and rewrites happen under it, so concurrent
``--mark-bad`` calls never lose or corrupt an entry. Node names are validated against Slurm's hostname
grammar before anything is written; reasons are flattened to one line. A malformed line is skipped with a
warning, never fatal, and never reaches an ``sbatch`` command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import fcntl
import getpass
import os
import socket
import sys
from pathlib import Path
from typing import Iterator

from pipeline.common.errors import UserError
from pipeline.common.io import write_text
from pipeline.slurm.hostlist import expand, is_hostlist, is_node_name

FMT = "%Y-%m-%dT%H:%M:%SZ"


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
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _clean_reason(reason: str) -> str:
    return " ".join(reason.replace("\t", " ").split())[:300] or "unspecified"


def parse_line(line: str) -> Entry | None:
    parts = line.rstrip("\n").split("\t")
    if len(parts) != 5:
        return None
    ts, node, user, host, reason = parts
    if not is_node_name(node):
        return None
    try:
        t = dt.datetime.strptime(ts, FMT).replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return None
    return Entry(t, node, user, host, reason)


class BadNodeLog:
    def __init__(self, path: Path, ttl_days: float = 7.0):
        self.path = Path(path)
        self.ttl_days = ttl_days
        self._warned: set[int] = set()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lf:
            fcntl.flock(lf.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lf.fileno(), fcntl.LOCK_UN)

    def entries(self, warn: bool = True) -> list[Entry]:
        if not self.path.exists():
            return []
        out = []
        for i, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            if not line.strip() or line.startswith("#"):
                continue
            e = parse_line(line)
            if e is None:
                if warn and i not in self._warned:
                    self._warned.add(i)
                    print(f"warning: {self.path}:{i}: skipping malformed line", file=sys.stderr)
                continue
            out.append(e)
        return out

    def active(self, now: dt.datetime | None = None) -> list[Entry]:
        """Newest entry per node, younger than the TTL."""
        now = now or _now()
        latest: dict[str, Entry] = {}
        for e in self.entries():
            if e.age_days(now) <= self.ttl_days and (e.node not in latest or e.time >= latest[e.node].time):
                latest[e.node] = e
        return sorted(latest.values(), key=lambda e: e.node)

    def _validate(self, nodes: str) -> list[str]:
        if not is_hostlist(nodes):
            raise UserError(f"invalid node name or hostlist {nodes!r}: expected names like nid001234 or nid[001-004]")
        return expand(nodes)

    def mark(self, nodes: str, reason: str = "") -> list[str]:
        names = self._validate(nodes)
        now, user, host = _now(), getpass.getuser(), socket.gethostname().split(".")[0]
        lines = "".join(Entry(now, n, user, host, _clean_reason(reason)).line() + "\n" for n in names)
        with self.locked():
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o664)
            try:
                data = lines.encode()
                if self.path.stat().st_size and not self._ends_with_newline():
                    data = b"\n" + data
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        return names

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _rewrite(self, keep) -> int:
        """Rewrite the log keeping entries for which keep(entry) is True; returns how many were dropped."""
        with self.locked():
            entries = self.entries(warn=False)
            kept = [e for e in entries if keep(e)]
            write_text(self.path, "".join(e.line() + "\n" for e in kept))
        return len(entries) - len(kept)

    def update(self, nodes: str, reason: str) -> int:
        names = set(self._validate(nodes))
        changed = 0
        with self.locked():
            entries = self.entries(warn=False)
            for e in entries:
                if e.node in names:
                    e.reason = _clean_reason(reason)
                    changed += 1
            if changed:
                write_text(self.path, "".join(e.line() + "\n" for e in entries))
        if not changed:
            raise UserError(f"no entry for {nodes} in {self.path}")
        return changed

    def unmark(self, nodes: str) -> int:
        names = set(self._validate(nodes))
        dropped = self._rewrite(lambda e: e.node not in names)
        if not dropped:
            raise UserError(f"no entry for {nodes} in {self.path}")
        return dropped

    def prune(self, now: dt.datetime | None = None) -> int:
        now = now or _now()
        return self._rewrite(lambda e: e.age_days(now) <= self.ttl_days)


def from_env(root: Path | None = None) -> BadNodeLog:
    path = os.environ.get("BAD_NODES_LOG") or os.environ.get("PIPELINE_BAD_NODES_LOG")
    if not path:
        root = root or Path(os.environ.get("PIPELINE_ROOT") or Path(__file__).resolve().parents[3])
        path = str(root / ".slurm" / "bad_nodes.log")
    ttl = os.environ.get("BAD_NODES_TTL_DAYS") or os.environ.get("PIPELINE_BAD_NODES_TTL_DAYS") or "7"
    try:
        ttl_days = float(ttl)
    except ValueError:
        raise UserError(f"BAD_NODES_TTL_DAYS={ttl!r} is not a number") from None
    return BadNodeLog(Path(path), ttl_days)
