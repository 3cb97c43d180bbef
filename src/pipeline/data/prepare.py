"""The ``prepare`` and ``pack`` actions: conversations -> chat template + loss masks -> packed Parquet.

Stages, each resumable (outputs are written atomically and a finished stage is skipped):
  1. export    load + normalise + split -> ``<root>/training.jsonl``, ``<root>/validation.jsonl`` (a JSONL
               dataset is read by the tokenize workers, a byte range each)
  2. tokenize  chat template + assistant-only loss mask, in chunks, by the workers ->
               ``<root>/tokenized/<tokenizer>/<split>/chunk_NNNNN.parquet`` (a killed run resumes at the
               first missing chunk)
  3. pack      pad to ``pad_seq_to_mult``, roll the loss mask, ``pack_order``, vectorised over the split ->
               ``<root>/packed/<tokenizer>_pad_seq_to_mult<N>/training_<S>.idx.parquet`` (+ validation,
               ``<S>_metadata.jsonl``)

Resume by fingerprint, not by path: each stage records what it was made from (the input's identity and
every option that changes its output, plus the upstream stage's fingerprint) in its marker
(``export_stats.json``, ``_DONE.json``, ``<S>_summary.json``). A finished stage is skipped only when the
fingerprint is identical; otherwise it is redone (and so is everything downstream), with one log line naming
the difference (``input changed: size 1234 -> 5678``, ``--limit 5 -> 40``). One run per data root at a time:
a second ``prepare``/``pack`` on a root in use is refused (``<root>/.prepare.lock``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np

from pipeline.common.errors import UserError, exc_line
from pipeline.common.io import atomic_path, exclusive_lock, read_json, write_bytes, write_json, write_text
from pipeline.data import packed_parquet
from pipeline.data.packing import check_pad_multiple, pack_order

log = logging.getLogger(__name__)
SPLITS = ("train", "validation")
SPLIT_FILES = {"train": "training.jsonl", "validation": "validation.jsonl"}
CHUNK_SIZE = 2048  # conversations per tokenized chunk (the resume unit); in the tokenize fingerprint
MAX_SEQ_LENGTH = 1_048_576  # the packer allocates O(seq_length): bound it before anything runs
FINGERPRINT_VERSION = 1
FLAGS = {"limit": "--limit", "seed": "--seed", "val_fraction": "--val-fraction", "overlong": "--overlong",
         "seq_length": "--seq-length", "pad_seq_to_mult": "--pad-seq-to-mult", "tokenizer": "--tokenizer",
         "chunk_size": "--chunk-size", "text_field": "--text-field", "docs_per_part": "--docs-per-part"}


def _flatten(d, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _iso_ns(ns) -> str:
    import datetime as dt

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


def check_pack_args(seq_length: int, pad_seq_to_mult: int, context_parallel_size: int = 1,
                    tensor_parallel_size: int = 1, sequence_parallel: bool = False, seed: int = 0) -> list[str]:
    """Every problem with the packing arguments, checked before anything is read or allocated."""
    problems = [] if seed >= 0 else [f"--seed must be >= 0, got {seed}"]
    if not 2 <= seq_length <= MAX_SEQ_LENGTH:
        problems.append(f"--seq-length must be between 2 and {MAX_SEQ_LENGTH}, got {seq_length}")
    if pad_seq_to_mult < 1:
        problems.append(f"pad_seq_to_mult must be >= 1, got {pad_seq_to_mult}")
    if context_parallel_size < 1 or tensor_parallel_size < 1:
        problems.append(f"--context-parallel-size and --tensor-parallel-size must be >= 1, got "
                        f"{context_parallel_size} and {tensor_parallel_size}")
    if problems:
        return problems
    p = check_pad_multiple(pad_seq_to_mult, context_parallel_size, tensor_parallel_size, sequence_parallel)
    if p:
        problems.append(p)
    if pad_seq_to_mult > seq_length:
        problems.append(f"pad_seq_to_mult({pad_seq_to_mult}) > seq_length({seq_length})")
    return problems


def root_lock(root: Path):
    return exclusive_lock(Path(root) / ".prepare.lock", f"data root {root}")


@dataclasses.dataclass
class PrepareOptions:
    dataset: str
    dataset_root: Path
    seq_length: int
    tokenizer: str = "smollm2-135m"
    pad_seq_to_mult: int = 1
    context_parallel_size: int = 1
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    val_fraction: float = 0.05
    seed: int = 0
    overlong: str = "drop"  # drop | truncate
    limit: int | None = None
    chunk_size: int = CHUNK_SIZE
    workers: int | None = None  # tokenize worker processes; None: every usable CPU (not in any fingerprint)
    force: bool = False
    quiet: bool = False

    def validate(self) -> None:
        problems = check_pack_args(self.seq_length, self.pad_seq_to_mult, self.context_parallel_size,
                                   self.tensor_parallel_size, self.sequence_parallel)
        if self.limit is not None and self.limit < 1:
            problems.append(f"--limit must be >= 1, got {self.limit}")
        if self.seed < 0:
            problems.append(f"--seed must be >= 0, got {self.seed}")
        if self.dataset_root.exists() and self.dataset_root.is_dir():
            from pipeline.data.sources import input_files

            outputs = {(self.dataset_root / f).resolve() for f in SPLIT_FILES.values()}
            problems += [f"--dataset-root {self.dataset_root} would overwrite the dataset's own {f.name}; choose "
                         "another --dataset-root" for f in input_files(self.dataset) if f.resolve() in outputs]
        if self.chunk_size < 1:
            problems.append(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            problems.append(f"--workers must be an integer >= 1, got {self.workers!r}")
        if self.dataset_root.exists() and not self.dataset_root.is_dir():
            problems.append(f"--dataset-root {self.dataset_root} exists and is not a directory")
        if not 0 <= self.val_fraction < 1:
            problems.append(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.overlong not in ("drop", "truncate"):
            problems.append(f"--overlong must be drop or truncate, got {self.overlong}")
        if problems:
            raise UserError("; ".join(problems))


class Timer:
    def __init__(self):
        self.stages: dict[str, float] = {}

    def stage(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.stages[name] = round(timer.stages.get(name, 0.0) + time.perf_counter() - self.t0, 3)

        return _Ctx()


def _progress(it, quiet: bool, desc: str, unit: str, total: int):
    """A bar on a terminal; a line every PIPELINE_PROGRESS_INTERVAL seconds in a log file."""
    from pipeline.common.log import Progress

    with Progress(desc, total=total, unit=unit, quiet=quiet, logger=log) as p:
        for x in it:
            yield x
            p.update(1)


def export_fingerprint(opts: PrepareOptions) -> dict:
    from pipeline.data.sources import input_identity

    return {"version": FINGERPRINT_VERSION, "input": input_identity(opts.dataset, exclude=opts.dataset_root),
            "limit": opts.limit, "seed": opts.seed, "val_fraction": opts.val_fraction}


def tokenize_fingerprint(opts: PrepareOptions, export: dict) -> dict:
    return {"export": export.get("fingerprint"), "tokenizer": opts.tokenizer, "chunk_size": opts.chunk_size}


# ---- stage 1: export ----------------------------------------------------------------------------
def _export_rows(opts: PrepareOptions, pool) -> tuple[list[bytes], collections.Counter]:
    """The usable rows as JSON lines (UTF-8, no newline), and the counts (``rows_in``, ``dropped_<reason>``). A
    dataset of JSONL files is read by ``pool``'s workers, a byte range each, in order; any other source row by row
    here."""
    from pipeline.data import workers as wk
    from pipeline.data.sources import export_line, jsonl_files, load_conversations

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
        tasks += [(f, a, b) for a, b in _slices(starts, 0, len(starts) - 1)]
    lines: list[bytes] = []
    for kept, dropped, n in _progress(pool.imap(wk.export_slice, tasks), opts.quiet, "export", "slice", len(tasks)):
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


def stage_export(opts: PrepareOptions, timer: Timer, fp: dict | None = None, pool=None) -> dict:
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
    with timer.stage("export"):
        from pipeline.data.sources import unread_files

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
        for split, name in SPLIT_FILES.items():
            write_bytes(root / name, b"\n".join(splits[split]) + b"\n" if splits[split] else b"")
        out = {"dataset": opts.dataset, "rows_in": stats["rows_in"], "kept": len(lines), "dropped": dropped,
               "train": len(splits["train"]), "validation": len(splits["validation"]), "fingerprint": fp}
        write_json(stats_path, out)
    log.info("stage export: %d rows in, %d kept (%d train, %d validation), dropped %s -> %s",
             out["rows_in"], out["kept"], out["train"], out["validation"], dropped or "none", root)
    return out


# ---- stage 2: tokenize ----------------------------------------------------------------------------
SLICE_CONVERSATIONS = 256  # the unit of work a worker takes: at most this many conversations ...
SLICE_BYTES = 1 << 19  # ... or about this many bytes of exported JSONL (~0.13 M tokens), whichever comes first;
# small, so the workers finish together (the last slice is ~0.2 s of one core) and chunks are written as they go
KEEP_TOKENS = 1 << 28  # the pack stage gets splits up to this many tokens from memory instead of reading them back


class _TemplateMismatch(Exception):
    """The direct render differs from transformers' on the checked conversation: redo with the full tokenizer."""


def tokenized_dir(root: Path, tok_name: str, split: str) -> Path:
    return root / "tokenized" / tok_name / split


def _slices(starts: np.ndarray, first: int, last: int) -> list[tuple[int, int]]:
    """Byte ranges covering lines ``first`` .. ``last - 1`` (``starts`` ends with the file size), cut every
    SLICE_CONVERSATIONS lines or SLICE_BYTES bytes. Only the amount of work per task depends on the cut: each
    conversation is encoded on its own, so a chunk's content never does."""
    out, a = [], first
    while a < last:
        b = min(last, a + SLICE_CONVERSATIONS,
                max(a + 1, int(np.searchsorted(starts, starts[a] + SLICE_BYTES, side="right")) - 1))
        out.append((int(starts[a]), int(starts[b])))
        a = b
    return out


def _write_chunk(path: Path, parts: list[tuple]) -> dict:
    """One chunk's Parquet file from its slices' flat arrays (vectorised: no per-token Python)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = np.concatenate([p[0] for p in parts])
    mask = np.concatenate([p[1] for p in parts])
    lengths = np.concatenate([p[2] for p in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > packed_parquet.MAX_LIST_VALUES:
        raise UserError(f"{path.name} would hold {int(offsets[-1]):,} tokens, more than one Parquet list column "
                        f"can ({packed_parquet.MAX_LIST_VALUES:,}); use a smaller --chunk-size")
    counts = {"examples": len(lengths), "tokens": int(offsets[-1]), "loss_tokens": int(np.count_nonzero(mask)),
              "dropped_template_mismatch": int(sum(p[3] for p in parts))}
    table = pa.Table.from_arrays([packed_parquet.list_column(offsets, ids), packed_parquet.list_column(offsets, mask)],
                                 names=["input_ids", "loss_mask"])
    table = table.replace_schema_metadata({"pipeline_counts": json.dumps(counts)})
    with atomic_path(path) as tmp:
        pq.write_table(table, str(tmp), use_dictionary=False)
    return counts


def _chunk_counts(path: Path) -> dict | None:
    """A finished chunk's counts, or None when it cannot be read (damaged on disk): then it is removed, to be
    made again, with a warning."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return json.loads((pq.read_metadata(path).metadata or {})[b"pipeline_counts"])
    except (OSError, KeyError, ValueError, pa.ArrowException) as exc:
        log.warning("%s is unreadable (%s); making it again", path, exc_line(exc))
        path.unlink(missing_ok=True)
        return None


def _first_line(path: Path) -> dict | None:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return json.loads(line)
    return None


def tokenize_pending(opts: PrepareOptions, tok_name: str, fp: dict) -> bool:
    """Whether the tokenize stage will have work to do (a split not finished with this fingerprint)."""
    if opts.force:
        return True
    for split in SPLITS:
        done = tokenized_dir(opts.dataset_root, tok_name, split) / "_DONE.json"
        if not done.exists() or fingerprint_diff((read_marker(done) or {}).get("fingerprint"), fp):
            return True
    return False


def start_pool(opts: PrepareOptions, files: dict):
    """The tokenize workers, their encoder made from the tokenizer's files (:func:`tokenizer_files`), started now:
    their start-up overlaps the rest of this process's set-up, and they read the export stage's input."""
    from pipeline.data import workers as wk
    from pipeline.data.chat import ChatEncoder

    n = wk.resolve_workers(opts.workers)
    if n > 1:
        return wk.OrderedPool(n, wk.init_chat, (ChatEncoder.files_payload(files, opts.tokenizer),)).start()
    encoder = ChatEncoder.from_files(files, name=opts.tokenizer)
    return wk.OrderedPool(1, wk.init_chat, (), local=lambda: wk.set_chat(encoder))


def stage_tokenize(opts: PrepareOptions, tok_name: str, timer: Timer, tokenizer=None,
                   export: dict | None = None, pool=None, keep: dict | None = None) -> dict:
    """``tokenizer``: a tokenizer, None (loaded when needed) or a zero-argument callable returning one.
    ``pool``: workers from :func:`start_pool` (their encoder made from the tokenizer's files); the direct render is
    then checked against transformers' once, in a worker, before any chunk is written (a mismatch redoes the stage
    with the full tokenizer). ``keep``: a dict that gets, for each
    split made entirely in this run (up to KEEP_TOKENS tokens), its flat (ids, mask, lengths) for the pack stage.

    Each split's exported JSONL is cut into chunks of ``chunk_size`` conversations (the resume unit: one
    Parquet file each, written atomically) and each chunk into slices (byte ranges of the JSONL) that the
    workers read, render, encode and mask; results come back in slice order and each chunk is written as soon
    as its last slice is in, so the files are the same whatever the number of workers."""
    try:
        return _stage_tokenize(opts, tok_name, timer, tokenizer, export, pool, keep)
    except _TemplateMismatch:
        if pool is not None:
            pool.close()
        log.info("stage tokenize: the chat template's direct render differs from transformers' "
                 "apply_chat_template; rendering with transformers instead")
        if keep is not None:
            keep.clear()
        return _stage_tokenize(opts, tok_name, timer, tokenizer, export, None, keep)


def _stage_tokenize(opts, tok_name, timer, tokenizer, export, pool, keep) -> dict:
    from pipeline.data import workers as wk
    from pipeline.data.chat import ChatEncoder, load_tokenizer

    if export is None:
        export = read_marker(opts.dataset_root / "export_stats.json") or {}
    fp = tokenize_fingerprint(opts, export)
    result, plans = {}, []
    for split in SPLITS:
        out_dir = tokenized_dir(opts.dataset_root, tok_name, split)
        done = out_dir / "_DONE.json"
        started = out_dir / "_FINGERPRINT.json"
        if not opts.force and done.exists():
            old = reuse_if_current(done, fp, f"stage tokenize[{split}]", out_dir)
            if old is not None:
                result[split] = old
                continue
        with timer.stage("tokenize"):
            # Chunks are reused only when they were made from this very fingerprint.
            if out_dir.exists() and (opts.force or fingerprint_diff(
                    (read_marker(started) or {}).get("fingerprint"), fp)):
                shutil.rmtree(out_dir)
            if not started.exists():
                write_json(started, {"fingerprint": fp})
            src = opts.dataset_root / SPLIT_FILES[split]
            starts = wk.line_starts(src)
            n_convs = len(starts) - 1
            n_chunks = max(1, -(-n_convs // opts.chunk_size))
            chunks = []
            for c in range(n_chunks):
                path = out_dir / f"chunk_{c:05d}.parquet"
                first, last = c * opts.chunk_size, min(n_convs, (c + 1) * opts.chunk_size)
                counts = _chunk_counts(path) if path.exists() else None  # a finished chunk is reused
                chunks.append((path, counts, None if counts is not None else _slices(starts, first, last) or [(0, 0)]))
            plans.append((split, out_dir, done, src, chunks))
    if not plans:
        return result
    with timer.stage("tokenize"):
        tasks = [(src, a, b) for _, _, _, src, chunks in plans for _, _, sl in chunks if sl for a, b in sl]
        first = next((_first_line(src) for _, _, _, src, _ in plans if os.path.getsize(src)), None)
        check = None
        if tasks and pool is not None:  # files-made encoder: checked in a worker
            check = pool.submit(wk.template_check, PROBES)
        elif tasks:  # the caller's (or a freshly loaded) tokenizer, checked here on the first conversation
            tok = tokenizer
            if tok is None:
                tok = load_tokenizer(opts.tokenizer)
            elif callable(tok) and not hasattr(tok, "apply_chat_template"):
                tok = tok()
            encoder = ChatEncoder.from_tokenizer(tok, (first or {}).get("messages"), name=opts.tokenizer)
            workers = min(wk.resolve_workers(opts.workers), max(1, len(tasks)))
            pool = wk.OrderedPool(workers, wk.init_chat, (encoder.payload(),) if workers > 1 else (),
                                  local=lambda: wk.set_chat(encoder))
        elif pool is None:
            pool = wk.OrderedPool(1, wk.init_chat, ())
        kept = 0
        with pool:
            results = pool.imap(wk.chat_slice, tasks)
            for split, out_dir, done, _, chunks in plans:
                totals = collections.Counter()
                parts: list | None = [] if keep is not None and all(sl for _, _, sl in chunks) else None
                for path, counts, sl in _progress(chunks, opts.quiet, f"tokenize {split}", "chunk", len(chunks)):
                    if sl is None:
                        totals.update(counts)
                        continue
                    got = [next(results) for _ in sl]
                    if check is not None:  # before the first chunk is written
                        if not pool.result(check):
                            raise _TemplateMismatch
                        check = None
                    totals.update(_write_chunk(path, got))
                    if parts is not None:
                        kept += sum(len(g[0]) for g in got)
                        if kept <= KEEP_TOKENS:
                            parts.extend(got)
                        else:
                            parts = None
                summary = {"chunks": len(chunks), **{k: int(v) for k, v in totals.items()}, "fingerprint": fp}
                write_json(done, summary)
                result[split] = summary
                if parts is not None:
                    keep[split] = tuple(np.concatenate([g[i] for g in parts]) if parts else np.zeros(0, dt)
                                        for i, dt in enumerate((np.int32, np.int8, np.int64)))
                log.info("stage tokenize[%s]: %d examples, %d tokens (%d with loss) -> %s", split,
                         summary.get("examples", 0), summary.get("tokens", 0), summary.get("loss_tokens", 0), out_dir)
    return {split: result[split] for split in SPLITS}


# What the one-time template check renders both ways: every shape an exported conversation can take (roles
# system/user/assistant, one or several exchanges) with text that escaping or stripping would change.
PROBES = [
    [{"role": "user", "content": "Say \"hi\" & <b>bye</b> {{ x }}"}, {"role": "assistant", "content": " hi\n\nbye "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "é? 😀"},
     {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "Und?"},
     {"role": "assistant", "content": "Ja."}],
]


def load_tokenized(root: Path, tok_name: str, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A finished split's tokenized chunks as flat (int32 ids, int8 loss mask, int64 lengths)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tokenized_dir(root, tok_name, split)
    if not (d / "_DONE.json").exists():
        raise UserError(f"no complete tokenized export at {d}; "
                        "run: pipeline_data_prepare.py prepare --dataset ... first")
    parts = []
    for f in sorted(d.glob("chunk_*.parquet")):
        try:
            t = pq.ParquetFile(f).read()  # not read_table: that imports pyarrow.dataset (~0.3 s)
        except (OSError, pa.ArrowException) as exc:
            f.unlink(missing_ok=True)
            (d / "_DONE.json").unlink(missing_ok=True)
            raise UserError(f"{f} is unreadable ({exc_line(exc)}); "
                            "removed it: re-run prepare, which makes only the missing chunk again") from None
        col_ids, col_mask = t.column("input_ids").combine_chunks(), t.column("loss_mask").combine_chunks()
        off = packed_parquet.numpy_view(col_ids.offsets, np.int32).astype(np.int64)
        a, b = int(off[0]), int(off[-1])
        parts.append((packed_parquet.numpy_view(col_ids.values, np.int32)[a:b],
                      packed_parquet.numpy_view(col_mask.values, np.int8)[a:b], np.diff(off)))
    return tuple(np.concatenate([p[i] for p in parts]) if parts else np.zeros(0, dt)
                 for i, dt in enumerate((np.int32, np.int8, np.int64)))


# ---- stage 3: pack ------------------------------------------------------------------------------------
PACK_META = ("dataset_max_seqlen", "max_samples_per_bin", "packing_factor", "packing_efficiency", "pack_size",
             "min_packed_seqlen")  # Bridge's packing-metadata keys, one dict per split in <S>_metadata.jsonl
PACK_BLOCK_TOKENS = 1 << 21  # packs are built and written this many tokens at a time (bounded memory)


@dataclasses.dataclass
class Selected:
    """The sequences of a split that are packed, after Bridge's conventions (see :func:`select_sequences`)."""
    index: np.ndarray  # kept sequences (positions in the split)
    start: np.ndarray  # per kept sequence: its first token's position in the split's flat arrays
    copy: np.ndarray  # per kept sequence: tokens taken from the tokenized sequence ...
    final: np.ndarray  # ... and its stored length (the rest is padding); its runtime length is final - 1
    stats: dict  # dropped_too_long / truncated / dropped_no_loss_tokens counts (only those that happened)


def select_sequences(lengths: np.ndarray, mask: np.ndarray, seq_length: int, pad_mult: int,
                     overlong: str) -> Selected:
    """Bridge's conventions, vectorised over a split: a sequence counts as len(input_ids)-1 (its runtime length),
    which is padded up to a multiple of ``pad_mult``; so the longest runtime length is the largest multiple of
    ``pad_mult`` <= ``seq_length`` (``seq_length`` itself without padding), and a longer sequence is dropped or
    truncated there (counted either way); then one with no loss token after its first is dropped."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    stats = {}
    limit = (seq_length // pad_mult) * pad_mult
    too_long = lengths - 1 > limit
    n_long = int(np.count_nonzero(too_long))
    if overlong == "drop":
        keep, eff = ~too_long, lengths
        if n_long:
            stats["dropped_too_long"] = n_long
    else:
        keep, eff = np.ones(len(lengths), dtype=bool), np.minimum(lengths, limit + 1)
        if n_long:
            stats["truncated"] = n_long
    # Any loss token in positions 1 .. eff-1: one OR-reduction over the segments [start+1, start+eff) of the
    # sequences with eff >= 2, which are non-empty and strictly increasing (the last may run to the end).
    has_loss = eff >= 2
    cand = np.flatnonzero(has_loss)
    if len(cand):
        cuts = np.empty(2 * len(cand), dtype=np.int64)
        cuts[0::2], cuts[1::2] = starts[cand] + 1, starts[cand] + eff[cand]
        any_loss = np.bitwise_or.reduceat(mask, cuts[:-1] if cuts[-1] == len(mask) else cuts)[0::2] != 0
        has_loss[cand] = any_loss
    no_loss = int(np.count_nonzero(keep & ~has_loss))
    if no_loss:
        stats["dropped_no_loss_tokens"] = no_loss
    index = np.flatnonzero(keep & has_loss)
    copy = eff[index]
    final = -(-(copy - 1) // pad_mult) * pad_mult + 1 if pad_mult > 1 else copy  # <= limit + 1: nothing is cut
    return Selected(index, starts[index], copy, final, stats)


def pack_blocks(ids: np.ndarray, mask: np.ndarray, sel: Selected, items: np.ndarray, bounds: np.ndarray,
                pad_id: int):
    """The packed rows, PACK_BLOCK_TOKENS at a time (whole row groups): each pack concatenates its sequences,
    padded with ``pad_id`` (loss 0) to their stored length, the loss mask rolled by one (position i says whether
    token i+1 is a target; a sequence's last position is 0). Copies whole slices (one memcpy per sequence)."""
    rolled = np.zeros_like(mask)
    rolled[:-1] = mask[1:]  # a sequence's last copied position is set to 0 below, once packed
    src, copy, final = sel.start[items], sel.copy[items], sel.final[items]  # in pack order
    pad = final - copy
    fill_ids = np.full(int(pad.max(initial=0)), pad_id, dtype=np.int64)
    fill_mask = np.zeros(len(fill_ids), dtype=np.int8)
    per_pack = np.add.reduceat(final, bounds[:-1]) if len(items) else np.zeros(0, dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(per_pack)])
    step, p0, n_packs = packed_parquet.ROW_GROUP_SIZE, 0, len(bounds) - 1
    while p0 < n_packs:
        # whole row groups, at least one, up to about PACK_BLOCK_TOKENS tokens
        p1 = int(np.searchsorted(cum, cum[p0] + PACK_BLOCK_TOKENS, side="right")) - 1
        p1 = min(n_packs, max(p0 + step, p0 + (p1 - p0) // step * step))
        s0, s1 = int(bounds[p0]), int(bounds[p1])
        id_parts, mask_parts = [], []
        for a, n, g in zip(src[s0:s1].tolist(), copy[s0:s1].tolist(), pad[s0:s1].tolist()):
            id_parts.append(ids[a:a + n])
            mask_parts.append(rolled[a:a + n])
            if g:
                id_parts.append(fill_ids[:g])
                mask_parts.append(fill_mask[:g])
        out_ids = np.concatenate(id_parts, dtype=np.int64)
        out_mask = np.concatenate(mask_parts)
        seq_off = np.zeros(s1 - s0 + 1, dtype=np.int64)
        np.cumsum(final[s0:s1], out=seq_off[1:])
        out_mask[seq_off[1:] - pad[s0:s1] - 1] = 0
        pack_off = seq_off[bounds[p0:p1 + 1] - s0]
        pack_of_seq = np.repeat(np.arange(p1 - p0), np.diff(bounds[p0:p1 + 1]))
        yield packed_parquet.packs_table(pack_off, out_ids, out_mask, bounds[p0:p1 + 1] - s0,
                                         seq_off[:-1] - pack_off[pack_of_seq])
        p0 = p1


def pack_split(flat: tuple, seq_length: int, pad_mult: int, pad_id: int, overlong: str, seed: int,
               path: Path) -> dict:
    """Select, pad, pack and write one split (``flat``: ids, mask, lengths); its summary (``sequences`` 0 and
    nothing written when no sequence is left)."""
    ids, mask, lengths = flat
    sel = select_sequences(lengths, mask, seq_length, pad_mult, overlong)
    if not len(sel.index):
        return {"sequences": 0, **sel.stats}
    runtime = sel.final - 1
    items, bounds = pack_order(runtime, seq_length, seed=seed)
    packed_parquet.write(pack_blocks(ids, mask, sel, items, bounds, pad_id), path)
    sizes = np.diff(bounds)
    sums = np.add.reduceat(runtime[items], bounds[:-1])
    n_packs = len(sizes)
    meta = {
        "dataset_max_seqlen": int(runtime.max()),
        "max_samples_per_bin": int(sizes.max()),
        "packing_factor": round(len(runtime) / n_packs, 2),
        "packing_efficiency": round(int(sums.sum()) / n_packs / seq_length * 100, 2),
        "pack_size": seq_length,
        "min_packed_seqlen": int(sums.min()),
    }
    return {"sequences": len(sel.index), "packs": n_packs, "tokens": int(sel.final.sum()), **sel.stats, **meta}


def pack_fingerprint(root: Path, tok_name: str, tokenizer: str, seq_length: int, pad_mult: int, seed: int,
                     overlong: str) -> dict:
    tokenized = {sp: (read_marker(tokenized_dir(root, tok_name, sp) / "_DONE.json") or {}).get("fingerprint")
                 for sp in SPLITS}
    return {"tokenize": tokenized, "tokenizer": tokenizer, "seq_length": seq_length, "pad_seq_to_mult": pad_mult,
            "seed": seed, "overlong": overlong}


def stage_pack(root: Path, tok_name: str, tokenizer: str, seq_length: int, pad_mult: int, seed: int,
               overlong: str, force: bool, timer: Timer, pad_id: int | None = None, kept: dict | None = None) -> dict:
    """``kept``: splits' flat arrays from this run's tokenize stage (read back from the chunks otherwise)."""
    problems = check_pack_args(seq_length, pad_mult, seed=seed)
    if problems:
        raise UserError("; ".join(problems))
    paths = packed_parquet.packed_paths(root, tok_name, pad_mult, seq_length)
    summary_path = paths["train"].parent / f"{seq_length}_summary.json"
    fp = pack_fingerprint(root, tok_name, tokenizer, seq_length, pad_mult, seed, overlong)
    if not force and summary_path.exists():
        old = read_marker(summary_path) or {}
        files_there = all(paths[k].exists() for k in ("train", "metadata")) and (
            paths["validation"].exists() or (old.get("validation") or {}).get("sequences") == 0)
        diff = fingerprint_diff(old.get("fingerprint"), fp)
        if files_there and not diff:
            log.info("stage pack: already done (%s), skipping", paths["train"].parent)
            return old
        if files_there:
            log.info("stage pack: redoing, %s (%s)", diff, paths["train"].parent)
    if pad_id is None:
        from pipeline.data.chat import load_tokenizer, tokenizer_files

        files = tokenizer_files(tokenizer)
        pad_id = files["eos_id"] if files else load_tokenizer(tokenizer).eos_token_id
    metas, out = [], {}
    with timer.stage("pack"):
        for split in SPLITS:
            flat = kept[split] if kept and split in kept else load_tokenized(root, tok_name, split)
            key = "train" if split == "train" else "validation"
            res = out[split] = pack_split(flat, seq_length, pad_mult, pad_id, overlong, seed, paths[key])
            if not res["sequences"]:
                stats = {k: v for k, v in res.items() if k != "sequences"}
                if split == "train":
                    raise UserError(f"no training sequences left to pack at seq_length {seq_length} ({stats})")
                paths[key].unlink(missing_ok=True)  # an earlier run's split would not match this summary
                log.info("stage pack[%s]: no sequences (empty split), nothing to write", split)
                continue
            metas.append({k: res[k] for k in PACK_META})
            log.info("stage pack[%s]: %d sequences -> %d packs of %d (%.1f%% full) -> %s", split, res["sequences"],
                     res["packs"], seq_length, res["packing_efficiency"], paths[key])
        write_text(paths["metadata"], json.dumps(metas))
    out["paths"] = {k: str(v) for k, v in paths.items() if k != "validation" or out["validation"]["sequences"]}
    out["fingerprint"] = fp
    write_json(summary_path, out)
    return out


def prepare(opts: PrepareOptions) -> dict:
    """Export, tokenize, pack. When the tokenize stage has work and the tokenizer's files are in the plain
    layout, its workers start before the export (no transformers import in this process at all)."""
    from pipeline.data.chat import load_tokenizer, tokenizer_files, tokenizer_model_name

    opts.validate()
    timer = Timer()
    tok_name = tokenizer_model_name(opts.tokenizer)
    loaded: list = []

    def get_tokenizer():  # loaded at most once, and only when the tokenize or pack stage has work to do
        if not loaded:
            loaded.append(load_tokenizer(opts.tokenizer))
        return loaded[0]

    with root_lock(opts.dataset_root):
        export_fp = export_fingerprint(opts)
        files = pool = None
        if tokenize_pending(opts, tok_name, tokenize_fingerprint(opts, {"fingerprint": export_fp})):
            files = tokenizer_files(opts.tokenizer)
            pool = start_pool(opts, files) if files is not None else None
        kept: dict = {}
        try:
            export = stage_export(opts, timer, fp=export_fp, pool=pool)
            tokenized = stage_tokenize(opts, tok_name, timer, tokenizer=get_tokenizer, export=export, pool=pool,
                                       keep=kept)
        finally:
            if pool is not None:
                pool.close()
        pad_id = loaded[0].eos_token_id if loaded else (files["eos_id"] if files is not None else None)
        packed = stage_pack(opts.dataset_root, tok_name, opts.tokenizer, opts.seq_length, opts.pad_seq_to_mult,
                            opts.seed, opts.overlong, opts.force, timer, pad_id=pad_id, kept=kept)
    summary = {"dataset": opts.dataset, "dataset_root": str(opts.dataset_root), "tokenizer": tok_name,
               "seq_length": opts.seq_length, "pad_seq_to_mult": opts.pad_seq_to_mult,
               "export": export, "tokenize": tokenized, "pack": packed, "seconds_per_stage": timer.stages}
    return summary
