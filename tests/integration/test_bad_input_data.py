"""Bad input to the data pipeline's real entry point: one line ``error: ...``, exit 2, never a traceback.

Each case runs ``python pipeline_data_prepare.py ...`` in a subprocess whose address space is capped
(4 GiB), so a missing bound on an allocation fails the test instead of running the machine out of memory.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from tests.helpers import ROOT

MEM_CAP = 4 << 30


def _cap_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEM_CAP, MEM_CAP))


def run_prepare(args, env, cwd):
    return subprocess.run([sys.executable, str(ROOT / "pipeline_data_prepare.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, preexec_fn=_cap_memory)


GOOD_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def make(tmp, kind):
    """Build the input a case needs under tmp; return its path as a string."""
    p = tmp / "in"
    p.mkdir(exist_ok=True)
    if kind == "empty_parquet":
        (p / "e.parquet").write_bytes(b"")
        return str(p / "e.parquet")
    if kind == "corrupt_parquet":
        (p / "c.parquet").write_bytes(b"PAR1" + b"\x00garbage" * 100 + b"PAR1")
        return str(p / "c.parquet")
    if kind == "zero_row_parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"messages": pa.array([], pa.string())}), p / "z.parquet")
        return str(p / "z.parquet")
    if kind == "dir_named_jsonl":
        (p / "x.jsonl").mkdir()
        return str(p / "x.jsonl")
    if kind == "good":
        (p / "good.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
        return str(p / "good.jsonl")
    if kind == "binary_jsonl":
        (p / "bin.jsonl").write_bytes(bytes(range(256)) * 4)
        return str(p / "bin.jsonl")
    if kind == "empty_dir":
        (p / "empty").mkdir()
        return str(p / "empty")
    if kind == "empty_jsonl":
        (p / "empty.jsonl").write_text("")
        return str(p / "empty.jsonl")
    if kind == "file":
        (p / "afile").write_text("x")
        return str(p / "afile")
    if kind == "stray_dataset_info":  # a plain folder with a dataset_info.json that is not a saved dataset
        (p / "fake").mkdir()
        (p / "fake" / "a.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
        (p / "fake" / "dataset_info.json").write_text("{}")
        return str(p / "fake")
    if kind == "own_training_file":  # the export would write its training.jsonl over this very file
        (p / "root").mkdir()
        (p / "root" / "training.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
        return str(p / "root" / "training.jsonl")
    raise AssertionError(kind)


PREP = ["prepare", "--quiet", "--seq-length", "64"]
CASES = {
    "empty parquet": (lambda t: PREP + ["--dataset", make(t, "empty_parquet")]),
    "corrupt parquet": (lambda t: PREP + ["--dataset", make(t, "corrupt_parquet")]),
    "parquet with no rows": (lambda t: PREP + ["--dataset", make(t, "zero_row_parquet")]),
    "directory named x.jsonl": (lambda t: PREP + ["--dataset", make(t, "dir_named_jsonl")]),
    "binary jsonl": (lambda t: PREP + ["--dataset", make(t, "binary_jsonl")]),
    "missing dataset": (lambda t: PREP + ["--dataset", str(t / "nope.jsonl")]),
    "seq-length 2e9": (lambda t: ["prepare", "--dataset", make(t, "good"), "--seq-length", "2000000000"]),
    "seq-length 1e11": (lambda t: ["prepare", "--dataset", make(t, "good"), "--seq-length", "1e11"]),
    "seq-length 0": (lambda t: ["prepare", "--dataset", make(t, "good"), "--seq-length", "0"]),
    "seq-length negative": (lambda t: ["prepare", "--dataset", make(t, "good"), "--seq-length", "-5"]),
    "chunk-size 0": (lambda t: PREP + ["--dataset", make(t, "good"), "--chunk-size", "0"]),
    "limit 0": (lambda t: PREP + ["--dataset", make(t, "good"), "--limit", "0"]),
    "val-fraction nan": (lambda t: PREP + ["--dataset", make(t, "good"), "--val-fraction", "nan"]),
    "pad multiple 0": (lambda t: PREP + ["--dataset", make(t, "good"), "--pad-seq-to-mult", "0"]),
    "dataset root is a file": (lambda t: PREP + ["--dataset", make(t, "good"), "--dataset-root", make(t, "file")]),
    "unknown flag": (lambda t: PREP + ["--dataset", make(t, "good"), "--frobnicate"]),
    "seed negative": (lambda t: PREP + ["--dataset", make(t, "good"), "--seed", "-1"]),
    "dataset root below a file": (lambda t: PREP + ["--dataset", make(t, "good"), "--dataset-root",
                                                    make(t, "file") + "/sub"]),
    "dataset root would overwrite the input": (lambda t: PREP + ["--dataset", make(t, "own_training_file"),
                                                                 "--dataset-root", str(t / "in" / "root")]),
    "folder with a stray dataset_info.json": (lambda t: PREP + ["--dataset", make(t, "stray_dataset_info")]),
    "missing relative dataset path": (lambda t: PREP + ["--dataset", "in/nope.jsonl"]),
    "pack: seed negative": (lambda t: ["pack", str(t), "smollm2-135m", "64", "--seed", "-1"]),
    "pack: missing root": (lambda t: ["pack", str(t / "nowhere"), "smollm2-135m", "64"]),
    "pack: root without a tokenized export": (lambda t: ["pack", str(t), "smollm2-135m", "64"]),
    "pack: seq-length 2e9": (lambda t: ["pack", str(t), "smollm2-135m", "2000000000"]),
    "pack: seq-length 1": (lambda t: ["pack", str(t), "smollm2-135m", "1"]),
    "pack: pad multiple 0": (lambda t: ["pack", str(t), "smollm2-135m", "64", "0"]),
    "pack: pad multiple > seq-length": (lambda t: ["pack", str(t), "smollm2-135m", "64", "128"]),
    "pack: seq-length not a number": (lambda t: ["pack", str(t), "smollm2-135m", "lots"]),
    "tokenize: missing corpus": (lambda t: ["tokenize", str(t / "missing"), "smollm2-135m", "pt", "--quiet"]),
    "tokenize: empty corpus folder": (lambda t: ["tokenize", make(t, "empty_dir"), "smollm2-135m", "pt", "--quiet"]),
    "tokenize: empty jsonl": (lambda t: ["tokenize", make(t, "empty_jsonl"), "smollm2-135m", "pt", "--quiet",
                                         "--output-dir", str(t / "out")]),
    "tokenize: docs-per-part 0": (lambda t: ["tokenize", make(t, "empty_dir"), "smollm2-135m", "pt",
                                             "--docs-per-part", "0"]),
    "tokenize: output dir is a file": (lambda t: ["tokenize", make(t, "good"), "smollm2-135m", "pt", "--quiet",
                                                  "--output-dir", make(t, "file")]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, pipeline_env):
    args = CASES[case](tmp_path)
    res = run_prepare(args, pipeline_env, tmp_path)
    err_lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert len(err_lines) == 1, res.stderr[-2000:]
    assert not [ln for ln in res.stderr.splitlines() if "error" in ln.lower() and not ln.startswith("error:")], \
        res.stderr[-2000:]


def test_invalid_utf8_row_is_counted_not_fatal(tmp_path, pipeline_env):
    f = tmp_path / "mixed.jsonl"
    good = (json.dumps(GOOD_ROW) + "\n").encode()
    f.write_bytes(good * 3 + b'{"messages": "\xff\xfe broken"}\n' + good)
    res = run_prepare(["prepare", "--dataset", str(f), "--seq-length", "64", "--quiet", "--json",
                       "--dataset-root", str(tmp_path / "out")], pipeline_env, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout)
    assert summary["export"]["rows_in"] == 5 and summary["export"]["kept"] == 4
    assert summary["export"]["dropped"] == {"invalid_utf8": 1}


def test_empty_validation_split_still_counts_as_done(tmp_path, pipeline_env):
    f = make(tmp_path, "good")
    args = ["prepare", "--dataset", f, "--seq-length", "64", "--quiet", "--val-fraction", "0", "--json",
            "--dataset-root", str(tmp_path / "out")]
    first = run_prepare(args, pipeline_env, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert json.loads(first.stdout)["pack"]["validation"]["sequences"] == 0
    again = run_prepare(args, pipeline_env, tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["seconds_per_stage"] == {}  # every stage, pack included, was done
