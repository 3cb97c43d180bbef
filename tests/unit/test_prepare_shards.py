"""Chat ``prepare`` in shards (one per node): the export on one node, shard I of N of its tokenize chunks on each,
then the merge and the pack. Every file the one-node run writes (the splits, the chunks, the markers, the packed
Parquet and its metadata) is the same byte for byte; a shard resumes by itself; a merge of unfinished shards, or of
shards of another export, is refused in one line naming them; an interrupted merge finishes."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import sys

import pytest

from pipeline.cli import data as data_cli
from pipeline.common.errors import UserError
from pipeline.data import prepare_shards, stage_tokenize
from pipeline.data.prepare import PrepareOptions, prepare
from pipeline.data.shards import SHARDS_DIR, shard_dir
from pipeline.data.stage_base import SPLITS, Timer
from pipeline.data.stage_pack import stage_pack
from pipeline.data.stage_tokenize import chunk_plan, shard_chunks
from tests.helpers import ROOT, run

TOK = "HuggingFaceTB--SmolLM2-135M-Instruct"
TOK_NAME = TOK  # the tokenizer's folder name under tokenized/
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "é", "日本"]


def chat_file(path, n=300, seed=0):
    """``n`` conversations of one to three exchanges of varied length (seeded: the same bytes every run)."""
    r = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            msgs = []
            for _ in range(r.randint(1, 3)):
                msgs.append({"role": "user", "content": " ".join(r.choice(WORDS) for _ in range(r.randint(2, 30)))})
                msgs.append({"role": "assistant",
                             "content": " ".join(r.choice(WORDS) for _ in range(r.randint(2, 70)))})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def opts(dataset, root, **kw):
    kw.setdefault("workers", 1)
    kw.setdefault("chunk_size", 16)
    return PrepareOptions(dataset=str(dataset), dataset_root=root, seq_length=384, quiet=True, **kw)


def outputs(root) -> dict[str, bytes]:
    """Every file a prepare leaves in ``root``, as bytes (the root's own path written as ROOT; the lock aside)."""
    return {str(f.relative_to(root)): f.read_bytes().replace(str(root).encode(), b"ROOT")
            for f in sorted(root.rglob("*")) if f.is_file() and f.name != ".prepare.lock"}


def in_shards(o: PrepareOptions, count: int) -> dict:
    prepare_shards.export_only(o)
    records = [prepare_shards.prepare_shard(o, i, count) for i in range(count)]
    assert all(set(r) == set(SPLITS) for r in records)
    return prepare_shards.merge_shards(o, count)


def merge_killed_after(monkeypatch, o: PrepareOptions, count: int, moves: int) -> None:
    """A merge of ``count`` shards killed after it has moved ``moves`` chunks."""
    real, moved = prepare_shards.os.replace, []

    def die(a, b):
        if len(moved) == moves:
            raise KeyboardInterrupt  # the merge killed mid-move
        moved.append(b)
        real(a, b)

    monkeypatch.setattr(prepare_shards.os, "replace", die)
    with pytest.raises(KeyboardInterrupt):
        prepare_shards.merge_shards(o, count)
    monkeypatch.setattr(prepare_shards.os, "replace", real)


@pytest.mark.parametrize("count,kw", [(3, {}), (1, {}), (5, {"limit": 250, "pad_seq_to_mult": 8, "seed": 7}),
                                      (2, {"val_fraction": 0.0})])
def test_the_merged_shards_are_the_one_node_prepare_byte_for_byte(tmp_path, count, kw):
    data = chat_file(tmp_path / "chat.jsonl")
    one = prepare(opts(data, tmp_path / "one", **kw))
    merged = in_shards(opts(data, tmp_path / "multi", **kw), count)
    single, multi = outputs(tmp_path / "one"), outputs(tmp_path / "multi")
    assert multi == single
    assert any(k.endswith("training_384.idx.parquet") for k in multi)
    assert not (tmp_path / "multi" / SHARDS_DIR).exists()
    assert merged["pack"]["train"] == one["pack"]["train"] and merged["tokenize"] == one["tokenize"]


def test_a_shard_is_a_contiguous_run_of_the_chunks_and_together_they_are_all_of_them(tmp_path):
    data = chat_file(tmp_path / "chat.jsonl", n=400, seed=3)
    o = opts(data, tmp_path / "root")
    prepare_shards.export_only(o)
    plan = chunk_plan(o.dataset_root, o.chunk_size)
    every = [(sp, c) for sp in SPLITS for c in range(plan[sp][1])]
    for count in (1, 2, 3, 7, len(every)):
        runs = [shard_chunks(plan, o.chunk_size, i, count) for i in range(count)]
        got = [(sp, c) for r in runs for sp in SPLITS for c in r[sp]]
        assert got == every  # contiguous, in order, each chunk once
        assert all(sum(len(r[sp]) for sp in SPLITS) >= 1 for r in runs)
        if count == 3:  # balanced by bytes: no shard holds twice another's share (chunks are ~equal here)
            sizes = [sum(len(r[sp]) for sp in SPLITS) for r in runs]
            assert max(sizes) <= 2 * min(sizes), sizes
    with pytest.raises(UserError, match=f"use at most {len(every)} node"):
        shard_chunks(plan, o.chunk_size, 0, len(every) + 1)


def test_a_killed_shard_redoes_only_its_missing_chunks(tmp_path, monkeypatch):
    data = chat_file(tmp_path / "chat.jsonl")
    o = opts(data, tmp_path / "root")
    prepare_shards.export_only(o)
    prepare_shards.prepare_shard(o, 1, 3)
    where = shard_dir(o.dataset_root, 1, 3) / "tokenized" / TOK / "train"
    chunks = sorted(where.glob("chunk_*.parquet"))
    assert len(chunks) > 2
    chunks[-1].unlink()  # killed while writing its last chunk: neither it nor the split's marker is there
    (where / "_DONE.json").unlink()
    kept = {f: f.stat().st_mtime_ns for f in chunks[:-1]}
    made = []
    real = stage_tokenize._write_chunk
    monkeypatch.setattr(stage_tokenize, "_write_chunk", lambda path, parts: made.append(path.name) or real(path, parts))
    prepare_shards.prepare_shard(o, 1, 3)
    assert made == [chunks[-1].name]
    assert {f: f.stat().st_mtime_ns for f in chunks[:-1]} == kept
    for i in (0, 2):
        prepare_shards.prepare_shard(o, i, 3)
    prepare_shards.merge_shards(o, 3)
    prepare(opts(data, tmp_path / "one"))
    assert outputs(o.dataset_root) == outputs(tmp_path / "one")


def test_a_merge_of_unfinished_or_stale_shards_is_refused_naming_them(tmp_path):
    data = chat_file(tmp_path / "chat.jsonl")
    o = opts(data, tmp_path / "root")
    with pytest.raises(UserError, match="export .* is not done: run the same prepare command with --export-only"):
        prepare_shards.prepare_shard(o, 0, 3)
    prepare_shards.export_only(o)
    prepare_shards.prepare_shard(o, 1, 4)
    with pytest.raises(UserError, match=r"shard\(s\) 0, 2-3 are not finished"):
        prepare_shards.merge_shards(o, 4)
    other = opts(data, o.dataset_root, seed=5)  # another split of the same data: the shards are of the old export
    with pytest.raises(UserError, match=r"made from another input or options \(--seed 0 -> 5\)"):
        prepare_shards.merge_shards(other, 4)
    prepare_shards.export_only(other)
    with pytest.raises(UserError, match=r"shard\(s\) 0-3 are not finished"):  # shard 1 was of the old export
        prepare_shards.merge_shards(other, 4)
    assert not (o.dataset_root / "packed").exists()


def test_an_interrupted_merge_finishes_from_what_it_had_moved(tmp_path, monkeypatch):
    data = chat_file(tmp_path / "chat.jsonl")
    o = opts(data, tmp_path / "root")
    prepare_shards.export_only(o)
    for i in range(3):
        prepare_shards.prepare_shard(o, i, 3)
    merge_killed_after(monkeypatch, o, 3, moves=5)
    prepare_shards.merge_shards(o, 3)
    prepare(opts(data, tmp_path / "one"))
    assert outputs(o.dataset_root) == outputs(tmp_path / "one")


def test_a_merge_removes_only_its_own_split_of_shards(tmp_path):
    data = chat_file(tmp_path / "chat.jsonl")
    o = opts(data, tmp_path / "root")
    prepare_shards.export_only(o)
    for i in range(2):
        prepare_shards.prepare_shard(o, i, 2)
    prepare_shards.prepare_shard(o, 0, 3)  # another count's split, still running
    prepare_shards.merge_shards(o, 2)
    assert [p.name for p in (o.dataset_root / SHARDS_DIR).iterdir()] == ["shard_00000_of_00003"]


@pytest.mark.parametrize("args,message", [
    (["--shard", "3/3"], "the shard index must be below the count"),
    (["--shard", "0/0"], "the shard count must be an integer in [1, 4096]"),
    (["--merge-shards", "0"], "must be >= 1"),
    (["--shard", "0/2", "--merge-shards", "2"], "not allowed with argument"),
    (["--export-only", "--shard", "0/2"], "not allowed with argument"),
    (["--shard", "0/999"], "999 shards of an export of"),
])
def test_the_shard_options_refuse_bad_values_in_one_line(tmp_path, args, message):
    data = chat_file(tmp_path / "chat.jsonl", n=40)
    base = [sys.executable, str(ROOT / "pipeline_data_prepare.py"), "prepare", "--dataset", str(data),
            "--seq-length", "256", "--dataset-root", str(tmp_path / "root"), "--quiet", "--workers", "1"]
    assert run([*base, "--export-only"]).returncode == 0
    res = run([*base, *args])
    assert res.returncode == 2, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], res.stderr
    assert not any(p.name.startswith("shard_") for p in (tmp_path / "root").rglob("*"))


def test_the_command_line_shards_and_merges_a_prepare(tmp_path):
    data = chat_file(tmp_path / "chat.jsonl", n=120)
    base = [sys.executable, str(ROOT / "pipeline_data_prepare.py"), "prepare", "--dataset", str(data),
            "--seq-length", "256", "--chunk-size", "8", "--quiet", "--workers", "1"]
    for step in (["--export-only"], ["--shard", "1/2"], ["--shard", "0/2"], ["--merge-shards", "2", "--json"]):
        res = run([*base, "--dataset-root", str(tmp_path / "multi"), *step])
        assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["pack"]["train"]["sequences"] > 0
    assert run([*base, "--dataset-root", str(tmp_path / "one")]).returncode == 0
    assert outputs(tmp_path / "multi") == outputs(tmp_path / "one")


def test_shards_of_a_root_one_node_already_prepared_are_merged_to_the_same_files_and_removed(tmp_path):
    data = chat_file(tmp_path / "chat.jsonl", n=100)
    o = opts(data, tmp_path / "root")
    prepare(o)
    before = outputs(o.dataset_root)
    merged = in_shards(o, 2)
    assert outputs(o.dataset_root) == before and merged["seconds_per_stage"] == {}
    assert not (o.dataset_root / SHARDS_DIR).exists()


def test_a_shard_missing_a_chunk_makes_it_again_and_the_merge_then_passes(tmp_path):
    data = chat_file(tmp_path / "chat.jsonl")
    o = opts(data, tmp_path / "root")
    prepare_shards.export_only(o)
    for i in range(3):
        prepare_shards.prepare_shard(o, i, 3)
    own = shard_dir(o.dataset_root, 1, 3) / "tokenized" / TOK / "train"
    victim = sorted(own.glob("chunk_*.parquet"))[2]
    victim.unlink()
    with pytest.raises(UserError, match=r"shard\(s\) 1 are not finished"):
        prepare_shards.merge_shards(o, 3)
    prepare_shards.prepare_shard(o, 1, 3)  # what the refusal says to run: it makes the missing chunk
    assert victim.is_file()
    prepare_shards.merge_shards(o, 3)
    prepare(opts(data, tmp_path / "one"))
    assert outputs(o.dataset_root) == outputs(tmp_path / "one")


def test_a_finished_split_missing_a_chunk_is_never_packed_short(tmp_path):
    data = chat_file(tmp_path / "chat.jsonl")
    prepare(opts(data, tmp_path / "one"))
    reference = outputs(tmp_path / "one")
    o = opts(data, tmp_path / "root")
    prepare(o)
    in_dir = tmp_path / "root" / "tokenized" / TOK / "train"
    (in_dir / "chunk_00003.parquet").unlink()
    with pytest.raises(UserError, match="missing 1 of its chunks \\(chunk_00003.parquet\\)"):
        stage_pack(dataclasses.replace(o.for_pack(TOK_NAME), force=True), Timer())
    for i in range(3):  # the shards hold the chunk again; the merge moves it in and packs the whole split
        prepare_shards.prepare_shard(o, i, 3)
    prepare_shards.merge_shards(dataclasses.replace(o, force=True), 3)
    assert outputs(o.dataset_root) == reference
    (in_dir / "chunk_00005.parquet").unlink()  # and a one-node run makes a missing chunk again
    prepare(o)
    assert outputs(o.dataset_root) == reference


def test_a_job_resubmitted_after_its_merge_or_mid_merge_tokenizes_nothing_again(tmp_path, monkeypatch):
    data = chat_file(tmp_path / "chat.jsonl")
    o = opts(data, tmp_path / "root")
    prepare_shards.export_only(o)
    for i in range(3):
        prepare_shards.prepare_shard(o, i, 3)
    merge_killed_after(monkeypatch, o, 3, moves=7)
    made = []
    write = stage_tokenize._write_chunk
    monkeypatch.setattr(stage_tokenize, "_write_chunk", lambda path, parts: made.append(path) or write(path, parts))
    for i in range(3):  # the resubmitted job's shard steps: the moved chunks count as made
        assert prepare_shards.prepare_shard(o, i, 3)["train"]["made_already"]
    prepare_shards.merge_shards(o, 3)
    for i in range(3):  # and once merged: nothing, and no shard folder made
        prepare_shards.prepare_shard(o, i, 3)
    assert made == [] and not (o.dataset_root / SHARDS_DIR).exists()


@pytest.mark.parametrize("bad,message", [(["--chunk-size", "0"], "--chunk-size must be >= 1, got 0"),
                                         (["--limit", "0"], "--limit must be >= 1"),
                                         (["--val-fraction", "2"], "--val-fraction must be in [0, 1)")])
def test_a_submission_with_a_bad_prepare_value_is_refused_before_the_queue(tmp_path, bad, message):
    data = chat_file(tmp_path / "chat.jsonl", n=10)
    argv = ["prepare", "--dataset", str(data), "--seq-length", "256", "--dataset-root", str(tmp_path / "r"), *bad]
    for nodes in (1, 3):
        with pytest.raises(UserError, match=re.escape(message)):
            data_cli.check_submission(argv, nodes=nodes)


def test_a_shard_that_fails_before_making_anything_leaves_no_folder(tmp_path):
    data = chat_file(tmp_path / "chat.jsonl", n=40)
    o = opts(data, tmp_path / "root", tokenizer=str(tmp_path / "no-such-tokenizer"))
    prepare_shards.export_only(opts(data, tmp_path / "root"))  # the export does not depend on the tokenizer
    with pytest.raises(UserError):
        prepare_shards.prepare_shard(o, 0, 2)
    assert not (tmp_path / "root" / SHARDS_DIR).exists()


@pytest.mark.parametrize("flag,expect", [(["--export-only"], {"step": "the export stage alone"}),
                                         (["--shard", "1/3"], {"step": "tokenize shard 1/3 of the export's chunks"}),
                                         (["--merge-shards", "3"], {"step": "merge 3 shards' chunks, then pack"})])
def test_a_dry_run_of_a_step_says_which_step_and_makes_nothing(tmp_path, flag, expect):
    data = chat_file(tmp_path / "chat.jsonl", n=10)
    res = run([sys.executable, str(ROOT / "pipeline_data_prepare.py"), "prepare", "--dataset", str(data),
               "--seq-length", "256", "--dataset-root", str(tmp_path / "root"), "--dry-run", *flag])
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert {k: plan[k] for k in expect} == expect
    if flag[0] == "--shard":
        assert plan["shard_folder"] == str(tmp_path / "root" / SHARDS_DIR / "shard_00001_of_00003" / "tokenized")
    assert not (tmp_path / "root").exists()
