"""Issue 60, items 2-4: --force replaces only what this suite wrote, and an evaluation never replaces another
model's results. Each case ran on main before: the user's file was deleted and never named."""

from __future__ import annotations

import json

import pytest

from pipeline.common import layout
from pipeline.common.errors import UserError
from tests.unit.test_issue50_data_loss import _convert


def test_export_force_never_deletes_a_users_file_beside_a_real_export(tmp_path, tokenizer):
    """Item 2: iter_N/hf/MY_NOTES.md next to an export of ours was removed by export --force (any folder with an
    export record passed). Now only what the record lists, the records and the results (eval/, coherence/) are the
    export's: anything else is named, and kept."""
    from pipeline.checkpoint.export import ExportRequest, export_iteration
    from tests.unit.test_export_fidelity import _save_iteration

    it = _save_iteration(tmp_path / "checkpoints", tokenizer, tied=False)
    req = ExportRequest(hf_model="test/llama", reasoning=False, force=True)
    assert export_iteration(it, req)["verdict"] == "PASS"
    (it / "hf" / "MY_NOTES.md").write_text("mine")
    (it / "hf" / "eval").mkdir()
    with pytest.raises(UserError) as exc:
        export_iteration(it, req)
    assert str(exc.value) == (f"export output {it / 'hf'} holds files that are not an export of this suite "
                              "(MY_NOTES.md): refusing to replace it, even with --force; move them away")
    assert (it / "hf" / "MY_NOTES.md").read_text() == "mine"
    (it / "hf" / "MY_NOTES.md").unlink()
    assert export_iteration(it, req)["verdict"] == "PASS"  # the export alone (and its results): replaced


def test_import_force_never_deletes_a_users_file_inside_an_iteration_of_ours(tmp_path):
    """Item 3: an iter_0000000 holding our marker and a user's notes.txt passed the output-folder rule, and import
    --force deleted the notes. The marker now lists what was written; anything else inside is named and kept, by
    the plan (dry run) and by the job."""
    out = tmp_path / "ours"
    staged = tmp_path / "staged"
    staged.mkdir()
    out.mkdir()
    (staged / "model.safetensors").write_bytes(b"x")
    (staged / "config.json").write_text("{}")
    it = layout.publish_iteration(staged, out, 0, {"engine": "local", "iteration": 0})  # the trainer's own writer
    (it / "hf").mkdir()  # its export: written into the iteration later, ours
    assert layout.output_folder_problem(out, force=True) is None
    (it / "notes.txt").write_text("mine")
    for args in (["--dry-run"], ["--dry-run", "--force"], ["--force"]):
        res = _convert(["import", "smollm2-135m", "--output", str(out), *args])
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error")]
        assert res.returncode == 2 and len(errors) == 1, (args, res.stderr)
        assert "holds files that are not a checkpoint (iter_0000000/notes.txt)" in errors[0], errors
    assert (it / "notes.txt").read_text() == "mine"


def test_an_evaluation_of_another_model_never_replaces_the_first_ones_results(tmp_path, monkeypatch, capsys):
    """Item 4: two models evaluated into one --output-dir with the same settings: the second replaced the first's
    results (the check compared settings, not the model). Refused in one line naming both, by the run before the
    model loads and by the plan; --force replaces; the same model (however its path is spelled) reruns freely.
    lm-eval itself is stubbed as in tests/unit/test_issue50_data_loss.py: what is under test is the rule."""
    from pipeline.cli.evaluation import main as eval_main
    from pipeline.common.io import read_json, write_json
    from pipeline.evaluation import run as ev
    from tests.unit.test_evaluation import HARNESS

    models = []
    for name in ("a", "b"):
        hf = tmp_path / name / "iter_0000010" / "hf"
        hf.mkdir(parents=True)
        write_json(hf / "config.json", {"model_type": "llama"})
        models.append(hf)
    shared = tmp_path / "results"
    runs = []
    monkeypatch.setattr(ev, "evaluate", lambda cfg: runs.append(cfg.model) or json.loads(json.dumps(HARNESS)))
    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")

    def evaluation(model, **kw):
        return ev.run(ev.EvalRun(model=str(model), no_wandb=True, quiet=True, output_dir=shared, limit=2, **kw))

    out = shared / "pipeline_smoke.json"
    evaluation(models[0])
    with pytest.raises(UserError) as exc:
        evaluation(models[1])
    assert str(exc.value) == (f"{out} holds results of pipeline_smoke for another model ({models[0]}); this run "
                              f"evaluates {models[1]}: --force to replace them, or --output-dir for another folder")
    assert runs == [str(models[0])] and read_json(out)["summary"]["model"] == str(models[0])
    assert eval_main([str(models[1]), "--output-dir", str(shared), "--limit", "2", "--no-wandb", "--dry-run"]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and "for another model" in errors[0], errors
    monkeypatch.chdir(tmp_path)
    evaluation("a/iter_0000010/hf")  # the first model again, spelled relative: its own results, rerun
    evaluation(models[1], force=True)
    assert read_json(out)["summary"]["model"] == str(models[1])


def test_upload_all_never_reports_success_for_an_iteration_without_its_export(tmp_path, tokenizer, capsys, caplog):
    """Item 7: a converted_checkpoints/iter_N.done whose hf/ was deleted, or an old .failed marker, gave "converted 0;
    failed none", exit 0. Now a marker whose export is gone is not trusted (converted again), and an iteration an
    earlier failure left without its export is named with why, and fails the run. Real exports (the local engine's
    iteration through upload-all's own entry point)."""
    import logging
    import shutil

    from pipeline.checkpoint import poll
    from pipeline.cli.checkpoint import main as convert_main
    from tests.unit.test_export_fidelity import _save_iteration

    caplog.set_level(logging.INFO)
    ckpt = tmp_path / "checkpoints"
    it = _save_iteration(ckpt, tokenizer, tied=False)
    argv = ["upload-all", str(ckpt), "--hf-model", "test/llama", "--no-reasoning"]
    assert convert_main(argv) == 0 and (it / "hf" / "verification.json").is_file()
    assert "converted 1 iteration(s) [1]; failed none" in capsys.readouterr().out
    shutil.rmtree(it / "hf")  # the marker stays; the export is gone
    assert convert_main(argv) == 0
    assert "converted 1 iteration(s) [1]; failed none" in capsys.readouterr().out
    assert "iter_0000001 is marked converted" in caplog.text and (it / "hf" / "verification.json").is_file()
    # an earlier failure: the marker of a failed conversion, no export
    shutil.rmtree(it / "hf")
    (ckpt / poll.DONE_DIR / "iter_0000001.done").unlink()
    (ckpt / poll.DONE_DIR / "iter_0000001.failed").write_text('{"iteration": 1, "error": "verification FAILED"}')
    caplog.clear()
    assert convert_main(argv) == 1
    assert "converted 0 iteration(s) []; failed [1]" in capsys.readouterr().out
    assert "iter_0000001 has no export: its conversion failed before (verification FAILED): not retried; remove " \
           f"{ckpt / poll.DONE_DIR / 'iter_0000001.failed'} to try again" in caplog.text


def test_a_results_or_import_folder_that_cannot_be_written_is_refused_by_the_plan(tmp_path, capsys, monkeypatch):
    """Item 11: an evaluation with --output-dir a file, and import --output <file>/sub, planned OK and failed only
    after the whole evaluation or the model load. The plan (the dry run, and isambard_sbatch's check) refuses both
    in one line."""
    from pipeline.cli.evaluation import main as eval_main
    from pipeline.common.io import write_json

    hf = tmp_path / "iter_0000010" / "hf"
    hf.mkdir(parents=True)
    write_json(hf / "config.json", {"model_type": "llama"})
    blocker = tmp_path / "results.txt"
    blocker.write_text("mine")
    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")
    assert eval_main([str(hf), "--output-dir", str(blocker), "--no-wandb", "--dry-run"]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert errors == [f"error: the results folder {blocker}: {blocker} is a file, not a folder (--output-dir names a "
                      "folder)"], errors
    res = _convert(["import", "smollm2-135m", "--output", str(blocker / "sub"), "--dry-run"])
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error")]
    assert res.returncode == 2 and errors == [f"error: import output {blocker / 'sub'}: {blocker} is a file, so "
                                              f"{blocker / 'sub'} cannot be created"], res.stderr
    assert blocker.read_text() == "mine"
    res = _convert(["import", "smollm2-135m", "--output", str(tmp_path / "new" / "folder"), "--dry-run"])
    assert res.returncode == 0, res.stderr  # a folder that can be made: planned as before


def test_upload_all_with_new_eval_settings_is_refused_by_its_plan_with_its_own_option(tmp_path, tokenizer, capsys,
                                                                                        monkeypatch):
    """Item 12: upload-all after changing --eval-limit: the dry run said OK, then the job marked every iteration
    .failed and exited 1, advising options upload-all does not have (--force, --output-dir). Now its plan refuses
    in one line naming --eval-force, and --eval-force evaluates again. A real export; lm-eval stubbed as in
    tests/unit/test_issue50_data_loss.py (the rule is under test, not the harness)."""
    from pipeline.cli.checkpoint import main as convert_main
    from pipeline.common.io import read_json
    from pipeline.evaluation import run as ev
    from tests.unit.test_evaluation import HARNESS
    from tests.unit.test_export_fidelity import _save_iteration

    monkeypatch.setattr(ev, "evaluate", lambda cfg: json.loads(json.dumps(HARNESS)))
    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")
    ckpt = tmp_path / "checkpoints"
    it = _save_iteration(ckpt, tokenizer, tied=False)
    base = ["upload-all", str(ckpt), "--hf-model", "test/llama", "--no-reasoning", "--eval", "pipeline_smoke"]
    assert convert_main([*base, "--eval-limit", "2"]) == 0
    results = it / "hf" / "eval" / "pipeline_smoke.json"
    assert read_json(results)["summary"]["limit"] == 2
    capsys.readouterr()
    for extra in (["--dry-run"], []):  # the plan, and the job itself (it plans first)
        assert convert_main([*base, "--eval-limit", "1", *extra]) == 2
        errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
        assert len(errors) == 1 and "1 iteration(s) (iter_0000001) already hold other results" in errors[0], errors
        assert "rerun upload-all with --eval-force to replace them" in errors[0] and "--output-dir" not in errors[0]
    assert not list((ckpt / "evaluated_checkpoints").glob("*.failed"))
    assert convert_main([*base, "--eval-limit", "1", "--eval-force"]) == 0
    assert read_json(results)["summary"]["limit"] == 1


def test_hostile_markers_traces_and_devices_are_one_line_each(tmp_path, caplog, capsys):
    """Item 14 and "Also": upload-all --poll on a FAILED_NAN of blank lines (IndexError), an export onto an hf/ that
    is a link to a user's folder (failed after the whole conversion), a profile trace nested past the interpreter's
    limit and a capture record whose steps is [2] or 5 (tracebacks); --device cuda:00 and non-ASCII digits passed
    the device check, and every CUDA device evaluates in bf16."""
    import argparse
    import logging

    from pipeline.checkpoint.export import hf_output_problem
    from pipeline.checkpoint.poll import upload_all
    from pipeline.cli.evaluation import device_arg
    from pipeline.evaluation.run import model_dtype

    caplog.set_level(logging.INFO)
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (tmp_path / "FAILED_NAN").write_text("\n\n   \n")
    assert upload_all(ckpt, lambda p: {}, poll=True, interval=0.01) == ([], [])
    assert "the training has failed" in caplog.text
    user = tmp_path / "user"
    user.mkdir()
    (tmp_path / "it").mkdir()
    (tmp_path / "it" / "hf").symlink_to(user)
    assert hf_output_problem(tmp_path / "it" / "hf") == (f"export output {tmp_path / 'it' / 'hf'} is a link (to {user}):"
                                                          " move it away; the export writes a folder there")
    from pipeline.cli.profile import main as profile_main

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    assert profile_main([str(deep), "--no-plot"]) == 2
    assert "is not a torch.profiler trace" in capsys.readouterr().err
    # a run whose capture record names a real trace, with steps of another shape
    import gzip

    from pipeline.training import goodput, records

    trace = tmp_path / "rank-0.json.gz"
    with gzip.open(trace, "wt") as f:
        f.write('{"traceEvents": []}')
    for steps in ([2], 5):
        run_dir = tmp_path / f"run{steps}"
        run_dir.mkdir()
        (run_dir / goodput.EVENTS).write_text(json.dumps({"event": records.PROFILE_EVENT, "t": 1, "rank": 0,
                                                          "trace": str(trace), "steps": steps}) + "\n")
        assert profile_main([str(run_dir), "--no-plot"]) == 0, capsys.readouterr().err
    for bad in ("cuda:00", "cuda:\u0661", "cuda:01", "gpu"):
        with pytest.raises(argparse.ArgumentTypeError):
            device_arg(bad)
    assert device_arg("cuda:0") == "cuda:0" and device_arg("cuda:12") == "cuda:12"
    assert model_dtype("cuda:0") == model_dtype("cuda") == "bfloat16" and model_dtype("cpu") == "float32"
