"""Slurm node names and hostlists: validation and expansion, without shelling out.

Grammar accepted (a strict subset of Slurm's): a host name is letters, digits, ``-``, ``_`` and ``.``,
starting with a letter or digit; a hostlist is comma-separated items, each a name optionally followed
by one bracket range list ``[001-004,7]``. Anything else (spaces, quotes, ``;``, ``$``, backticks, ...)
is refused, so a node name can never inject into a shell or an ``sbatch`` command line.
"""

from __future__ import annotations

import re

NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}"
RANGE = r"\d+(?:-\d+)?"
_NODE_RE = re.compile(rf"^{NAME}$")
_ITEM_RE = re.compile(rf"^({NAME})(?:\[({RANGE}(?:,{RANGE})*)\]([A-Za-z0-9_.\-]*))?$")
MAX_EXPANSION = 100000


def is_node_name(name: str) -> bool:
    return bool(_NODE_RE.match(name))


def _split_items(hostlist: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in hostlist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return items


def is_hostlist(hostlist: str) -> bool:
    if not hostlist or len(hostlist) > 4096:
        return False
    try:
        return all(_ITEM_RE.match(i) for i in _split_items(hostlist)) and bool(expand(hostlist))
    except ValueError:
        return False


def expand(hostlist: str) -> list[str]:
    out: list[str] = []
    for item in _split_items(hostlist):
        m = _ITEM_RE.match(item)
        if not m:
            raise ValueError(f"invalid hostlist item {item!r}")
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3) or ""
        if ranges is None:
            out.append(prefix)
            continue
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            hi = hi or lo
            if int(hi) < int(lo):
                raise ValueError(f"descending range {r!r}")
            if int(hi) - int(lo) + len(out) > MAX_EXPANSION:
                raise ValueError("hostlist too large")
            width = len(lo) if lo.startswith("0") else 0
            for i in range(int(lo), int(hi) + 1):
                out.append(f"{prefix}{str(i).zfill(width)}{suffix}")
    return out
