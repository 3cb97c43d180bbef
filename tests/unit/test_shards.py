"""A pretraining corpus tokenized in shards (one per node) and merged: the merge is byte for byte the one-node output
(``.bin``, ``.idx`` and ``token_count.json``), the split is contiguous and balanced, each shard resumes by itself,
and a merge of unfinished or stale shards is refused in one line naming them."""

from __future__ import annotations

import json
import random
import shutil
import sys

import numpy as np
import pytest

from pipeline.common.errors import UserError
from pipeline.data import indexed
from pipeline.data.indexed import merge_shards, read_index, tokenize_corpus
from pipeline.data.shards import SHARDS_DIR, parse_shard, shard_dir, split_files
from tests.helpers import ROOT, run

OUTPUTS = ("c_text_document.bin", "c_text_document.idx", "token_count.json")


def text_corpus(root, n=23, seed=0):
    """Text files of varied sizes, a binary one and a Latin-1 one (skipped and counted, in different shards)."""
    r = random.Random(seed)
    root.mkdir()
    for i in range(n):
        (root / f"d{i:03d}.txt").write_text(" ".join(f"w{r.randrange(900)}" for _ in range(r.randrange(1, 400))))
    (root / "d005b.txt").write_bytes(b"\0binary")
    (root / "d017b.txt").write_bytes("caf\xe9".encode("latin-1"))
    return root


def jsonl_corpus(root, n=9, seed=1):
    r = random.Random(seed)
    root.mkdir()
    for i in range(n):
        rows = [{"text": " ".join(f"t{r.randrange(700)}" for _ in range(r.randrange(1, 60)))}
                for _ in range(r.randrange(1, 12))]
        (root / f"part{i:02d}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    return root


def one_node_then_shards(corpus, out, count, **kw):
    """The one-node output of ``corpus`` in ``out`` (kept aside), then the same folder written by ``count`` shards
    and their merge: both sets of files, as bytes."""
    tokenize_corpus(str(corpus), "smollm2-135m", out, "c", quiet=True, workers=1, **kw)
    single = {f: (out / f).read_bytes() for f in OUTPUTS}
    shutil.rmtree(out)
    records = [tokenize_corpus(str(corpus), "smollm2-135m", out, "c", quiet=True, workers=1, shard=(i, count), **kw)
               for i in range(count)]
    merged_rec = merge_shards(str(corpus), "smollm2-135m", out, "c", count, **kw)
    return single, {f: (out / f).read_bytes() for f in OUTPUTS}, records, merged_rec


@pytest.mark.parametrize("kind,count", [("text", 3), ("text", 1), ("jsonl", 4)])
def test_the_merged_shards_are_the_one_node_output_byte_for_byte(tmp_path, kind, count):
    corpus = (text_corpus if kind == "text" else jsonl_corpus)(tmp_path / "corpus")
    single, merged, records, rec = one_node_then_shards(corpus, tmp_path / "out", count, docs_per_part=5)
    assert merged == single
    assert sum(r["documents"] for r in records) == rec["documents"] and all(r["documents"] for r in records)
    assert not (tmp_path / "out" / SHARDS_DIR).exists()
    if kind == "text":  # each skipped file counted once, by the shard that read it
        assert rec["skipped_binary_files"] == rec["skipped_non_utf8_files"] == 1
        assert sum(r["skipped_binary_files"] for r in records) == 1


def test_a_shard_is_a_megatron_indexed_dataset_of_its_own_run_of_files(tmp_path, tokenizer):
    corpus = text_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    files = sorted(p for p in corpus.iterdir())
    pieces = split_files(files, 3)
    rec = tokenize_corpus(str(corpus), "smollm2-135m", out, "c", quiet=True, workers=1, shard=(1, 3))
    prefix = shard_dir(out, 1, 3) / "c_text_document"
    assert rec["prefix"] == str(prefix)
    dtype, lengths, _, _ = read_index(prefix.with_name(prefix.name + ".idx"))
    tokens = np.fromfile(prefix.with_name(prefix.name + ".bin"), dtype=dtype).tolist()
    texts = [p.read_bytes().decode("utf-8") for p in pieces[1].files if b"\0" not in p.read_bytes()]
    expected = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    assert tokens == sum(expected, []) and lengths.tolist() == [len(e) for e in expected]


def test_the_split_is_contiguous_non_empty_and_balanced_by_size(tmp_path):
    r = random.Random(3)
    files = []
    for i in range(200):
        f = tmp_path / f"f{i:03d}"
        f.write_bytes(b"x" * r.choice([1, 10, 100, 1000, 5000]))
        files.append(f)
    sizes = [f.stat().st_size for f in files]
    for count in (1, 2, 3, 7, 16, 200):
        shards = split_files(files, count)
        assert [s.index for s in shards] == list(range(count)) and all(s.count == count for s in shards)
        assert [f for s in shards for f in s.files] == files  # every file once, in reading order
        assert all(s.files for s in shards)
        assert sum(s.size for s in shards) == sum(sizes)
        if count < 200:  # each shard's bytes within one file of its share
            assert max(s.size for s in shards) <= sum(sizes) / count + max(sizes)
    with pytest.raises(UserError, match=r"4 shards of a corpus of 3 file\(s\).*at most 3 node"):
        split_files(files[:3], 4)
    for bad in ("3/3", "-1/2", "1", "a/b", "0/0", "0/5000", " 1/2x"):
        with pytest.raises(UserError, match="--shard|shard count"):
            parse_shard(bad)
    assert parse_shard("2/3") == (2, 3)


def test_a_finished_shard_is_kept_and_an_interrupted_one_redoes_only_its_own_parts(tmp_path, monkeypatch):
    corpus = text_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    tokenize_corpus(str(corpus), "smollm2-135m", out, "c", quiet=True, workers=1, docs_per_part=2, shard=(0, 2))
    done = (shard_dir(out, 0, 2) / "token_count.json").read_bytes()
    calls, lost = [], []
    real = indexed.wk.text_part

    def dies_on_the_third_part(task):
        calls.append(task[1])
        if len(calls) == 3 and not lost:
            lost.append(task[1])
            raise KeyboardInterrupt  # the node lost mid-shard (once)
        return real(task)

    monkeypatch.setattr(indexed.wk, "text_part", dies_on_the_third_part)
    with pytest.raises(KeyboardInterrupt):
        tokenize_corpus(str(corpus), "smollm2-135m", out, "c", quiet=True, workers=1, docs_per_part=2, shard=(1, 2))
    assert len(list((shard_dir(out, 1, 2) / ".parts").glob("part_*.bin"))) == 2
    with pytest.raises(UserError, match=r"shard\(s\) 1 are not finished"):
        merge_shards(str(corpus), "smollm2-135m", out, "c", 2, docs_per_part=2)
    calls.clear()
    for i in (0, 1):  # the requeued task, and shard 0 run again (already done: nothing redone)
        tokenize_corpus(str(corpus), "smollm2-135m", out, "c", quiet=True, workers=1, docs_per_part=2, shard=(i, 2))
    assert calls and not any(p.endswith(("part_00000.bin", "part_00001.bin")) for p in calls)
    assert (shard_dir(out, 0, 2) / "token_count.json").read_bytes() == done
    monkeypatch.undo()
    merged = merge_shards(str(corpus), "smollm2-135m", out, "c", 2, docs_per_part=2)
    ref = tokenize_corpus(str(corpus), "smollm2-135m", tmp_path / "ref", "c", quiet=True, workers=1, docs_per_part=2)
    assert (out / OUTPUTS[0]).read_bytes() == (tmp_path / "ref" / OUTPUTS[0]).read_bytes()
    assert {k: v for k, v in merged.items() if k != "prefix"} == {k: v for k, v in ref.items() if k != "prefix"}


def test_a_merge_of_missing_or_stale_shards_is_refused_naming_them(tmp_path):
    corpus = jsonl_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"shard\(s\) 0-3 are not finished"):
        merge_shards(str(corpus), "smollm2-135m", out, "c", 4)
    for i in (0, 2):
        tokenize_corpus(str(corpus), "smollm2-135m", out, "c", quiet=True, workers=1, shard=(i, 4))
    with pytest.raises(UserError, match=r"shard\(s\) 1, 3 are not finished"):
        merge_shards(str(corpus), "smollm2-135m", out, "c", 4)
    with pytest.raises(UserError, match=r"shard\(s\) 0-3 are not finished"):  # other options: none of them counts
        merge_shards(str(corpus), "smollm2-135m", out, "c", 4, docs_per_part=7)
    for i in (1, 3):
        tokenize_corpus(str(corpus), "smollm2-135m", out, "c", quiet=True, workers=1, shard=(i, 4))
    (corpus / "part03.jsonl").write_text('{"text": "changed after the shards were made"}\n')
    with pytest.raises(UserError, match=r"shard\(s\) 0-3 are not finished"):  # the corpus changed
        merge_shards(str(corpus), "smollm2-135m", out, "c", 4)
    assert not (out / OUTPUTS[0]).exists()


def test_a_merge_removes_its_own_split_and_leaves_another_running_one(tmp_path):
    """Shards of another count in the same output folder (a resubmission with other --nodes, still running) are not
    the merge's to delete: only its own split's folders go, and ``.shards`` once it is empty."""
    corpus = jsonl_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    tokenize_corpus(str(corpus), "smollm2-135m", out, "c", quiet=True, workers=1, shard=(0, 3))
    for i in range(2):
        tokenize_corpus(str(corpus), "smollm2-135m", out, "c", quiet=True, workers=1, shard=(i, 2))
    merge_shards(str(corpus), "smollm2-135m", out, "c", 2)
    assert sorted(p.name for p in (out / SHARDS_DIR).iterdir()) == [shard_dir(out, 0, 3).name]
    assert (shard_dir(out, 0, 3) / "token_count.json").is_file()


def test_a_corpus_that_is_no_local_files_cannot_be_split(tmp_path):
    with pytest.raises(UserError, match="not local data files.*one node"):
        tokenize_corpus("chatterbot-corpus", "smollm2-135m", tmp_path / "out", "c", quiet=True, shard=(0, 2))
    corpus = jsonl_corpus(tmp_path / "corpus")
    with pytest.raises(UserError, match="--limit.*cannot be split"):
        tokenize_corpus(str(corpus), "smollm2-135m", tmp_path / "out", "c", quiet=True, limit=5, shard=(0, 2))


@pytest.mark.parametrize("args,message", [
    (["--shard", "3/3"], "the shard index must be below the count"),
    (["--shard", "1-3"], "must be I/N"),
    (["--shard", "0/2", "--merge-shards", "2"], "not allowed with argument"),
    (["--merge-shards", "0"], "must be >= 1"),
    (["--merge-shards", "2", "--limit", "5"], "--limit"),
])
def test_the_shard_options_refuse_bad_values_in_one_line(tmp_path, args, message):
    corpus = jsonl_corpus(tmp_path / "corpus")
    res = run([sys.executable, str(ROOT / "pipeline_data_prepare.py"), "tokenize",
               str(corpus), "smollm2-135m", "c", "--output-dir", str(tmp_path / "out"), *args])
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
        res.stderr
