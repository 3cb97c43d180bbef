"""What a training job does when its training step ends (``pipeline_training_submit.sbatch``): cancel the
auto-requeue successor of a finished run, requeue a checkpointed unfinished run, or end FAILED when the requeue budget
is spent, saying how to continue. A pure function of the job's facts (:func:`decide`), so every branch is unit-tested;
the sbatch file keeps only the trap and the Slurm commands, and reads the decision as tab-separated lines:

  python3 -m pipeline.slurm.requeue --job ID --exit-code RC --restart-count N --max-requeues M [--saved]
      [--successor ID] [--log-file FILE --stop-regex RE] [--resume-command CMD]
  ->  info|warn|error<TAB>message    a log line
      cancel<TAB>JOB                 scancel the successor
      requeue                        scontrol requeue this job
      exit<TAB>CODE                  the job's exit code

Standard library only: it runs on the batch host before (or without) any environment.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

STOP_REGEX = r"\[after training is done\] datetime:"


@dataclass(frozen=True)
class JobEnd:
    """The facts at the end of the training step."""

    exit_code: int  # the training srun's exit code
    restart_count: int  # SLURM_RESTART_COUNT: requeues so far
    max_requeues: int  # PIPELINE_MAX_REQUEUES
    saved: bool = False  # the engine checkpointed on a save request (time limit, preemption) and stopped
    finished: bool = False  # the job log says training finished
    successor: str | None = None  # the auto-requeue chain's successor job
    resume_command: str = ""  # the submission that continues the run
    job: str = ""  # this job's id


@dataclass(frozen=True)
class Decision:
    exit_code: int
    cancel_successor: bool = False
    requeue: bool = False
    messages: list[tuple[str, str]] = field(default_factory=list)

    def lines(self, successor: str | None) -> list[str]:
        out = [f"{level}\t{text}" for level, text in self.messages]
        if self.cancel_successor and successor:
            out.append(f"cancel\t{successor}")
        if self.requeue:
            out.append("requeue")
        out.append(f"exit\t{self.exit_code}")
        return out


def decide(end: JobEnd) -> Decision:
    msgs: list[tuple[str, str]] = []
    cancel = False
    if end.successor and end.finished:
        msgs.append(("info", f"auto-requeue: training has finished; cancelling successor {end.successor}"))
        cancel = True
    if not end.saved:
        return Decision(end.exit_code, cancel, False, msgs)
    if end.successor and not cancel:
        msgs.append(("info", f"checkpoint saved; the auto-requeue successor {end.successor} resumes from it"))
        return Decision(0, cancel, False, msgs)
    if cancel:
        return Decision(0, cancel, False, msgs)
    if end.restart_count < end.max_requeues:
        msgs.append(("info", f"checkpoint saved; requeueing job {end.job} (restart {end.restart_count + 1} of "
                             f"{end.max_requeues})"))
        return Decision(0, False, True, msgs)
    # Training is unfinished: a non-success state, so Slurm, chains and people are not told it finished.
    msgs.append(("error", f"checkpoint saved at an unfinished step, but PIPELINE_MAX_REQUEUES={end.max_requeues} is "
                          "used up; continue with the same submission (it resumes from the checkpoint): "
                          f"{end.resume_command}"))
    return Decision(3, False, False, msgs)


def log_says_finished(log_file: Path | None, stop_regex: str) -> bool:
    if log_file is None or not log_file.is_file():
        return False
    pattern = re.compile(stop_regex)
    with open(log_file, errors="replace") as f:
        return any(pattern.search(line) for line in f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m pipeline.slurm.requeue", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="")
    p.add_argument("--exit-code", type=int, required=True)
    p.add_argument("--restart-count", type=int, default=0)
    p.add_argument("--max-requeues", type=int, required=True)
    p.add_argument("--saved", action="store_true")
    p.add_argument("--successor", default="")
    p.add_argument("--log-file", type=Path)
    p.add_argument("--stop-regex", default=STOP_REGEX)
    p.add_argument("--resume-command", default="")
    a = p.parse_args(argv)
    try:
        finished = bool(a.successor) and log_says_finished(a.log_file, a.stop_regex)
    except re.error as exc:
        print(f"error: PIPELINE_AUTO_REQUEUE_STOP_REGEX {a.stop_regex!r} is not a regular expression: {exc}",
              file=sys.stderr)
        return 2
    end = JobEnd(a.exit_code, a.restart_count, a.max_requeues, a.saved, finished, a.successor or None,
                 a.resume_command, a.job)
    print("\n".join(decide(end).lines(end.successor)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
