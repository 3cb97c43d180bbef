"""Stage 3 of ``prepare``, and the ``pack`` action: pad to ``pad_seq_to_mult``, roll the loss mask, ``pack_order``,
vectorised over the split -> ``<root>/packed/<tokenizer>_pad_seq_to_mult<N>/training_<S>.idx.parquet`` (+ validation,
``<S>_metadata.jsonl``) and the marker ``<S>_summary.json``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from pipeline.common.errors import UserError
from pipeline.common.io import write_json, write_text
from pipeline.data import packed_parquet
from pipeline.data.chat import load_tokenizer, tokenizer_files
from pipeline.data.fingerprint import as_recorded, fingerprint_diff, read_marker
from pipeline.data.packing import check_pad_multiple, pack_order
from pipeline.data.stage_base import SPLITS, Timer, log, tokenized_dir
from pipeline.data.stage_tokenize import load_tokenized

MAX_SEQ_LENGTH = 1_048_576  # the packer allocates O(seq_length): bound it before anything runs


@dataclasses.dataclass
class PackOptions:
    """Which tokenized export is packed, into what sequence length and padding, and how."""

    dataset_root: Path  # the data root holding the tokenize stage's chunks
    tok_name: str  # the tokenizer's folder name under <root>/tokenized/ (tokenizer_model_name(tokenizer))
    tokenizer: str  # registry model name, local dir or HF id (its EOS token pads)
    seq_length: int  # the packed sequence length S
    pad_seq_to_mult: int = 1  # every sequence is padded to a multiple of this
    seed: int = 0  # pack_order's seed
    overlong: str = "drop"  # drop | truncate: a sequence longer than seq_length
    force: bool = False  # redo the stage even when its marker matches


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


def pack_fingerprint(opts: PackOptions, tokenized: dict | None = None) -> dict:
    """What the packs were made from: each split's tokenize fingerprint (from ``tokenized``, the tokenize stage's
    result, or else its ``_DONE.json`` on disk) and the packing options."""
    if tokenized is None:
        tokenized = {sp: read_marker(tokenized_dir(opts.dataset_root, opts.tok_name, sp) / "_DONE.json")
                     for sp in SPLITS}
    return {"tokenize": {sp: as_recorded((tokenized.get(sp) or {}).get("fingerprint")) for sp in SPLITS},
            "tokenizer": opts.tokenizer, "seq_length": opts.seq_length, "pad_seq_to_mult": opts.pad_seq_to_mult,
            "seed": opts.seed, "overlong": opts.overlong}


def stage_pack(opts: PackOptions, timer: Timer, pad_id: int | None = None, kept: dict | None = None,
               tokenized: dict | None = None) -> dict:
    """Pack both splits. ``pad_id``: the tokenizer's EOS id, when the caller has it. ``kept``: splits' flat arrays
    from this run's tokenize stage (read back from the chunks otherwise). ``tokenized``: that stage's result
    (its markers, read from disk otherwise)."""
    root, seq_length, pad_mult = opts.dataset_root, opts.seq_length, opts.pad_seq_to_mult
    problems = check_pack_args(seq_length, pad_mult, seed=opts.seed)
    if problems:
        raise UserError("; ".join(problems))
    paths = packed_parquet.packed_paths(root, opts.tok_name, pad_mult, seq_length)
    summary_path = paths["train"].parent / f"{seq_length}_summary.json"
    fp = pack_fingerprint(opts, tokenized)
    if not opts.force and summary_path.exists():
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
        files = tokenizer_files(opts.tokenizer)
        pad_id = files["eos_id"] if files else load_tokenizer(opts.tokenizer).eos_token_id
    metas, out = [], {}
    with timer.stage("pack"):
        for split in SPLITS:
            flat = kept[split] if kept and split in kept else load_tokenized(root, opts.tok_name, split)
            key = "train" if split == "train" else "validation"
            res = out[split] = pack_split(flat, seq_length, pad_mult, pad_id, opts.overlong, opts.seed, paths[key])
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
