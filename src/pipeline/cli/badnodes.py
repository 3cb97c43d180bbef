"""isambard_sbatch's bad-node commands on the team's shared log (slurm/badnodes.py):

    isambard_sbatch --mark-bad NODE [REASON]     report a node (or hostlist nid[001-004])
    isambard_sbatch --list-bad                   list the log (active entries marked *)
    isambard_sbatch --update-bad NODE REASON     change the reason
    isambard_sbatch --unmark-bad NODE            remove a node (it got fixed)
    isambard_sbatch --prune-bad                  drop entries older than the TTL

Standard library only: isambard_sbatch runs on login nodes without the pipeline environment.
"""

from __future__ import annotations

import datetime as dt

from pipeline.common.errors import UserError
from pipeline.slurm.badnodes import BadNodeLog, is_future, printable

COMMANDS = ("--mark-bad", "--list-bad", "--update-bad", "--unmark-bad", "--prune-bad")


def _entries(n: int) -> str:
    return f"entr{'y' if n == 1 else 'ies'}"


def mark(log: BadNodeLog, rest: list[str]) -> None:
    if not rest:
        raise UserError("--mark-bad needs a node name")
    names = log.mark(rest[0], " ".join(rest[1:]))
    print(f"marked bad: {', '.join(names)} (excluded for {log.ttl_days:g} days) - file: {log.path}")


def list_bad(log: BadNodeLog) -> None:
    now = dt.datetime.now(dt.UTC)
    entries = log.entries()
    print(f"# {log.path} (TTL {log.ttl_days:g} days; * = excluded now, ! = dated in the future)")
    for e in entries:
        star = "!" if is_future(e, now) else "*" if log.is_active(e, now) else " "
        print(f"{star} {e.node:<16} {e.time:%Y-%m-%d %H:%M}Z  {printable(e.user):<10} "
              f"{printable(e.host):<12} {printable(e.reason)}")
    print(f"{len(log.active())} node(s) excluded, {len(entries)} {_entries(len(entries))}")


def update(log: BadNodeLog, rest: list[str]) -> None:
    if len(rest) < 2:
        raise UserError("--update-bad needs NODE REASON")
    n = log.update(rest[0], " ".join(rest[1:]))
    print(f"updated {n} {_entries(n)} for {rest[0]}")


def unmark(log: BadNodeLog, rest: list[str]) -> None:
    if len(rest) != 1:
        raise UserError("--unmark-bad needs exactly one NODE")
    n = log.unmark(rest[0])
    print(f"removed {n} {_entries(n)} for {rest[0]}")


def prune(log: BadNodeLog) -> None:
    n = log.prune()
    print(f"pruned {n} {_entries(n)} older than {log.ttl_days:g} days from {log.path}")


def run_command(log: BadNodeLog, command: str, rest: list[str]) -> int:
    """One bad-node command (``command`` is one of COMMANDS); UserError on bad input. Returns the exit code."""
    if command == "--mark-bad":
        mark(log, rest)
    elif command == "--list-bad":
        list_bad(log)
    elif command == "--update-bad":
        update(log, rest)
    elif command == "--unmark-bad":
        unmark(log, rest)
    elif command == "--prune-bad":
        prune(log)
    else:
        raise UserError(f"unknown bad-node command {command!r} (one of {', '.join(COMMANDS)})")
    return 0
