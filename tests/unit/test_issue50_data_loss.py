"""Issue 50, data loss: outputs never deleted that are not ours, one atomic claim of a checkpoint.save, markers that
go with the results they stand for, evaluations that never replace results of other settings silently.

1. One output-folder rule (``layout.output_folder_problem``) before an import writes or deletes its folder: absent,
   empty, or a checkpoint of ours with --force; a folder holding anything else is refused in one line, even with
   --force, at plan time (the dry run too), before anything is deleted.
2. Two trainings launched at the same moment on one checkpoint.save: the owner record is claimed atomically (read
   again and written under a flock), so exactly one claims it and the other is refused in one line.
3. A new hf/ (export --force) removes upload-all's markers of that iteration with the results they stood for
   (hf/eval/, hf/coherence/): the next upload-all evaluates the new export instead of reporting success.
4. An evaluation never replaces results of the same tasks measured with other settings (limit, few-shot, task
   folders) silently: refused in one line naming the recorded settings, in the job and its plan, unless --force.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest

from pipeline.common import layout
from pipeline.common.errors import UserError
from tests.helpers import run

PY = sys.executable


# ---- 1. the output-folder rule ------------------------------------------------------------------------------
def _ours(folder):
    it = layout.iter_dir(folder, 0)
    it.mkdir(parents=True)
    (it / "model.safetensors").write_bytes(b"x")
    (it / layout.MARKER).write_text('{"engine": "local", "iteration": 0}')
    layout.write_tracker(folder, 0)
    return folder


def test_the_output_folder_rule_absent_empty_ours_or_force_never_foreign(tmp_path):
    rule = layout.output_folder_problem
    assert rule(tmp_path / "absent", force=False) is None
    (tmp_path / "empty").mkdir()
    assert rule(tmp_path / "empty", force=False) is None
    ours = _ours(tmp_path / "ours")
    assert rule(ours, force=False) == f"{ours} already holds a checkpoint; --force to overwrite"
    assert rule(ours, force=True) is None
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    for force in (False, True):  # --force never deletes what is not a checkpoint
        assert rule(user, force=force) == (f"the output {user} holds files that are not a checkpoint (thesis.tex): "
                                           "refusing to write or delete it, even with --force; choose a new or "
                                           "empty folder")
    notes = tmp_path / "D"
    (notes / "iter_0000000").mkdir(parents=True)
    (notes / "iter_0000000" / "notes.txt").write_text("mine")
    for force in (False, True):  # an iter_ folder that holds no checkpoint, no tracker: not ours either
        assert "(iter_0000000/notes.txt)" in rule(notes, force=force)
    (ours / "notes.txt").write_text("mine")  # a checkpoint with a user's file beside it
    assert "(notes.txt)" in rule(ours, force=True)
    (tmp_path / "file").write_text("")
    assert "exists and is not a folder" in rule(tmp_path / "file", force=True)
    with pytest.raises(Exception, match="holds files that are not a checkpoint"):
        layout.check_output_folder(user, force=True)


def _convert(args, env_extra=None):
    env = {**os.environ, "PIPELINE_CLUSTER": "isambard_gh200", **(env_extra or {})}
    return run([PY, "-m", "pipeline.cli.checkpoint", *args], env=env, timeout=300)


def test_an_import_onto_a_users_folder_is_refused_at_plan_time_and_nothing_is_deleted(tmp_path):
    """`import nano --output DIR` on a user's folder planned PASS and the import removed the folder; `import
    smollm2-135m --output D` with D/iter_0000000/notes.txt replaced it without --force; --output set to the shared
    models folder itself planned PASS."""
    user = tmp_path / "U"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    notes = tmp_path / "D"
    (notes / "iter_0000000").mkdir(parents=True)
    (notes / "iter_0000000" / "notes.txt").write_text("mine")
    for args in (["nano", "--output", str(user), "--dry-run", "--nodes", "1"],
                 ["nano", "--output", str(user), "--force", "--dry-run", "--nodes", "1"],
                 ["smollm2-135m", "--output", str(notes), "--dry-run"],
                 ["smollm2-135m", "--output", str(notes)],  # the job itself: refused before the model loads
                 ["smollm2-135m", "--output", str(notes), "--force"]):
        res = _convert(["import", *args])
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error")]
        assert res.returncode == 2 and len(errors) == 1, (args, res.stdout, res.stderr)
        assert "holds files that are not a checkpoint" in errors[0] and "even with --force" in errors[0]
    assert (user / "thesis.tex").read_text() == "years of work"
    assert (notes / "iter_0000000" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["D", "U"]  # nothing staged beside them either

    models = tmp_path / "models"  # the local profile's shared folder: $PIPELINE_MODELS_DIR/megatron_bridges/models
    root = models / "megatron_bridges" / "models"
    root.mkdir(parents=True)
    res = _convert(["import", "nano", "--output", str(root), "--dry-run"],
                   {"PIPELINE_CLUSTER": "local_cpu", "PIPELINE_MODELS_DIR": str(models)})
    assert res.returncode == 2 and f"error: --output {root} is the shared models folder itself" in res.stderr

    ours = _ours(tmp_path / "ours")
    res = _convert(["import", "smollm2-135m", "--output", str(ours), "--dry-run"])
    assert res.returncode == 2 and f"error: {ours} already holds a checkpoint; --force to overwrite" in res.stderr
    res = _convert(["import", "smollm2-135m", "--output", str(ours), "--dry-run", "--force"])
    assert res.returncode == 0, res.stderr


def test_an_export_never_replaces_an_hf_folder_that_is_not_an_export(tmp_path, tokenizer):
    """The same rule for export's own output: an iteration's hf/ holding a user's files (no export records) was
    deleted by the export, --force or not; empty, or holding only results (eval/), it is written as before."""
    from pipeline.checkpoint.export import ExportRequest, export_iteration
    from tests.unit.test_export_fidelity import _save_iteration

    it = _save_iteration(tmp_path / "checkpoints", tokenizer, tied=False)
    (it / "hf").mkdir()
    (it / "hf" / "notes.txt").write_text("mine")
    for force in (False, True):
        with pytest.raises(UserError) as exc:
            export_iteration(it, ExportRequest(hf_model="test/llama", reasoning=False, force=force))
        assert str(exc.value) == (f"export output {it / 'hf'} holds files that are not an export of this suite "
                                  "(notes.txt): refusing to replace it, even with --force; move them away")
    assert (it / "hf" / "notes.txt").read_text() == "mine"
    (it / "hf" / "notes.txt").unlink()
    (it / "hf" / "eval").mkdir()  # results of an export whose files are gone: ours, redone
    assert export_iteration(it, ExportRequest(hf_model="test/llama", reasoning=False))["verdict"] == "PASS"


# ---- 2. one atomic claim of a checkpoint.save -------------------------------------------------------------------
def _claim(records, plan, start, outcome):
    start.wait()  # both threads call the real claim at the same moment
    try:
        records.claim_save(plan.cfg.checkpoint.save, plan.run_dir, plan.cfg)
        outcome[plan.run_dir.name] = "claimed"
    except UserError as exc:
        outcome[plan.run_dir.name] = str(exc)


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "no-flock-across-hosts"])
def test_two_trainings_claiming_one_save_at_once_one_wins_the_other_is_refused(tmp_path, monkeypatch, flock):
    """Both passed the ownership check (neither had written its record yet) and both wrote into the same folder;
    the owner record named only the second. Without the flock (two hosts on a file system where it does not reach)
    the first record's exclusive publish still lets only one claim it."""
    from pipeline.training import records
    from pipeline.training.launch import LaunchRequest, plan_launch
    from tests.helpers import ROOT

    if not flock:
        monkeypatch.setattr(records, "try_flock", lambda path, wait=False: (os.open(os.devnull, os.O_RDONLY), ""))
        monkeypatch.setattr(records, "release", os.close)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    save = tmp_path / "shared"
    plans = [plan_launch(LaunchRequest(config="configs/local/tiny_moe_sft.yaml", model="tiny-qwen3-moe", mode="sft",
                                       overrides=(f"checkpoint.save={save}",), disable_ft=True, path_checks=False,
                                       run_dir=tmp_path / name)) for name in ("a", "b")]  # both pass the check
    for _ in range(20):  # many rounds: a race that passes once by luck must not pass the test
        (save / records.OWNER_FILE).unlink(missing_ok=True)
        start, outcome = threading.Barrier(2), {}

        threads = [threading.Thread(target=_claim, args=(records, p, start, outcome)) for p in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [name for name, o in outcome.items() if o == "claimed"]
        assert len(winners) == 1, outcome
        loser = "b" if winners == ["a"] else "a"
        refusal = outcome[loser]
        assert refusal.startswith(f"checkpoint.save {save.resolve()} belongs to run {tmp_path.resolve() / winners[0]}")
        assert "\n" not in refusal
        owner = records.read_json(save / records.OWNER_FILE)
        assert owner["run_dir"] == str((tmp_path / winners[0]).resolve())
    won = plans[0] if winners == ["a"] else plans[1]  # the winner relaunching (a requeue) claims it again
    assert records.claim_save(won.cfg.checkpoint.save, won.run_dir, won.cfg) == save.resolve() / records.OWNER_FILE


def test_a_claim_on_a_file_system_without_hard_links_still_records_the_owner(tmp_path, monkeypatch):
    from pipeline.config.schema import TrainingConfig
    from pipeline.training import records

    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(records.os, "link", no_links)
    cfg = TrainingConfig()
    assert records.claim_save(tmp_path / "save", tmp_path / "run", cfg) == tmp_path / "save" / records.OWNER_FILE
    assert records.read_json(tmp_path / "save" / records.OWNER_FILE)["run_dir"] == str((tmp_path / "run").resolve())
    assert [p.name for p in (tmp_path / "save").iterdir() if p.name.endswith(".tmp")] == []


# ---- 3. markers go with the results they stand for ------------------------------------------------------------
def test_a_forced_export_removes_the_markers_of_the_results_it_deleted(tmp_path, tokenizer):
    """export --force deleted hf/eval/ and hf/coherence/ while evaluated_checkpoints/*.done stayed: upload-all
    reported success and never evaluated that iteration again."""
    from pipeline.checkpoint import poll
    from pipeline.checkpoint.export import ExportRequest, export_iteration
    from tests.unit.test_export_fidelity import _save_iteration

    ckpt = tmp_path / "checkpoints"
    it = _save_iteration(ckpt, tokenizer, tied=False)
    req = ExportRequest(hf_model="test/llama", reasoning=False, locked=True)  # upload-all's: it holds the lock
    evaluated = []

    def evaluate(iter_path):  # what upload-all --eval writes: the results inside hf/
        evaluated.append(iter_path.name)
        (iter_path / "hf" / "eval").mkdir(exist_ok=True)
        (iter_path / "hf" / "eval" / "pipeline_smoke.json").write_text('{"summary": {}}')
        return {"tasks": {}}

    def upload_all_pass():
        return poll.convert_pending(ckpt, lambda p: export_iteration(p, req), evaluate=evaluate,
                                    eval_key="pipeline_smoke")

    assert upload_all_pass() == ([1], []) and evaluated == ["iter_0000001"]
    (it / "hf" / "coherence").mkdir()
    (it / "hf" / "coherence" / "coherence_hf.json").write_text("{}")
    assert poll.eval_marker(ckpt, 1, "pipeline_smoke", "done").exists()
    assert upload_all_pass() == ([], []) and evaluated == ["iter_0000001"]  # done once: nothing to do

    rec = export_iteration(it, ExportRequest(hf_model="test/llama", reasoning=False, force=True))  # export --force
    assert rec["verdict"] == "PASS"
    assert not (it / "hf" / "eval").exists() and not (it / "hf" / "coherence").exists()
    assert not poll.eval_marker(ckpt, 1, "pipeline_smoke", "done").exists()  # gone with the results it stood for
    assert not list((ckpt / poll.DONE_DIR).iterdir())  # the conversion's (its coherence) too
    assert upload_all_pass() == ([1], []) and evaluated == ["iter_0000001"] * 2  # evaluated again
    assert (it / "hf" / "eval" / "pipeline_smoke.json").is_file()
    assert poll.eval_marker(ckpt, 1, "pipeline_smoke", "done").exists()


# ---- 4. evaluations that know their settings ------------------------------------------------------------------
def test_an_evaluation_with_other_settings_never_replaces_results_silently(tmp_path, monkeypatch, capsys):
    """An evaluation over an earlier one of the same tasks replaced its results silently (limit 2 -> 1)."""
    from pipeline.cli.evaluation import main as eval_main
    from pipeline.common.io import read_json, write_json
    from pipeline.evaluation import run as ev
    from tests.unit.test_evaluation import HARNESS

    hf = tmp_path / "checkpoints" / "iter_0000010" / "hf"
    hf.mkdir(parents=True)
    write_json(hf / "config.json", {"model_type": "llama"})
    runs = []
    monkeypatch.setattr(ev, "evaluate", lambda cfg: runs.append(cfg.limit) or json.loads(json.dumps(HARNESS)))
    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")

    def evaluation(**kw):
        return ev.run(ev.EvalRun(model=str(hf), no_wandb=True, quiet=True, **kw))

    out = hf / "eval" / "pipeline_smoke.json"
    evaluation(limit=2)
    assert read_json(out)["summary"]["limit"] == 2
    for kw in ({"limit": 1}, {"limit": 2, "num_fewshot": 3}):
        with pytest.raises(UserError) as exc:
            evaluation(**kw)
        assert str(exc.value).startswith(f"{out} holds results of pipeline_smoke with limit 2")
        assert "--force to replace them" in str(exc.value) and "\n" not in str(exc.value)
    assert runs == [2] and read_json(out)["summary"]["limit"] == 2  # refused before the model loaded; kept
    # the plan (and its dry run) says so before the job is queued
    assert eval_main([str(hf), "--limit", "1", "--no-wandb", "--dry-run"]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and "holds results of pipeline_smoke with limit 2" in errors[0], errors
    evaluation(limit=2.0)  # the same settings: a rerun replaces its own results
    evaluation(limit=1, force=True)  # --force: replaced, knowingly
    assert runs == [2, 2.0, 1] and read_json(out)["summary"]["limit"] == 1


def test_upload_all_stops_polling_a_training_that_has_failed(tmp_path, caplog):
    """Issue 50 item 11 (hang): upload-all --poll kept polling a training that had written FAILED_NAN ("training
    still running") until Slurm's time limit, holding a GPU node for hours. It converts what is complete and stops,
    finding the training's run directory through the save's owner record (or a record beside the checkpoints)."""
    import json
    import logging
    import threading

    from pipeline.checkpoint.poll import upload_all
    from pipeline.common import layout

    caplog.set_level(logging.INFO)
    run, ckpt = tmp_path / "run", tmp_path / "ck"
    run.mkdir()
    ckpt.mkdir()
    (ckpt / layout.OWNER_FILE).write_text(json.dumps({"run_dir": str(run), "identity": "x", "since": "now"}))
    (run / "FAILED_NAN").write_text("Megatron stopped on a non-finite value at iteration 7\n")
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=upload_all(ckpt, lambda p: {"verdict": "PASS"}, poll=True,
                                                                   interval=0.01)), daemon=True)
    t.start()
    t.join(timeout=60)  # the old poller never returns: the thread would still be alive
    assert not t.is_alive(), "upload-all kept polling a failed training"
    assert result["r"] == ([], [])
    assert "the training has failed" in caplog.text and "FAILED_NAN" in caplog.text
    assert "non-finite value at iteration 7" in caplog.text
