"""The end-of-job decisions of pipeline_training_submit.sbatch (src/pipeline/slurm/requeue.py), branch by branch,
and the line protocol the sbatch file reads."""

import subprocess

import pytest

from pipeline.common.errors import UserError
from pipeline.slurm.requeue import (
    Decision,
    JobEnd,
    carry_out,
    decide,
    finish,
    job_log_path,
    main,
    start,
    submit_successor,
)
from tests.helpers import ROOT

RESUME = "isambard_sbatch --nodes=2 pipeline_training_submit.sbatch c.yaml nano sft"


@pytest.mark.parametrize("end,exit_code,cancel,requeue,says", [
    # the training step failed, nothing saved: its exit code is the job's
    (JobEnd(exit_code=1, restart_count=0, max_requeues=3), 1, False, False, None),
    (JobEnd(exit_code=0, restart_count=0, max_requeues=3), 0, False, False, None),
    # checkpointed before the limit, budget left: requeue
    (JobEnd(0, 1, 3, saved=True, job="42"), 0, False, True, "requeueing job 42 (restart 2 of 3)"),
    # budget spent: FAILED (exit 3) with the command that continues
    (JobEnd(0, 3, 3, saved=True, resume_command=RESUME), 3, False, False, f"is used up; continue with the same "
                                                                           f"submission (it resumes from the checkpoint): {RESUME}"),
    (JobEnd(0, 0, 0, saved=True, resume_command=RESUME), 3, False, False, "PIPELINE_MAX_REQUEUES=0 is used up"),
    # an auto-requeue chain: the successor resumes; no requeue of this job
    (JobEnd(0, 0, 3, saved=True, successor="43"), 0, False, False, "the auto-requeue successor 43 resumes from it"),
    # the run finished: the successor is cancelled (also when the training step's exit code is not 0)
    (JobEnd(0, 0, 3, finished=True, successor="43"), 0, True, False, "cancelling successor 43"),
    (JobEnd(7, 0, 3, finished=True, successor="43"), 7, True, False, "cancelling successor 43"),
    (JobEnd(0, 0, 3, saved=True, finished=True, successor="43"), 0, True, False, "cancelling successor 43"),
])
def test_decisions(end, exit_code, cancel, requeue, says):
    d = decide(end)
    assert (d.exit_code, d.cancel_successor, d.requeue) == (exit_code, cancel, requeue)
    text = " ".join(m for _, m in d.messages)
    assert (says in text) if says else not d.messages, text


def test_line_protocol_reads_the_job_log(tmp_path, capsys):
    log = tmp_path / "job.out"
    log.write_text("step 10\n[after training is done] datetime: 2026-11-30 12:00:00\n")
    assert main(["--job", "42", "--exit-code", "0", "--max-requeues", "3", "--successor", "43",
                 "--log-file", str(log)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "info\tauto-requeue: training has finished; cancelling successor 43", "cancel\t43", "exit\t0"]
    log.write_text("step 10\n")  # not finished: the successor stays
    assert main(["--exit-code", "0", "--max-requeues", "3", "--successor", "43", "--log-file", str(log)]) == 0
    assert capsys.readouterr().out.splitlines() == ["exit\t0"]
    assert main(["--exit-code", "0", "--max-requeues", "3", "--successor", "43", "--log-file", str(log),
                 "--stop-regex", "(unclosed"]) == 2
    assert "is not a regular expression" in capsys.readouterr().err


# --- the job's side: the Slurm commands go through a runner, recorded here --------------------------------------

SUBMISSION = ["c.yaml", "nano", "sft", "--disable-ft", "train.train_iters=200"]


class Runner:
    """Answers each command by its first words and records every argv it was given."""

    def __init__(self, answers: dict[tuple[str, ...], tuple[int, str, str]]):
        self.answers, self.calls = answers, []

    def __call__(self, argv):
        self.calls.append(list(argv))
        for key, (rc, out, err) in self.answers.items():
            if tuple(argv[:len(key)]) == key:
                return subprocess.CompletedProcess(list(argv), rc, out, err)
        raise AssertionError(f"unexpected command {argv}")


SHOW_JOB = ("JobId=42 JobName=training-x\n   UserId=me(1000) GroupId=me(1000)\n"
            "   StdErr=/team logs/training-42.out\n   StdIn=/dev/null\n   StdOut=/team logs/training-42.out\n")


def test_the_log_path_is_read_whole_from_the_multi_line_form():
    run = Runner({("scontrol", "show", "job"): (0, SHOW_JOB, "")})
    assert str(job_log_path("42", run)) == "/team logs/training-42.out"
    assert run.calls == [["scontrol", "show", "job", "42"]]
    assert job_log_path("42", Runner({("scontrol",): (1, "", "Invalid job id")})) is None


def test_the_successor_is_submitted_singleton_with_this_jobs_nodes_and_limit(tmp_path, capsys):
    run = Runner({("squeue",): (0, "1:00:00\n", ""), (str(tmp_path / "isambard_sbatch"),): (0, "43;cluster\n", "")})
    assert submit_successor(tmp_path, "42", "training-x", "2", SUBMISSION, run) == "43"
    assert run.calls == [["squeue", "-h", "-j", "42", "-o", "%l"],
                         [str(tmp_path / "isambard_sbatch"), "--parsable", "--dependency=singleton",
                          "--job-name=training-x", "--nodes=2", "--time=1:00:00",
                          str(tmp_path / "pipeline_training_submit.sbatch"), *SUBMISSION]]
    assert "INFO auto-requeue: successor job 43 (singleton) submitted" in capsys.readouterr().err


def test_a_failed_successor_submission_warns_and_the_job_goes_on(tmp_path, capsys):
    run = Runner({("squeue",): (0, "10:00\n", ""), (str(tmp_path / "isambard_sbatch"),):
                  (1, "", "a\nb\nerror: the preflight failed\nnothing was submitted\n")})
    assert submit_successor(tmp_path, "42", "training-x", "1", SUBMISSION, run) is None
    err = capsys.readouterr().err
    assert ("WARN auto-requeue: submitting the successor failed; this job continues without one: b error: the "
            "preflight failed nothing was submitted") in err


def test_start_submits_only_with_auto_requeue(tmp_path, capsys):
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "training-x", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_NODELIST": "n1", "PIPELINE_ROOT": str(tmp_path)}
    run = Runner({})
    assert start(SUBMISSION, env, run) is None and run.calls == []
    assert "INFO job 42: 1 node(s) [n1], restart 0" in capsys.readouterr().err
    run = Runner({("squeue",): (0, "10:00\n", ""), (str(tmp_path / "isambard_sbatch"),): (0, "43\n", "")})
    assert start(SUBMISSION, {**env, "PIPELINE_AUTO_REQUEUE": "1"}, run) == "43"
    with pytest.raises(UserError, match="is not a regular expression"):  # refused before the training, not after
        start(SUBMISSION, {**env, "PIPELINE_AUTO_REQUEUE": "1", "PIPELINE_AUTO_REQUEUE_STOP_REGEX": "(x"}, run)


def test_carry_out_runs_the_decision():
    run, pauses = Runner({("scontrol", "requeue"): (0, "", ""), ("scancel",): (1, "", "gone")}), []
    assert carry_out(Decision(0, requeue=True), "42", None, run, pauses.append) == 0
    assert run.calls == [["scontrol", "requeue", "42"]] and pauses == [5]
    run.calls.clear()
    assert carry_out(Decision(7, cancel_successor=True), "42", "43", run, pauses.append) == 7  # a gone successor
    assert run.calls == [["scancel", "43"]]
    failing = Runner({("scontrol", "requeue"): (1, "", "Requested operation is presently disabled")})
    assert carry_out(Decision(0, requeue=True), "42", None, failing, pauses.append) == 1


def test_finish_reads_the_save_marker_and_the_log_then_acts(tmp_path, capsys):
    log = tmp_path / "team logs" / "train-42.out"
    log.parent.mkdir()
    log.write_text("[after training is done] datetime: 2026-11-30 12:00:00\n")
    request = tmp_path / ".save-request-42"
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "2", "SLURM_RESTART_COUNT": "3", "PIPELINE_MAX_REQUEUES": "3",
           "PIPELINE_SAVE_REQUEST_FILE": str(request)}
    # finished: the successor is cancelled, the exit code is the training's
    run = Runner({("scontrol", "show", "job"): (0, f"JobId=42\n   StdOut={log}\n", ""), ("scancel",): (0, "", "")})
    assert finish(0, "43", SUBMISSION, env, run, lambda s: None) == 0
    assert run.calls[-1] == ["scancel", "43"]
    # checkpointed with the budget spent: FAILED (3) with the submission that continues, the request used up
    request.touch()
    request.with_name(request.name + ".saved").touch()
    assert finish(0, None, SUBMISSION, env, Runner({}), lambda s: None) == 3
    assert ("continue with the same submission (it resumes from the checkpoint): isambard_sbatch --nodes=2 "
            "pipeline_training_submit.sbatch c.yaml nano sft --disable-ft train.train_iters=200") in capsys.readouterr().err
    assert not request.exists() and not request.with_name(request.name + ".saved").exists()


def test_the_cli_needs_the_submission_after_a_double_dash(capsys):
    assert main(["finish", "--exit-code", "0", "c.yaml"]) == 2
    assert capsys.readouterr().err.startswith("error: the submission goes after --")


@pytest.mark.parametrize("value,seconds", [("5", 300), ("4:30", 270), ("1:00:00", 3600), ("1-2", 93600),
                                           ("1-0:30", 88200), ("0-0:0:45", 45), ("UNLIMITED", None), ("x", None)])
def test_slurm_time_limits_read_as_sbatch_reads_them(value, seconds):
    from pipeline.slurm.sbatch_options import time_limit_seconds

    assert time_limit_seconds(value) == seconds


def test_a_time_limit_inside_the_pre_limit_signal_lead_is_refused():
    """Issue 50 item 10: --time at or under the USR1 lead (the training script's --signal=B:USR1@300) made the
    pre-limit save fire at once: a checkpoint at step 1 and a requeue, again and again, each reported PASS."""
    from pipeline.cli.submission import check_signal_lead
    from pipeline.common.errors import UserError
    from pipeline.common.paths import TRAINING_SUBMIT
    from pipeline.slurm.sbatch_options import signal_lead_seconds

    assert signal_lead_seconds("B:USR1@300") == 300 and signal_lead_seconds("USR1") == 60
    script = str(ROOT / TRAINING_SUBMIT)
    for opts in (["--time=5"], ["--time=4"], ["-t", "3:00"], ["--time=10", "--signal=B:USR1@600"]):
        with pytest.raises(UserError, match="is at or under the pre-limit save signal's lead"):
            check_signal_lead(script, opts)
    for opts in (["--time=6"], ["--time=30"], [], ["--time=5", "--signal=B:USR1@60"]):
        check_signal_lead(script, opts)


def test_the_signal_lead_check_reads_time_min_the_environment_and_no_limit(monkeypatch):
    """Issue 60, item 9: --time-min (Slurm may lower the limit to it) and SBATCH_TIMELIMIT (sbatch's input variable,
    over the script's header) bypassed the check; --time=0, Slurm's "no limit", was refused as "0 s"."""
    from pipeline.cli.submission import check_signal_lead
    from pipeline.common.errors import UserError
    from pipeline.common.paths import TRAINING_SUBMIT

    script = str(ROOT / TRAINING_SUBMIT)
    monkeypatch.delenv("SBATCH_TIMELIMIT", raising=False)
    monkeypatch.delenv("SBATCH_SIGNAL", raising=False)
    with pytest.raises(UserError, match=r"^--time-min=4 \(240 s, the limit Slurm may lower the job's to\) is at or "):
        check_signal_lead(script, ["--time=600", "--time-min=4"])
    check_signal_lead(script, ["--time=0"])  # no limit: nothing to save before
    check_signal_lead(script, ["--time=600", "--time-min=30"])
    monkeypatch.setenv("SBATCH_TIMELIMIT", "3")
    with pytest.raises(UserError, match=r"^--time=3 \(180 s\) is at or under"):
        check_signal_lead(script, [])
    check_signal_lead(script, ["--time=60"])  # the command line wins over the environment
    monkeypatch.setenv("SBATCH_TIMELIMIT", "60")
    monkeypatch.setenv("SBATCH_SIGNAL", "B:USR1@3900")
    with pytest.raises(UserError, match=r"--signal=B:USR1@3900: 3900 s before the limit"):
        check_signal_lead(script, [])
