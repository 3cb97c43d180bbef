"""The data pipeline is never silently wrong about its input or its own outputs: every row is counted, a BOM or
a JSON null line is read as such, a FIFO never blocks the export, a root inside the dataset folder is not mistaken
for a changed input, a damaged chunk is made again, and a row too large to tokenize safely is refused by name."""

from __future__ import annotations

import json
import os

import pytest

from pipeline.common.errors import UserError
from pipeline.data import sources
from pipeline.data.prepare import PrepareOptions, prepare

GOOD = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]}
TOK_TRAIN = "tokenized/HuggingFaceTB--SmolLM2-135M-Instruct/train"


def write_rows(path, rows, n_good=0):
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n"
                              for r in [*rows, *[GOOD] * n_good]))
    return path


def opts(dataset, root, **kw):
    kw.setdefault("workers", 1)
    return PrepareOptions(dataset=str(dataset), dataset_root=root, seq_length=256, quiet=True, **kw)


def test_null_lines_and_a_byte_order_mark_are_read_as_rows(tmp_path):
    f = write_rows(tmp_path / "d.jsonl", [b"\xef\xbb\xbf" + json.dumps(GOOD).encode(), b"null", b" null ", b"",
                                          b"[]"], n_good=2)
    convs, stats = sources.load_conversations(str(f))
    assert len(convs) == 3  # the first row, behind the BOM, is kept
    assert stats["rows_in"] == 6 and stats["dropped_not_an_object"] == 3  # two nulls and a list; the blank line is none


def test_a_fifo_in_a_dataset_folder_is_not_read_and_what_is_left_out_is_logged(tmp_path, caplog):
    d = tmp_path / "folder"
    d.mkdir()
    write_rows(d / "a.jsonl", [], n_good=3)
    write_rows(d / "training.jsonl", [], n_good=5)  # an earlier export's split, next to the data
    os.mkfifo(d / "b.jsonl")  # opening it would block until a writer came
    assert sources.input_files(str(d)) == [d / "a.jsonl"]
    with caplog.at_level("INFO", logger="pipeline.data.prepare"):
        s = prepare(opts(d, tmp_path / "root", val_fraction=0))
    assert s["export"]["kept"] == 3 and "not reading b.jsonl, training.jsonl" in caplog.text


def test_a_root_that_is_the_dataset_folder_is_skipped_on_rerun(tmp_path, caplog):
    d = tmp_path / "folder"
    d.mkdir()
    write_rows(d / "a.jsonl", [], n_good=40)
    prepare(opts(d, d))
    again = prepare(opts(d, d))
    assert again["seconds_per_stage"] == {}  # its own outputs are not part of the input
    (d / "a.jsonl").write_bytes((d / "a.jsonl").read_bytes() + json.dumps(GOOD).encode() + b"\n")
    with caplog.at_level("INFO", logger="pipeline.data.prepare"):
        changed = prepare(opts(d, d))
    assert "input changed" in caplog.text and changed["export"]["kept"] == 41


def test_a_damaged_chunk_is_made_again_on_resume_and_named_by_pack(tmp_path, caplog):
    f = write_rows(tmp_path / "d.jsonl", [], n_good=60)
    ref, root = tmp_path / "ref", tmp_path / "root"
    prepare(opts(f, ref, chunk_size=10))
    prepare(opts(f, root, chunk_size=10))
    chunk = root / TOK_TRAIN / "chunk_00003.parquet"
    good = chunk.read_bytes()

    # A run that stopped before finishing the split (no _DONE): the resume remakes the damaged chunk.
    chunk.write_bytes(good[: len(good) // 2])
    (root / TOK_TRAIN / "_DONE.json").unlink()
    with caplog.at_level("WARNING", logger="pipeline.data.prepare"):
        prepare(opts(f, root, chunk_size=10))
    assert "chunk_00003.parquet is unreadable" in caplog.text and chunk.read_bytes() == good

    # A finished split read back by the pack action: one line naming the chunk, which is removed with the split's
    # marker, so the next prepare remakes just it.
    from pipeline.data.stage_base import Timer
    from pipeline.data.stage_pack import PackOptions, stage_pack

    chunk.write_bytes(b"garbage")
    with pytest.raises(UserError, match="chunk_00003.parquet is unreadable.*re-run prepare"):
        stage_pack(PackOptions(dataset_root=root, tok_name="HuggingFaceTB--SmolLM2-135M-Instruct",
                               tokenizer="smollm2-135m", seq_length=512, pad_seq_to_mult=1, seed=0, overlong="drop",
                               force=True), Timer())
    s = prepare(opts(f, root, chunk_size=10))
    assert chunk.read_bytes() == good and s["seconds_per_stage"].get("export") is None
    for p in sorted(ref.rglob("*.parquet")):
        assert (root / p.relative_to(ref)).read_bytes() == p.read_bytes()


def test_a_conversation_too_large_to_tokenize_safely_is_dropped_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "MAX_CONVERSATION_CHARS", 100)  # stands for 8 Mi characters
    big = {"messages": [{"role": "user", "content": "x" * 60}, {"role": "assistant", "content": "y" * 60}]}
    f = write_rows(tmp_path / "d.jsonl", [big], n_good=3)
    s = prepare(opts(f, tmp_path / "root", val_fraction=0))
    assert s["export"]["dropped"] == {"too_large": 1} and s["export"]["kept"] == 3
