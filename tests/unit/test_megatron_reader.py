"""Our indexed .bin/.idx are read correctly by Megatron-Core's own IndexedDataset (the pinned wheel's source, loaded
by the ``megatron_indexed_dataset`` fixture in tests/conftest.py)."""


import numpy as np
import pytest

from pipeline.data.indexed import merge_shards, tokenize_corpus
from pipeline.data.shards import shard_dir

pytestmark = pytest.mark.bridge


def test_megatron_core_reads_our_indexed_dataset(megatron_indexed_dataset, tmp_path, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = [f"Document number {i}. " + "word " * (i % 17 + 1) for i in range(50)]
    for i, d in enumerate(docs):
        (corpus / f"d{i:03d}.txt").write_text(d)
    res = tokenize_corpus(str(corpus), "smollm2-135m", tmp_path / "out", "c", docs_per_part=7, quiet=True)
    ds = megatron_indexed_dataset.IndexedDataset(str(tmp_path / "out" / "c_text_document"))
    assert len(ds) == 50
    expected = [tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for d in docs]
    assert [ds[i].tolist() for i in range(50)] == expected
    assert ds.document_indices.tolist() == list(range(51))
    assert int(np.sum(ds.sequence_lengths)) == res["tokens"]
    assert ds.index.dtype == np.uint16


def test_megatron_cores_own_merge_of_the_shards_is_our_merge_and_the_one_node_output(megatron_indexed_dataset,
                                                                                      tmp_path):
    """Shards tokenized on separate nodes are megatron-core indexed datasets; its own builder's ``add_index`` merge
    of them (what its merge_datasets tool does) writes the bytes our merge writes, which are the one-node run's."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"d{i:03d}.txt").write_text(f"Document {i}. " + "token " * (i * 7 % 23 + 1))
    one = tokenize_corpus(str(corpus), "smollm2-135m", tmp_path / "one", "c", docs_per_part=5, quiet=True)
    out = tmp_path / "out"
    for i in range(3):
        tokenize_corpus(str(corpus), "smollm2-135m", out, "c", docs_per_part=5, quiet=True, shard=(i, 3))
    theirs = tmp_path / "theirs" / "c_text_document"
    theirs.parent.mkdir()
    builder = megatron_indexed_dataset.IndexedDatasetBuilder(str(theirs) + ".bin", dtype=np.uint16)
    for i in range(3):
        builder.add_index(str(shard_dir(out, i, 3) / "c_text_document"))
    builder.finalize(str(theirs) + ".idx")
    ours = merge_shards(str(corpus), "smollm2-135m", out, "c", 3, docs_per_part=5)
    for suffix in (".bin", ".idx"):
        expected = (tmp_path / "one" / f"c_text_document{suffix}").read_bytes()
        assert (out / f"c_text_document{suffix}").read_bytes() == expected
        assert (tmp_path / "theirs" / f"c_text_document{suffix}").read_bytes() == expected
    ds = megatron_indexed_dataset.IndexedDataset(str(out / "c_text_document"))
    assert len(ds) == 40 == ours["documents"] == one["documents"]
    assert int(np.sum(ds.sequence_lengths)) == ours["tokens"] == one["tokens"]
