"""The five pipelines end to end through the quickstart script, on the tiny MoE model (about a minute)."""

import json

import pytest

from tests.helpers import run

pytestmark = pytest.mark.slow


def test_quickstart_tiny_chain_and_rerun(pipeline_env, tmp_path):
    # A team's shared project directory: umask 002. Every file the five pipelines write must be group-readable
    # (and group-writable, as umask 002 says), never the 0600 of a temporary file.
    res = run(["bash", "-c", "umask 002 && exec bash pipeline_quickstart.sh --tiny"], env=pipeline_env, check=True)
    ours = [str(f) for f in tmp_path.rglob("*") if not f.is_symlink() and "wandb" not in f.parts
            and (f.stat().st_mode & 0o060) != 0o060]
    assert ours == [], ours[:20]  # files and directories alike follow the umask
    # W&B writes its own run files (some with a fixed 0644): group-readable is what the team needs
    unreadable = [str(f) for f in (tmp_path / "wandb").rglob("*") if not f.is_symlink() and not f.stat().st_mode & 0o040]
    assert unreadable == [], unreadable[:20]
    runs = tmp_path / "runs" / "tiny_moe_sft"
    ckpt = runs / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "40"
    for f in ("config.yaml", "manifest.json", "progress.ndjson", "metrics_summary.json", "preflight.json"):
        assert (runs / f).exists(), f
    summary = json.loads((runs / "metrics_summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == 40
    assert summary["final_loss"] < summary["first_loss"]
    manifest = json.loads((runs / "manifest.json").read_text())
    assert manifest["launches"][0]["git"]["commit"] and manifest["launches"][0]["packages"]["torch"]
    hf = ckpt / "iter_0000040" / "hf"
    ver = json.loads((hf / "verification.json").read_text())
    assert ver["verdict"] == "PASS" and ver["max_abs_logit_diff"] <= 1e-3
    report = json.loads((hf / "coherence" / "coherence_hf.json").read_text())
    rows = report["results"][0]["rows"]
    assert len(rows) == 8 and {"prompt", "response", "response_length", "empty"} <= set(rows[0])
    assert (hf / "coherence" / "coherence_hf.md").exists()
    assert list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    ev = json.loads((hf / "eval" / "pipeline_smoke.json").read_text())  # the quickstart ends with an evaluation
    assert ev["harness"]["n-samples"]["pipeline_smoke"]["effective"] == 8
    assert ev["summary"]["iteration"] == 40 and ev["summary"]["tasks"]["pipeline_smoke"]["metric"] == "acc"
    assert ev["summary"]["wandb_dir"].startswith(str(tmp_path / "wandb"))
    assert "eval iter 40 pipeline_smoke: acc " in res.stdout
    assert "=== quickstart: done ===" in res.stdout

    again = run(["bash", "pipeline_quickstart.sh", "--tiny"], env=pipeline_env, check=True)
    out = again.stdout + again.stderr
    assert "stage export: already done" in out and "stage pack: already done" in out
    assert "training already finished" in out
    assert "already exported and verified" in out
    assert "already done:" in out  # coherence
    assert f"already done: {hf / 'eval' / 'pipeline_smoke.json'}" in out  # the evaluation


def test_pretrain_on_indexed_corpus(pipeline_env, tmp_path):
    corpus = tmp_path / "data" / "pretrain_corpus"
    corpus.mkdir(parents=True)
    from pathlib import Path

    import chatterbot_corpus

    for f in sorted((Path(chatterbot_corpus.__file__).parent / "data" / "english").glob("*.yml")):
        (corpus / (f.stem + ".txt")).write_text(f.read_text())
    run([str(pipeline_env.get("PYTHON", ".venv/bin/python")), "pipeline_data_prepare.py", "tokenize", str(corpus),
         "smollm2-135m", "tokenized", "--quiet"], env=pipeline_env, check=True)
    assert (corpus / "tokenized" / "token_count.json").exists()
    run(["bash", "pipeline_training_launch.sh", "configs/local/tiny_moe_pretrain.yaml", "--model", "tiny-qwen3-moe",
         "--mode", "pretrain", "--disable-ft"], env=pipeline_env, check=True)
    summary = json.loads((tmp_path / "runs" / "tiny_moe_pretrain" / "metrics_summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_loss"] < summary["first_loss"]
