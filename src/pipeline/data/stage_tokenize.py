"""Stage 2 of ``prepare``, tokenize: chat template + assistant-only loss mask, in chunks, by the workers ->
``<root>/tokenized/<tokenizer>/<split>/chunk_NNNNN.parquet`` and the split's marker ``_DONE.json`` (a killed run
resumes at the first missing chunk; ``_FINGERPRINT.json`` says what the chunks there were made from)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np

from pipeline.common.errors import UserError, exc_line
from pipeline.common.io import atomic_path, write_json
from pipeline.data import packed_parquet
from pipeline.data import workers as wk
from pipeline.data.chat import DROP_REASONS, ChatEncoder, load_tokenizer
from pipeline.data.fingerprint import fingerprint_diff, read_marker, reuse_if_current
from pipeline.data.shards import CHUNK_SIZE, balanced_bounds, shard_dir
from pipeline.data.stage_base import SPLIT_FILES, SPLITS, Timer, log, progress, slices, tokenized_dir

KEEP_TOKENS = 1 << 28  # the pack stage gets splits up to this many tokens from memory instead of reading them back


@dataclasses.dataclass
class TokenizeOptions:
    """Which tokenizer encodes the exported splits, in what chunks, with how many workers, and where."""

    dataset_root: Path  # the data root holding the export stage's splits
    tok_name: str  # the tokenizer's folder name under <root>/tokenized/ (tokenizer_model_name(tokenizer))
    tokenizer: str = "smollm2-135m"  # registry model name, local dir or HF id
    chunk_size: int = CHUNK_SIZE  # conversations per chunk (the resume unit)
    workers: int | None = None  # worker processes; None: every usable CPU (not in any fingerprint)
    force: bool = False  # redo the stage even when its markers match
    quiet: bool = False  # no progress bar or periodic progress line
    shard: tuple[int, int] | None = None  # (I, N): only shard I of N's chunks, into its shard folder (prepare_shards)

    @property
    def out_root(self) -> Path:
        """Where ``tokenized/`` is written: the data root, or a shard's own folder under ``<root>/.shards/``."""
        return self.dataset_root if self.shard is None else shard_dir(self.dataset_root, *self.shard)


def tokenize_fingerprint(opts: TokenizeOptions, export: dict) -> dict:
    """What a split's chunks were made from: the export's fingerprint, the tokenizer and the chunk size (and, for a
    shard's folder, which shard of how many)."""
    fp = {"export": export.get("fingerprint"), "tokenizer": opts.tokenizer, "chunk_size": opts.chunk_size}
    return fp if opts.shard is None else {**fp, "shard": list(opts.shard)}


def chunk_path(out_dir: Path, index: int) -> Path:
    """A split's chunk ``index`` in its tokenized folder."""
    return out_dir / f"chunk_{index:05d}.parquet"


def missing_chunks(out_dir: Path, marker: dict | None) -> list[str]:
    """The chunk files a finished split's marker (``_DONE.json``) counts that are not on disk (deleted, or moved
    away): its chunks ``0 .. chunks - 1``, or a shard's ``chunk_range``."""
    if not isinstance(marker, dict) or not isinstance(marker.get("chunks"), int):
        return []
    first, last = marker.get("chunk_range") or (0, marker["chunks"])
    return [p.name for p in (chunk_path(out_dir, c) for c in range(int(first), int(last))) if not p.is_file()]


def chunk_plan(root: Path, chunk_size: int) -> dict[str, tuple[np.ndarray, int]]:
    """Each exported split's line starts (:func:`workers.line_starts`) and its number of chunks (an empty split has
    one, empty)."""
    plan = {}
    for split in SPLITS:
        starts = wk.line_starts(root / SPLIT_FILES[split])
        plan[split] = starts, max(1, -(-(len(starts) - 1) // chunk_size))
    return plan


def shard_chunks(plan: dict[str, tuple[np.ndarray, int]], chunk_size: int, index: int, count: int) -> dict[str, range]:
    """Shard ``index`` of ``count``: a contiguous run of the export's chunks (the training split's, then the
    validation split's, in order), balanced by their bytes of JSONL. Every chunk is made from its own lines alone,
    so the shards' chunks, put together, are the one-node run's chunks."""
    chunks = [(split, c) for split in SPLITS for c in range(plan[split][1])]
    if count > len(chunks):
        raise UserError(f"{count} shards of an export of {len(chunks)} chunk(s) of {chunk_size} conversations: a "
                        f"shard is at least one chunk, so use at most {len(chunks)} node(s) or a smaller --chunk-size")
    sizes = []
    for split, c in chunks:
        starts = plan[split][0]
        n = len(starts) - 1
        sizes.append(int(starts[min(n, (c + 1) * chunk_size)] - starts[min(n, c * chunk_size)]))
    bounds = balanced_bounds(sizes, count)
    mine = chunks[bounds[index]:bounds[index + 1]]
    return {split: range(min((c for s, c in mine if s == split), default=0),
                         max((c + 1 for s, c in mine if s == split), default=0)) for split in SPLITS}


class _TemplateMismatch(Exception):
    """The direct render differs from transformers' on the checked conversation: redo with the full tokenizer."""


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
              **{f"dropped_{r}": int(sum(p[3][r] for p in parts)) for r in DROP_REASONS}}
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


def tokenize_pending(opts: TokenizeOptions, fp: dict) -> bool:
    """Whether the tokenize stage will have work to do (a split not finished with this fingerprint)."""
    if opts.force:
        return True
    for split in SPLITS:
        done = tokenized_dir(opts.out_root, opts.tok_name, split) / "_DONE.json"
        marker = read_marker(done)
        if marker is None or fingerprint_diff(marker.get("fingerprint"), fp) or missing_chunks(done.parent, marker):
            return True
    return False


def start_pool(opts: TokenizeOptions, files: dict):
    """The tokenize workers, their encoder made from the tokenizer's files (:func:`tokenizer_files`), started now:
    their start-up overlaps the rest of this process's set-up, and they read the export stage's input."""
    n = wk.resolve_workers(opts.workers)
    if n > 1:
        return wk.OrderedPool(n, wk.init_chat, (ChatEncoder.files_payload(files, opts.tokenizer),)).start()
    encoder = ChatEncoder.from_files(files, name=opts.tokenizer)
    return wk.OrderedPool(1, wk.init_chat, (), local=lambda: wk.set_chat(encoder))


def stage_tokenize(opts: TokenizeOptions, timer: Timer, tokenizer=None, export: dict | None = None, pool=None,
                   keep: dict | None = None) -> dict:
    """``tokenizer``: a tokenizer, None (loaded when needed) or a zero-argument callable returning one.
    ``pool``: workers from :func:`start_pool` (their encoder made from the tokenizer's files); the direct render is
    then checked against transformers' once, in a worker, before any chunk is written (a mismatch redoes the stage
    with the full tokenizer). ``keep``: a dict that gets, for each split made entirely in this run (up to
    KEEP_TOKENS tokens), its flat (ids, mask, lengths) for the pack stage.

    Each split's exported JSONL is cut into chunks of ``chunk_size`` conversations (the resume unit: one
    Parquet file each, written atomically) and each chunk into slices (byte ranges of the JSONL) that the
    workers read, render, encode and mask; results come back in slice order and each chunk is written as soon
    as its last slice is in, so the files are the same whatever the number of workers."""
    try:
        return _stage_tokenize(opts, timer, tokenizer, export, pool, keep)
    except _TemplateMismatch:
        if pool is not None:
            pool.close()
        log.info("stage tokenize: the chat template's direct render differs from transformers' "
                 "apply_chat_template; rendering with transformers instead")
        if keep is not None:
            keep.clear()
        return _stage_tokenize(opts, timer, tokenizer, export, None, keep)


def _stage_tokenize(opts: TokenizeOptions, timer: Timer, tokenizer, export: dict | None, pool,
                    keep: dict | None) -> dict:
    if export is None:
        export = read_marker(opts.dataset_root / "export_stats.json") or {}
    fp = tokenize_fingerprint(opts, export)
    result, plans = {}, []
    chunk_plan_ = chunk_plan(opts.dataset_root, opts.chunk_size)
    mine = shard_chunks(chunk_plan_, opts.chunk_size, *opts.shard) if opts.shard is not None else None
    for split in SPLITS:
        out_dir = tokenized_dir(opts.out_root, opts.tok_name, split)
        done = out_dir / "_DONE.json"
        started = out_dir / "_FINGERPRINT.json"
        if not opts.force and done.exists():
            gone = missing_chunks(out_dir, read_marker(done))
            if gone:  # a finished split whose chunks were deleted: made again, the others reused
                log.warning("stage tokenize[%s]: %d chunk(s) of the finished split in %s are missing (%s): making "
                            "them again", split, len(gone), out_dir, ", ".join(gone[:3]) + (" ..." if gone[3:] else ""))
                done.unlink()
            else:
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
            starts, n_chunks = chunk_plan_[split]
            n_convs = len(starts) - 1
            chunks = []
            for c in (range(n_chunks) if mine is None else mine[split]):
                path = chunk_path(out_dir, c)
                first, last = c * opts.chunk_size, min(n_convs, (c + 1) * opts.chunk_size)
                counts = _chunk_counts(path) if path.exists() else None  # a finished chunk is reused
                chunks.append((path, counts, None if counts is not None else slices(starts, first, last) or [(0, 0)]))
            reused = sum(counts is not None for _, counts, _ in chunks)
            if reused:
                log.info("stage tokenize[%s]: resumed: %d of %d chunks were already on disk (%s)", split, reused,
                         len(chunks), out_dir)
            plans.append((split, out_dir, done, src, chunks))
    if not plans:
        return result
    with timer.stage("tokenize"):
        tasks = [(src, a, b) for _, _, _, src, chunks in plans for _, _, sl in chunks if sl for a, b in sl]
        first_conv = next((_first_line(src) for _, _, _, src, _ in plans if os.path.getsize(src)), None)
        check = None
        if tasks and pool is not None:  # files-made encoder: checked in a worker
            check = pool.submit(wk.template_check, PROBES)
        elif tasks:  # the caller's (or a freshly loaded) tokenizer, checked here on the first conversation
            tok = tokenizer
            if tok is None:
                tok = load_tokenizer(opts.tokenizer)
            elif callable(tok) and not hasattr(tok, "apply_chat_template"):
                tok = tok()
            encoder = ChatEncoder.from_tokenizer(tok, (first_conv or {}).get("messages"), name=opts.tokenizer)
            workers = min(wk.resolve_workers(opts.workers), max(1, len(tasks)))
            pool = wk.OrderedPool(workers, wk.init_chat, (encoder.payload(),) if workers > 1 else (),
                                  local=lambda: wk.set_chat(encoder))
        elif pool is None:
            pool = wk.OrderedPool(1, wk.init_chat, ())
        kept = 0
        with pool:
            results = pool.imap(wk.chat_slice, tasks)
            for split, out_dir, done, _, chunks in plans:
                totals: collections.Counter[str] = collections.Counter()
                parts: list | None = [] if keep is not None and all(sl for _, _, sl in chunks) else None
                for path, counts, sl in progress(chunks, opts.quiet, f"tokenize {split}", "chunk", len(chunks)):
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
                if mine is not None:  # a shard's run of the split's chunks
                    summary["chunk_range"] = [mine[split].start, mine[split].stop]
                write_json(done, summary)
                result[split] = summary
                if parts is not None and keep is not None:  # (parts is None without a keep)
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
    gone = missing_chunks(d, read_marker(d / "_DONE.json"))
    if gone:
        raise UserError(f"the tokenized split {d} is missing {len(gone)} of its chunks ({', '.join(gone[:3])}"
                        f"{' ...' if gone[3:] else ''}): re-run prepare, which makes only the missing chunks again")
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
