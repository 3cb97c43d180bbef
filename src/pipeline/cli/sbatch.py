"""isambard_sbatch - a drop-in for ``sbatch`` that keeps the team off known-bad nodes.

    isambard_sbatch [sbatch options] SCRIPT [script args]     submit, excluding every node in the shared
                                                             bad-node log younger than the TTL
    isambard_sbatch --no-preflight [sbatch options] SCRIPT    the same without the training preflight
    isambard_sbatch --dry-run [sbatch options] SCRIPT ...    every check and the plan, then print the exact sbatch
                                                             command (with --exclude and the profile's options)
                                                             and queue nothing
    isambard_sbatch --mark-bad NODE [REASON]                 report a node (or hostlist nid[001-004])
    isambard_sbatch --list-bad                               list the log (active entries marked *)
    isambard_sbatch --update-bad NODE REASON                 change the reason
    isambard_sbatch --unmark-bad NODE                        remove a node (it got fixed)
    isambard_sbatch --prune-bad                              drop entries older than the TTL

The log is $BAD_NODES_LOG (else PIPELINE_BAD_NODES_LOG from pipeline_env_config.env); the TTL is
$BAD_NODES_TTL_DAYS (default 7). A user --exclude/-x is merged with the log's nodes. Training submissions
(pipeline_training_submit.sbatch) run the login-node preflight first and are refused (exit 2) when it fails,
or when it cannot run: it needs the pipeline venv or, on a cluster's login node, the planner environment
(`bash pipeline_env_setup.sh --only planner`); `--no-preflight` queues without the checks.
Only mark a node for hardware faults (GPU Xid, a tunnel that never comes up, NCCL dying on the first
collective on that node) - not for OOM, bad YAML or parallelism mistakes.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.cli.badnodes import COMMANDS as CRUD
from pipeline.cli.badnodes import run_command
from pipeline.cli.submission import JobCheck, check_job, run_job_name, submission_profile
from pipeline.common import shell
from pipeline.common.errors import UserError, cli_main
from pipeline.common.io import write_text
from pipeline.common.paths import TRAINING_SUBMIT
from pipeline.slurm.badnodes import from_env
from pipeline.slurm.hostlist import compress, expand, is_hostlist
from pipeline.slurm.sbatch_options import (
    directive_value,
    header_options,
    option_value,
    profile_sbatch_options,  # pure; shared with the dry run
    script_directives,
    split_sbatch_args,
)

# Above this length the exclusion goes to a file (sbatch reads --exclude=PATH when the value has a "/"):
# one argument may not exceed MAX_ARG_STRLEN (128 KiB) on Linux.
MAX_EXCLUDE_ARG = 64 * 1024
OWN_FLAGS = ("--no-preflight", "--dry-run")  # isambard_sbatch's options among sbatch's; never passed to sbatch


def log_path(opts: list[str], script: str | None, job_id: str, job_name: str | None) -> Path | None:
    """Where the job's output goes: the user's --output, else the script's ``#SBATCH --output``, else sbatch's
    default; relative to --chdir when given; %j %A %x %u %% substituted (%a stays: one file per array task)."""
    pattern = option_value(opts, "--output", "-o") or directive_value(script, "--output", "-o") or "slurm-%j.out"
    name = job_name or option_value(opts, "--job-name", "-J") or directive_value(script, "--job-name", "-J") \
        or (Path(script).name if script else "wrap")
    out = (pattern.replace("%%", "\0").replace("%j", job_id).replace("%A", job_id).replace("%x", name)
           .replace("%u", getpass.getuser()).replace("\0", "%"))
    base = option_value(opts, "--chdir", "-D")
    return (Path(base) / out if base else Path(out)).resolve()


def cluster_nodes() -> set[str] | None:
    """Node names Slurm knows (sbatch rejects an --exclude naming an unknown node), or None if unknown."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return set(out.stdout.split())


def render_exclude(nodes: list[str], spill_dir: Path = Path("logs/slurm"), write: bool = True) -> str:
    """The --exclude value: a compressed hostlist (nid[001-004,010]); if even that is too long for one
    argument, a file holding it (sbatch treats a value containing "/" as a file of node names). ``write=False`` (a
    dry run, which creates nothing) names the file without writing it."""
    expr = compress(nodes)
    if len(expr) <= MAX_EXCLUDE_ARG:
        return expr

    path = spill_dir.resolve() / f"exclude.{os.getpid()}.hostlist"
    if write:
        write_text(path, expr + "\n")
    print(f"warning: {len(nodes)} excluded nodes do not fit one argument; "
          f"{'passing' if write else 'a submission passes'} them as file {path}", file=sys.stderr)
    return str(path)


@dataclass(frozen=True)
class Submission:
    """One sbatch submission, as built: its options, the job script and its arguments, the logged bad nodes."""

    opts: list[str]
    script: str | None
    script_args: list[str]
    bad: list[str]
    bad_log: Path
    dry_run: bool = False

    @property
    def cmd(self) -> list[str]:
        return ["sbatch", *self.opts, *([self.script, *self.script_args] if self.script is not None else [])]


def plan_submission(argv: list[str]) -> Submission:
    """Check the job and build its submission (UserError, one line per problem, before anything is queued)."""
    log = from_env()
    opts, user_ex, script, script_args = split_sbatch_args(argv, own_flags=OWN_FLAGS)
    no_preflight = "--no-preflight" in opts
    dry_run = "--dry-run" in opts
    if not dry_run and "--dry-run" in script_args:
        # after the script it is the job's argument: sbatch would queue a job that only plans
        raise UserError("--dry-run after the batch script would be passed to the job, and the job queued: put it "
                        "before the script (isambard_sbatch --dry-run [sbatch options] SCRIPT ...); nothing was "
                        "submitted")
    opts = [o for o in opts if o not in OWN_FLAGS]
    if script is None and option_value(opts, "--wrap") is None:
        raise UserError("no batch script given (usage: isambard_sbatch [sbatch options] SCRIPT [args])")
    if dry_run and script is not None and not Path(script).is_file():
        # sbatch itself refuses it when submitting, so the dry run must not say OK
        raise UserError(f"batch script {script} is not a file here ({Path.cwd()}); nothing was submitted")
    # sbatch lets a command-line --exclude replace the script's own #SBATCH --exclude: merge the header's in, or a
    # bad-node exclusion would silently drop the nodes the script itself excludes.
    try:
        header_ex = header_options(script)[1] if script is not None else []
    except UserError:
        header_ex = []  # a header sbatch itself would refuse: sbatch says so when it reads it
    user_nodes: list[str] = []
    for ex in user_ex + header_ex:
        if not is_hostlist(ex):
            raise UserError(f"invalid --exclude value {ex!r}: expected node names or a hostlist like nid[001-004]")
        user_nodes += expand(ex)
    bad = [e.node for e in log.active()]
    known = cluster_nodes()
    if known is not None:
        unknown = sorted(set(bad) - known)
        if unknown:
            print(f"warning: {len(unknown)} logged node(s) are not in this cluster and are not excluded: "
                  f"{', '.join(unknown[:5])}", file=sys.stderr)
        bad = [n for n in bad if n in known]
    excluded = sorted(set(user_nodes) | set(bad))
    checked = check_job(script, script_args, opts, required=not no_preflight) if script is not None else JobCheck()
    # the training plan's own cluster profile; the launcher's order read without the plan where none was made here
    profile = checked.cluster or submission_profile(script, script_args)
    opts = [*opts, *profile_sbatch_options(profile, opts, script_directives(script))]
    if excluded:
        opts.append("--exclude=" + render_exclude(excluded, write=not dry_run))
    if script is not None and Path(script).name == TRAINING_SUBMIT and option_value(opts, "--job-name", "-J") is None:
        opts.insert(0, f"--job-name={run_job_name(checked.run_name, script_args[0])}")
    return Submission(opts=opts, script=script, script_args=list(script_args), bad=bad, bad_log=log.path,
                      dry_run=dry_run)


def build_submission(argv: list[str]) -> tuple[list[str], list[str], Path]:
    """The sbatch command line (a list, never a shell string), the excluded nodes, and the log path."""
    sub = plan_submission(argv)
    return sub.cmd, sub.bad, sub.bad_log


def job_log_dir(sub: Submission) -> Path:
    """Create the folder the job's log goes to (Slurm does not, and a job whose log cannot be opened fails with no
    log at all); a folder this user cannot create or write is refused in one line (a teammate submitting from a
    checkout that is not theirs: the scripts' ``logs/slurm/`` is relative to the submission's directory)."""
    log = log_path(sub.opts, sub.script, "0", option_value(sub.opts, "--job-name", "-J"))
    if log is None:
        return Path.cwd()
    out = log.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        writable = os.access(out, os.W_OK | os.X_OK)
    except OSError as exc:
        writable, why = False, exc.strerror or str(exc)
    else:
        why = "not writable by you"
    if not writable:
        raise UserError(f"the job's log would go to {out}, which cannot be created here ({why}); submit from a "
                        "directory of your own (your checkout) or pass --output=PATH; nothing was submitted")
    return out


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    log = from_env()
    if argv[0] in CRUD:
        return run_command(log, argv[0], argv[1:])

    sub = plan_submission(argv)
    cmd, bad, path = sub.cmd, sub.bad, sub.bad_log
    if not sub.dry_run:
        job_log_dir(sub)  # (refused before anything is said of the submission)
    print(f"Bad nodes: {len(bad)} excluded (last {log.ttl_days:g}d) - file: {path}", file=sys.stderr)
    if sub.dry_run:
        out = log_path(sub.opts, sub.script, "<jobid>", option_value(sub.opts, "--job-name", "-J"))
        print(f"dry run: nothing was queued; the job's log would be {out if out else 'in ' + str(Path.cwd())}",
              file=sys.stderr)
        print(shell.join(cmd))  # stdout: the command alone, on one line (common/shell.py), to read or to run
        return 0
    print("           report more: isambard_sbatch --mark-bad <node> [reason]", file=sys.stderr)
    if shutil.which("sbatch") is None:
        raise UserError("sbatch not found on PATH (is this a Slurm login node?)")
    sys.stdout.flush()

    res = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.returncode != 0:
        return res.returncode

    m = re.search(r"(\d+)", res.stdout)
    if m:
        out = log_path(sub.opts, sub.script, m.group(1), option_value(sub.opts, "--job-name", "-J"))
        print(f"job {m.group(1)}: log {out}" if out else f"job {m.group(1)} submitted", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
