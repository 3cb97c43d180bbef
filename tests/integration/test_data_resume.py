"""Interrupting prepare and tokenize mid-way (SIGKILL) and re-running yields byte-identical outputs."""

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow
PY = str(ROOT / ".venv/bin/python")


@pytest.fixture(scope="module")
def big_chat(tmp_path_factory):
    """~20k conversations (the chatterbot corpus, each conversation varied 10 times) as JSONL."""
    from pipeline.data.sources import load_conversations

    convs, _ = load_conversations("chatterbot-corpus")
    f = tmp_path_factory.mktemp("src") / "chat.jsonl"
    with open(f, "w") as out:
        for k in range(10):
            for c in convs:
                msgs = [dict(m, content=f"{m['content']} ({k})" if m["role"] == "user" else m["content"])
                        for m in c["messages"]]
                out.write(json.dumps({"messages": msgs}) + "\n")
    return f


def files_of(root: Path, patterns) -> dict[str, bytes]:
    out = {}
    for pat in patterns:
        for p in sorted(root.glob(pat)):
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def kill_when(cmd, env, ready, timeout=300):
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail("the process finished before it could be interrupted")
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_prepare_resumes_byte_identical(big_chat, tmp_path, pipeline_env):
    def cmd(root):
        return [PY, "pipeline_data_prepare.py", "prepare", "--dataset", str(big_chat), "--dataset-root", str(root),
                "--seq-length", "512", "--chunk-size", "500", "--quiet"]

    full, cut = tmp_path / "full", tmp_path / "cut"
    subprocess.run(cmd(full), cwd=ROOT, env=pipeline_env, check=True, capture_output=True)
    chunks = cut / "tokenized" / "HuggingFaceTB--SmolLM2-135M-Instruct" / "train"
    kill_when(cmd(cut), pipeline_env, lambda: len(list(chunks.glob("chunk_*.parquet"))) >= 5)
    n_before = len(list(chunks.glob("chunk_*.parquet")))
    assert not (chunks / "_DONE.json").exists() and n_before < 38
    res = subprocess.run(cmd(cut), cwd=ROOT, env=pipeline_env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    pats = ["*.jsonl", "tokenized/*/*/chunk_*.parquet", "packed/*/*.parquet", "packed/*/*_metadata.jsonl"]
    a, b = files_of(full, pats), files_of(cut, pats)
    assert len(a) > 40 and a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]
    assert not list(cut.rglob(".*.tmp"))  # no temporary left-overs


def test_tokenize_resumes_byte_identical(tmp_path, pipeline_env):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = Path(json.__file__).read_text()  # any real text will do: the stdlib json module source
    for i in range(3000):
        (corpus / f"doc{i:05d}.txt").write_text(f"{i}: " + text[(i * 37) % 2000:][:1500])

    def cmd(out):
        return [PY, "pipeline_data_prepare.py", "tokenize", str(corpus), "smollm2-135m", "pt", "--output-dir", str(out),
                "--docs-per-part", "100", "--quiet"]

    full, cut = tmp_path / "full", tmp_path / "cut"
    subprocess.run(cmd(full), cwd=ROOT, env=pipeline_env, check=True, capture_output=True)
    kill_when(cmd(cut), pipeline_env, lambda: len(list((cut / ".parts").glob("part_*.bin"))) >= 5)
    assert not (cut / "pt_text_document.idx").exists()
    subprocess.run(cmd(cut), cwd=ROOT, env=pipeline_env, check=True, capture_output=True)
    for f in ("pt_text_document.bin", "pt_text_document.idx"):
        assert (full / f).read_bytes() == (cut / f).read_bytes(), f
    ca, cb = (json.loads((d / "token_count.json").read_text()) for d in (full, cut))
    ca.pop("prefix"), cb.pop("prefix")
    assert ca == cb and ca["documents"] == 3000
