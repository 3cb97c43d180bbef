"""The packed-SFT Parquet format Megatron Bridge reads (``GPTSFTPackedParquetDataset``).

One row per pack: ``input_ids`` (list<int64>), ``loss_mask`` (list<int8>, already rolled by one so
that position i says whether token i+1 is a target), ``seq_start_id`` (list<int64>, start offset of
each sequence in the pack, beginning with 0). The schema and row-group size match Bridge's own
``write_packed_parquet``. The metadata file ``<S>_metadata.jsonl`` is a JSON list with one dict per
split (train, then validation) holding Bridge's packing-metadata keys.

This module is the only writer and reader of that format in the suite.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeline.common.io import atomic_path

ROW_GROUP_SIZE = 500  # Bridge's write_packed_parquet default
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


def build_rows(bins: list[list[int]], ids: Sequence[np.ndarray], rolled_masks: Sequence[np.ndarray]):
    """Concatenate each bin's sequences into one pack: a pyarrow Table with the three columns."""
    import pyarrow as pa

    n_tok = [sum(len(ids[i]) for i in b) for b in bins]
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum(n_tok, out=offsets[1:])
    order = [i for b in bins for i in b]
    flat_ids = np.concatenate([ids[i] for i in order]).astype(np.int64) if order else np.zeros(0, np.int64)
    flat_mask = np.concatenate([rolled_masks[i] for i in order]).astype(np.int8) if order else np.zeros(0, np.int8)
    starts, s_off = [], [0]
    for b in bins:
        pos = 0
        for i in b:
            starts.append(pos)
            pos += len(ids[i])
        s_off.append(len(starts))
    table = pa.table({
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_ids)),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_mask)),
        "seq_start_id": pa.ListArray.from_arrays(pa.array(np.asarray(s_off, dtype=np.int64)),
                                                 pa.array(np.asarray(starts, dtype=np.int64))),
    })
    return table.cast(schema())


def write(table, path: Path) -> None:
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp:
        pq.write_table(table, str(tmp), row_group_size=ROW_GROUP_SIZE)


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
