"""The end-of-job decisions of pipeline_training_submit.sbatch (src/pipeline/slurm/requeue.py), branch by branch,
and the line protocol the sbatch file reads."""

import pytest

from pipeline.slurm.requeue import JobEnd, decide, main

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
