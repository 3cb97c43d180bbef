"""Records only their writer writes (issue 34): the run directory's writer lock, run identity, experiment flags,
readers of the run's records."""

from __future__ import annotations

import os

import pytest

from pipeline.common.errors import UserError
from pipeline.training import records

SLURM = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NODEID", "SLURM_RESTART_COUNT", "SLURMD_NODENAME")


def _claim(run_dir, monkeypatch, **env):
    for k in SLURM:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return records.claim_run_dir(run_dir)


def test_second_launch_in_the_same_salloc_is_refused(tmp_path, monkeypatch):
    # The first training was started in the allocation's shell (or by srun: step 0); a second launch in the same
    # salloc shares the job id but is another training: it used to be taken as "the same writer" and rewrote the
    # live run's launch.json, config.yaml, manifest and events.
    fd = _claim(tmp_path, monkeypatch, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_NODEID="0")
    try:
        for step in ({}, {"SLURM_STEP_ID": "1"}, {"SLURM_STEP_ID": "0"}):  # the shell, another step, the same node
            with pytest.raises(UserError, match=r"is being written by Slurm job 77 step 0 \(pid \d+ \(alive\)"):
                _claim(tmp_path, monkeypatch, SLURM_JOB_ID="77", SLURM_NODEID="0", **step)
        # the same training: another node of the same job step, and the requeued job's next incarnation
        assert _claim(tmp_path, monkeypatch, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_NODEID="1") is None
        assert _claim(tmp_path, monkeypatch, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_NODEID="0",
                      SLURM_RESTART_COUNT="1") is None
        with pytest.raises(UserError, match="one training per run directory"):
            _claim(tmp_path, monkeypatch, SLURM_JOB_ID="78", SLURM_STEP_ID="0", SLURM_NODEID="1")
    finally:
        os.close(fd)
    assert isinstance(_claim(tmp_path, monkeypatch, SLURM_JOB_ID="77"), int)  # released: the next launch writes


def _plan(run_dir, model="tiny-qwen3-moe", mode="sft", allow=False):
    from pipeline.training.launch import LaunchRequest, plan_launch

    return plan_launch(LaunchRequest(config="configs/local/tiny_moe_sft.yaml", model=model, mode=mode, disable_ft=True,
                                     path_checks=False, run_dir=run_dir, allow_config_change=allow,
                                     overrides=(f"checkpoint.save={run_dir / 'checkpoints'}",)))


def _record(plan):
    records.write_launch_records(plan.run_dir, cfg=plan.cfg, spec=plan.spec, mode=plan.request.mode, peft=None,
                                 cluster=plan.cluster, alloc=plan.alloc, nodes=plan.nodes, plan=plan.preflight,
                                 command=["pipeline_training_launch.sh"], launch_cmd=plan.command(), view=plan.view)


def test_run_identity_includes_model_and_mode(tmp_path, monkeypatch):
    # A qwen3 run relaunched as tiny-nemotronh-moe (same config) said "already finished" and rewrote launch.json,
    # or loaded qwen3 weights into NemotronH; another --mode resumed the run as if it were the same one.
    from tests.helpers import ROOT

    monkeypatch.chdir(ROOT)
    run_dir = (tmp_path / "run").resolve()
    _record(_plan(run_dir))
    assert _plan(run_dir).preflight.ok  # the same run relaunching
    for allow in (False, True):  # no weights carry over to another model: refused even with --allow-config-change
        with pytest.raises(UserError, match="holds a run of model 'tiny-qwen3-moe', not 'tiny-nemotronh-moe'"):
            _plan(run_dir, model="tiny-nemotronh-moe", allow=allow)
    with pytest.raises(UserError, match=r"launch.mode: 'sft' -> 'pretrain'"):
        _plan(run_dir, mode="pretrain")
    assert _plan(run_dir, mode="pretrain", allow=True).preflight.ok
    assert records.read_json(run_dir / "launch.json")["model"] == "tiny-qwen3-moe"  # untouched by the refusals


# ---- readers of progress, events and summaries: a line with wrong field types is skipped, as broken JSON is -----
def test_a_progress_line_missing_time_does_not_stop_the_run_finishing(tmp_path):
    # One line without `time`: the end-of-run summary raised KeyError, so training exited 0 without TRAINING_DONE
    # (what upload-all --poll and the requeue chain wait for).
    log = records.ProgressLog(tmp_path, tokens_per_step=10)
    log.log(1, {"loss": 2.0})
    (tmp_path / "progress.ndjson").open("a").write('{"step": 2, "loss": 1.9, "tokens": 20}\n'
                                                   '{"step": 3, "time": "x", "loss": 1.8}\n'
                                                   '{"step": true, "time": 1.0, "loss": 1.7}\n')
    log.log(4, {"loss": 1.5})
    summary = records.finish_completed(tmp_path, None, log, 4, 1.0)
    assert (tmp_path / records.DONE_MARKER).read_text() == "4\n"
    assert [r["step"] for r in log.records()] == [1, 2, 4] and summary["logged_steps"] == 3  # wrong types skipped
    assert summary["first_loss"] == 2.0 and summary["final_loss"] == 1.5


def test_junk_field_types_in_a_runs_records_do_not_crash_status_or_csv(tmp_path, monkeypatch, capsys):
    from pipeline.cli.experiment import main
    from pipeline.experiment import spec
    from pipeline.experiment.plan import plan_experiment
    from tests.helpers import ROOT

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    path = "configs/experiments/tiny_lr_batch_sweep.yaml"
    plans = plan_experiment(spec.load(path), allow_config_change=True)
    run_dir = plans[0].jobs[0].run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "progress.ndjson").write_text('{"step": 1, "time": 0.5, "loss": 3.0, "tokens": 8}\n'
                                             '{"step": 2, "time": "late", "loss": 2.0, "tokens": "many"}\n'
                                             '{"step": 3, "time": 1.5, "loss": [1], "tokens": 24}\n'
                                             '{"step": 4, "time": 2.5, "loss": 2.5, "tokens": 32}\n')
    (run_dir / "events.ndjson").write_text('{"event": "job", "t": 100.0, "submit": 90.0, "start": 95.0}\n'
                                           '{"event": "attempt", "t": 101.0}\n{"event": "ready", "t": 102.0}\n'
                                           '{"event": "step", "t": 103.0, "step": 1, "seconds": "abc"}\n'
                                           '{"event": "step", "t": 1e308, "step": 2, "seconds": 1.0}\n'
                                           '{"event": "step", "t": NaN, "step": 3, "seconds": 1.0}\n'
                                           '{"event": "save", "t": 104.0, "step": "4", "seconds": 1.0}\n'
                                           '{"event": "step", "t": 105.0, "step": 4, "seconds": 1.0}\n')
    (run_dir / "metrics_summary.json").write_text('{"status": 7, "final_step": "abc", "tokens": "x", "train_seconds": '
                                                  '"slow", "tokens_per_second": "fast", "final_loss": "low", '
                                                  '"goodput": "all of it"}')
    assert main(["status", path, "--no-plots"]) == 0
    board = capsys.readouterr().out
    row = next(ln for ln in board.splitlines() if ln.startswith(plans[0].run.label))
    assert " 4/20 " in row and " 2.5000 " in row  # the last good line; the bad ones skipped
    out = tmp_path / "r.csv"
    assert main(["csv", path, "--output", str(out)]) == 0
    first = out.read_text().splitlines()[1].split(",")
    assert first[0] == plans[0].run.label
    (run_dir / "metrics_summary.json").write_text('{"status": "completed", "final_step": 4, "goodput": '
                                                  '{"total_seconds": "long", "goodput": 0.5}}')
    assert main(["csv", path, "--output", str(out)]) == 0


# ---- launcher flags in an experiment file: modelled by the planner or refused ------------------------------------
EXP = """
name: f
base: {config: configs/local/tiny_moe_sft.yaml, model: tiny-qwen3-moe, mode: sft, flags: FLAGS}
grid: {optimizer.lr: [1.0e-3, 2.0e-3]}
"""


@pytest.mark.parametrize("flags, message", [
    ("[--run-dir, /tmp/x]", "--run-dir is not an experiment flag: the experiment names each run's directory"),
    ("[--run-dir=/tmp/x]", "--run-dir is not an experiment flag"),
    ("[--nodes, '2']", "--nodes is not an experiment flag: use base.nodes"),
    ("[--frobnicate]", "'--frobnicate' is not a launcher flag the planner models"),
    ("[--peft, dora]", "--peft 'dora' is not one of: lora"),
    ("[--peft]", "--peft needs a value"),
    ("[--max-restarts, lots]", "--max-restarts 'lots' must be an integer"),
    ("[--disable-ft, --disable-ft]", "--disable-ft is given twice"),
])
def test_experiment_flags_the_planner_does_not_model_are_refused(tmp_path, flags, message):
    # flags: [--run-dir, X] was passed to both jobs of a sweep unplanned: one run directory, the second run failed
    from pipeline.experiment import spec

    p = tmp_path / "f.yaml"
    p.write_text(EXP.replace("FLAGS", flags))
    with pytest.raises(UserError, match=rf"base.flags: {message}") as err:
        spec.load(p)
    assert "\n" not in str(err.value)


def test_experiment_flags_that_are_modelled_reach_the_plan(tmp_path, monkeypatch):
    from pipeline.experiment import spec
    from pipeline.experiment.plan import plan_run
    from tests.helpers import ROOT

    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    p = tmp_path / "f.yaml"
    p.write_text(EXP.replace("FLAGS", "[--disable-ft, --max-restarts, '0', --cluster, local_cpu]"))
    exp = spec.load(p, root=ROOT)
    monkeypatch.chdir(ROOT)
    a, b = (plan_run(exp, r) for r in exp.runs)
    # planned (only the data, which this checkout may not have prepared, can be missing)
    assert all("dataset.dataset_root" in x for x in a.problems + b.problems), (a.problems, b.problems)
    assert a.jobs[0].run_dir is not None and "--max-restarts" in a.jobs[0].args
    assert a.jobs[0].run_dir != b.jobs[0].run_dir  # each run its own directory
    p.write_text(EXP.replace("base: {", "base: {cluster: isambard_gh200, ").replace("FLAGS", "[--cluster, local_cpu]"))
    exp = spec.load(p, root=ROOT)
    assert any("base.cluster 'isambard_gh200' and base.flags --cluster 'local_cpu' differ" in x
               for x in plan_run(exp, exp.runs[0]).problems)


@pytest.mark.parametrize("text, message", [
    ("garbage\n", "holds 'garbage', not an iteration number"),
    ("\xff\xfe", "is unreadable or not text"),
    ("40\n", "names iteration 40, but iter_0000040 does not exist (iterations there: 20)"),
])
def test_a_corrupt_checkpoint_tracker_fails_the_preflight(tmp_path, monkeypatch, text, message):
    # It passed the preflight and then failed in every restart (each start reads it).
    from pipeline.training.launch import LaunchRequest, plan_launch
    from tests.helpers import ROOT

    monkeypatch.chdir(ROOT)
    save = tmp_path / "ckpt"
    req = LaunchRequest(config="configs/local/tiny_moe_sft.yaml", model="tiny-qwen3-moe", mode="sft", disable_ft=True,
                        run_dir=tmp_path / "run", overrides=(f"checkpoint.save={save}",))
    first = plan_launch(req)
    records.claim_save(first.cfg.checkpoint.save, first.run_dir, first.cfg)  # this run's own save, as a launch does
    (save / "iter_0000020").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_bytes(text.encode("latin-1"))
    plan = plan_launch(req)
    assert not plan.preflight.ok
    assert any(p.startswith("checkpoint.save: ") and message in p for p in plan.preflight.problems), \
        plan.preflight.problems
