"""The start and the end of a training job (``pipeline_training_submit.sbatch``): the sbatch file keeps the trap
and the one srun; this module does the rest.

  python3 -m pipeline.slurm.requeue start -- CONFIG MODEL MODE [ARGS...]
      logs the job's placement; with PIPELINE_AUTO_REQUEUE=1 submits the singleton-dependent successor (through
      isambard_sbatch, same job name, node count and time limit) and prints its id (nothing when there is none).
  python3 -m pipeline.slurm.requeue finish --exit-code RC [--successor ID] -- CONFIG MODEL MODE [ARGS...]
      cancels the auto-requeue successor of a finished run, requeues a checkpointed unfinished run, or ends FAILED
      (exit 3) when the requeue budget is spent, saying how to continue; exits with the job's exit code.
  python3 -m pipeline.slurm.requeue --job ID --exit-code RC --restart-count N --max-requeues M [--saved]
      [--successor ID] [--log-file FILE --stop-regex RE] [--resume-command CMD]
      the decision alone, printed as tab-separated lines (info|warn|error<TAB>message, cancel<TAB>JOB, requeue,
      exit<TAB>CODE), nothing carried out.

The decision is a pure function of the job's facts (:func:`decide`); the Slurm commands go through a runner
callable, so each piece is unit-tested without Slurm. The job's facts come from Slurm's environment (SLURM_JOB_ID,
SLURM_JOB_NAME, SLURM_JOB_NUM_NODES, SLURM_JOB_NODELIST, SLURM_RESTART_COUNT) and the pipeline's
(PIPELINE_ROOT, PIPELINE_AUTO_REQUEUE, PIPELINE_AUTO_REQUEUE_STOP_REGEX, PIPELINE_MAX_REQUEUES,
PIPELINE_SAVE_REQUEST_FILE). Standard library only: it runs on the batch host before (or without) any environment.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.common.errors import UserError, cli_main
from pipeline.common.paths import TRAINING_SUBMIT

STOP_REGEX = r"\[after training is done\] datetime:"

# Runs one command (an argv list, never shell text) and returns its exit code and captured text.
Runner = Callable[[Sequence[str]], subprocess.CompletedProcess]


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True)


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


# --- the job's side: log lines, Slurm commands ------------------------------------------------------------------

def log(level: str, text: str, environ: Mapping[str, str] | None = None) -> None:
    """One line on stderr in lib.sh's format (``HH:MM:SS [node:rN] LEVEL text``), so the job log reads as one."""
    e = os.environ if environ is None else environ
    node = e.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0] or "localhost"
    rank = e.get("SLURM_NODEID") or e.get("NODE_RANK") or "0"
    print(f"{time.strftime('%H:%M:%S')} [{node}:r{rank}] {level.upper()} {text}", file=sys.stderr, flush=True)


def job_log_path(job: str, run: Runner = run_command) -> Path | None:
    """The job's StdOut file, from ``scontrol show job``'s multi-line form: StdOut= is on a line of its own there,
    so a path with spaces is read whole (the one-line form splits at spaces)."""
    res = run(["scontrol", "show", "job", job])
    if res.returncode != 0:
        return None
    for line in res.stdout.splitlines():
        stripped = line.lstrip(" ")
        if stripped.startswith("StdOut="):
            return Path(stripped[len("StdOut="):])
    return None


def _tail(text: str, n: int = 3) -> str:
    return " ".join(text.splitlines()[-n:])


def submit_successor(root: Path, job: str, name: str, nodes: str, submission: Sequence[str],
                     run: Runner = run_command) -> str | None:
    """Submit the auto-requeue successor: the same submission, singleton-dependent on this job's name, with this
    job's node count and time limit. Its id, or None (with a warning: this job still trains) when that failed."""
    limit = run(["squeue", "-h", "-j", job, "-o", "%l"])
    if limit.returncode != 0:
        log("warn", f"auto-requeue: reading this job's time limit failed; this job continues without a successor: "
                    f"{_tail(limit.stderr)}")
        return None
    res = run([str(root / "isambard_sbatch"), "--parsable", "--dependency=singleton", f"--job-name={name}",
               f"--nodes={nodes}", f"--time={limit.stdout.strip()}", str(root / TRAINING_SUBMIT), *submission])
    successor = res.stdout.strip().split(";")[0]
    if res.returncode != 0 or not successor:
        # The chain ends here, but this job still trains: say why the successor was not submitted.
        log("warn", f"auto-requeue: submitting the successor failed; this job continues without one: "
                    f"{_tail(res.stderr)}")
        return None
    log("info", f"auto-requeue: successor job {successor} (singleton) submitted")
    return successor


def resume_command(nodes: str, submission: Sequence[str]) -> str:
    """The submission that continues the run, as a shell line to copy."""
    return shlex.join(["isambard_sbatch", f"--nodes={nodes}", TRAINING_SUBMIT, *submission])


def take_saved(request_file: str | None) -> bool:
    """Whether the engine checkpointed on the save request (it writes REQUEST.saved); the request is used up."""
    if not request_file:
        return False
    saved = Path(request_file + ".saved")
    if not saved.is_file():
        return False
    for p in (Path(request_file), saved):
        p.unlink(missing_ok=True)
    return True


def carry_out(decision: Decision, job: str, successor: str | None, run: Runner = run_command,
              pause: Callable[[float], None] = time.sleep) -> int:
    """Log the decision's messages and run its Slurm commands; the job's exit code."""
    for level, text in decision.messages:
        log(level, text)
    if decision.cancel_successor and successor:
        run(["scancel", successor])  # already gone is fine: the chain stops either way
    if decision.requeue:
        res = run(["scontrol", "requeue", job])
        if res.returncode != 0:
            log("error", f"scontrol requeue {job} failed: {_tail(res.stderr)}")
            return res.returncode
        pause(5)  # the requeue takes hold before this batch shell exits
    return decision.exit_code


# --- the two calls of the sbatch file -----------------------------------------------------------------------------

def _int(environ: Mapping[str, str], key: str, default: int) -> int:
    raw = environ.get(key) or str(default)
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{key}={raw!r} is not an integer") from None


def stop_regex(environ: Mapping[str, str]) -> str:
    """PIPELINE_AUTO_REQUEUE_STOP_REGEX (default: Megatron's "[after training is done] datetime:" line), checked."""
    regex = environ.get("PIPELINE_AUTO_REQUEUE_STOP_REGEX") or STOP_REGEX
    try:
        re.compile(regex)
    except re.error as exc:
        raise UserError(f"PIPELINE_AUTO_REQUEUE_STOP_REGEX {regex!r} is not a regular expression: {exc}") from None
    return regex


def start(submission: Sequence[str], environ: Mapping[str, str], run: Runner = run_command) -> str | None:
    job = environ.get("SLURM_JOB_ID") or ""
    nodes = environ.get("SLURM_JOB_NUM_NODES") or "1"
    successor = None
    if environ.get("PIPELINE_AUTO_REQUEUE", "0") == "1":
        stop_regex(environ)  # a bad stop line is refused before the training, not after it
        root = Path(environ.get("PIPELINE_ROOT") or ".")
        successor = submit_successor(root, job, environ.get("SLURM_JOB_NAME") or "training", nodes, submission, run)
    log("info", f"job {job}: {nodes} node(s) [{environ.get('SLURM_JOB_NODELIST', '')}], restart "
                f"{environ.get('SLURM_RESTART_COUNT') or 0}")
    return successor


def finish(exit_code: int, successor: str | None, submission: Sequence[str], environ: Mapping[str, str],
           run: Runner = run_command, pause: Callable[[float], None] = time.sleep) -> int:
    job = environ.get("SLURM_JOB_ID") or ""
    finished = bool(successor) and log_says_finished(job_log_path(job, run), stop_regex(environ))
    end = JobEnd(exit_code, _int(environ, "SLURM_RESTART_COUNT", 0), _int(environ, "PIPELINE_MAX_REQUEUES", 3),
                 take_saved(environ.get("PIPELINE_SAVE_REQUEST_FILE")), finished, successor or None,
                 resume_command(environ.get("SLURM_JOB_NUM_NODES") or "1", submission), job)
    return carry_out(decide(end), job, end.successor, run, pause)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """Options before ``--``, the submission (CONFIG MODEL MODE ARGS...) after it."""
    if "--" not in argv or len(argv) - argv.index("--") - 1 < 3:
        raise UserError("the submission goes after --: CONFIG MODEL MODE [ARGS...]")
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def _decision_lines(argv: list[str]) -> int:
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


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["start"]:
        opts, submission = _split(argv[1:])
        if opts:
            raise UserError(f"start takes no options before -- (got {' '.join(opts)})")
        print(start(submission, os.environ) or "")
        return 0
    if argv[:1] == ["finish"]:
        opts, submission = _split(argv[1:])
        p = argparse.ArgumentParser(prog="python3 -m pipeline.slurm.requeue finish")
        p.add_argument("--exit-code", type=int, required=True)
        p.add_argument("--successor", default="")
        a = p.parse_args(opts)
        return finish(a.exit_code, a.successor or None, submission, os.environ)
    return _decision_lines(argv)


if __name__ == "__main__":
    sys.exit(main())
