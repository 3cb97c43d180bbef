"""Run records and markers shared by both engines (exercised on the local engine): the completion marker lands
beside ``checkpoint.save`` when the checkpoints live outside the run directory, so ``upload-all --poll`` stops;
and a multi-node salloc shell starts every node instead of waiting for ever on the rendezvous."""

import json
import re
import subprocess

import pytest

from tests.helpers import ROOT, run

pytestmark = pytest.mark.slow
PY = str(ROOT / ".venv/bin/python")
TRAIN = ["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--disable-ft"]


@pytest.fixture
def data(pipeline_env):
    run([PY, "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256",
         "--limit", "600", "--quiet"], env=pipeline_env, check=True)
    return pipeline_env


def test_done_marker_beside_checkpoint_save_stops_the_poller(data, tmp_path):
    run_dir, save = tmp_path / "run", tmp_path / "elsewhere" / "ckpts"
    run(["bash", "pipeline_training_launch.sh", *TRAIN, "--run-dir", str(run_dir), f"checkpoint.save={save}",
         "train.train_iters=20", "checkpoint.save_interval=10", "optimizer.lr=3e-3"], env=data, check=True)
    assert (run_dir / "TRAINING_DONE").read_text().strip() == "20"
    assert (save / "TRAINING_DONE").read_text().strip() == "20"
    summary = json.loads((run_dir / "metrics_summary.json").read_text())
    steps = [json.loads(x)["step"] for x in (run_dir / "progress.ndjson").read_text().splitlines()]
    assert summary["status"] == "completed" and summary["logged_steps"] == len(steps) == 20
    # the poller watches the checkpoint directory only; it must see the end of training and stop by itself
    res = run(["bash", "pipeline_checkpoint_convert.sh", "upload-all", str(save), "--hf-model",
               "pipeline/tiny-qwen3-moe", "--no-reasoning", "--poll", "--interval", "1"], env=data, timeout=600)
    assert "training has finished" in res.stderr, res.stderr[-2000:]
    assert sorted(p.name for p in (save / "converted_checkpoints").glob("*")) in (
        ["iter_0000010.done", "iter_0000020.done"], ["iter_0000010.failed", "iter_0000020.done"],
        ["iter_0000010.failed", "iter_0000020.failed"], ["iter_0000010.done", "iter_0000020.failed"])


@pytest.mark.slurm
def test_by_hand_in_a_multi_node_salloc_every_node_starts(slurm, data, tmp_path):
    env = {**data, "SLURM_CONF": slurm["SLURM_CONF"], "PIPELINE_CLUSTER": "local_cpu"}
    run_dir = tmp_path / "run2"
    cmd = ["salloc", "--nodes=2", "--time=10", "bash", "pipeline_training_launch.sh", *TRAIN, "--run-dir",
           str(run_dir), "train.train_iters=6", "checkpoint.save_interval=6"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "2-node allocation and no job step: starting every node with: srun --ntasks-per-node=1" in out
    assert re.search(r"--nnodes=2 --node-rank=0", out) and re.search(r"--nnodes=2 --node-rank=1", out)
    assert json.loads((run_dir / "metrics_summary.json").read_text())["final_step"] == 6
    assert len(json.loads((run_dir / "manifest.json").read_text())["launches"][-1]["node_list"]) == 2
