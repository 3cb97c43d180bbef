"""A pretraining corpus tokenized, and a chat dataset prepared, across nodes on the real local Slurm cluster (issue 64,
steps 3 and 4): one job of three nodes, one shard step per node, one step killed mid-shard and run again by the job,
then the merge; the output is byte for byte the one-node output (megatron-core's own IndexedDataset reads the
tokenized corpus with the exact token count; the packed Parquet, its metadata and every marker are the same)."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.data.indexed import tokenize_corpus
from pipeline.data.prepare import PrepareOptions, prepare
from pipeline.data.shards import shard_dir
from tests.helpers import ROOT, run
from tests.integration.test_slurm import job_log, job_state, submit, wait_job
from tests.unit.test_prepare_shards import chat_file, outputs

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FILES, NODES = 600, 3


def write_corpus(where: Path) -> Path:
    """Several hundred text files of different sizes (a seeded vocabulary, so the bytes are the same every run)."""
    rng = random.Random(64)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    where.mkdir(parents=True)
    for i in range(FILES):
        (where / f"doc_{i:04d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(150, 600))))
    return where


def running_step(env, job: str, name: str) -> str | None:
    """The id (JOB.STEP) of the job's running step named ``name``."""
    out = run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], env=env).stdout
    return next((ln.split()[0] for ln in out.splitlines() if ln.split()[1:] == [name]), None)


def kill_mid_shard(env, job: str, step_name: str, started, finished, what: str) -> None:
    """SIGKILL the job's step ``step_name`` once ``started()`` (it has written part of its shard) and not
    ``finished()``: the node lost."""
    while job_state(env, job) in ("PENDING", "RUNNING", "CONFIGURING"):
        step = running_step(env, job, step_name)
        if step and started() and not finished():
            run(["scancel", "--signal=KILL", step], env=env, check=True)
            return
        time.sleep(0.02)
    raise AssertionError(f"job {job} ended before {what} could be killed mid-run: {job_log('data', job)}")


def test_tokenize_across_three_nodes_with_a_shard_killed_is_the_one_node_output(senv, tmp_path,
                                                                                   megatron_indexed_dataset):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "tokenized"
    job = submit(senv, f"--nodes={NODES}", "pipeline_data_submit.sbatch", "tokenize", str(corpus), "smollm2-135m",
                 "web", "--output-dir", str(out), "--docs-per-part", "4")
    parts = shard_dir(out, 1, NODES) / ".parts"
    kill_mid_shard(senv, job, "tokenize-shard-1", lambda: list(parts.glob("part_*.bin")),
                   lambda: (parts.parent / "token_count.json").exists(), "shard 1")
    ref = tokenize_corpus(str(corpus), "smollm2-135m", tmp_path / "one", "web", docs_per_part=4, quiet=True)
    assert wait_job(senv, job) == "COMPLETED", job_log("data", job)
    log = job_log("data", job)
    assert "shard 1/3 failed" in log and "shard 1/3 done (try 2)" in log, log
    resumed = re.search(r"tokenize: resumed: (\d+) of (\d+) parts were already on disk", log)
    assert resumed and 0 < int(resumed.group(1)) < int(resumed.group(2)), log  # only the unfinished parts redone
    for suffix in (".bin", ".idx"):
        assert (out / f"web_text_document{suffix}").read_bytes() == \
            (tmp_path / "one" / f"web_text_document{suffix}").read_bytes()
    merged = json.loads((out / "token_count.json").read_text())
    assert {k: v for k, v in merged.items() if k != "prefix"} == {k: v for k, v in ref.items() if k != "prefix"}
    assert not (out / ".shards").exists()
    ds = megatron_indexed_dataset.IndexedDataset(str(out / "web_text_document"))
    assert len(ds) == FILES == merged["documents"]
    assert int(np.sum(ds.sequence_lengths)) == merged["tokens"]
    assert ds[FILES - 1][-1] == merged["eod_id"]


def test_a_chat_prepare_across_three_nodes_with_a_shard_killed_is_the_one_node_output(senv, tmp_path):
    data = chat_file(tmp_path / "chat.jsonl", n=3000, seed=64)
    root = tmp_path / "multi"
    # --force redoes every stage, but a retried shard resumes: the job gives --force to a shard's first try only
    job = submit(senv, f"--nodes={NODES}", "pipeline_data_submit.sbatch", "prepare", "--dataset", str(data),
                 "--seq-length", "384", "--chunk-size", "8", "--dataset-root", str(root), "--force")
    done = shard_dir(root, 1, NODES) / "tokenized" / "HuggingFaceTB--SmolLM2-135M-Instruct" / "train"
    kill_mid_shard(senv, job, "prepare-shard-1", lambda: list(done.glob("chunk_*.parquet")),
                   lambda: (done / "_DONE.json").exists(), "shard 1")
    prepare(PrepareOptions(dataset=str(data), dataset_root=tmp_path / "one", seq_length=384, chunk_size=8,
                           quiet=True))
    assert wait_job(senv, job) == "COMPLETED", job_log("data", job)
    log = job_log("data", job)
    assert "shard 1/3 failed" in log and "shard 1/3 done (try 2)" in log, log
    resumed = re.search(r"stage tokenize\[train\]: resumed: (\d+) of (\d+) chunks were already on disk", log)
    assert resumed and 0 < int(resumed.group(1)) < int(resumed.group(2)), log  # only the missing chunks redone
    single, multi = outputs(tmp_path / "one"), outputs(root)
    assert multi == single
    assert any(k.endswith("training_384.idx.parquet") for k in multi)
    assert not (root / ".shards").exists()


def test_what_cannot_be_split_is_refused_at_submission(senv, tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    for args, needle in [(["pack", str(corpus), "smollm2-135m", "256"], "pack runs on one node"),
                         (["prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256", "--shard", "0/3"],
                          "the job's own steps"),
                         (["tokenize", str(corpus), "smollm2-135m", "web", "--limit", "5"], "--limit takes"),
                         (["tokenize", str(corpus), "smollm2-135m", "web", "--shard", "0/3"], "the job's own steps"),
                         (["tokenize", "org/name", "smollm2-135m", "web"], "hub dataset")]:
        res = run([str(ROOT / "isambard_sbatch"), "--nodes=3", "pipeline_data_submit.sbatch", *args], env=senv)
        assert res.returncode == 2 and needle in res.stderr, res.stderr
        assert len([ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]) == 1, res.stderr
