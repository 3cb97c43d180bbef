"""Stage 1 of ``prepare``, export: load + normalise + split -> ``<root>/training.jsonl``, ``<root>/validation.jsonl``
and its marker ``<root>/export_stats.json`` (the tokenize stage's workers read the splits back, a byte range each)."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import numpy as np

from pipeline.common.errors import UserError
from pipeline.common.io import write_bytes, write_json
from pipeline.data import workers as wk
from pipeline.data.fingerprint import FINGERPRINT_VERSION, read_marker, reuse_if_current
from pipeline.data.sources import export_line, input_identity, jsonl_files, load_conversations, unread_files
from pipeline.data.stage_base import SPLIT_FILES, Timer, log, progress, slices


@dataclasses.dataclass
class ExportOptions:
    """What the export stage reads, how it splits, and where it writes."""

    dataset: str  # HF id ORG/NAME, a local dir/.jsonl/.parquet, or chatterbot-corpus
    dataset_root: Path  # the data root the splits are written to
    limit: int | None = None  # use only the first N usable conversations
    seed: int = 0  # the train/validation split's permutation
    val_fraction: float = 0.05  # the share of conversations in the validation split
    force: bool = False  # redo the stage even when its marker matches
    quiet: bool = False  # no progress bar or periodic progress line


def export_fingerprint(opts: ExportOptions) -> dict:
    """What the export was made from: the input's identity and the options that change it."""
    return {"version": FINGERPRINT_VERSION, "input": input_identity(opts.dataset, exclude=opts.dataset_root),
            "limit": opts.limit, "seed": opts.seed, "val_fraction": opts.val_fraction}


def _export_rows(opts: ExportOptions, pool) -> tuple[list[bytes], collections.Counter]:
    """The usable rows as JSON lines (UTF-8, no newline), and the counts (``rows_in``, ``dropped_<reason>``). A
    dataset of JSONL files is read by ``pool``'s workers, a byte range each, in order; any other source row by row
    here."""
    files = jsonl_files(opts.dataset) if pool is not None else None
    stats: collections.Counter = collections.Counter()
    if not files:
        convs, stats = load_conversations(opts.dataset, limit=opts.limit)
        return [export_line(c) for c in convs], stats
    tasks = []
    for f in files:
        try:
            starts = wk.line_starts(f)
        except OSError as exc:
            raise UserError(f"cannot read {f}: {exc.strerror or exc}") from None
        tasks += [(f, a, b) for a, b in slices(starts, 0, len(starts) - 1)]
    lines: list[bytes] = []
    for kept, dropped, n in progress(pool.imap(wk.export_slice, tasks), opts.quiet, "export", "slice", len(tasks)):
        if opts.limit and len(lines) + len(kept) >= opts.limit:  # this slice holds the limit-th usable row:
            kept, drops, seen = kept[:opts.limit - len(lines)], dict(dropped), 0  # count its rows up to that one
            for i in range(n):
                seen += i not in drops
                if seen == len(kept):
                    n = i + 1
                    break
            dropped = [(i, r) for i, r in dropped if i < n]
        stats["rows_in"] += n
        stats.update(f"dropped_{r}" for _, r in dropped)
        lines += kept
        if opts.limit and len(lines) >= opts.limit:
            break
    return lines, stats


def stage_export(opts: ExportOptions, timer: Timer, fp: dict | None = None, pool=None) -> dict:
    """Export the normalised splits (the tokenize stage's workers read them back, each its own byte ranges).
    ``fp``: :func:`export_fingerprint`, when the caller has computed it already. ``pool``: the started tokenize
    workers, which read a JSONL dataset's byte ranges (the same bytes as reading it here)."""
    root = opts.dataset_root
    stats_path = root / "export_stats.json"
    fp = export_fingerprint(opts) if fp is None else fp
    if not opts.force and stats_path.exists() and all((root / f).exists() for f in SPLIT_FILES.values()):
        old = reuse_if_current(stats_path, fp, "stage export", root)
        if old is not None:
            return old
    _refuse_foreign_splits(root, stats_path)
    with timer.stage("export"):
        unread = unread_files(opts.dataset)
        if unread:
            log.info("stage export: not reading %s in %s (an earlier export's splits, or not regular files)",
                     ", ".join(f.name for f in unread), opts.dataset)
        lines, stats = _export_rows(opts, pool)
        dropped = {k[len("dropped_"):]: v for k, v in stats.items() if k.startswith("dropped_")}
        if not lines:
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())) or "no rows"
            raise UserError(f"dataset '{opts.dataset}': all {stats['rows_in']} rows were unusable ({reasons})")
        rng = np.random.default_rng(opts.seed)
        perm = rng.permutation(len(lines))
        n_val = int(round(opts.val_fraction * len(lines)))
        if opts.val_fraction > 0 and len(lines) >= 2:
            n_val = max(1, n_val)
        is_val = np.zeros(len(lines), dtype=bool)
        is_val[perm[:n_val]] = True
        splits = {"train": [x for x, v in zip(lines, is_val.tolist()) if not v],
                  "validation": [x for x, v in zip(lines, is_val.tolist()) if v]}
        write_json(stats_path, {"dataset": opts.dataset, "writing": True})  # the splits are this stage's from now on
        for split, name in SPLIT_FILES.items():
            write_bytes(root / name, b"\n".join(splits[split]) + b"\n" if splits[split] else b"")
        out = {"dataset": opts.dataset, "rows_in": stats["rows_in"], "kept": len(lines), "dropped": dropped,
               "train": len(splits["train"]), "validation": len(splits["validation"]), "fingerprint": fp}
        write_json(stats_path, out)
    log.info("stage export: %d rows in, %d kept (%d train, %d validation), dropped %s -> %s",
             out["rows_in"], out["kept"], out["train"], out["validation"], dropped or "none", root)
    return out


def _refuse_foreign_splits(root: Path, stats_path: Path) -> None:
    """The export replaces only the splits it wrote: a ``training.jsonl`` / ``validation.jsonl`` in the root with no
    export marker beside it (``export_stats.json``, written before the splits and rewritten after them) is someone
    else's file, and is refused in one line (``--dataset-root ""`` overwrote an unrelated training.jsonl in the
    current directory, exit 0)."""
    if read_marker(stats_path) is not None:
        return
    for name in SPLIT_FILES.values():
        if (root / name).exists() or (root / name).is_symlink():
            raise UserError(f"{root / name} exists and was not written by an export ({stats_path.name} is missing "
                            "or unreadable): not replacing it; choose another --dataset-root, or move the file away")
