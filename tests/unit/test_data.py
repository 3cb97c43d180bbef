"""Data pipeline: loss masks on assistant turns only, bad rows counted, Bridge-compatible packed Parquet."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.common.errors import UserError
from pipeline.data import packed_parquet
from pipeline.data.chat import render, tokenize_conversations
from pipeline.data.prepare import PrepareOptions, pad_and_roll, prepare
from pipeline.data.sources import load_conversations, normalise


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
])
def test_bad_rows_have_reasons(row, reason):
    assert normalise(row) == (None, reason)


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


def test_pad_and_roll_follow_bridge_conventions():
    ids = [np.arange(10)]
    mask = [np.array([0, 0, 0, 0, 1, 1, 1, 0, 0, 0], dtype=np.int8)]
    out_ids, out_masks, stats = pad_and_roll(ids, mask, seq_length=32, pad_mult=4, pad_id=99, overlong="drop")
    # runtime length 9 -> padded to 12, stored 13 tokens; mask padded with 0 then rolled by one
    assert len(out_ids[0]) == 13 and list(out_ids[0][10:]) == [99, 99, 99]
    assert list(out_masks[0]) == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    long = [np.arange(50)]
    _, _, s = pad_and_roll(long, [np.ones(50, np.int8)], 32, 1, 0, "drop")
    assert s["dropped_too_long"] == 1
    t_ids, _, s = pad_and_roll(long, [np.ones(50, np.int8)], 32, 1, 0, "truncate")
    assert s["truncated"] == 1 and len(t_ids[0]) == 33


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
