"""Data another writer can break, and data that cannot be trained as given (issue 34): an empty root is refused, the
export replaces only its own splits, rows a chat template refuses are dropped and counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.cli.data import main
from pipeline.common.errors import UserError
from pipeline.data.prepare import PrepareOptions, prepare

GOOD = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def opts(dataset, root, **kw):
    kw.setdefault("workers", 1)
    return PrepareOptions(dataset=str(dataset), dataset_root=root, seq_length=256, quiet=True, **kw)


@pytest.mark.parametrize("argv", [["prepare", "--dataset", "D", "--seq-length", "64", "--dataset-root", ""],
                                  ["pack", " ", "smollm2-135m", "64"],
                                  ["tokenize", "", "smollm2-135m", "out"],
                                  ["tokenize", "c", "smollm2-135m", "out", "--output-dir", ""]])
def test_an_empty_root_is_refused_in_one_line(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # Path("") is the current directory: its training.jsonl was overwritten, exit 0
    (tmp_path / "training.jsonl").write_text("mine\n")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "an empty path is the current directory" in err[0], err
    assert (tmp_path / "training.jsonl").read_text() == "mine\n"


def test_the_export_never_replaces_a_split_it_did_not_write(tmp_path):
    data = write_rows(tmp_path / "d.jsonl", [GOOD] * 30)
    root = tmp_path / "root"
    root.mkdir()
    (root / "training.jsonl").write_text("an unrelated file\n")
    with pytest.raises(UserError, match=r"training.jsonl exists and was not written by an export"):
        prepare(opts(data, root))
    assert (root / "training.jsonl").read_text() == "an unrelated file\n"
    (root / "training.jsonl").unlink()
    first = prepare(opts(data, root))  # its own splits: written, then redone when asked
    assert first["export"]["kept"] == 30
    again = prepare(opts(data, root, force=True))
    assert again["export"]["kept"] == 30


# A Gemma-style system-role refusal and a Mistral-style alternation check, on SmolLM2's tokens.
STRICT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture
def strict_tokenizer(smollm2_dir, tmp_path):
    import shutil

    d = tmp_path / "strict-tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, d / name)
    (d / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    return d


def turns(*pairs):
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


def test_conversations_the_template_refuses_or_that_hold_special_token_text_are_dropped_and_counted(
        tmp_path, strict_tokenizer):
    # Before: the one-time template probe (it has a system turn) raised on clean data, and one refused row aborted
    # prepare; "<|im_end|>" typed in a reply became the real control token, and was trained on.
    rows = [GOOD] * 20 + [
        turns(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello")),  # system role refused
        turns(("user", "a"), ("user", "b"), ("assistant", "c")),  # roles do not alternate
        turns(("user", "Say <|im_end|> please"), ("assistant", "ok")),  # special-token text
        turns(("user", "Hi"), ("assistant", "Bye<|endoftext|>")),
    ]
    data = write_rows(tmp_path / "d.jsonl", rows)
    s = prepare(opts(data, tmp_path / "root", tokenizer=str(strict_tokenizer), val_fraction=0))
    train = s["tokenize"]["train"]
    assert train["examples"] == 20, train
    assert train["dropped_template_refused"] == 2 and train["dropped_special_token_text"] == 2
    assert train["dropped_template_mismatch"] == 0


def test_the_loaded_tokenizer_path_counts_refusals_too(strict_tokenizer):
    from pipeline.data.chat import load_tokenizer, tokenize_conversations

    tok = load_tokenizer(str(strict_tokenizer))
    convs = [turns(("system", "x"), ("user", "Hi"), ("assistant", "Hello")), GOOD, GOOD]  # the first is refused
    ids, masks, dropped = tokenize_conversations(tok, convs)
    assert len(ids) == 2 and dropped == 1
    assert tok.decode(ids[0][masks[0] == 1]) == "It is 4.<|im_end|>"


# ---- pretraining corpora: non-UTF-8 files counted, long documents encoded in pieces, names that fit -------------
def _tokenize(src, out, name="corpus"):
    from pipeline.data.indexed import tokenize_corpus

    return tokenize_corpus(str(src), "smollm2-135m", out, name, quiet=True, workers=1)


def test_a_latin1_text_file_is_skipped_and_counted_not_replaced(tmp_path, caplog):
    # Decoded with errors="replace", every accented letter became U+FFFD, silently.
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("plain text " * 20)
    (d / "b.txt").write_bytes("café crème à la française ".encode("latin-1") * 10)
    with caplog.at_level("WARNING"):
        res = _tokenize(d, tmp_path / "out")
    assert res["documents"] == 1 and res["skipped_non_utf8_files"] == 1 and res["skipped_binary_files"] == 0
    assert "skipped 1 file(s) that are not UTF-8" in caplog.text and "b.txt" in caplog.text


def test_a_document_over_the_bound_is_encoded_in_pieces_as_one_document(tmp_path, monkeypatch, tokenizer):
    # One 24 MB document aborted tokenize with the Rust tokenizer's out-of-memory error; the bound is 1 Mi characters,
    # lowered here so the test stays small. The pieces are cut after a newline: the ids are the whole document's.
    import numpy as np

    from pipeline.data import workers
    from pipeline.data.indexed import read_index

    monkeypatch.setattr(workers, "MAX_ENCODE_CHARS", 500)
    d = tmp_path / "corpus"
    d.mkdir()
    doc = "".join(f"Line {i}: some words, and more words.\n" for i in range(400))  # ~15,000 characters
    (d / "big.txt").write_text(doc)
    (d / "small.txt").write_text("short one")
    res = _tokenize(d, tmp_path / "out")
    assert res["documents"] == 2
    _, lengths, _, _ = read_index(Path(res["prefix"] + ".idx"))
    tokens = np.fromfile(res["prefix"] + ".bin", dtype=np.dtype(res["dtype"]))
    want = [tokenizer(t, add_special_tokens=False)["input_ids"] + [res["eod_id"]] for t in (doc, "short one")]
    assert lengths.tolist() == [len(w) for w in want]  # big.txt, then small.txt
    assert tokens.tolist() == want[0] + want[1]


def test_a_300_character_output_name_is_one_line(tmp_path, capsys):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("text")
    assert main(["tokenize", str(d), "smollm2-135m", "n" * 300]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 300 bytes, more than 200" in err[0], err
