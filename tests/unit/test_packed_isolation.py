"""Packed documents never see each other on the local engine (issue 23): for every model family it trains, through
the engine's own data path (PackedSFTDataset + collate from a packed Parquet file) and model set-up
(build_model_and_tokenizer), changing every token of one document leaves the other documents' per-token losses
exactly unchanged. With ``use_cache`` left on (transformers' default) attention crosses documents, which these tests
show they catch. NemotronH's Mamba layers (transformers' PyTorch fallback) scan the whole row whatever the
position_ids say, so the engine trains that model one document per sample."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config.models import get_model
from pipeline.config.schema import TrainingConfig
from pipeline.training.engines.local import PackedSFTDataset, build_model_and_tokenizer, collate, unpacks

LENS = (40, 50, 30)


def packed_file(path, docs: list[np.ndarray]):
    ids = np.concatenate(docs)
    starts = np.cumsum([0, *[len(d) for d in docs[:-1]]])
    table = pa.table({"input_ids": [ids.tolist()], "loss_mask": [[1] * len(ids)], "seq_start_id": [starts.tolist()]})
    pq.write_table(table, path)
    return path


def per_token_losses(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.float()
    labels = batch["input_ids"][0, 1:]
    return torch.nn.functional.cross_entropy(logits[0, :-1], labels, reduction="none")


def losses_of(model, tmp_path, docs, name: str, unpack: bool = False) -> list[torch.Tensor]:
    ds = PackedSFTDataset(packed_file(tmp_path / f"{name}.parquet", docs), unpack=unpack)
    return [per_token_losses(model, collate(0)([ds[i]])) for i in range(len(ds))]


@pytest.fixture(scope="module")
def documents():
    rng = np.random.default_rng(0)
    docs = [rng.integers(100, 5000, n) for n in LENS]
    changed = [rng.integers(100, 5000, LENS[0]), *docs[1:]]  # every token of the first document replaced
    return docs, changed


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-qwen3-moe"])
def test_a_changed_document_leaves_the_others_losses_exactly(tmp_path, documents, name):
    """Exactly equal, MoE included: the routed experts see the same tokens of the other documents (only their
    batch of tokens changes, and the expert matmuls are per token), so there is no float tolerance to state."""
    spec = get_model(name)
    assert not unpacks(spec)
    model, _ = build_model_and_tokenizer(TrainingConfig.from_dict({"rng": {"seed": 1}}), spec, "sft")
    model.eval()
    docs, changed = documents
    (a,), (b,) = losses_of(model, tmp_path, docs, "a"), losses_of(model, tmp_path, changed, "b")
    first = LENS[0]
    assert torch.equal(a[first:], b[first:])  # every position of documents 2 and 3 (first - 1 is doc 1's last)
    assert not torch.equal(a[:first - 1], b[:first - 1])  # the changed document itself did change
    # the guard works: with transformers' default use_cache=True, attention crosses the documents
    model.config.use_cache = True
    (c,) = losses_of(model, tmp_path, changed, "c")
    assert (c[first:] - b[first:]).abs().max() > 1e-3


def test_nemotronh_is_trained_one_document_per_sample(tmp_path, documents):
    spec = get_model("tiny-nemotronh-moe")
    assert unpacks(spec)
    model, _ = build_model_and_tokenizer(TrainingConfig.from_dict({"rng": {"seed": 1}}), spec, "sft")
    model.eval()
    docs, changed = documents
    # packed, its Mamba layers carry the first document into the next ones: why the engine does not train it so
    (a,), (b,) = losses_of(model, tmp_path, docs, "a"), losses_of(model, tmp_path, changed, "b")
    assert (a[LENS[0]:] - b[LENS[0]:]).abs().max() > 1e-4
    # un-packed (the engine's path for this model): one sample per document, the others untouched
    ua, ub = losses_of(model, tmp_path, docs, "ua", unpack=True), losses_of(model, tmp_path, changed, "ub", unpack=True)
    assert [len(x) + 1 for x in ua] == list(LENS)
    assert torch.equal(ua[1], ub[1]) and torch.equal(ua[2], ub[2]) and not torch.equal(ua[0], ub[0])
