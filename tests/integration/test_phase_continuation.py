"""Phases for real on the local engine (issue 33): a three-phase experiment planned by the experiment layer and each
training job run by the launcher, in order: a pretrain, a cooldown that continues it (init: continue, the default:
its iteration count goes on, its optimizer state is loaded, its own LR schedule applies from there) and a phase
from the pretrain's weights only (init: weights: iterations restart at 1, a fresh optimizer). A continuing phase
writes into its own save: pointing it at the pretrain's save is refused by the owner record (decision 56)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, run

pytestmark = pytest.mark.slow
PY = str(ROOT / ".venv/bin/python")

EXPERIMENT = """
name: phases
base: {config: configs/local/tiny_moe_sft.yaml, model: tiny-qwen3-moe, mode: sft, flags: [--disable-ft]}
phases:
  - {name: pretrain, overrides: {train.train_iters: 6, checkpoint.save_interval: 3}}
  - name: cooldown
    from: pretrain
    tokens: 4096
    overrides: {optimizer.lr: 1.0e-3, checkpoint.save_interval: 2, scheduler.lr_decay_style: WSD,
                scheduler.lr_wsd_decay_style: linear, scheduler.lr_wsd_decay_iters: 4}
  - {name: fresh, from: pretrain, init: weights, tokens: 4096}
"""


def _steps(run_dir):
    return [json.loads(x) for x in (run_dir / "progress.ndjson").read_text().splitlines()]


def _adam_step(iter_dir) -> int:
    import torch

    state = torch.load(iter_dir / "optimizer.pt", map_location="cpu", weights_only=True)["state"]
    return int(next(iter(state.values()))["step"])


def test_a_cooldown_continues_the_pretrain_and_weights_only_restarts(pipeline_env, tmp_path):
    from pipeline.experiment import spec
    from pipeline.experiment.plan import plan_run

    run([PY, "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256",
         "--limit", "600", "--quiet"], env=pipeline_env, check=True)
    path = tmp_path / "phases.yaml"
    path.write_text(EXPERIMENT)
    exp = spec.load(path, root=ROOT)
    rp = plan_run(exp, exp.runs[0])
    pre, cool, fresh = (rp.job(n) for n in ("pretrain", "cooldown", "fresh"))
    assert cool.iters == 10 and fresh.iters == 4  # 4096 tokens = 4 iterations of 4 x 256: on from 6, or from 0

    def launch(job):
        config, model, mode, *rest = job.args
        return run(["bash", "pipeline_training_launch.sh", config, "--model", model, "--mode", mode, *rest],
                   env=pipeline_env, check=True)

    launch(pre)
    assert [r["step"] for r in _steps(pre.run_dir)] == [1, 2, 3, 4, 5, 6]

    # continue: iterations 7..10, the pretrain's optimizer state (Adam's step count goes on to 10), the cooldown's
    # own rate and WSD decay (not the checkpoint's lr of 3e-3), checkpoints in its own save
    out = launch(cool)
    log = out.stdout + out.stderr
    assert f"continuing from {pre.save}/iter_0000006" in log, log[-3000:]
    recs = _steps(cool.run_dir)
    assert [r["step"] for r in recs] == [7, 8, 9, 10]
    lrs = [r["learning_rate"] for r in recs]
    assert lrs[0] <= 1.0e-3 and lrs == sorted(lrs, reverse=True) and lrs[-1] < lrs[0]
    own = sorted(p.name for p in cool.save.glob("iter_*"))
    assert own == ["iter_0000008", "iter_0000010"]
    assert _adam_step(cool.save / "iter_0000010") == 10
    assert json.loads((cool.save / "iter_0000010" / "trainer_state.json").read_text())["global_step"] == 10
    summary = json.loads((cool.run_dir / "metrics_summary.json").read_text())
    assert summary["final_step"] == 10 and summary["start_step"] == 6 and summary["tokens"] == 4 * 4 * 256
    assert sorted(p.name for p in pre.save.glob("iter_*")) == ["iter_0000003", "iter_0000006"]  # untouched

    # weights only: iterations 1..4, a fresh optimizer (Adam's step count is this phase's own)
    out = launch(fresh)
    assert f"initialising from {pre.save}/iter_0000006" in out.stdout + out.stderr
    assert [r["step"] for r in _steps(fresh.run_dir)] == [1, 2, 3, 4]
    assert _adam_step(fresh.save / "iter_0000004") == 4

    # a continuing run pointed at the pretrain's own save is refused before it trains (one line, exit 2)
    config, model, mode, *rest = cool.args
    res = run(["bash", "pipeline_training_launch.sh", config, "--model", model, "--mode", mode, *rest,
               f"checkpoint.save={pre.save}", "--run-dir", str(tmp_path / "other")], env=pipeline_env)
    err = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert res.returncode == 2 and len(err) == 1 and f"belongs to run {pre.run_dir}" in err[0], res.stderr[-2000:]
