"""Chain planning without Slurm: each phase's inputs come from the previous phase's planned outputs, the lines are
chained with afterok, a dependent export/coherence runs its own submit script (its inputs checked in the job), a named
iteration that is never saved is refused, and a cooldown continues the phase before it (optimizer, schedule and
iteration count; issue 33) unless it says init: weights."""

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
  - {name: cooldown, from: pretrain, iteration: ITER, tokens: 3000INIT}
  - {name: export, kind: export}
  - {name: coherence, kind: coherence, args: [--max-tokens, "8"]}
"""


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("PIPELINE_DATA_ROOT", str(tmp_path / "data"))
    return tmp_path


def _plan(tmp_path, iteration, init=""):
    p = tmp_path / "c.yaml"
    p.write_text(CHAIN.replace("ITER", str(iteration)).replace("INIT", init))
    exp = spec.load(p, root=ROOT)
    return exp, plan_run(exp, exp.runs[0])


def test_chain_inputs_come_from_the_previous_phase(dirs):
    exp, rp = _plan(dirs, 4)
    runs = dirs / "runs"
    pre, cool, ride, export, coh = (rp.job(n) for n in ("pretrain", "cooldown", "pretrain.upload_all", "export",
                                                         "coherence"))
    assert pre.run_dir == runs / "c.base.pretrain" and pre.iters == 8
    # the default: the cooldown continues the pretrain's iteration 4 (Bridge's checkpoint.load + ckpt_step), its
    # own iterations counting on from there: ceil(3000 tokens / (4 x 256 per iteration)) = 3 -> 5, 6, 7
    assert f"checkpoint.load={runs}/c.base.pretrain/checkpoints" in cool.args
    assert "checkpoint.ckpt_step=4" in cool.args and not any("pretrained_checkpoint" in a for a in cool.args)
    assert cool.iters == 7 and cool.continues == 4 and cool.start_iter == 0
    assert cool.cfg["checkpoint"]["save"] == str(runs / "c.base.cooldown" / "checkpoints")  # its own save
    assert cool.cfg["scheduler"]["override_opt_param_scheduler"] is True  # the cooldown's schedule, not the ckpt's
    assert cool.after == "pretrain" and cool.dep_type == "afterok"
    assert export.args[:2] == ["export", str(runs / "c.base.cooldown" / "checkpoints")]
    assert export.args[-2:] == ["--iteration", "7"]
    assert coh.args[0] == str(runs / "c.base.cooldown" / "checkpoints" / "iter_0000007" / "hf")
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


def test_init_weights_starts_from_the_weights_only(dirs):
    _, rp = _plan(dirs, 4, init=", init: weights")
    runs, cool = dirs / "runs", rp.job("cooldown")
    assert f"checkpoint.pretrained_checkpoint={runs}/c.base.pretrain/checkpoints/iter_0000004" in cool.args
    assert not any(a.startswith(("checkpoint.load=", "checkpoint.ckpt_step=")) for a in cool.args)
    assert cool.iters == 3 and cool.continues is None and cool.start_iter == 4  # iterations 1..3, plotted after 4
    assert rp.job("export").args[-2:] == ["--iteration", "3"]


def test_a_continuing_phase_saves_and_counts_after_the_iteration_it_continues(dirs):
    p = dirs / "c.yaml"
    p.write_text(CHAIN.replace("iteration: ITER, tokens: 3000INIT",
                               "iteration: 8, overrides: {train.train_iters: 16, checkpoint.save_interval: 3}"))
    exp = spec.load(p, root=ROOT)
    cool = plan_run(exp, exp.runs[0]).job("cooldown")
    assert cool.saved_iterations() == [9, 12, 15, 16]  # Megatron saves when the global iteration divides
    p.write_text(CHAIN.replace("iteration: ITER, tokens: 3000INIT", "overrides: {train.train_iters: 8}"))
    exp = spec.load(p, root=ROOT)
    (problem,) = [x for x in plan_run(exp, exp.runs[0]).problems if x.startswith("cooldown")]
    assert "train.train_iters=8 is not past iteration 8 of phase 'pretrain'" in problem and "tokens:" in problem
    for bad, says in (("init: resume", "init must be one of continue, weights"),):
        p.write_text(CHAIN.replace("ITER", "last").replace("tokens: 3000INIT", f"tokens: 3000, {bad}"))
        with pytest.raises(spec.UserError, match=says):
            spec.load(p, root=ROOT)


SUPER_CHAIN = """
name: super_chain
base: {config: configs/quickstart/nemotron_super_quickstart_sft.yaml, model: super, mode: sft, nodes: 16,
       overrides: {checkpoint.save: SAVE}}
phases:
  - {name: sft, overrides: {train.train_iters: 20}, upload_all: [--interval, "60"]}
  - {name: export, kind: export}
"""


def test_a_chains_export_and_upload_all_are_planned_before_anything_is_queued(dirs, monkeypatch, capsys):
    """Issue 49 item 2: the experiment's preflight plans every job of a chain as isambard_sbatch will plan it when
    it is queued. Super's export and upload-all need --not-strict (MTP layers); before, render showed them as
    submittable and submit queued the training, then isambard_sbatch refused the upload-all."""
    from pipeline.cli.experiment import main

    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    monkeypatch.setenv("PIPELINE_BINDS", str(dirs))
    p = dirs / "super.yaml"
    p.write_text(SUPER_CHAIN.replace("SAVE", str(dirs / "ck")))
    assert main(["render", str(p), "--no-configs"]) == 0
    out = capsys.readouterr().out
    for phase in ("sft.upload_all", "export"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"# {phase}: submit refuses: "))
        assert "has MTP layers" in line and line.endswith("add --not-strict"), line
    assert main(["submit", str(p)]) == 2  # nothing is queued: no Slurm is needed to refuse it
    err = capsys.readouterr().err
    assert "export: nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 has MTP layers" in err
    assert "nothing was submitted" in err and "job " not in capsys.readouterr().out



def test_upload_all_of_a_phase_that_saves_nothing_is_refused_not_rendered_with_none(dirs, monkeypatch):
    """Issue 49 item 9: with checkpoint.save null (the Nano quickstart's), render printed 'upload-all None'."""
    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    p = dirs / "nano.yaml"
    p.write_text("""
name: nano_chain
base: {config: configs/quickstart/nemotron_nano_quickstart_sft.yaml, model: nano, mode: sft, nodes: 16,
       flags: [--disable-ft]}
phases:
  - {name: sft, overrides: {train.train_iters: 20}, upload_all: [--interval, "60"]}
""")
    exp = spec.load(p, root=ROOT)
    rp = plan_run(exp, exp.runs[0])
    up = rp.job("sft.upload_all")
    assert up is not None and up.args == [] and any("checkpoint.save is null" in q for q in up.problems), up
    assert not any("upload-all None" in line for line in render_lines(exp, rp))


def test_render_shows_a_run_that_drifted_from_its_lock(dirs, capsys):
    """Issue 49 item 9: a run whose lock differs from the experiment file was refused by submit, but render showed
    its lines as submittable and said nothing."""
    from pipeline.cli.experiment import main
    from pipeline.experiment import locks

    exp, rp = _plan(dirs, 4)
    locks.write(exp, rp)
    p = dirs / "c.yaml"
    p.write_text(p.read_text().replace("train.train_iters: 8", "train.train_iters: 12"))
    assert main(["render", str(p), "--no-configs"]) == 0
    out = capsys.readouterr().out
    assert "# base: submit refuses: differs from its lock" in out and "pretrain:train.train_iters: 8 -> 12" in out
    assert "problem(s): submit would refuse" in out


def test_the_node_count_is_a_sweep_axis(dirs):
    """Issue 49 item 4: grid: {nodes: [1, 2]} listed two runs, then render said "unknown key 'nodes'". The node
    count is a run's own: its label, its plan and its --nodes."""
    p = dirs / "n.yaml"
    text = """
name: n
base: {config: configs/local/tiny_moe_sft.yaml, model: tiny-qwen3-moe, mode: sft, flags: [--disable-ft]}
grid: {nodes: NODES, optimizer.lr: [1.0e-3]}
"""
    p.write_text(text.replace("NODES", "[1, 2]"))
    exp = spec.load(p, root=ROOT)
    assert [(r.label, r.nodes) for r in exp.runs] == [("nodes1_lr0.001", 1), ("nodes2_lr0.001", 2)]
    assert all("nodes" not in r.overrides for r in exp.runs)
    for run, n in zip(exp.runs, (1, 2), strict=True):
        rp = plan_run(exp, run)
        job = rp.job("train")
        assert f"--nodes={n}" in job.sbatch and not any("unknown key" in q for q in job.problems), job
    for bad in ("[0]", "[2.5]", "[]", "[true]", "8"):
        p.write_text(text.replace("NODES", bad))
        with pytest.raises(spec.UserError, match="the node axis is a non-empty list of positive integers"):
            spec.load(p, root=ROOT)


def test_the_dependency_is_set_by_position_not_by_a_text_search(dirs):
    """Hostile pass of issue 60, S4: render put the chain's dependency in by replacing the text
    `--dependency=afterok:DEP` wherever it stood, so a user's sbatch option holding that text
    (`--comment=--dependency=afterok:DEP`) was rewritten into a shell expansion. Only the dependency option is."""
    p = dirs / "c.yaml"
    p.write_text(CHAIN.replace('sbatch: ["--time=9"]', 'sbatch: ["--time=9", "--comment=--dependency=afterok:DEP"]')
                 .replace("ITER", "last").replace("INIT", ""))
    exp = spec.load(p, root=ROOT)
    lines = [x for x in render_lines(exp, plan_run(exp, exp.runs[0])) if x.endswith("# cooldown")]
    assert len(lines) == 1 and lines[0].startswith('JOB_3=$(isambard_sbatch --parsable "--dependency=afterok:'
                                                   '${JOB_1%%;*}" --kill-on-invalid-dep=yes '), lines
    assert " --comment=--dependency=afterok:DEP " in lines[0] and lines[0].count("${JOB_") == 1, lines[0]
