"""The ``prepare`` and ``pack`` actions: conversations -> chat template + loss masks -> packed Parquet.

Stages, each resumable (outputs are written atomically and a finished stage is skipped):
  1. export    load + normalise + split -> ``<root>/training.jsonl``, ``<root>/validation.jsonl``
  2. tokenize  chat template + assistant-only loss mask, in chunks ->
               ``<root>/tokenized/<tokenizer>/<split>/chunk_NNNNN.parquet`` (a killed run resumes at the
               first missing chunk)
  3. pack      pad to ``pad_seq_to_mult``, roll the loss mask, ``pack_sequences`` ->
               ``<root>/packed/<tokenizer>_pad_seq_to_mult<N>/training_<S>.idx.parquet`` (+ validation,
               ``<S>_metadata.jsonl``)
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from pathlib import Path

import numpy as np

from pipeline.common.errors import UserError
from pipeline.common.io import atomic_path, read_json, write_json, write_text
from pipeline.data import packed_parquet
from pipeline.data.packing import check_pad_multiple, pack_sequences

log = logging.getLogger(__name__)
SPLITS = ("train", "validation")
SPLIT_FILES = {"train": "training.jsonl", "validation": "validation.jsonl"}


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
    chunk_size: int = 20000
    force: bool = False
    quiet: bool = False

    def validate(self) -> None:
        problems = []
        if self.seq_length < 2:
            problems.append(f"--seq-length must be >= 2, got {self.seq_length}")
        p = check_pad_multiple(self.pad_seq_to_mult, self.context_parallel_size, self.tensor_parallel_size,
                               self.sequence_parallel)
        if p:
            problems.append(p)
        if self.pad_seq_to_mult > self.seq_length:
            problems.append(f"pad_seq_to_mult({self.pad_seq_to_mult}) > seq_length({self.seq_length})")
        if not 0 <= self.val_fraction < 1:
            problems.append(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.overlong not in ("drop", "truncate"):
            problems.append(f"--overlong must be drop or truncate, got {self.overlong}")
        if problems:
            raise UserError("\n".join(problems))


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


def _tqdm(it, quiet: bool, **kw):
    from tqdm.auto import tqdm

    from pipeline.common.log import progress_disabled

    return tqdm(it, disable=progress_disabled(quiet), **kw)


# ---- stage 1: export ----------------------------------------------------------------------------
def stage_export(opts: PrepareOptions, timer: Timer, keep: dict | None = None) -> dict:
    """Export the normalised splits; when ``keep`` is given and the stage runs, the splits are also left in it
    (so the tokenize stage need not read back the JSONL it was just given)."""
    from pipeline.data.sources import load_conversations

    root = opts.dataset_root
    stats_path = root / "export_stats.json"
    if not opts.force and stats_path.exists() and all((root / f).exists() for f in SPLIT_FILES.values()):
        log.info("stage export: already done (%s), skipping", root)
        return read_json(stats_path)
    with timer.stage("export"):
        convs, stats = load_conversations(opts.dataset, limit=opts.limit)
        dropped = {k[len("dropped_"):]: v for k, v in stats.items() if k.startswith("dropped_")}
        if not convs:
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())) or "no rows"
            raise UserError(f"dataset '{opts.dataset}': all {stats['rows_in']} rows were unusable ({reasons})")
        rng = np.random.default_rng(opts.seed)
        perm = rng.permutation(len(convs))
        n_val = int(round(opts.val_fraction * len(convs)))
        if opts.val_fraction > 0 and len(convs) >= 2:
            n_val = max(1, n_val)
        val_idx = set(perm[:n_val].tolist())
        splits = {"train": [c for i, c in enumerate(convs) if i not in val_idx],
                  "validation": [c for i, c in enumerate(convs) if i in val_idx]}
        for split, name in SPLIT_FILES.items():
            write_text(root / name, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in splits[split]))
        if keep is not None:
            keep.update(splits)
        out = {"dataset": opts.dataset, "rows_in": stats["rows_in"], "kept": len(convs), "dropped": dropped,
               "train": len(splits["train"]), "validation": len(splits["validation"])}
        write_json(stats_path, out)
    log.info("stage export: %d rows in, %d kept (%d train, %d validation), dropped %s -> %s",
             out["rows_in"], out["kept"], out["train"], out["validation"], dropped or "none", root)
    return out


# ---- stage 2: tokenize ----------------------------------------------------------------------------
def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def tokenized_dir(root: Path, tok_name: str, split: str) -> Path:
    return root / "tokenized" / tok_name / split


def stage_tokenize(opts: PrepareOptions, tok_name: str, timer: Timer, tokenizer=None,
                   splits: dict | None = None) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.chat import load_tokenizer, tokenize_conversations

    result = {}
    for split in SPLITS:
        out_dir = tokenized_dir(opts.dataset_root, tok_name, split)
        done = out_dir / "_DONE.json"
        if not opts.force and done.exists():
            log.info("stage tokenize[%s]: already done (%s), skipping", split, out_dir)
            result[split] = read_json(done)
            continue
        with timer.stage("tokenize"):
            convs = (splits or {}).get(split)
            if convs is None:
                convs = _read_jsonl(opts.dataset_root / SPLIT_FILES[split])
            n_chunks = max(1, -(-len(convs) // opts.chunk_size))
            totals = collections.Counter()
            for c in _tqdm(range(n_chunks), opts.quiet, desc=f"tokenize {split}", unit="chunk"):
                chunk_path = out_dir / f"chunk_{c:05d}.parquet"
                if not opts.force and chunk_path.exists():
                    meta = pq.read_metadata(chunk_path).metadata or {}
                    totals.update(json.loads(meta.get(b"pipeline_counts", b"{}")))
                    continue
                if tokenizer is None:
                    tokenizer = load_tokenizer(opts.tokenizer)
                part = convs[c * opts.chunk_size:(c + 1) * opts.chunk_size]
                ids, masks, mismatched = tokenize_conversations(tokenizer, part)
                counts = {"examples": len(ids), "tokens": int(sum(len(x) for x in ids)),
                          "loss_tokens": int(sum(int(m.sum()) for m in masks)), "dropped_template_mismatch": mismatched}
                offsets = np.zeros(len(ids) + 1, dtype=np.int32)
                np.cumsum([len(x) for x in ids], out=offsets[1:])
                flat_ids = np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32)
                flat_mask = np.concatenate(masks).astype(np.int8) if masks else np.zeros(0, np.int8)
                table = pa.table({
                    "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_ids)),
                    "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_mask)),
                })
                table = table.replace_schema_metadata({"pipeline_counts": json.dumps(counts)})
                with atomic_path(chunk_path) as tmp:
                    pq.write_table(table, str(tmp))
                totals.update(counts)
            summary = {"chunks": n_chunks, **{k: int(v) for k, v in totals.items()}}
            write_json(done, summary)
        result[split] = summary
        log.info("stage tokenize[%s]: %d examples, %d tokens (%d with loss) -> %s", split,
                 summary.get("examples", 0), summary.get("tokens", 0), summary.get("loss_tokens", 0), out_dir)
    return result


def load_tokenized(root: Path, tok_name: str, split: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    import pyarrow.parquet as pq

    d = tokenized_dir(root, tok_name, split)
    if not (d / "_DONE.json").exists():
        raise UserError(f"no complete tokenized export at {d}; run: pipeline_data_prepare.py prepare --dataset ... first")
    ids, masks = [], []
    for f in sorted(d.glob("chunk_*.parquet")):
        t = pq.read_table(f)
        col_ids, col_mask = t.column("input_ids").combine_chunks(), t.column("loss_mask").combine_chunks()
        flat_ids = col_ids.values.to_numpy().astype(np.int64)
        flat_mask = col_mask.values.to_numpy()
        off = col_ids.offsets.to_numpy()
        for i in range(len(off) - 1):
            ids.append(flat_ids[off[i]:off[i + 1]])
            masks.append(flat_mask[off[i]:off[i + 1]])
    return ids, masks


# ---- stage 3: pack ------------------------------------------------------------------------------------
def pad_and_roll(ids: list[np.ndarray], masks: list[np.ndarray], seq_length: int, pad_mult: int, pad_id: int,
                 overlong: str) -> tuple[list[np.ndarray], list[np.ndarray], collections.Counter]:
    """Bridge's conventions: a sequence counts as len(input_ids)-1; runtime length padded to pad_mult
    (capped at the largest multiple <= seq_length); loss mask padded with 0, then rolled by one."""
    out_ids, out_masks = [], []
    stats = collections.Counter()
    cap = (seq_length // pad_mult) * pad_mult
    for x, m in zip(ids, masks):
        runtime = len(x) - 1
        if runtime > seq_length:
            if overlong == "drop":
                stats["dropped_too_long"] += 1
                continue
            stats["truncated"] += 1
            x, m = x[: seq_length + 1], m[: seq_length + 1]
            runtime = seq_length
        if not m[1:].any():
            stats["dropped_no_loss_tokens"] += 1
            continue
        if pad_mult > 1:
            target = min(cap, -(-runtime // pad_mult) * pad_mult) + 1
            if len(x) < target:
                x = np.concatenate([x, np.full(target - len(x), pad_id, dtype=x.dtype)])
                m = np.concatenate([m, np.zeros(target - len(m), dtype=m.dtype)])
            else:
                x, m = x[:target], m[:target]
        rolled = np.empty_like(m)
        rolled[:-1] = m[1:]
        rolled[-1:] = 0
        out_ids.append(x)
        out_masks.append(rolled)
    return out_ids, out_masks, stats


def pack_split(ids, masks, seq_length: int, seed: int):
    lengths = np.fromiter((len(x) - 1 for x in ids), dtype=np.int64, count=len(ids))
    bins = pack_sequences(lengths, seq_length, seed=seed)
    table = packed_parquet.build_rows(bins, ids, masks)
    sums = [int(lengths[b].sum()) for b in bins]
    meta = {
        "dataset_max_seqlen": int(lengths.max()),
        "max_samples_per_bin": max(len(b) for b in bins),
        "packing_factor": round(len(lengths) / len(bins), 2),
        "packing_efficiency": round(sum(sums) / len(bins) / seq_length * 100, 2),
        "pack_size": seq_length,
        "min_packed_seqlen": min(sums),
    }
    return table, meta


def stage_pack(root: Path, tok_name: str, tokenizer: str, seq_length: int, pad_mult: int, seed: int,
               overlong: str, force: bool, timer: Timer, pad_id: int | None = None) -> dict:
    paths = packed_parquet.packed_paths(root, tok_name, pad_mult, seq_length)
    summary_path = paths["train"].parent / f"{seq_length}_summary.json"
    if not force and all(paths[k].exists() for k in ("train", "validation", "metadata")) and summary_path.exists():
        log.info("stage pack: already done (%s), skipping", paths["train"].parent)
        return read_json(summary_path)
    if pad_id is None:
        from pipeline.data.chat import load_tokenizer

        pad_id = load_tokenizer(tokenizer).eos_token_id
    metas, out = [], {}
    with timer.stage("pack"):
        for split in SPLITS:
            ids, masks = load_tokenized(root, tok_name, split)
            ids, masks, stats = pad_and_roll(ids, masks, seq_length, pad_mult, pad_id, overlong)
            if not ids:
                if split == "train":
                    raise UserError(f"no training sequences left to pack at seq_length {seq_length} ({dict(stats)})")
                out[split] = {"sequences": 0, **stats}
                continue
            table, meta = pack_split(ids, masks, seq_length, seed)
            key = "train" if split == "train" else "validation"
            packed_parquet.write(table, paths[key])
            metas.append(meta)
            out[split] = {"sequences": len(ids), "packs": table.num_rows,
                          "tokens": int(sum(len(x) for x in ids)), **{k: int(v) for k, v in stats.items()}, **meta}
            log.info("stage pack[%s]: %d sequences -> %d packs of %d (%.1f%% full) -> %s", split, len(ids),
                     table.num_rows, seq_length, meta["packing_efficiency"], paths[key])
        write_text(paths["metadata"], json.dumps(metas))
    out["paths"] = {k: str(v) for k, v in paths.items()}
    write_json(summary_path, out)
    return out


def prepare(opts: PrepareOptions) -> dict:
    from pipeline.data.chat import tokenizer_model_name

    opts.validate()
    timer = Timer()
    tok_name = tokenizer_model_name(opts.tokenizer)
    from pipeline.data.chat import load_tokenizer

    splits: dict = {}
    export = stage_export(opts, timer, keep=splits)
    tokenizer = None
    done = all((tokenized_dir(opts.dataset_root, tok_name, sp) / "_DONE.json").exists() for sp in SPLITS)
    if opts.force or not done:
        tokenizer = load_tokenizer(opts.tokenizer)  # loaded once for the tokenize and pack stages
    tokenized = stage_tokenize(opts, tok_name, timer, tokenizer=tokenizer, splits=splits)
    packed = stage_pack(opts.dataset_root, tok_name, opts.tokenizer, opts.seq_length, opts.pad_seq_to_mult,
                        opts.seed, opts.overlong, opts.force, timer,
                        pad_id=tokenizer.eos_token_id if tokenizer is not None else None)
    summary = {"dataset": opts.dataset, "dataset_root": str(opts.dataset_root), "tokenizer": tok_name,
               "seq_length": opts.seq_length, "pad_seq_to_mult": opts.pad_seq_to_mult,
               "export": export, "tokenize": tokenized, "pack": packed, "seconds_per_stage": timer.stages}
    return summary
