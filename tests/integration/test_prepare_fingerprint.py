"""prepare resumes by fingerprint, not by path; default roots never collide; one writer per data root;
outputs follow the umask."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from tests.helpers import ROOT


def rows(n, tag=""):
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"question {tag}{i}"},
                                            {"role": "assistant", "content": f"answer {tag}{i}"}]}) + "\n"
                   for i in range(n))


def prepare(args, env, umask=None, **kw):
    pre = (lambda: os.umask(umask)) if umask is not None else None
    return subprocess.run([sys.executable, str(ROOT / "pipeline_data_prepare.py"), "prepare", "--seq-length", "64",
                           "--json", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          preexec_fn=pre, **kw)


def ok(res):
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def test_same_stem_gets_its_own_default_root_and_rerun_is_redone_with_the_difference_named(tmp_path,
                                                                                           pipeline_env):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    small, big = tmp_path / "a" / "chat.jsonl", tmp_path / "b" / "chat.jsonl"
    small.write_text(rows(5))
    big.write_text(rows(40, "b"))
    s1, s2 = ok(prepare(["--dataset", str(small)], pipeline_env)), ok(prepare(["--dataset", str(big)], pipeline_env))
    assert s1["dataset_root"] != s2["dataset_root"]
    assert Path(s1["dataset_root"]).name.startswith("chat-") and Path(s2["dataset_root"]).name.startswith("chat-")
    assert (s1["export"]["kept"], s2["export"]["kept"]) == (5, 40)

    # The same explicit root, a different input with the same stem: redone, the difference named.
    root = tmp_path / "root"
    ok(prepare(["--dataset", str(small), "--dataset-root", str(root)], pipeline_env))
    res = prepare(["--dataset", str(big), "--dataset-root", str(root)], pipeline_env)
    s = ok(res)
    assert s["export"]["kept"] == 40 and s["seconds_per_stage"].get("pack") is not None
    assert "stage export: redoing, input changed: path" in res.stderr and "size" in res.stderr
    assert "already done" not in res.stderr
    train = s["pack"]["paths"]["train"]
    assert s["pack"]["train"]["sequences"] + s["pack"]["validation"]["sequences"] == 40
    assert pq.read_table(train).num_rows == s["pack"]["train"]["packs"]

    # A changed --limit is redone too, naming the flag; an identical rerun is skipped.
    res = prepare(["--dataset", str(big), "--dataset-root", str(root), "--limit", "7"], pipeline_env)
    s = ok(res)
    assert "--limit None -> 7" in res.stderr and s["export"]["kept"] == 7 and "already done" not in res.stderr
    res = prepare(["--dataset", str(big), "--dataset-root", str(root), "--limit", "7"], pipeline_env)
    assert ok(res)["seconds_per_stage"] == {} and "stage pack: already done" in res.stderr

    # Only the pack options changed: export and tokenize are kept, pack is redone.
    res = prepare(["--dataset", str(big), "--dataset-root", str(root), "--limit", "7", "--overlong", "truncate"],
                  pipeline_env)
    ok(res)
    assert "stage export: already done" in res.stderr
    assert "stage pack: redoing, --overlong drop -> truncate" in res.stderr

    # The input file itself changed (same path): size and mtime differ, redone.
    big.write_text(rows(45, "b"))
    res = prepare(["--dataset", str(big), "--dataset-root", str(root)], pipeline_env)
    s = ok(res)
    assert "input changed: size" in res.stderr and s["export"]["kept"] == 45


def test_files_prepare_writes_follow_umask_002(tmp_path, pipeline_env):
    src = tmp_path / "chat.jsonl"
    src.write_text(rows(20))
    shared = tmp_path / "project"
    shared.mkdir()
    os.chmod(shared, 0o2775)
    ok(prepare(["--dataset", str(src), "--dataset-root", str(shared / "data")], pipeline_env, umask=0o002))
    files = [p for p in (shared / "data").rglob("*")]
    assert len([p for p in files if p.suffix == ".parquet"]) >= 4
    for p in files:
        mode = stat.S_IMODE(p.stat().st_mode)
        want = 0o775 if p.is_dir() else 0o664
        assert mode & want == want, f"{p} is {mode:o}"


def test_two_interleaved_prepares_on_one_root(tmp_path, pipeline_env):
    src = tmp_path / "chat.jsonl"
    src.write_text(rows(6000))
    root = tmp_path / "root"
    args = ["--dataset", str(src), "--dataset-root", str(root), "--chunk-size", "100", "--quiet"]
    first = subprocess.Popen([sys.executable, str(ROOT / "pipeline_data_prepare.py"), "prepare", "--seq-length", "64",
                              "--json", *args], cwd=ROOT, env=pipeline_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    chunks = root / "tokenized" / "HuggingFaceTB--SmolLM2-135M-Instruct" / "train"
    deadline, paused_with_tmp = time.time() + 300, False
    try:
        while True:  # pause it mid-write: while one of its temporaries exists, else soon after a chunk lands
            assert first.poll() is None, "the first run finished before it could be paused"
            assert time.time() < deadline
            tmps = list(chunks.glob(".*.tmp")) if chunks.is_dir() else []
            if tmps or len(list(chunks.glob("chunk_*.parquet"))) >= 3:
                first.send_signal(signal.SIGSTOP)
                paused_with_tmp = bool(tmps) and all(t.exists() for t in tmps)
                break
            time.sleep(0.002)
        second = prepare(args, pipeline_env)
        # The second run is refused with one line (the root is in use), and touched nothing.
        assert second.returncode == 2, second.stderr[-2000:]
        err = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
        assert len(err) == 1 and f"pid {first.pid}" in err[0] and "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGCONT)
    out, errs = first.communicate(timeout=600)
    assert first.returncode == 0, errs[-3000:]
    s = json.loads(out)
    assert s["export"]["kept"] == 6000 and not list(root.rglob(".*.tmp"))
    assert s["tokenize"]["train"]["examples"] + s["tokenize"]["validation"]["examples"] == 6000
    packed = pq.read_table(s["pack"]["paths"]["train"])
    n_seq = sum(len(x) for x in packed.column("seq_start_id").to_pylist())
    assert n_seq == s["pack"]["train"]["sequences"] == s["tokenize"]["train"]["examples"]
    # A later run on the same root finds the first run's complete output and skips every stage.
    assert ok(prepare(args, pipeline_env))["seconds_per_stage"] == {}
    print("paused while a temporary existed:", paused_with_tmp)
