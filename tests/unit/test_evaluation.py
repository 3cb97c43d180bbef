"""Issue 35, evaluation: upload-all's evaluation of every converted iteration (once, under the conversion's lock;
a killed evaluation redone; a failed one marked and not retried), the harness result's summary (the headline metric
per task, every metric), the results on the experiment board, in the CSV columns and the per-run plot, and the
options' one-line refusals. Nothing here loads a model or the harness (tests/integration/test_evaluation_cli.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from pipeline.checkpoint.poll import convert_pending, eval_marker, upload_all
from pipeline.common import layout
from pipeline.common.errors import UserError
from pipeline.common.io import write_json
from pipeline.evaluation.run import EvalRun, headline, read_results, summarize
from pipeline.evaluation.tasks import parse_tasks, results_name

HARNESS = {"results": {"pipeline_smoke": {"alias": "pipeline_smoke", "acc,none": 0.5, "acc_stderr,none": 0.25,
                                          "acc_norm,none": 0.75, "acc_norm_stderr,none": 0.2}},
           "n-samples": {"pipeline_smoke": {"original": 24, "effective": 4}}, "lm_eval_version": "0.4.13"}


def _ckpt(tmp_path, iterations=(10, 20)):
    ckpt = tmp_path / "checkpoints"
    for it in iterations:
        import torch
        from safetensors.torch import save_file

        d = layout.iter_dir(ckpt, it)  # a complete local-engine iteration, as far as the poller reads one
        (d / "hf").mkdir(parents=True)
        write_json(d / layout.MARKER, {"engine": "local", "iteration": it})
        write_json(d / "config.json", {"model_type": "llama"})
        save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
        layout.write_tracker(ckpt, it)
    return ckpt


def _write_result(iter_path, value: float):
    cfg = EvalRun(model=str(iter_path / "hf"))
    res = json.loads(json.dumps(HARNESS))
    res["results"]["pipeline_smoke"]["acc,none"] = value
    write_json(cfg.out_file, {"harness": res, "summary": summarize(res, cfg, 1.0)})
    return {"ok": True}


def test_every_converted_iteration_is_evaluated_once_after_it_converts(tmp_path):
    ckpt = _ckpt(tmp_path)
    order = []

    def convert(p):
        order.append(("convert", p.name))
        return {"verdict": "PASS"}

    def evaluate(p):
        assert (ckpt / "converted_checkpoints" / f"{p.name}.done").exists()  # after its export verified
        order.append(("eval", p.name))
        return _write_result(p, 0.25 * len(order))

    assert convert_pending(ckpt, convert, evaluate=evaluate, eval_key="pipeline_smoke") == ([10, 20], [])
    assert order == [("convert", "iter_0000010"), ("eval", "iter_0000010"), ("convert", "iter_0000020"),
                     ("eval", "iter_0000020")]
    assert eval_marker(ckpt, 20, "pipeline_smoke", "done").is_file()
    assert convert_pending(ckpt, convert, evaluate=evaluate, eval_key="pipeline_smoke") == ([], [])
    assert len(order) == 4  # once
    # an iteration converted before --eval was asked for is evaluated by the next pass, without a re-export
    other = []
    convert_pending(ckpt, convert, evaluate=lambda p: other.append(p.name) or {}, eval_key="hellaswag")
    assert other == ["iter_0000010", "iter_0000020"] and len(order) == 4
    assert [r["iteration"] for r in read_results(ckpt)] == [10, 20]


def test_a_killed_evaluation_is_redone_and_a_failed_one_is_marked(tmp_path):
    ckpt = _ckpt(tmp_path, (10,))
    convert_pending(ckpt, lambda p: {"verdict": "PASS"})  # converted, not evaluated
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = ckpt / "in_progress_checkpoints" / "iter_0000010.lock"  # the lock a killed evaluation left behind
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "time": 0}))
    ran = []
    assert convert_pending(ckpt, lambda p: pytest.fail("converted twice"),
                           evaluate=lambda p: ran.append(p.name) or _write_result(p, 0.5)) == ([], [])
    assert ran == ["iter_0000010"] and not lock.exists()
    # a live holder (this process, as another poller would be) is left alone
    ckpt2 = _ckpt(tmp_path / "b", (10,))
    convert_pending(ckpt2, lambda p: {"verdict": "PASS"})
    held = ckpt2 / "in_progress_checkpoints" / "iter_0000010.lock"
    held.parent.mkdir(parents=True, exist_ok=True)
    held.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": 9e12}))
    assert convert_pending(ckpt2, lambda p: {}, evaluate=lambda p: pytest.fail("evaluated under a live lock")) == \
        ([], [])
    held.unlink()

    def boom(p):
        raise RuntimeError("CUDA out of memory")

    assert convert_pending(ckpt2, lambda p: {}, evaluate=boom) == ([], [10])
    failed = json.loads(eval_marker(ckpt2, 10, "eval", "failed").read_text())
    assert failed["error"] == "CUDA out of memory"
    assert convert_pending(ckpt2, lambda p: {}, evaluate=boom) == ([], [])  # not retried automatically


def test_upload_all_poll_evaluates_until_training_ends(tmp_path):
    ckpt = _ckpt(tmp_path)
    (ckpt / layout.TRAINING_DONE).write_text("done\n")
    conv, failed = upload_all(ckpt, lambda p: {"verdict": "PASS"}, poll=True, interval=0.01,
                              evaluate=lambda p: _write_result(p, 0.5), eval_key="pipeline_smoke")
    assert conv == [10, 20] and failed == []
    assert sorted(p.name for p in (ckpt / "evaluated_checkpoints").iterdir()) == \
        ["iter_0000010.pipeline_smoke.done", "iter_0000020.pipeline_smoke.done"]


def test_the_summary_keeps_every_metric_and_a_headline_per_task(tmp_path):
    cfg = EvalRun(model=str(tmp_path / "ck" / "iter_0000040" / "hf"), limit=4)
    s = summarize(HARNESS, cfg, 2.0)
    assert s["iteration"] == 40 and s["metrics"] == {"pipeline_smoke/acc": 0.5, "pipeline_smoke/acc_norm": 0.75}
    assert s["tasks"]["pipeline_smoke"] == {"metric": "acc", "value": 0.5, "stderr": 0.25, "samples": 4}
    assert headline({"exact_match,strict-match": 0.1, "exact_match_stderr,strict-match": 0.01}) == \
        ("exact_match", 0.1, 0.01)
    assert headline({"alias": "x"}) is None
    assert cfg.out_file == tmp_path / "ck" / "iter_0000040" / "hf" / "eval" / "pipeline_smoke.json"
    assert results_name(parse_tasks("arc_easy, hellaswag,arc_easy")) == "arc_easy+hellaswag.json"


@pytest.mark.parametrize("kw, needle", [
    ({"tasks": "a,,b"}, "give task names separated by commas"),
    ({"tasks": "../etc"}, "is not a task name"),
    ({"limit": 0.0}, "--limit 0.0 must be"),
    ({"limit": 2.5}, "--limit 2.5 must be"),
    ({"limit": float("nan")}, "--limit nan must be"),
    ({"batch_size": 0}, "--batch-size 0 must be"),
    ({"num_fewshot": -1}, "--num-fewshot -1 must be"),
])
def test_bad_options_are_one_line(kw, needle):
    with pytest.raises(UserError, match=None) as exc:
        EvalRun(model="m", **kw).check()
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_the_board_csv_and_plot_show_each_runs_evaluations(tmp_path, monkeypatch):
    from pipeline.experiment import plots, status
    from pipeline.experiment.plan import Job, RunPlan
    from pipeline.experiment.spec import Run

    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    ckpt = _ckpt(tmp_path)
    for it, v in ((10, 0.25), (20, 0.5)):
        _write_result(layout.iter_dir(ckpt, it), v)
    rp = RunPlan(run=Run(label="base", overrides={}, values={}),
                 jobs=[Job(phase="train", kind="train", script="s", args=[], sbatch=[], save=ckpt, start_iter=100)])
    evals = status.run_evals(rp)
    assert [(e["iteration"], e["step"], e["tasks"]["pipeline_smoke"]["value"]) for e in evals] == \
        [(10, 110, 0.25), (20, 120, 0.5)]
    st = status.RunStatus(label="base", rows=[], verdict="done", evals=evals)
    line = status.eval_line(evals)
    assert line == "eval (latest, train iter 20): pipeline_smoke acc 0.5000 (2 iteration(s) evaluated)"
    assert status.eval_columns([st]) == ["eval_iteration", "eval_pipeline_smoke_acc", "eval_pipeline_smoke_acc_norm"]
    row = status.result_row(rp, st)
    assert row["eval_iteration"] == 20 and row["eval_pipeline_smoke_acc"] == 0.5

    class Exp:
        name, path = "e", tmp_path / "e.yaml"

    written = plots.write_eval_plots(Exp(), [st])
    png = written["base:eval"]
    assert png == tmp_path / "runs" / "_experiments" / "e" / "eval" / "base.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    board = status.board(Exp(), [st], written)
    assert f"  {line}; eval plot {png}" in board


def test_the_login_planner_without_lm_eval_leaves_the_tasks_to_the_job(monkeypatch, tmp_path):
    """isambard_sbatch's check in the login node's planner (no lm-eval there: requirements/planner.txt) plans the
    job and says the tasks are checked when it starts; it used to fail with an ImportError traceback."""
    from pipeline.evaluation import plan as eval_plan
    from pipeline.evaluation import tasks

    monkeypatch.setattr(tasks, "harness_installed", lambda: False)
    monkeypatch.setattr(eval_plan, "harness_installed", lambda: False)
    monkeypatch.setenv("PIPELINE_BINDS", str(tmp_path))
    (tmp_path / "hf").mkdir()
    plan = eval_plan.plan_evaluate(EvalRun(model=str(tmp_path / "hf"), tasks="hellaswag"))
    assert plan.ok, plan.problems
    assert any("the job checks that its tasks' data is reachable" in n for n in plan.notes)


@pytest.mark.parametrize("device", ["gpu0", "bogus", "cuda0", "cpu:1", ""])
def test_a_device_that_is_not_one_is_refused_at_parse_time(device):
    """Issue 50 item 10: --device gpu0 or bogus ran the evaluation on the CPU and exited 0."""
    from pipeline.cli.evaluation import build_parser

    with pytest.raises(UserError, match="argument --device: .* is not a device: use cpu, cuda or cuda:N"):
        build_parser().parse_args(["/m", "--device", device])  # the shared parser: one line, exit 2


def test_cuda_without_a_cuda_device_is_one_line_before_the_model_loads(monkeypatch):
    """Issue 50 item 12: --device cuda on a machine without CUDA was a traceback from inside the model load."""
    import torch

    from pipeline.cli.evaluation import build_parser
    from pipeline.evaluation.run import _device

    assert build_parser().parse_args(["/m", "--device", "cuda:1"]).device == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"--device cuda: torch sees 0 CUDA device\(s\) here; use --device cpu"):
        _device(EvalRun(model="m", device="cuda"))
    assert _device(EvalRun(model="m", device="cpu")) == "cpu"


@pytest.mark.parametrize("device,dtype", [("cuda", "bfloat16"), ("cuda:1", "bfloat16"), ("cuda:3", "bfloat16"),
                                          ("cpu", "float32")])
def test_every_cuda_device_loads_the_model_in_bf16(monkeypatch, device, dtype):
    """Issue 58 item 4: --device cuda:N loaded the model in fp32 (only "cuda" got bf16): Nano's 31.6B parameters are
    126 GB in fp32, more than one GPU holds. The dtype evaluate() hands lm-eval's HFLM, read at the call (the model
    itself needs the device: the call is stopped there)."""
    import lm_eval.models.huggingface as hf

    from pipeline.evaluation import run as eval_run

    seen = {}

    def hflm(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop: the model would load here")

    monkeypatch.setattr(eval_run, "_device", lambda cfg: device)
    monkeypatch.setattr(hf, "HFLM", hflm)
    with pytest.raises(RuntimeError, match="stop: the model would load here"):
        eval_run.evaluate(EvalRun(model="m", tasks="hellaswag", device=device))
    assert seen["dtype"] == dtype and seen["device"] == device


def test_upload_alls_marker_key_holds_every_setting_that_changes_a_result():
    """Issue 50 item 7: the evaluation marker's key was the task list only, so a rerun with another limit or few-shot
    evaluated nothing; it holds a digest of every setting now, and the same settings give the same key."""
    a = EvalRun(model="m1", tasks="pipeline_smoke", limit=2)
    assert a.marker_key() == EvalRun(model="m2", tasks="pipeline_smoke", limit=2).marker_key()
    assert a.marker_key().startswith("pipeline_smoke.")
    assert len({a.marker_key(), EvalRun(model="m", tasks="pipeline_smoke", limit=1).marker_key(),
                EvalRun(model="m", tasks="pipeline_smoke", limit=2, num_fewshot=3).marker_key()}) == 3


def test_upload_all_checks_the_evaluation_settings_before_any_export(tmp_path, capsys):
    """Issue 50 items 7 and 12: a bad --eval-limit (1e20) marked every iteration .failed, the corrected rerun then
    evaluated nothing, and the error named --limit where the user typed --eval-limit. Now it is one line, exit 2,
    before anything is converted or marked."""
    from pipeline.cli.checkpoint import main as convert_main

    ckpt = tmp_path / "ck"
    (layout.iter_dir(ckpt, 2)).mkdir(parents=True)
    layout.write_tracker(ckpt, 2)
    rc = convert_main(["upload-all", str(ckpt), "--hf-model", "m/x", "--no-reasoning", "--eval", "pipeline_smoke",
                       "--eval-limit", "1e20"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --eval-limit 1e+20 must be a whole number"), err
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
