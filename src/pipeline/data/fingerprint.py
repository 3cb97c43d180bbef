"""Resume by fingerprint: a finished stage's marker records what it was made from, and the stage is skipped only
when that record is identical to this run's (otherwise it is redone, with one log line naming the difference).

Used by ``prepare``'s stages (export, tokenize, pack) and by the ``tokenize`` action (:mod:`pipeline.data.indexed`).
"""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

from pipeline.common.io import read_json
from pipeline.common.mappings import flatten

log = logging.getLogger("pipeline.data.prepare")  # the name these log lines have always had
FINGERPRINT_VERSION = 1
FLAGS = {"limit": "--limit", "seed": "--seed", "val_fraction": "--val-fraction", "overlong": "--overlong",
         "seq_length": "--seq-length", "pad_seq_to_mult": "--pad-seq-to-mult", "tokenizer": "--tokenizer",
         "chunk_size": "--chunk-size", "text_field": "--text-field", "docs_per_part": "--docs-per-part"}


def _flatten(d) -> dict:
    """Dotted keys of a fingerprint's leaves (an empty section is no key)."""
    return {k: v for k, v in flatten(d or {}).items() if v != {}}


def _iso_ns(ns) -> str:
    if not isinstance(ns, int):
        return str(ns)
    return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def fingerprint_diff(old: dict | None, new: dict) -> str:
    """'' when identical, else one line naming what changed (``input changed: size 1 -> 2; --limit 5 -> 40``)."""
    if not isinstance(old, dict):
        return "no fingerprint recorded (made by an older version, or its marker is unreadable)"
    a, b = _flatten(old), _flatten(new)
    parts = []
    keys = list(b) + [k for k in a if k not in b]
    for key in sorted(keys, key=lambda k: k.count(".")):  # stable: a stage's own options, then upstream's
        if a.get(key, "<none>") == b.get(key, "<none>"):
            continue
        leaf = key.rsplit(".", 1)[-1]
        va, vb = a.get(key, "<none>"), b.get(key, "<none>")
        if leaf == "mtime_ns":
            leaf, va, vb = "mtime", _iso_ns(va), _iso_ns(vb)
        if ".input." in f".{key}" or key.startswith("input."):
            text = f"input changed: {leaf} {va} -> {vb}"
        elif leaf in FLAGS:
            text = f"{FLAGS[leaf]} {va} -> {vb}"
        else:
            text = f"{leaf} {va} -> {vb}"
        if text not in parts:
            parts.append(text)
    return "; ".join(parts)


def as_recorded(value):
    """``value`` with its keys in the order its marker holds them (``write_json`` sorts keys, at every level): a
    fingerprint passed on in memory then prints, and names its differences, exactly as one read back from disk."""
    if isinstance(value, dict):
        return {k: as_recorded(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [as_recorded(v) for v in value]
    return value


def reuse_if_current(marker: Path, fp: dict, what: str, where: Path) -> dict | None:
    """A finished stage's record when it was made from the same fingerprint (logged as skipped), else None
    (logged as redone, naming the difference)."""
    old = read_marker(marker)
    diff = fingerprint_diff((old or {}).get("fingerprint"), fp)
    if not diff:
        log.info("%s: already done (%s), skipping", what, where)
        return old
    log.info("%s: redoing, %s (%s)", what, diff, where)
    return None


def read_marker(path: Path) -> dict | None:
    """A stage's JSON marker, or None when it is absent or unreadable (then the stage is redone)."""
    try:
        obj = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s is unreadable (%s); redoing its stage", path, exc)
        return None
    return obj if isinstance(obj, dict) else None
