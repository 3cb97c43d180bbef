"""Tokenizing with worker processes: the same bytes whatever the number of workers, resumable chunk by chunk,
and a bad --workers is one line and exit 2."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pipeline.data import workers as wk
from pipeline.data.chat import ChatEncoder
from pipeline.data.indexed import tokenize_corpus
from pipeline.data.prepare import PrepareOptions, prepare
from tests.helpers import ROOT

TOK_DIR = "tokenized/HuggingFaceTB--SmolLM2-135M-Instruct"


def files_of(root, patterns) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for pat in patterns for p in sorted(root.glob(pat))}


def chat_opts(root, workers, **kw):
    # 600 conversations in chunks of 100: several chunks per split, so two workers really share the work.
    kw.setdefault("chunk_size", 100)
    return PrepareOptions(dataset="chatterbot-corpus", dataset_root=root, seq_length=256, limit=600,
                          workers=workers, quiet=True, **kw)


def test_prepare_is_byte_identical_with_one_and_two_workers_and_resumes_chunk_by_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr("pipeline.data.stage_base.SLICE_CONVERSATIONS", 37)  # many slices per chunk, odd sizes
    one, two = tmp_path / "one", tmp_path / "two"
    s1, s2 = prepare(chat_opts(one, 1)), prepare(chat_opts(two, 2))
    pats = [f"{TOK_DIR}/*/chunk_*.parquet", "packed/*/*.parquet", "packed/*/*_metadata.jsonl"]
    a, b = files_of(one, pats), files_of(two, pats)
    assert len([k for k in a if "chunk_" in k]) >= 7 and a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []
    assert s1["tokenize"] == s2["tokenize"] and s2["tokenize"]["train"]["chunks"] >= 6

    # A run killed mid-way leaves some chunks and no _DONE marker: the rerun (two workers) makes only the
    # missing chunks, and the result is the same bytes.
    train = two / TOK_DIR / "train"
    (train / "_DONE.json").unlink()
    for c in (1, 4):
        (train / f"chunk_{c:05d}.parquet").unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in train.glob("chunk_*.parquet")}
    s3 = prepare(chat_opts(two, 2))
    assert {p.name: p.stat().st_mtime_ns for p in train.glob("chunk_*.parquet") if p.name in kept} == kept
    assert files_of(two, pats) == a and s3["tokenize"]["train"] == s1["tokenize"]["train"]


def test_workers_rebuild_the_same_encoder_from_the_payload(tokenizer):
    convs = [{"messages": [{"role": "user", "content": f"What is {i}+{i}?"},
                           {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(50)]
    here = ChatEncoder.from_tokenizer(tokenizer, convs[0]["messages"])
    there = ChatEncoder.from_payload(here.payload())
    ids, mask, lengths, drops = there.encode(convs)
    ref = here.encode(convs)
    assert not any(drops.values()) and all(np.array_equal(x, y) for x, y in zip(ref[:3], (ids, mask, lengths),
                                                                               strict=True))
    texts = [tokenizer.apply_chat_template(c["messages"], tokenize=False) for c in convs]
    expected = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert ids.tolist() == [t for e in expected for t in e]  # what the tokenizer itself gives
    assert tokenizer.decode(ids[: lengths[0]][mask[: lengths[0]] == 1]) == "It is 0.<|im_end|>"


def test_tokenize_action_is_byte_identical_with_one_and_two_workers(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = (ROOT / "src/pipeline/data/prepare.py").read_text()
    for i in range(60):
        (corpus / f"doc{i:03d}.txt").write_text("" if i == 7 else f"{i}: " + text[(i * 97) % 3000:][:400])
    res = {w: tokenize_corpus(str(corpus), "smollm2-135m", tmp_path / f"w{w}", "pt", docs_per_part=7, quiet=True,
                              workers=w) for w in (1, 2)}
    for f in ("pt_text_document.bin", "pt_text_document.idx"):
        assert (tmp_path / "w1" / f).read_bytes() == (tmp_path / "w2" / f).read_bytes(), f
    assert res[1]["documents"] == res[2]["documents"] == 59  # the empty document is skipped either way
    assert res[1]["tokens"] == res[2]["tokens"] > 59 * 50


def test_line_starts_and_slices_cover_every_conversation_once(tmp_path):
    from pipeline.data.stage_base import slices

    f = tmp_path / "x.jsonl"
    rows = [json.dumps({"i": i, "pad": "é" * (i % 5)}) for i in range(23)]
    f.write_text("\n".join(rows[:10]) + "\n\n" + "\n".join(rows[10:]) + "\n")
    starts = wk.line_starts(f, block=16)  # tiny blocks: lines cross block edges
    assert len(starts) == 24 and starts[-1] == f.stat().st_size
    got = [r["i"] for a, b in slices(starts, 3, 20) for r in wk.read_lines(f, a, b)]
    assert got == list(range(3, 20))


def test_default_is_every_usable_cpu():
    import os

    assert wk.resolve_workers(None) == len(os.sched_getaffinity(0))
    assert PrepareOptions(dataset="x", dataset_root=ROOT / "nonexistent", seq_length=64).workers is None


def test_tokenizer_files_match_the_full_tokenizer(tokenizer):
    """The tokenize stage reads the tokenizer from its files (no transformers): the same special tokens, EOS id,
    and a jinja2-compiled template that renders what apply_chat_template renders."""
    from pipeline.data.chat import compile_template, render_direct, template_matches_transformers, tokenizer_files

    files = tokenizer_files("smollm2-135m")
    assert files is not None
    assert files["special"] == tokenizer.special_tokens_map and files["eos"] == tokenizer.eos_token
    assert files["eos_id"] == tokenizer.eos_token_id and files["chat_template"] == tokenizer.chat_template
    convs = [[{"role": "user", "content": "Say \"hi\" & <b>bye</b>"}, {"role": "assistant", "content": "hi\nbye"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "é?"},
              {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "Und?"},
              {"role": "assistant", "content": "Ja."}]]
    tpl = compile_template(files["chat_template"])
    for msgs in convs:
        assert render_direct(tpl, msgs, files["special"]) == tokenizer.apply_chat_template(msgs, tokenize=False)
        assert template_matches_transformers(files["chat_template"], files["special"], msgs)


def test_a_template_mismatch_falls_back_to_transformers_with_the_same_bytes(tmp_path, monkeypatch):
    # One worker: the check runs in this process, so it can be forced to fail here.
    monkeypatch.setattr("pipeline.data.workers.template_matches_transformers", lambda *a: False)
    ref, fallback = tmp_path / "ref", tmp_path / "fallback"
    prepare(chat_opts(fallback, 1))
    monkeypatch.undo()
    prepare(chat_opts(ref, 1))
    pats = [f"{TOK_DIR}/*/chunk_*.parquet", "packed/*/*.parquet"]
    assert files_of(ref, pats) == files_of(fallback, pats) != {}


def test_a_changed_default_chunk_size_redoes_the_tokenize_stage(tmp_path, caplog):
    import logging

    root = tmp_path / "r"
    prepare(chat_opts(root, 1, chunk_size=20000))  # what round 1's default made
    with caplog.at_level(logging.INFO, logger="pipeline.data.prepare"):
        s = prepare(PrepareOptions(dataset="chatterbot-corpus", dataset_root=root, seq_length=256, limit=600,
                                   workers=1, quiet=True))
    assert "--chunk-size 20000 -> 2048" in caplog.text
    assert s["tokenize"]["train"]["fingerprint"]["chunk_size"] == 2048


def _messy_jsonl(path, n, seed):
    """Good rows (OpenAI and ShareGPT shapes, non-ASCII, escapes) mixed with every kind of bad line."""
    bad = [b"{not json", b"\xff\xfe bad utf-8", b"   ", b"", json.dumps({"messages": []}).encode(),
           json.dumps({"text": "no messages"}).encode(), json.dumps([1, 2]).encode(),
           json.dumps({"messages": [{"role": "user", "content": "only a question"}]}).encode(),
           json.dumps({"messages": [{"role": "user", "content": "\ud800"}, {"role": "assistant", "content": "x"}]}).encode(),
           b"null"]
    lines = []
    for i in range(n):
        if i % 7 == seed % 7:  # every kind of bad line in every 70 lines
            lines.append(bad[(i // 7) % len(bad)])
        elif i % 3:
            lines.append(json.dumps({"messages": [{"role": "user", "content": f"q{i} é \"x\""},
                                                  {"role": "assistant", "content": f"a{i}\n😀"},
                                                  {"role": "user", "content": "dangling"}]}).encode())
        else:
            lines.append(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"},
                                                       {"from": "gpt", "value": f"a{i}"}], "id": i},
                                    ensure_ascii=False).encode("utf-8"))
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n")  # with the byte-order mark editors write


@pytest.mark.parametrize("limit", [None, 1, 7, 40, 10_000])
def test_the_export_read_by_workers_equals_the_serial_reader(tmp_path, monkeypatch, limit):
    """A JSONL dataset (a file, or a folder of files) is exported by the workers, a byte range each: the same split
    files and counts as reading it row by row in this process, whatever the limit (which may fall inside a slice
    with dropped rows in it)."""
    from pipeline.data.chat import tokenizer_files, tokenizer_model_name
    from pipeline.data.stage_base import Timer
    from pipeline.data.stage_export import stage_export
    from pipeline.data.stage_tokenize import start_pool

    monkeypatch.setattr("pipeline.data.stage_base.SLICE_CONVERSATIONS", 5)
    folder = tmp_path / "folder"
    folder.mkdir()
    for i in range(3):
        _messy_jsonl(folder / f"part{i}.jsonl", 72, seed=i)
    for dataset in (folder / "part0.jsonl", folder):
        out = {}
        for how in ("serial", "workers"):
            root = tmp_path / f"{how}-{dataset.name}-{limit}"
            opts = PrepareOptions(dataset=str(dataset), dataset_root=root, seq_length=256, limit=limit, workers=2,
                                  val_fraction=0.2, quiet=True)
            tokenize_opts = opts.for_tokenize(tokenizer_model_name(opts.tokenizer))
            pool = start_pool(tokenize_opts, tokenizer_files("smollm2-135m")) if how == "workers" else None
            try:
                stats = stage_export(opts.for_export(), Timer(), pool=pool)
            finally:
                if pool is not None:
                    pool.close()
            stats.pop("fingerprint")
            out[how] = stats, files_of(root, ["training.jsonl", "validation.jsonl"])
        assert out["serial"] == out["workers"]
        stats = out["workers"][0]
        assert stats["kept"] == (min(limit, stats["kept"]) if limit else stats["kept"]) > 0
        if limit in (None, 10_000):  # the whole input: every kind of bad line was seen, and counted
            assert set(stats["dropped"]) >= {"invalid_json", "invalid_utf8", "empty_conversation", "invalid_unicode",
                                             "not_an_object"}
            assert stats["rows_in"] == stats["kept"] + sum(stats["dropped"].values())


def _exit_now(task):
    import os

    os._exit(1)  # as a worker killed by the OOM killer would: no exception, the process is just gone


def test_a_worker_that_dies_is_one_clear_error_wherever_it_is_noticed():
    from pipeline.common.errors import UserError

    with wk.OrderedPool(2, wk._noop, ()) as pool:
        with pytest.raises(UserError, match="worker process died"):  # noticed by waiting for a result
            list(pool.imap(_exit_now, range(50)))
        with pytest.raises(UserError, match="worker process died"):  # noticed by handing out the next task
            list(pool.imap(len, ["a"]))


def test_a_chunk_too_large_for_a_parquet_list_is_refused_not_wrapped(tmp_path, monkeypatch):
    from pipeline.common.errors import UserError
    from pipeline.data import packed_parquet

    monkeypatch.setattr(packed_parquet, "MAX_LIST_VALUES", 1000)  # stands for 2**31 - 1 (int32 list offsets)
    with pytest.raises(UserError, match="chunk_00000.parquet would hold .* tokens.*smaller --chunk-size"):
        prepare(chat_opts(tmp_path / "r", 1))


def test_a_worker_count_above_the_usable_cpus_is_capped(caplog):
    """--workers 1000 started 1000 spawned processes (45-70 MB each) on any machine (issue 22, item 12)."""
    cpus = len(os.sched_getaffinity(0))
    with caplog.at_level("WARNING"):
        assert wk.resolve_workers(1000) == cpus
    assert f"--workers 1000 is more than the {cpus} usable CPU(s) of this process; using {cpus}" in caplog.text
    assert wk.resolve_workers(1) == 1


def test_the_template_check_verdict_is_kept_per_machine(tmp_path, monkeypatch, tokenizer):
    """The check imports transformers once per template and versions; later runs read the verdict by its hash, and a
    changed input (here the special tokens) is checked again (issue 36)."""
    from pipeline.data import chat

    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path))
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    special = tokenizer.special_tokens_map
    assert chat.template_matches_transformers(tokenizer.chat_template, special, msgs) is True
    [kept] = (tmp_path / "template_checks").glob("*.json")
    assert json.loads(kept.read_text()) == {"matches": True}
    calls = []
    monkeypatch.setattr(chat, "_template_matches_transformers", lambda *a: calls.append(a) or False)
    assert chat.template_matches_transformers(tokenizer.chat_template, special, msgs) is True and calls == []
    assert chat.template_matches_transformers(tokenizer.chat_template, {**special, "eos_token": "x"}, msgs) is False
    assert len(calls) == 1


def test_documents_are_the_tokenizers_own_ids_without_offsets(tokenizer, monkeypatch):
    """The tokenize action encodes documents with ``encode_batch_fast`` (no offsets tracked): each document's ids are
    the Rust tokenizer's ``encode`` of it, followed by EOD, for short documents and for one cut into pieces."""
    monkeypatch.setattr(wk, "MAX_ENCODE_CHARS", 64)
    backend = tokenizer.backend_tokenizer
    docs = ["Hello world.", "", "é 😀 日本語\n\nline two", "long line\n" * 20, "x" * 150]
    out, lens = wk.encode_documents(backend, docs, 0, np.dtype(np.int32))
    want = [backend.encode(d, add_special_tokens=False).ids for d in docs if d]
    assert lens.tolist() == [len(w) + 1 for w in want]
    assert out.tolist() == [t for w in want for t in [*w, 0]]
