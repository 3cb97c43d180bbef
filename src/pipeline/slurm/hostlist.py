"""Slurm node names and hostlists: validation and expansion, without shelling out.

Grammar accepted (a strict subset of Slurm's): a host name is letters, digits, ``-``, ``_`` and ``.``,
starting with a letter or digit; a hostlist is comma-separated items, each a name optionally followed
by one bracket range list ``[001-004,7]``. Anything else (spaces, quotes, ``;``, ``$``, backticks, ...)
is refused, so a node name can never inject into a shell or an ``sbatch`` command line. Digits are ASCII
``[0-9]`` only (``\\d`` and ``str.isdigit`` accept other scripts' digits, which Slurm does not).

``compress`` is the inverse of ``expand``: a sorted list of names -> ``nid[001-004,010],gpu7``, so an
``--exclude`` built from a 100,000-line bad-node log stays far below the kernel's argument limits.
"""

from __future__ import annotations

import re

NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}"
RANGE = r"[0-9]+(?:-[0-9]+)?"
_NODE_RE = re.compile(NAME)
_ITEM_RE = re.compile(rf"({NAME})(?:\[({RANGE}(?:,{RANGE})*)\]([A-Za-z0-9_.\-]*))?")
_SPLIT_RE = re.compile(r"(.*[^0-9])([0-9]+)([^0-9]*)")
MAX_EXPANSION = 100000


def is_node_name(name: str) -> bool:
    return bool(_NODE_RE.fullmatch(name))


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
        return all(_ITEM_RE.fullmatch(i) for i in _split_items(hostlist)) and bool(expand(hostlist))
    except ValueError:
        return False


def expand(hostlist: str) -> list[str]:
    out: list[str] = []
    for item in _split_items(hostlist):
        m = _ITEM_RE.fullmatch(item)
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


def compress(names) -> str:
    """Names -> one hostlist expression that ``expand`` turns back into the same (sorted, unique) names.

    A name splits into prefix, its last run of digits, and a digit-free suffix; names sharing prefix,
    suffix and digit width are merged into ``prefix[lo-hi,...]suffix`` (zero-padded to that width).
    """
    groups: dict[tuple[str, str, int], list[int]] = {}
    order: list[tuple[str, str, int] | str] = []
    for name in sorted(set(names)):
        m = _SPLIT_RE.fullmatch(name)
        if not m or not _NODE_RE.fullmatch(m.group(1)):
            order.append(name)
            continue
        key = (m.group(1), m.group(3), len(m.group(2)))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(m.group(2)))
    items: list[str] = []
    for entry in order:
        if isinstance(entry, str):
            items.append(entry)
            continue
        prefix, suffix, width = entry
        nums = sorted(groups[entry])
        if len(nums) == 1:
            items.append(f"{prefix}{str(nums[0]).zfill(width)}{suffix}")
            continue
        ranges: list[str] = []
        lo: int | None = nums[0]
        for a, b in zip(nums, [*nums[1:], None]):
            if b is None or b != a + 1:
                lo_s, hi_s = str(lo).zfill(width), str(a).zfill(width)
                ranges.append(lo_s if lo == a else f"{lo_s}-{hi_s}")
                lo = b
        items.append(f"{prefix}[{','.join(ranges)}]{suffix}")
    return ",".join(items)
