"""Data pipeline: loss masks on assistant turns only, bad rows counted, Bridge-compatible packed Parquet."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.common.errors import UserError
from pipeline.data import packed_parquet
from pipeline.data.chat import render, tokenize_conversations
from pipeline.data.packing import pack_sequences
from pipeline.data.prepare import PrepareOptions, prepare
from pipeline.data.sources import load_conversations, normalise
from pipeline.data.stage_pack import pack_split


def test_loss_mask_covers_assistant_content_and_end_of_turn(tokenizer):
    conv = {"messages": [{"role": "user", "content": "What is 2+2?"},
                         {"role": "assistant", "content": "It is 4."},
                         {"role": "user", "content": "And 3+3?"},
                         {"role": "assistant", "content": "Six."}]}
    ids, masks, mismatched = tokenize_conversations(tokenizer, [conv])
    assert mismatched == 0
    target = tokenizer.decode(ids[0][masks[0] == 1])
    assert target == "It is 4.<|im_end|>Six.<|im_end|>"
    assert "What is" not in target and "system" not in target


def test_render_finds_every_turn(tokenizer):
    text, spans = render(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    assert [text[a:b] for a, b in spans] == ["hello<|im_end|>"]


@pytest.mark.parametrize("row,reason", [
    ({"text": "x"}, "missing_messages"),
    ({"messages": []}, "empty_conversation"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "bad_role"),
    ({"messages": [{"role": "user", "content": "  "}]}, "empty_content"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": 3}]}, "bad_content"),
    ({"messages": [{"role": "user", "content": "a \ud800 b"}, {"role": "assistant", "content": "c"}]},
     "invalid_unicode"),
])
def test_bad_rows_have_reasons(row, reason):
    assert normalise(row) == (None, reason)


@pytest.mark.parametrize("doc", [b'{"a": NaN, "b": -Infinity}', b'{"x": "\\u00e9 \\ud83d\\ude00", "y": [1, 2.5, null]}',
                                 b'"\\ud800"', b'{"a": 1, "a": 2}', b'{"m": [{"role": "user", "content": "\\n\\t\\""}]}'])
def test_fast_json_parses_as_the_standard_parser(doc):
    from pipeline.data.sources import loads

    assert repr(loads(doc)) == repr(json.loads(doc))
    for bad in (b"{not json", b"", b'{"a": 1'):
        with pytest.raises(json.JSONDecodeError):
            loads(bad)


def test_sharegpt_shape_and_trailing_user_turn():
    conv, reason = normalise({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                                                 {"from": "human", "value": "c"}]})
    assert reason is None
    assert conv["messages"] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


def test_counts_per_reason_and_all_bad_is_an_error(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"messages": []}, {"messages": []}, {"nothing": 1}]) + "\n{not json\n")
    convs, stats = load_conversations(str(f))
    assert len(convs) == 1
    assert stats["dropped_empty_conversation"] == 2
    assert stats["dropped_missing_messages"] == 1
    assert stats["dropped_invalid_json"] == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": []}) + "\n")
    with pytest.raises(UserError, match="all 1 rows were unusable.*empty_conversation=1"):
        prepare(PrepareOptions(dataset=str(bad), dataset_root=tmp_path / "out", seq_length=64, quiet=True))


def _flat(seqs, masks):
    return (np.concatenate(seqs).astype(np.int32), np.concatenate(masks).astype(np.int8),
            np.array([len(x) for x in seqs], dtype=np.int64))


def test_pack_follows_bridge_conventions(tmp_path):
    ids = [np.arange(10)]
    mask = [np.array([0, 0, 0, 0, 1, 1, 1, 0, 0, 0], dtype=np.int8)]
    out = tmp_path / "p.parquet"
    res = pack_split(_flat(ids, mask), seq_length=32, pad_mult=4, pad_id=99, overlong="drop", seed=0, path=out)
    # runtime length 9 -> padded to 12, stored 13 tokens; mask padded with 0 then rolled by one
    [row] = packed_parquet.read(out)
    assert row["input_ids"] == list(range(10)) + [99, 99, 99] and row["seq_start_id"] == [0]
    assert row["loss_mask"] == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert res["tokens"] == 13 and res["dataset_max_seqlen"] == 12
    long = _flat([np.arange(50)], [np.ones(50, np.int8)])
    assert pack_split(long, 32, 1, 0, "drop", 0, out) == {"sequences": 0, "dropped_too_long": 1}
    res = pack_split(long, 32, 1, 0, "truncate", 0, out)
    assert res["truncated"] == 1 and res["tokens"] == 33 and packed_parquet.read(out)[0]["input_ids"] == list(range(33))


def _reference_rows(seqs, masks, seq_length, pad_mult, pad_id, overlong, seed):
    """The pack stage written one sequence at a time (the suite's first implementation), as the oracle."""
    kept_ids, kept_masks, stats = [], [], {}
    cap = seq_length // pad_mult * pad_mult  # the longest runtime length a padded sequence can have
    for x, m in zip(seqs, masks):
        if len(x) - 1 > cap:
            if overlong == "drop":
                stats["dropped_too_long"] = stats.get("dropped_too_long", 0) + 1
                continue
            stats["truncated"] = stats.get("truncated", 0) + 1
            x, m = x[:cap + 1], m[:cap + 1]
        if not m[1:].any():
            stats["dropped_no_loss_tokens"] = stats.get("dropped_no_loss_tokens", 0) + 1
            continue
        if pad_mult > 1:
            target = -(-(len(x) - 1) // pad_mult) * pad_mult + 1
            x = np.concatenate([x, np.full(target - len(x), pad_id)])
            m = np.concatenate([m, np.zeros(target - len(m), np.int8)])
        kept_ids.append([int(v) for v in x])
        kept_masks.append([int(v) for v in m[1:]] + [0])
    bins = pack_sequences([len(x) - 1 for x in kept_ids], seq_length, seed=seed) if kept_ids else []
    rows = []
    for b in bins:
        starts = np.cumsum([0] + [len(kept_ids[i]) for i in b])[:-1].tolist()
        rows.append({"input_ids": sum((kept_ids[i] for i in b), []), "loss_mask": sum((kept_masks[i] for i in b), []),
                     "seq_start_id": starts})
    return rows, stats


@pytest.mark.parametrize("seq_length,pad_mult,overlong", [(64, 1, "drop"), (64, 8, "truncate"), (40, 6, "truncate"),
                                                          (256, 4, "drop"), (33, 1, "truncate")])
def test_vectorised_pack_equals_the_per_sequence_reference(tmp_path, monkeypatch, seq_length, pad_mult, overlong):
    monkeypatch.setattr("pipeline.data.stage_pack.PACK_BLOCK_TOKENS", 700)  # many blocks (each whole row groups of 2 packs)
    monkeypatch.setattr(packed_parquet, "ROW_GROUP_SIZE", 2)
    rng = np.random.default_rng(seq_length * pad_mult)
    lengths = np.concatenate([[0, 1, 2], rng.integers(0, 90, 300), [seq_length + 1, seq_length + 2]])
    seqs = [rng.integers(0, 1000, n) for n in lengths]
    masks = [(rng.random(n) < rng.choice([0.0, 0.02, 0.5])).astype(np.int8) for n in lengths]
    out = tmp_path / "p.parquet"
    res = pack_split(_flat(seqs, masks), seq_length, pad_mult, 7, overlong, 3, out)
    rows, stats = _reference_rows(seqs, masks, seq_length, pad_mult, 7, overlong, 3)
    assert packed_parquet.read(out) == rows
    assert {k: v for k, v in res.items() if k in ("dropped_too_long", "truncated", "dropped_no_loss_tokens")} == stats
    for row in rows:  # every packed sequence trains on something and fits the padded layout
        bounds = [*row["seq_start_id"], len(row["input_ids"])]
        for a, b in zip(bounds, bounds[1:]):
            assert any(row["loss_mask"][a:b]) and (b - a - 1) % pad_mult == 0 and b - a - 1 <= seq_length
    assert res["packs"] == len(rows) and res["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert pq.ParquetFile(out).metadata.num_row_groups == -(-len(rows) // 2)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    summary = prepare(PrepareOptions(dataset="chatterbot-corpus", dataset_root=root, seq_length=256,
                                     pad_seq_to_mult=4, context_parallel_size=2, limit=400, quiet=True))
    return root, summary


def test_prepare_writes_bridge_schema_and_metadata(prepared):
    root, summary = prepared
    paths = summary["pack"]["paths"]
    assert paths["train"].endswith("packed/HuggingFaceTB--SmolLM2-135M-Instruct_pad_seq_to_mult4/training_256.idx.parquet")
    schema = pq.read_schema(paths["train"])
    # Bridge's write_packed_parquet: input_ids and seq_start_id from python ints (int64), loss_mask int8.
    assert schema.field("input_ids").type == pa.list_(pa.int64())
    assert schema.field("loss_mask").type == pa.list_(pa.int8())
    assert schema.field("seq_start_id").type == pa.list_(pa.int64())
    assert pq.ParquetFile(paths["train"]).metadata.row_group(0).num_rows <= packed_parquet.ROW_GROUP_SIZE
    meta = json.loads(open(paths["metadata"]).read())
    assert isinstance(meta, list) and len(meta) == 2
    assert set(meta[0]) == {"dataset_max_seqlen", "max_samples_per_bin", "packing_factor", "packing_efficiency",
                            "pack_size", "min_packed_seqlen"}
    assert meta[0]["pack_size"] == 256


def test_every_row_has_correct_boundaries_and_masks(prepared, tokenizer):
    root, summary = prepared
    rows = packed_parquet.read(summary["pack"]["paths"]["train"])
    n_seq = 0
    for i, row in enumerate(rows):
        packed_parquet.validate_row(i, row)
        ids, mask, starts = row["input_ids"], row["loss_mask"], row["seq_start_id"] + [len(row["input_ids"])]
        assert sum(b - a - 1 for a, b in zip(starts[:-1], starts[1:])) <= 256  # Bridge's length convention
        for a, b in zip(starts[:-1], starts[1:]):
            n_seq += 1
            seg, m = ids[a:b], mask[a:b]
            assert (b - a - 1) % 4 == 0 or b - a - 1 == 256 // 4 * 4  # CP padding of the runtime length
            assert m[-1] == 0  # rolled: nothing after the last token of a sequence
            text = tokenizer.decode(seg)
            assert text.startswith("<|im_start|>system")
            targets = tokenizer.decode([seg[j + 1] for j in range(len(seg) - 1) if m[j]])
            assert targets.endswith("<|im_end|>") and "<|im_start|>" not in targets
    assert n_seq == summary["pack"]["train"]["sequences"]


def test_rerun_skips_finished_stages(prepared, caplog):
    root, _ = prepared
    caplog.set_level("INFO")
    s = prepare(PrepareOptions(dataset="chatterbot-corpus", dataset_root=root, seq_length=256, pad_seq_to_mult=4,
                               context_parallel_size=2, limit=400, quiet=True))
    assert s["seconds_per_stage"] == {}
    assert "stage pack: already done" in caplog.text


def test_bad_pad_rule_is_rejected(tmp_path):
    with pytest.raises(UserError, match="2\\*cp = 4"):
        prepare(PrepareOptions(dataset="chatterbot-corpus", dataset_root=tmp_path, seq_length=256,
                               pad_seq_to_mult=2, context_parallel_size=2))
