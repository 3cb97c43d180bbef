"""Chain planning without Slurm: each phase's inputs come from the previous phase's planned outputs, the lines are
chained with afterok, a dependent export/coherence runs its own submit script (its inputs checked in the job), and a named iteration
that is never saved is refused."""

from __future__ import annotations

import pytest

from pipeline.experiment import spec
from pipeline.experiment.plan import plan_run, render_lines
from tests.helpers import ROOT

CHAIN = """
name: c
base: {config: configs/local/tiny_moe_sft.yaml, model: tiny-qwen3-moe, mode: sft, flags: [--disable-ft],
       sbatch: ["--time=9"]}
phases:
  - {name: pretrain, overrides: {train.train_iters: 8, checkpoint.save_interval: 4}, upload_all: [--interval, "5"]}
  - {name: cooldown, from: pretrain, iteration: ITER, tokens: 3000}
  - {name: export, kind: export}
  - {name: coherence, kind: coherence, args: [--max-tokens, "8"]}
"""


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("PIPELINE_DATA_ROOT", str(tmp_path / "data"))
    return tmp_path


def _plan(tmp_path, iteration):
    p = tmp_path / "c.yaml"
    p.write_text(CHAIN.replace("ITER", str(iteration)))
    exp = spec.load(p, root=ROOT)
    return exp, plan_run(exp, exp.runs[0])


def test_chain_inputs_come_from_the_previous_phase(dirs):
    exp, rp = _plan(dirs, 4)
    runs = dirs / "runs"
    pre, cool, ride, export, coh = (rp.job(n) for n in ("pretrain", "cooldown", "pretrain.upload_all", "export",
                                                         "coherence"))
    assert pre.run_dir == runs / "c.base.pretrain" and pre.iters == 8
    assert f"checkpoint.pretrained_checkpoint={runs}/c.base.pretrain/checkpoints/iter_0000004" in cool.args
    assert cool.iters == 3  # ceil(3000 tokens / (4 x 256 per iteration))
    assert cool.start_iter == 4 and cool.after == "pretrain" and cool.dep_type == "afterok"
    assert export.args[:2] == ["export", str(runs / "c.base.cooldown" / "checkpoints")]
    assert export.args[-2:] == ["--iteration", "3"]
    assert coh.args[0] == str(runs / "c.base.cooldown" / "checkpoints" / "iter_0000003" / "hf")
    assert ride.dep_type == "after" and ride.args[0] == "upload-all" and "--poll" in ride.args
    lines = render_lines(exp, rp)
    text = "\n".join(lines)
    assert lines[0].startswith("# pretrain: submit refuses: dataset.dataset_root")  # no data prepared here
    assert 'JOB_3=$(isambard_sbatch --parsable "--dependency=afterok:${JOB_1%%;*}" --kill-on-invalid-dep=yes ' \
           '--nodes=1 --time=9 ' \
           "pipeline_training_submit.sbatch configs/local/tiny_moe_sft.yaml" in text
    assert "--job-name=checkpoint-c.base.export pipeline_checkpoint_submit.sbatch export " in text
    assert f"mkdir -p {runs}/c.base.pretrain/checkpoints" in text
    assert "--time=04:00:00" not in text  # the experiment's --time replaces the script's own


def test_an_iteration_that_is_never_saved_is_refused(dirs):
    _, rp = _plan(dirs, 6)
    (problem,) = [p for p in rp.problems if p.startswith("cooldown")]
    assert "iteration 6 of phase 'pretrain' is never saved (it saves 4, 8)" in problem
    assert rp.job("export").problems  # nothing downstream of it is planned
