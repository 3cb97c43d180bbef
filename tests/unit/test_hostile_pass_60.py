"""Findings of the hostile pass of issue 60 (docs/decisions.md, decision 103), each a test that failed (or hung)
before its fix."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from pipeline.common.errors import UserError
from tests.helpers import ROOT


def test_a_fifo_where_a_lock_lives_never_blocks(tmp_path):
    """H2-H4: a FIFO at a bad-node log's .lock, an iteration's export lock or a save's owner lock blocked
    --mark-bad, export/upload-all and the training launch for ever. Each is now refused in one line (the iteration
    lock is reported as held), within the test's bound."""
    from pipeline.checkpoint.lock import Lock, iteration_lock_path
    from pipeline.config.schema import TrainingConfig
    from pipeline.training import records

    log = tmp_path / "bad.log"
    os.mkfifo(f"{log}.lock")
    res = subprocess.run([str(ROOT / "isambard_sbatch"), "--mark-bad", "nid000001", "x"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "BAD_NODES_LOG": str(log)})
    assert res.returncode == 2 and f"{log}.lock" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    lock = iteration_lock_path(tmp_path / "ck", 10)
    lock.parent.mkdir(parents=True)
    os.mkfifo(lock)
    held = Lock(lock, ttl=3600)
    assert held.acquire() is False and held.holder() == "an unknown process"
    save = tmp_path / "save"
    save.mkdir()
    os.mkfifo(save / records.OWNER_LOCK)
    with pytest.raises(UserError, match="is not a regular file"):
        records.claim_save(save, tmp_path / "run", TrainingConfig())


def test_an_iteration_lock_of_another_json_shape_is_an_unknown_holder(tmp_path):
    """T10: an iteration lock holding [1] made export raise AttributeError."""
    from pipeline.checkpoint.lock import Lock

    path = tmp_path / "iter.lock"
    path.write_text("[1]")
    lock = Lock(path, ttl=3600)
    assert lock.holder() == "pid None on None" and lock.acquire() in (True, False)


def test_dry_run_after_the_script_is_refused_not_queued(tmp_path):
    """W4: `isambard_sbatch SCRIPT ... --dry-run` passed --dry-run to the job and really called sbatch."""
    trip = tmp_path / "bin"
    trip.mkdir()
    (trip / "sbatch").write_text(f'#!/bin/sh\ncase "$1" in --help|--usage) exit 0;; esac\ntouch {tmp_path}/queued\n')
    (trip / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{trip}:{os.environ['PATH']}", "BAD_NODES_LOG": str(tmp_path / "bad.log"),
           "PIPELINE_CLUSTER": "local_cpu"}
    res = subprocess.run([str(ROOT / "isambard_sbatch"), "pipeline_training_submit.sbatch",
                          "configs/local/tiny_moe_sft.yaml", "tiny-qwen3-moe", "sft", "--disable-ft", "--dry-run"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 2 and "put it before the script" in res.stderr, res.stderr
    assert not (tmp_path / "queued").exists()


def test_a_forced_export_keeps_a_users_files_in_its_results_folders(tmp_path, tokenizer):
    """D1, D2: export --force deleted a user's file inside hf/eval/ (and hf/coherence/), and over a legacy record
    (weights only) any file named like tokenizer_notes.md or my_helper.py."""
    import json

    from pipeline.checkpoint.export import ExportRequest, export_iteration, hf_output_problem
    from tests.unit.test_export_fidelity import _save_iteration

    it = _save_iteration(tmp_path / "checkpoints", tokenizer, tied=False)
    req = ExportRequest(hf_model="test/llama", reasoning=False, force=True)
    assert export_iteration(it, req)["verdict"] == "PASS"
    hf = it / "hf"
    (hf / "eval").mkdir()
    (hf / "eval" / "pipeline_smoke.json").write_text("{}")  # the evaluation's own results: the export's to replace
    (hf / "coherence").mkdir()
    (hf / "coherence" / "coherence_hf.md").write_text("report")
    assert hf_output_problem(hf) is None
    (hf / "eval" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"\(eval/notes.txt\): refusing to replace it, even with --force"):
        export_iteration(it, req)
    assert (hf / "eval" / "notes.txt").read_text() == "mine"
    (hf / "eval" / "notes.txt").unlink()
    meta = json.loads((hf / "pipeline_export.json").read_text())  # a record of before every file was listed
    meta["weights"] = {k: v for k, v in meta.pop("files").items() if k.endswith(".safetensors")}
    (hf / "pipeline_export.json").write_text(json.dumps(meta))
    assert hf_output_problem(hf) is None  # its config and tokenizer files are the export's
    for name in ("tokenizer_notes.md", "my_helper.py"):
        (hf / name).write_text("mine")
        assert f"({name})" in hf_output_problem(hf)
        (hf / name).unlink()


def test_import_force_keeps_a_users_file_inside_a_megatron_iteration(tmp_path):
    """D3: an iter_0000000 in Megatron's format (metadata.json, common.pt, shards; no marker of ours) holding a
    user's notes.txt: import --force planned OK and deleted it. Megatron's own files (as the megatron_cpu tier's
    checkpoints hold them) are still replaced."""
    from pipeline.common import layout
    from tests.unit.test_issue50_data_loss import _convert

    out = tmp_path / "meg"
    it = layout.iter_dir(out, 0)
    it.mkdir(parents=True)
    for name in ("metadata.json", "common.pt", "__0_0.distcp", ".metadata", "run_config.yaml", "train_state.pt"):
        (it / name).write_bytes(b"{}")
    (it / "tokenizer").mkdir()
    layout.write_tracker(out, 0)
    assert layout.output_folder_problem(out, force=True) is None
    (it / "notes.txt").write_text("mine")
    res = _convert(["import", "smollm2-135m", "--output", str(out), "--force", "--dry-run"])
    assert res.returncode == 2 and "(iter_0000000/notes.txt)" in res.stderr, res.stderr
    assert (it / "notes.txt").read_text() == "mine"


def test_an_evaluation_never_replaces_a_file_that_is_not_its_results(tmp_path, monkeypatch, capsys):
    """D6: a user's file (or a FIFO) at <output-dir>/<tasks>.json was replaced silently; the dry run said OK."""
    from pipeline.cli.evaluation import main as eval_main
    from pipeline.common.io import write_json

    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")
    hf = tmp_path / "hf"
    hf.mkdir()
    write_json(hf / "config.json", {"model_type": "llama"})
    out = tmp_path / "results"
    out.mkdir()
    (out / "pipeline_smoke.json").write_text('{"mine": 1}')
    os.mkfifo(out / "other.json")
    for tasks, name in (("pipeline_smoke", "pipeline_smoke.json"), ("other", "other.json")):
        for force in ([], ["--force"]):
            assert eval_main([str(hf), "--tasks", tasks, "--output-dir", str(out), "--no-wandb", "--dry-run",
                              *force]) == 2
            err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
            assert any(f"{out / name} exists and is not results of this suite" in e for e in err), err
    assert (out / "pipeline_smoke.json").read_text() == '{"mine": 1}'


def test_the_memory_plot_never_replaces_a_fifo_or_device_and_an_unwritable_place_is_one_line(tmp_path, capsys):
    """D5, T8: `profile --plot` onto a FIFO (or, as root, /dev/full) replaced it with a PNG; --plot and --json into
    a read-only folder or /proc were tracebacks."""
    import json
    import stat

    from pipeline.cli.profile import main as profile_main

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"name": "[memory]", "ph": "i", "ts": t, "args": {"Total Allocated": 1000 * t, "Device Type": 0}}
        for t in (1, 2, 3)]}))
    fifo = tmp_path / "plot.png"
    os.mkfifo(fifo)
    assert profile_main([str(trace), "--plot", str(fifo)]) == 2
    assert "is not a regular file" in capsys.readouterr().err and stat.S_ISFIFO(os.stat(fifo).st_mode)
    for bad in (["--plot", "/proc/pipeline-test.png"], ["--no-plot", "--json", "/proc/pipeline-test.json"]):
        assert profile_main([str(trace), *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: cannot "), err
    assert profile_main([str(trace), "--plot", str(tmp_path / "ok.png")]) == 0
    assert (tmp_path / "ok.png").read_bytes()[:4] == b"\x89PNG"


def test_the_suites_own_folders_in_an_import_output_hold_only_its_markers(tmp_path):
    """D4: a Megatron import --force removes its output folder whole, and the check before it skipped everything in
    the suite's own folders (converted_checkpoints/, non_persistent/, ...) and any dot-name ending in .tmp: a user's
    files there were deleted. Now they are named (the import refused); the suite's markers, locks and temporaries
    are still its own."""
    from pipeline.common import layout
    from tests.helpers import megatron_checkpoint
    from tests.unit.test_issue50_data_loss import _convert

    out = megatron_checkpoint(tmp_path / "meg", 0)
    for folder, names in (("converted_checkpoints", ["iter_0000000.done", "iter_0000010.failed"]),
                          ("evaluated_checkpoints", ["iter_0000000.pipeline_smoke.0a1b2c3d4e.done"]),
                          ("in_progress_checkpoints", ["iter_0000000.lock", "iter_0000000.lock.123.stale"]),
                          ("non_persistent", ["iter_0000005"])):
        (out / folder).mkdir()
        for n in names:
            (out / folder / n).write_text("x") if "." in n else (out / folder / n).mkdir()
    (out / ".latest_checkpointed_iteration.txt.host1~42~abcd.tmp").write_text("0")
    assert layout.foreign_entries(out) == [] and layout.output_folder_problem(out, force=True) is None
    (out / "converted_checkpoints" / "my_notes.txt").write_text("mine")
    (out / "non_persistent" / "important.bin").write_text("data")
    (out / ".backup.tmp").write_text("mine")
    assert layout.foreign_entries(out) == [".backup.tmp", "converted_checkpoints/my_notes.txt",
                                           "non_persistent/important.bin"]
    res = _convert(["import", "nano", "--output", str(out), "--force", "--dry-run"])
    assert res.returncode == 2 and "holds files that are not a checkpoint (.backup.tmp, " in res.stderr, res.stderr


def test_sbatchs_array_variable_and_a_missing_script_are_refused(tmp_path, monkeypatch):
    """W2: SBATCH_ARRAY_INX=0-3 (sbatch's variable for --array) got past the --array refusal. W3: the dry run said
    OK (rc 0) for a batch script that does not exist."""
    from pipeline.cli.submission import refuse_placement_options
    from pipeline.common.paths import TRAINING_SUBMIT

    monkeypatch.setenv("SBATCH_ARRAY_INX", "0-3")
    with pytest.raises(UserError, match=r"^--array=0-3 is not supported"):
        refuse_placement_options(str(ROOT / TRAINING_SUBMIT), [])
    res = subprocess.run([str(ROOT / "isambard_sbatch"), "--dry-run", str(tmp_path / "no-such.sbatch")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "BAD_NODES_LOG": str(tmp_path / "bad.log")})
    assert res.returncode == 2 and f"batch script {tmp_path / 'no-such.sbatch'} is not a file here" in res.stderr, \
        res.stderr


def test_upload_all_evaluates_again_when_the_results_behind_its_marker_are_gone(tmp_path, tokenizer, monkeypatch,
                                                                               capsys):
    """S5: upload-all --eval trusted evaluated_checkpoints/*.done after hf/eval/ was deleted: success, no results.
    A real export; lm-eval stubbed as in tests/unit/test_issue50_data_loss.py."""
    import json
    import shutil

    from pipeline.cli.checkpoint import main as convert_main
    from pipeline.evaluation import run as ev
    from tests.unit.test_evaluation import HARNESS
    from tests.unit.test_export_fidelity import _save_iteration

    runs = []
    monkeypatch.setattr(ev, "evaluate", lambda cfg: runs.append(cfg.model) or json.loads(json.dumps(HARNESS)))
    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")
    ckpt = tmp_path / "checkpoints"
    it = _save_iteration(ckpt, tokenizer, tied=False)
    argv = ["upload-all", str(ckpt), "--hf-model", "test/llama", "--no-reasoning", "--eval", "pipeline_smoke"]
    assert convert_main(argv) == 0 and len(runs) == 1
    assert convert_main(argv) == 0 and len(runs) == 1  # evaluated once
    shutil.rmtree(it / "hf" / "eval")
    assert convert_main(argv) == 0 and len(runs) == 2 and (it / "hf" / "eval" / "pipeline_smoke.json").is_file()


def test_a_progress_file_of_blank_lines_keeps_its_records(tmp_path):
    """H1: 4 MiB of blank lines took 20 s to read (every line was parsed as JSON); lines that cannot be a record are
    now skipped before any parse (no timing asserted here: the machine may be busy), and the records among them are
    kept, junk lines skipped."""
    from pipeline.training.records import read_progress

    (tmp_path / "progress.ndjson").write_text("\n" * (4 << 20) + 'junk\n[1]\n{"step": 1, "loss": 2.0}\n  \n')
    assert [r["step"] for r in read_progress(tmp_path)] == [1]


def test_list_and_runs_print_control_characters_escaped(tmp_path, capsys):
    """O1 (in part): `list` printed a swept value's ESC/CR raw, `runs` a run folder's name; each line is now one
    line on a terminal, control characters escaped as render escapes them."""
    from pipeline.cli.experiment import main
    from tests.integration.test_runs_view import make_run

    exp = tmp_path / "e.yaml"
    exp.write_text("name: o1\nbase: {config: configs/local/tiny_moe_sft.yaml, model: tiny-qwen3-moe, mode: sft}\n"
                   'grid:\n  logger.wandb_project: ["a\\x1b[2Kb", "c\\rd"]\n')
    assert main(["list", str(exp)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\\E[2K" in out and "\\r" in out, repr(out)
    make_run(tmp_path / "runs", "evil\x1b]0;title\x07run", 1)
    assert main(["runs", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "evil\\E]0;title\\arun" in out, repr(out)


EXP_T5 = ("name: t5\nbase: {config: configs/local/tiny_moe_sft.yaml, model: tiny-qwen3-moe, mode: sft}\n"
          "grid:\n  optimizer.lr: [1.0e-3, 2.0e-3]\n")


@pytest.fixture
def t5_exp(tmp_path, monkeypatch):
    """A two-run experiment file whose runs and data live under tmp_path."""
    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("PIPELINE_DATA_ROOT", str(tmp_path / "data"))
    exp = tmp_path / "e.yaml"
    exp.write_text(EXP_T5)
    return exp


@pytest.mark.parametrize("body", ["a: " + "[" * 5000 + "]" * 5000 + "\n",  # deeper than the interpreter recurses
                                  "a: " + "[" * 80 + "]" * 80 + "\n",       # past the record depth, within it
                                  "big"])                                   # past the record size
def test_a_deep_or_huge_config_of_record_is_one_line_in_render_status_and_csv(tmp_path, t5_exp, capsys, body):
    """Hostile pass of issue 60, T5: a run folder's config.yaml nested 5000 deep crashed render, status, csv (and
    the launcher's preflight) with RecursionError; a huge one was read whole (MemoryError). Every reader of the
    record goes through yamlio.read_record: a regular file, bounded in size and depth; render names the file."""
    from pipeline.cli.experiment import main
    from pipeline.common import yamlio

    cfg = tmp_path / "runs" / "t5.lr0.001" / "config.yaml"
    cfg.parent.mkdir(parents=True)
    if body == "big":
        with open(cfg, "wb") as f:  # sparse: nothing is written, the size is what counts
            f.truncate(yamlio.RECORD_MAX_BYTES + 1)
    else:
        cfg.write_text(body)
    assert main(["render", str(t5_exp)]) == 0
    out = capsys.readouterr().out
    assert f"submit refuses: {cfg} is unreadable" in out, out[-2000:]
    assert main(["status", str(t5_exp), "--no-plots"]) == 0
    assert "lr0.001" in capsys.readouterr().out
    assert main(["csv", str(t5_exp)]) == 0
    with pytest.raises((OSError, ValueError, __import__("yaml").YAMLError)):
        yamlio.read_record(cfg)


@pytest.mark.parametrize("lock", ["phases: {train: 5}\n", "phases: {train: {kind: train, config: 5}}\n",
                                  "phases: " + "[" * 3000 + "]" * 3000 + "\n"])
def test_a_hand_edited_lock_file_is_one_line(tmp_path, t5_exp, capsys, lock):
    """Hostile pass of issue 60, T6: a lock file edited to `phases: {train: 5}` (or nested deep) crashed render with
    AttributeError (RecursionError); it is now a problem line naming the lock file and the fix."""
    from pipeline.cli.experiment import main

    path = tmp_path / "locks" / "t5" / "lr0.001.lock.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(lock)
    assert main(["render", str(t5_exp)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: lock file {path}") and "re-lock with submit --relock" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_unbounded_readers_are_bounded(tmp_path, monkeypatch):
    """Hostile pass of issue 60, T7/T9: the bad-node log, a run's events.ndjson and a profiler trace were read whole
    (a log linked to a huge file, a gzip bomb inflated into memory) or blocked on a FIFO. Each is a regular file read
    up to a bound, and anything else is one line."""
    import gzip

    from pipeline.cli.profile import main as profile
    from pipeline.slurm.badnodes import LOG_MAX_BYTES, BadNodeLog
    from pipeline.training import goodput, profiling

    log = tmp_path / "bad_nodes.log"
    with open(log, "wb") as f:
        f.truncate(LOG_MAX_BYTES + 1)
    with pytest.raises(UserError, match=r"the bad-node log .* is over 64 MiB, far more than a team's bad nodes"):
        BadNodeLog(log).entries()

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / goodput.EVENTS)  # a FIFO blocked the reader for ever
    with pytest.raises(UserError, match=r"^cannot read .*events.ndjson: not a regular file"):
        goodput.read_events(run)
    assert profile([str(run)]) == 2  # T9: the profile summary of the run is one line, not a traceback

    monkeypatch.setattr(profiling, "TRACE_MAX_BYTES", 1 << 20)
    bomb = tmp_path / "rank-0.json.gz"
    bomb.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * (2 << 20) + b"]}", compresslevel=1))
    assert bomb.stat().st_size < (1 << 20)
    with pytest.raises(UserError, match=r"is not a torch.profiler trace .*inflates past 1 MiB"):
        profiling.load_trace(bomb)
    ok = tmp_path / "rank-1.json.gz"
    ok.write_bytes(gzip.compress(b'{"traceEvents": []}'))
    assert profiling.load_trace(ok).events == []


def test_printed_summaries_logs_and_errors_show_control_characters_escaped(tmp_path, capsys):
    """Hostile pass of issue 60, O1 (the rest): status, the profile summary, the logs (upload-all's among them) and
    `error:` lines printed a file's or a name's ESC sequences and CRs raw; they are shown escaped, newlines kept."""
    import logging

    from pipeline.common.errors import cli_main
    from pipeline.common.log import TerminalSafeFormatter
    from pipeline.common.shell import terminal_lines

    assert terminal_lines("a\x1b[2Kb\rc\nd\te\u202e") == "a\\E[2Kb\\rc\nd\te\\u202e"
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "converted %s", ("it\x1b]0;t\x07",), None)
    assert TerminalSafeFormatter("%(message)s").format(rec) == "converted it\\E]0;t\\a"

    @cli_main
    def fails(argv):
        raise UserError(f"{tmp_path}/\x1b[31mred does not exist")

    assert fails([]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\E[31mred does not exist" in err, repr(err)


def test_the_export_and_upload_all_plans_apply_the_hf_rule_and_name_skipped_iterations(tmp_path, tokenizer, capsys):
    """Hostile pass of issue 60, W5: the dry run of export --force (and of upload-all) said OK for an hf/ holding a
    user's file or linked to a user's folder; the job refused only when it got there. W6: an iteration upload-all
    skips for an old .failed marker was not in its plan. Both are in the plan now."""
    from pipeline.checkpoint.export import ExportRequest, export_iteration
    from pipeline.cli.checkpoint import main
    from tests.unit.test_export_fidelity import _save_iteration

    ckpt = tmp_path / "checkpoints"
    it = _save_iteration(ckpt, tokenizer, tied=False)
    assert export_iteration(it, ExportRequest(hf_model="test/llama", reasoning=False))["verdict"] == "PASS"
    (it / "hf" / "MY_NOTES.md").write_text("mine")
    export = ["export", str(ckpt), "--hf-model", "test/llama", "--no-reasoning", "--dry-run"]
    assert main(export) == 0  # exported and verified: the job skips it, nothing is replaced
    capsys.readouterr()
    assert main([*export, "--force"]) == 2
    err = capsys.readouterr().err
    assert f"error: export output {it / 'hf'} holds files that are not an export of this suite (MY_NOTES.md)" in err
    (it / "hf" / "MY_NOTES.md").unlink()
    mine = tmp_path / "mine"
    mine.mkdir()
    (it / "hf").rename(tmp_path / "old_hf")
    (it / "hf").symlink_to(mine)
    upload = ["upload-all", str(ckpt), "--hf-model", "test/llama", "--no-reasoning", "--dry-run"]
    assert main(upload) == 2
    assert f"error: export output {it / 'hf'} is a link (to {mine})" in capsys.readouterr().err
    (it / "hf").unlink()
    marker = ckpt / "converted_checkpoints" / f"{it.name}.failed"
    marker.parent.mkdir(exist_ok=True)
    marker.write_text(json.dumps({"error": "disk full"}))
    assert main(upload) == 0
    out = capsys.readouterr().out
    assert f"{it.name} is skipped: its conversion failed before (disk full): not retried; remove {marker}" in out, out


def test_a_kernel_filesystem_is_no_place_for_outputs(tmp_path, capsys, monkeypatch):
    """Hostile pass of issue 60, W7: as root, `--output-dir /proc` (or /sys/x) planned OK by the permission bits,
    and the evaluation failed after it had run. /proc, /sys and /dev (/dev/shm aside) are refused by the plan."""
    from pipeline.cli.evaluation import main as eval_main
    from pipeline.common.io import folder_problem, write_json

    assert folder_problem("/proc/results") == "/proc/results is in /proc, a kernel filesystem, not a place for outputs"
    assert folder_problem("/sys") == "/sys is in /sys, a kernel filesystem, not a place for outputs"
    assert folder_problem("/dev/shm/results") is None and folder_problem(tmp_path / "new") is None
    hf = tmp_path / "iter_0000010" / "hf"
    hf.mkdir(parents=True)
    write_json(hf / "config.json", {"model_type": "llama"})
    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")
    assert eval_main([str(hf), "--output-dir", "/proc", "--no-wandb", "--dry-run"]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert errors == ["error: the results folder /proc: /proc is in /proc, a kernel filesystem, not a place for "
                      "outputs (--output-dir names a folder)"], errors


def test_a_dry_run_writes_no_exclude_file(tmp_path, monkeypatch, capsys):
    """Hostile pass of issue 60, O2: `isambard_sbatch --dry-run` with an exclude list past one argument wrote
    logs/slurm/exclude.<pid>.hostlist (a dry run creates nothing); it names the file a submission would pass."""
    from pipeline.cli.sbatch import MAX_EXCLUDE_ARG, render_exclude

    monkeypatch.chdir(tmp_path)
    nodes = [f"n{i}x{i % 7}" for i in range(MAX_EXCLUDE_ARG // 4)]  # names no hostlist range compresses
    value = render_exclude(nodes, write=False)
    assert value == str(tmp_path / "logs" / "slurm" / f"exclude.{os.getpid()}.hostlist")
    assert not (tmp_path / "logs").exists()
    assert "a submission passes them as file" in capsys.readouterr().err
    assert render_exclude(nodes) == value and len((tmp_path / value).read_text()) > MAX_EXCLUDE_ARG
