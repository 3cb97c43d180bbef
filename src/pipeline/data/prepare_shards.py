"""Chat ``prepare`` across nodes: the export on one node, the tokenize stage's chunks in shards (one per node), then
the merge and the pack on one node. Byte for byte what one node writes.

- ``export_only``: the export stage alone (``--export-only``): its splits are global (one seeded permutation of every
  usable conversation, and ``--limit`` counts from the start of the dataset), so one node writes them.
- ``prepare_shard`` (``--shard I/N``): shard I of the export's tokenize chunks (``stage_tokenize.shard_chunks``: a
  contiguous run of the training split's chunks then the validation split's, balanced by bytes of JSONL) into
  ``<root>/.shards/shard_IIIII_of_NNNNN/tokenized/``, with its own lock and markers; a killed shard resumes at its
  first missing chunk. Every chunk is made from its own lines alone, so a chunk is the same file whichever node
  makes it.
- ``merge_shards`` (``--merge-shards N``): once every shard is finished, their chunks are moved (a rename on the
  same filesystem) into ``<root>/tokenized/``, and the tokenize stage's markers and the pack are written as one node
  writes them. Packing is a best fit over the whole split (``packing.pack_order``), so it is not split.

Decision 111 says why the tokenize chunks, and not the conversations or the packs, are what is split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path

from pipeline.common.errors import UserError
from pipeline.common.io import write_json
from pipeline.common.locks import exclusive_lock
from pipeline.data.chat import load_tokenizer, tokenizer_files, tokenizer_model_name
from pipeline.data.fingerprint import fingerprint_diff, read_marker
from pipeline.data.prepare import PrepareOptions, root_lock
from pipeline.data.shards import SHARDS_DIR, check_count, ranges, shard_dir
from pipeline.data.stage_base import SPLIT_FILES, SPLITS, Timer, log, tokenized_dir
from pipeline.data.stage_export import export_fingerprint, stage_export
from pipeline.data.stage_pack import stage_pack
from pipeline.data.stage_tokenize import (
    TokenizeOptions,
    chunk_path,
    chunk_plan,
    shard_chunks,
    stage_tokenize,
    start_pool,
    tokenize_fingerprint,
    tokenize_pending,
)


def _workers(opts: TokenizeOptions, export: dict | None):
    """The tokenize workers made from the tokenizer's files, started when the stage has work (None otherwise, or
    when the tokenizer's files are not in the plain layout: the stage then loads the tokenizer itself)."""
    if export is not None and not tokenize_pending(opts, tokenize_fingerprint(opts, export)):
        return None
    files = tokenizer_files(opts.tokenizer)
    return start_pool(opts, files) if files is not None else None


def export_only(opts: PrepareOptions) -> dict:
    """The export stage alone (skipped when it is current): the splits the shards tokenize."""
    opts.validate()
    tok = opts.for_tokenize(tokenizer_model_name(opts.tokenizer))
    with root_lock(opts.dataset_root):
        pool = _workers(tok, None)  # a JSONL dataset is read by the workers, a byte range each
        try:
            return stage_export(opts.for_export(), Timer(), pool=pool)
        finally:
            if pool is not None:
                pool.close()


def current_export(opts: PrepareOptions, what: str) -> dict:
    """The export's marker when it is finished from this input and these options; otherwise one line saying to run
    ``--export-only`` first."""
    root = opts.dataset_root
    marker = read_marker(root / "export_stats.json")
    if marker is None or marker.get("writing") or not all((root / f).is_file() for f in SPLIT_FILES.values()):
        raise UserError(f"{what}: the export of {opts.dataset} in {root} is not done: run the same prepare command "
                        "with --export-only first (a job across nodes does)")
    diff = fingerprint_diff(marker.get("fingerprint"), export_fingerprint(opts.for_export()))
    if diff:
        raise UserError(f"{what}: the export in {root} was made from another input or options ({diff}): run the same "
                        "prepare command with --export-only first")
    return marker


def prepare_shard(opts: PrepareOptions, index: int, count: int) -> dict:
    """Tokenize shard ``index`` of ``count`` of the export's chunks into its own folder (resumable by itself)."""
    opts.validate()
    check_count(count)
    if not 0 <= index < count:
        raise UserError(f"--shard {index}/{count}: the shard index must be below the count")
    export = current_export(opts, f"prepare --shard {index}/{count}")
    base = opts.for_tokenize(tokenizer_model_name(opts.tokenizer))
    tok = dataclasses.replace(base, shard=(index, count))
    mine = shard_chunks(chunk_plan(opts.dataset_root, opts.chunk_size), opts.chunk_size, index, count)  # refusals
    if not opts.force and _all_made(base, tok, export, mine):  # before any folder is made
        log.info("prepare --shard %d/%d: every chunk of this shard is made already (in its folder, or merged into %s):"
                 " nothing to do", index, count, opts.dataset_root / "tokenized")
        return {sp: {"chunks": len(mine[sp]), "made_already": True} for sp in SPLITS}
    where = tok.out_root
    new = not where.exists()
    where.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive_lock(where / ".prepare.lock", f"shard folder {where}"):
            pool = _workers(tok, export)
            try:
                return stage_tokenize(tok, Timer(), export=export, pool=pool)
            finally:
                if pool is not None:
                    pool.close()
    except BaseException:
        if new and not any(where.rglob("chunk_*.parquet")):  # a shard that made nothing leaves no folder
            shutil.rmtree(where, ignore_errors=True)
            with contextlib.suppress(OSError):
                (opts.dataset_root / SHARDS_DIR).rmdir()
        raise


def _all_made(base: TokenizeOptions, tok: TokenizeOptions, export: dict, mine: dict[str, range]) -> bool:
    """Every chunk of the shard is on disk: in its finished shard folder, or already in the data root's tokenized
    folder (made from the same export and options: moved there by a merge, or made by a one-node run). A job
    resubmitted after its merge, or after a merge that was interrupted, then tokenizes nothing again."""
    fp = tokenize_fingerprint(base, export)
    finished = _shard_finished(tok, tokenize_fingerprint(tok, export))
    for sp, chunks in mine.items():
        root_dir = tokenized_dir(base.dataset_root, base.tok_name, sp)
        merged = not fingerprint_diff((read_marker(root_dir / "_FINGERPRINT.json") or {}).get("fingerprint"), fp)
        own = tokenized_dir(tok.out_root, tok.tok_name, sp)
        for c in chunks:
            if not ((merged and chunk_path(root_dir, c).is_file()) or (finished and chunk_path(own, c).is_file())):
                return False
    return True


def _shard_finished(tok: TokenizeOptions, fp: dict) -> bool:
    return all(not fingerprint_diff((read_marker(tokenized_dir(tok.out_root, tok.tok_name, sp) / "_DONE.json")
                                     or {}).get("fingerprint"), fp) for sp in SPLITS)


def merge_shards(opts: PrepareOptions, count: int) -> dict:
    """The data root's tokenized chunks from ``count`` finished shards (moved, not copied), then the tokenize
    stage's markers and the pack: the summary one ``prepare`` prints. Refused, naming them, while a shard is
    unfinished or was made from another export or options. ``opts.force`` redoes the pack only (each shard's own
    ``--force`` redoes its chunks)."""
    opts.validate()
    check_count(count)
    root, tok_name = opts.dataset_root, tokenizer_model_name(opts.tokenizer)
    base = dataclasses.replace(opts.for_tokenize(tok_name), force=False)
    timer = Timer()
    with root_lock(root):
        export = current_export(opts, f"prepare --merge-shards {count}")
        fp = tokenize_fingerprint(base, export)
        if tokenize_pending(base, fp):
            _move_chunks(base, export, fp, count)
        else:
            log.info("prepare: the tokenize stage is already merged in %s", root / "tokenized" / tok_name)
        for i in range(count):  # this split's shards only: another split's may still be running
            shutil.rmtree(shard_dir(root, i, count), ignore_errors=True)
        with contextlib.suppress(OSError):
            (root / SHARDS_DIR).rmdir()  # when no other split's shards are left in it
        loaded: list = []

        def get_tokenizer():
            if not loaded:
                loaded.append(load_tokenizer(opts.tokenizer))
            return loaded[0]

        tokenized = stage_tokenize(base, timer, tokenizer=get_tokenizer, export=export)
        packed = stage_pack(opts.for_pack(tok_name), timer, tokenized=tokenized)
    return {"dataset": opts.dataset, "dataset_root": str(root), "tokenizer": tok_name, "seq_length": opts.seq_length,
            "pad_seq_to_mult": opts.pad_seq_to_mult, "export": export, "tokenize": tokenized, "pack": packed,
            "seconds_per_stage": timer.stages}


def _move_chunks(base: TokenizeOptions, export: dict, fp: dict, count: int) -> None:
    """Every chunk of the export from the shard that made it into ``<root>/tokenized/`` (a chunk already there,
    moved by a merge that was interrupted, counts as moved)."""
    root, size = base.dataset_root, base.chunk_size
    plan = chunk_plan(root, size)
    dst = {sp: tokenized_dir(root, base.tok_name, sp) for sp in SPLITS}
    current = {sp: not fingerprint_diff((read_marker(dst[sp] / "_FINGERPRINT.json") or {}).get("fingerprint"), fp)
               for sp in SPLITS}
    moves, unfinished = [], []
    for i in range(count):
        tok = dataclasses.replace(base, shard=(i, count))
        finished = _shard_finished(tok, tokenize_fingerprint(tok, export))
        for sp, chunks in shard_chunks(plan, size, i, count).items():
            for c in chunks:
                target = chunk_path(dst[sp], c)
                if current[sp] and target.is_file():
                    continue
                source = chunk_path(tokenized_dir(tok.out_root, base.tok_name, sp), c)
                if not (finished and source.is_file()):
                    unfinished.append(i)
                    break
                moves.append((source, target))
            if unfinished and unfinished[-1] == i:
                break
    if unfinished:
        raise UserError(f"cannot merge {count} shards into {root / 'tokenized'}: shard(s) {ranges(unfinished)} are "
                        f"not finished (or were made from another export or options): run prepare --shard I/{count} "
                        f"for each, then --merge-shards {count}")
    for sp in SPLITS:
        if not current[sp]:
            if dst[sp].exists():
                shutil.rmtree(dst[sp])
            write_json(dst[sp] / "_FINGERPRINT.json", {"fingerprint": fp})
    for source, target in moves:
        os.replace(source, target)
    log.info("prepare: merged %d shards: %d chunks moved into %s", count, len(moves), Path(root) / "tokenized")
