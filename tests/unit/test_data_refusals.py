"""Data another writer can break, and data that cannot be trained as given (issue 34): an empty root is refused, the
export replaces only its own splits, rows a chat template refuses are dropped and counted."""

from __future__ import annotations

import json

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
