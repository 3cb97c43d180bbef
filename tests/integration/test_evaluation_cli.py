"""Issue 35, evaluation through the real entry points: pipeline_eval_harness.py evaluates an export on the local
task (lm-eval's simple_evaluate on its HFLM; the harness's own result format plus our summary beside the export,
W&B offline); a task whose data this machine cannot reach is refused in one line before any model loads (by the
evaluation, by upload-all --eval before any conversion, and by isambard_sbatch's plan check); the plan's GPUs and
memory on the cluster profile. The export is a tiny random-init Llama with the SmolLM2 tokenizer, published as an
iteration's hf/ (seconds to write); --limit keeps the harness to a few questions."""

from __future__ import annotations

import json

import pytest

from pipeline.common.errors import UserError
from tests.helpers import ROOT, run

pytestmark = pytest.mark.slow
PY = str(ROOT / ".venv/bin/python")


@pytest.fixture(scope="module")
def export(tmp_path_factory, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = tmp_path_factory.mktemp("eval") / "checkpoints" / "iter_0000010" / "hf"
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    return hf


def test_evaluate_writes_the_harness_results_beside_the_export_and_to_wandb(export, pipeline_env, tmp_path):
    res = run([PY, "pipeline_eval_harness.py", str(export), "--tasks", "pipeline_smoke", "--limit", "3",
               "--batch-size", "4"], env=pipeline_env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [x for x in res.stdout.splitlines() if x.startswith("eval ")]
    assert len(lines) == 1 and lines[0].startswith("eval iter 10 pipeline_smoke: acc "), res.stdout
    out = json.loads((export / "eval" / "pipeline_smoke.json").read_text())
    harness, summary = out["harness"], out["summary"]
    assert {"results", "configs", "versions", "n-shot", "higher_is_better", "n-samples"} <= set(harness)
    assert harness["n-samples"]["pipeline_smoke"] == {"original": 24, "effective": 3}
    assert harness["lm_eval_version"] == "0.4.13"
    acc = harness["results"]["pipeline_smoke"]["acc,none"]
    assert summary["iteration"] == 10 and summary["tasks"]["pipeline_smoke"]["value"] == acc
    assert acc in (0.0, 1 / 3, 2 / 3, 1.0) and summary["metrics"]["pipeline_smoke/acc"] == acc
    wandb_dir = summary["wandb_dir"]
    assert wandb_dir.startswith(pipeline_env["WANDB_DIR"] + "/wandb/offline-run-"), wandb_dir
    assert any(p.suffix == ".wandb" for p in (tmp_path / "wandb" / "wandb").glob("offline-run-*/*"))
    assert not list((export / "eval").glob(".*"))  # written atomically: no temporary left


def test_a_task_whose_data_is_unreachable_is_refused_before_any_load(export, pipeline_env, tmp_path):
    broken = tmp_path / "ckpt" / "iter_0000010" / "hf"  # a model that cannot load: loading it would not say this
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{not json")
    res = run([PY, "pipeline_eval_harness.py", str(broken), "--tasks", "pipeline_smoke,hellaswag"],
              env=pipeline_env, timeout=600)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: task 'hellaswag' reads its data from the Hugging Face hub (Rowan/hellaswag), which this machine cannot "
        "reach (cluster profile 'local_cpu' has hub_offline, or HF_HUB_OFFLINE=1): run it where the profile's hub is "
        "online, or use the local task pipeline_smoke"]
    assert not (broken / "eval").exists()
    typo = run([PY, "pipeline_eval_harness.py", str(export), "--tasks", "pipeline_smok"], env=pipeline_env)
    assert typo.returncode == 2 and typo.stderr.count("\n") == 1 and "did you mean pipeline_smoke" in typo.stderr
    # upload-all --eval: refused before the first conversion
    ckpt = export.parent.parent
    res = run(["bash", "pipeline_checkpoint_convert.sh", "upload-all", str(ckpt), "--hf-model", "x/y",
               "--no-reasoning", "--eval", "hellaswag"], env=pipeline_env, timeout=600)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "'hellaswag' reads its data" in res.stderr
    assert not (ckpt / "converted_checkpoints").exists() and not (ckpt / "evaluated_checkpoints").exists()


def test_isambard_sbatch_checks_the_eval_plan(export, monkeypatch):
    """The submit-time check of pipeline_eval_submit.sbatch: on the cluster profile (hub online) a hub task plans,
    with the GPUs and memory of the model; on a profile without the hub it is refused before anything is queued."""
    from pipeline.cli.evaluation import plan_from_argv
    from pipeline.cli.submission import check_job

    monkeypatch.setenv("PIPELINE_BINDS", str(export.parent.parent))
    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    monkeypatch.setenv("HF_HUB_OFFLINE", "")
    plan = plan_from_argv(["nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "--tasks", "hellaswag,pipeline_smoke"], 1)
    d = plan.as_dict()
    assert plan.ok, plan.problems
    assert (d["nodes"], d["gpus_per_node"], d["job"]) == (1, 1, "evaluate") and 60 < d["memory_per_gpu_gb"] < 95
    check_job("pipeline_eval_submit.sbatch", ["nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "--tasks", "hellaswag"],
              ["--gpus-per-node=1"])
    big = plan_from_argv(["nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "--batch-size", "64"], 1)
    assert big.as_dict()["gpus_per_node"] == 4 and big.env["PIPELINE_EVAL_PARALLELIZE"] == "1"
    with pytest.raises(UserError, match="uses 4 GPU"):
        check_job("pipeline_eval_submit.sbatch", ["nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "--batch-size", "64"],
                  ["--gpus-per-node=1"])
    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")
    with pytest.raises(UserError, match=r"^task 'hellaswag' reads its data .*\nplan: 1 problem\(s\); nothing was "
                                        "submitted$"):
        check_job("pipeline_eval_submit.sbatch", [str(export), "--tasks", "hellaswag"], [])
