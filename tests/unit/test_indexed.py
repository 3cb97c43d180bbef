"""The tokenize action writes Megatron's MMIDIDX format with an exact token count."""

import struct

import numpy as np

from pipeline.data.indexed import INDEX_HEADER, read_index, tokenize_corpus


def test_indexed_dataset_round_trip(tmp_path, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = ["The quick brown fox jumps over the lazy dog.", "Hello world!\nSecond line.", "Short."]
    for i, d in enumerate(docs):
        (corpus / f"doc{i}.txt").write_text(d)
    out = tmp_path / "out"
    res = tokenize_corpus(str(corpus), "smollm2-135m", out, "tiny", docs_per_part=2, quiet=True)
    prefix = out / "tiny_text_document"
    raw = prefix.with_suffix(".idx").read_bytes()
    assert raw[:9] == INDEX_HEADER and struct.unpack("<Q", raw[9:17])[0] == 1 and raw[17] == 8  # uint16
    dtype, lengths, pointers, docs_idx = read_index(prefix.with_suffix(".idx"))
    tokens = np.fromfile(prefix.with_suffix(".bin"), dtype=dtype)
    expected = [tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for d in docs]
    assert lengths.tolist() == [len(e) for e in expected]
    assert pointers.tolist() == [0, 2 * len(expected[0]), 2 * (len(expected[0]) + len(expected[1]))]
    assert docs_idx.tolist() == [0, 1, 2, 3]
    assert tokens.tolist() == sum(expected, [])
    assert res["tokens"] == len(tokens) == sum(len(e) for e in expected)
    assert res["documents"] == 3
    assert not (out / ".parts").exists()


def test_temporaries_left_by_a_killed_run_do_not_break_the_resume(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"d{i}.txt").write_text(f"document {i}")
    out = tmp_path / "out"
    stale = out / ".parts" / ".part_00001.bin.abc123.tmp"  # what a SIGKILL inside atomic_path leaves
    (stale / "part_00001.bin").parent.mkdir(parents=True)
    (stale / "part_00001.bin").write_bytes(b"half")
    res = tokenize_corpus(str(corpus), "smollm2-135m", out, "c", docs_per_part=2, quiet=True)
    assert res["documents"] == 5 and not (out / ".parts").exists()
