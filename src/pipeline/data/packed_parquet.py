"""The packed-SFT Parquet format Megatron Bridge reads (``GPTSFTPackedParquetDataset``).

One row per pack: ``input_ids`` (list<int64>), ``loss_mask`` (list<int8>, already rolled by one so
that position i says whether token i+1 is a target), ``seq_start_id`` (list<int64>, start offset of
each sequence in the pack, beginning with 0). The schema and row-group size match Bridge's own
``write_packed_parquet``. The metadata file ``<S>_metadata.jsonl`` is a JSON list with one dict per
split (train, then validation) holding Bridge's packing-metadata keys.

This module is the only writer and reader of that format in the suite.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pipeline.common.io import atomic_path

ROW_GROUP_SIZE = 500  # Bridge's write_packed_parquet default
MAX_LIST_VALUES = 2**31 - 1  # a list<...> column (int32 offsets) holds at most this many values
REQUIRED_COLUMNS = ("input_ids", "loss_mask", "seq_start_id")


def packed_dir(dataset_root: Path, tokenizer_name: str, pad_seq_to_mult: int) -> Path:
    return Path(dataset_root) / "packed" / f"{tokenizer_name}_pad_seq_to_mult{pad_seq_to_mult}"


def packed_paths(dataset_root: Path, tokenizer_name: str, pad_seq_to_mult: int, seq_length: int) -> dict[str, Path]:
    d = packed_dir(dataset_root, tokenizer_name, pad_seq_to_mult)
    return {
        "train": d / f"training_{seq_length}.idx.parquet",
        "validation": d / f"validation_{seq_length}.idx.parquet",
        "metadata": d / f"{seq_length}_metadata.jsonl",
    }


def schema():
    import pyarrow as pa

    return pa.schema([
        ("input_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.int8())),
        ("seq_start_id", pa.list_(pa.int64())),
    ])


def arrow(x: np.ndarray):
    """A numpy array as a pyarrow array without copying (``pa.array`` on numpy imports pandas: ~0.4 s)."""
    import pyarrow as pa

    x = np.ascontiguousarray(x)
    return pa.Array.from_buffers(pa.from_numpy_dtype(x.dtype), len(x), [None, pa.py_buffer(x)])


def numpy_view(arr, dtype) -> np.ndarray:
    """A primitive pyarrow array without nulls as a numpy view (``Array.to_numpy`` imports pandas)."""
    dtype = np.dtype(dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def list_column(offsets: np.ndarray, values: np.ndarray):
    """``list<values.dtype>`` from ``offsets`` (``len(rows) + 1``, from 0, at most MAX_LIST_VALUES) and flat values."""
    import pyarrow as pa

    if len(offsets) and offsets[-1] > MAX_LIST_VALUES:  # list offsets are int32: never let them wrap
        raise ValueError(f"{int(offsets[-1])} values in one list column (at most {MAX_LIST_VALUES})")
    return pa.ListArray.from_arrays(arrow(offsets.astype(np.int32)), arrow(values))


def packs_table(pack_offsets: np.ndarray, input_ids: np.ndarray, loss_mask: np.ndarray, seq_offsets: np.ndarray,
                seq_start_id: np.ndarray):
    """Packs as a Table of the three columns: pack ``p`` holds tokens ``pack_offsets[p]:pack_offsets[p + 1]`` of the
    flat int64 ``input_ids`` and int8 ``loss_mask`` and sequence starts ``seq_offsets[p]:seq_offsets[p + 1]`` of the
    flat ``seq_start_id``."""
    import pyarrow as pa

    return pa.Table.from_arrays([list_column(pack_offsets, input_ids.astype(np.int64, copy=False)),
                                 list_column(pack_offsets, loss_mask.astype(np.int8, copy=False)),
                                 list_column(seq_offsets, seq_start_id.astype(np.int64, copy=False))],
                                schema=schema())


def write(tables: Iterable, path: Path) -> None:
    """Write packs given as consecutive Tables (each a multiple of ROW_GROUP_SIZE rows but the last): the same
    bytes as one ``pq.write_table(all, row_group_size=ROW_GROUP_SIZE)``, without holding every pack at once. A
    thread encodes each Table (pyarrow releases the GIL) while the caller's iterator builds the next."""
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp, pq.ParquetWriter(str(tmp), schema()) as w, ThreadPoolExecutor(1) as ex:
        pending = None
        for t in tables:
            if pending is not None:
                pending.result()
            pending = ex.submit(w.write_table, t, row_group_size=ROW_GROUP_SIZE)
        if pending is not None:
            pending.result()


def read(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(str(path), columns=list(REQUIRED_COLUMNS)).to_pylist()


def validate_row(idx: int, row: dict) -> None:
    """The invariants Bridge's ``GPTSFTPackedParquetDataset.validate_row`` checks."""
    ids, mask, starts = row["input_ids"], row["loss_mask"], row["seq_start_id"]
    if len(mask) != len(ids):
        raise ValueError(f"row {idx}: loss_mask length {len(mask)} != input_ids length {len(ids)}")
    if not starts or starts[0] != 0:
        raise ValueError(f"row {idx}: seq_start_id must start with 0")
    for i, s in enumerate(starts):
        if s >= len(ids) or (i and s < starts[i - 1]):
            raise ValueError(f"row {idx}: bad seq_start_id[{i}]={s}")


def check_packed(paths: dict[str, Path], seq_length: int, pad_seq_to_mult: int) -> list[str]:
    """Why the packed files at ``paths`` (:func:`packed_paths`, or the config's explicit ones) cannot be trained
    on, one line each (empty when they can): the training file must be a readable Parquet (its footer, read by
    pyarrow: a 0-byte or truncated file fails here, not on the GPU node) with rows and the three columns, and the
    metadata file (``<S>_metadata.jsonl``) and the pack summary beside it (``<S>_summary.json``) must say the packs'
    sequence length and pad multiple are the config's."""
    import pyarrow.parquet as pq

    problems: list[str] = []
    train = Path(paths["train"])
    redo = f"repack it (python pipeline_data_prepare.py pack ... {seq_length} {pad_seq_to_mult} --force)"
    try:
        size = train.stat().st_size
        meta = pq.read_metadata(str(train)) if size else None
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError on a truncated footer
        reason = str(exc).splitlines()[0][:120] if str(exc) else exc.__class__.__name__
        return [f"packed training data {train} is not a readable Parquet file ({reason}): it is truncated or not "
                f"Parquet; {redo}"]
    if meta is None:
        return [f"packed training data {train} is empty (0 bytes): an interrupted write or copy; {redo}"]
    if meta.num_rows < 1:
        problems.append(f"packed training data {train} has no rows (no packs); {redo}")
    names = set(meta.schema.to_arrow_schema().names)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        problems.append(f"packed training data {train} lacks the column(s) {', '.join(missing)} (has "
                        f"{', '.join(sorted(names)) or 'none'}): not a packed-SFT file; {redo}")
    md = paths.get("metadata")
    if md is not None:
        md = Path(md)
        try:
            metas = json.loads(md.read_text())
        except FileNotFoundError:
            problems.append(f"packing metadata {md} does not exist (the packer writes it beside the packs); {redo}")
            metas = None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            problems.append(f"packing metadata {md} is unreadable ({exc.__class__.__name__}); {redo}")
            metas = None
        if metas is not None:
            first = metas[0] if isinstance(metas, list) and metas and isinstance(metas[0], dict) else None
            if first is None:
                problems.append(f"packing metadata {md} is not a list of per-split dicts; {redo}")
            elif first.get("pack_size") != seq_length:
                problems.append(f"packing metadata {md} says pack_size {first.get('pack_size')!r} but the config's "
                                f"sequence length is {seq_length}: the packs were made for another length; {redo}")
        summary = md.parent / f"{seq_length}_summary.json"
        try:
            recorded = (json.loads(summary.read_text()).get("fingerprint") or {}).get("pad_seq_to_mult")
        except (OSError, ValueError, AttributeError):
            recorded = None  # no summary (packs made elsewhere): the metadata's pack_size is what there is
        if recorded is not None and recorded != pad_seq_to_mult:
            problems.append(f"packs in {md.parent} were made with pad_seq_to_mult {recorded} ({summary}) but the "
                            f"config says dataset.offline_packing_specs.pad_seq_to_mult={pad_seq_to_mult}; {redo}")
    return problems
