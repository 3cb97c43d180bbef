"""isambard_sbatch - a drop-in for ``sbatch`` that keeps the team off known-bad nodes.

    isambard_sbatch [sbatch options] SCRIPT [script args]     submit, excluding every node in the shared
                                                             bad-node log younger than the TTL
    isambard_sbatch --mark-bad NODE [REASON]                 report a node (or hostlist nid[001-004])
    isambard_sbatch --list-bad                               list the log (active entries marked *)
    isambard_sbatch --update-bad NODE REASON                 change the reason
    isambard_sbatch --unmark-bad NODE                        remove a node (it got fixed)
    isambard_sbatch --prune-bad                              drop entries older than the TTL

The log is $BAD_NODES_LOG (else PIPELINE_BAD_NODES_LOG from pipeline_env_config.env); the TTL is
$BAD_NODES_TTL_DAYS (default 7). A user --exclude/-x is merged with the log's nodes. Training submissions
(pipeline_training_submit.sbatch) run the login-node preflight first and are refused (exit 2) when it fails.
Only mark a node for hardware faults (GPU Xid, a tunnel that never comes up, NCCL dying on the first
collective on that node) - not for OOM, bad YAML or parallelism mistakes.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from pipeline.common.errors import UserError, cli_main
from pipeline.slurm.badnodes import from_env, is_future, printable
from pipeline.slurm.hostlist import compress, expand, is_hostlist

# sbatch options that take a value when written without "=" (long and short forms).
VALUE_OPTS = {
    "-A", "--account", "-p", "--partition", "-t", "--time", "-N", "--nodes", "-n", "--ntasks", "-J", "--job-name",
    "-o", "--output", "-e", "--error", "-x", "--exclude", "-w", "--nodelist", "--gpus-per-node", "--gres", "--mem",
    "-c", "--cpus-per-task", "-d", "--dependency", "--signal", "-q", "--qos", "--reservation", "-C", "--constraint",
    "-a", "--array", "--begin", "-D", "--chdir", "--export", "--mail-type", "--mail-user", "--ntasks-per-node",
    "--time-min", "--comment", "--mem-per-cpu", "--mem-per-gpu", "-G", "--gpus", "--gpus-per-task", "--nice",
    "--wckey", "--cpus-per-gpu", "-i", "--input", "--network", "--licenses", "-L", "--deadline", "--wrap",
    "--open-mode",
}
# Above this length the exclusion goes to a file (sbatch reads --exclude=PATH when the value has a "/"):
# one argument may not exceed MAX_ARG_STRLEN (128 KiB) on Linux.
MAX_EXCLUDE_ARG = 64 * 1024
CRUD = ("--mark-bad", "--list-bad", "--update-bad", "--unmark-bad", "--prune-bad")
TRAINING_SCRIPT = "pipeline_training_submit.sbatch"


def split_sbatch_args(argv: list[str]) -> tuple[list[str], list[str], str | None, list[str]]:
    """(sbatch options without excludes, user excludes, script, script args)."""
    opts, excludes = [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("-") or a == "-":
            return opts, excludes, a, argv[i + 1:]
        if a in ("-x", "--exclude"):
            if i + 1 >= len(argv):
                raise UserError(f"{a} needs a value")
            excludes.append(argv[i + 1])
            i += 2
            continue
        if a.startswith("--exclude="):
            excludes.append(a.split("=", 1)[1])
        elif a.startswith("-x") and len(a) > 2:
            excludes.append(a[2:])
        elif a in VALUE_OPTS:
            if i + 1 >= len(argv):
                raise UserError(f"{a} needs a value")
            opts += [a, argv[i + 1]]
            i += 2
            continue
        else:
            opts.append(a)
        i += 1
    return opts, excludes, None, []


def option_value(opts: list[str], *names: str) -> str | None:
    for i, a in enumerate(opts):
        for n in names:
            if a == n and i + 1 < len(opts):
                return opts[i + 1]
            if n.startswith("--") and a.startswith(n + "="):
                return a.split("=", 1)[1]
            if not n.startswith("--") and a.startswith(n) and len(a) > len(n):
                return a[len(n):]
    return None


def training_preflight(script_args: list[str], opts: list[str]) -> None:
    """Run the training preflight for a pipeline_training_submit.sbatch submission; UserError on failure."""
    if len(script_args) < 3:
        raise UserError(f"{TRAINING_SCRIPT} needs CONFIG MODEL MODE [launcher flags] [overrides]")
    try:
        from pipeline.training.launch import plan_from_args
    except ImportError as exc:
        print(f"warning: preflight skipped: the pipeline environment is not available here ({exc})", file=sys.stderr)
        return
    nodes = (option_value(opts, "--nodes", "-N") or "1").split("-")[0]
    if not nodes.isdigit():
        raise UserError(f"--nodes={nodes!r} is not a node count")
    config, model, mode, *rest = script_args
    argv = [config, "--model", model, "--mode", mode, "--nodes", nodes, *rest]
    cluster = os.environ.get("PIPELINE_CLUSTER")
    if cluster and "--cluster" not in rest:
        argv += ["--cluster", cluster]
    *_, plan, _ = plan_from_args(argv)
    if not plan.ok:
        raise UserError("\n".join(plan.problems) + f"\npreflight: {len(plan.problems)} problem(s); nothing was submitted")
    print(f"Preflight: PASS - world {plan.world} (tp {plan.tp} pp {plan.pp} cp {plan.cp} ep {plan.ep} dp {plan.dp}), "
          f"memory estimate {plan.memory_gb.get('total', 0):.1f} of {plan.memory_budget_gb:g} GB", file=sys.stderr)


def cluster_nodes() -> set[str] | None:
    """Node names Slurm knows (sbatch rejects an --exclude naming an unknown node), or None if unknown."""
    import subprocess

    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return set(out.stdout.split())


def render_exclude(nodes: list[str], spill_dir: Path = Path("logs/slurm")) -> str:
    """The --exclude value: a compressed hostlist (nid[001-004,010]); if even that is too long for one
    argument, a file holding it (sbatch treats a value containing "/" as a file of node names)."""
    expr = compress(nodes)
    if len(expr) <= MAX_EXCLUDE_ARG:
        return expr
    from pipeline.common.io import write_text

    path = write_text(spill_dir.resolve() / f"exclude.{os.getpid()}.hostlist", expr + "\n")
    print(f"warning: {len(nodes)} excluded nodes do not fit one argument; passing them as file {path}",
          file=sys.stderr)
    return str(path)


def build_submission(argv: list[str]) -> tuple[list[str], list[str], Path]:
    """The sbatch command line (a list, never a shell string), the excluded nodes, and the log path."""
    log = from_env()
    opts, user_ex, script, script_args = split_sbatch_args(argv)
    if script is None and option_value(opts, "--wrap") is None:
        raise UserError("no batch script given (usage: isambard_sbatch [sbatch options] SCRIPT [args])")
    user_nodes: list[str] = []
    for ex in user_ex:
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
    cmd = ["sbatch", *opts]
    if excluded:
        cmd.append("--exclude=" + render_exclude(excluded))
    if script is not None:
        cmd += [script, *script_args]
    if script is not None and Path(script).name == TRAINING_SCRIPT:
        training_preflight(script_args, opts)
    return cmd, bad, log.path


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    log = from_env()
    if argv[0] in CRUD:
        action, rest = argv[0], argv[1:]
        if action == "--mark-bad":
            if not rest:
                raise UserError("--mark-bad needs a node name")
            names = log.mark(rest[0], " ".join(rest[1:]))
            print(f"marked bad: {', '.join(names)} (excluded for {log.ttl_days:g} days) - file: {log.path}")
        elif action == "--list-bad":
            import datetime as dt

            now = dt.datetime.now(dt.timezone.utc)
            entries = log.entries()
            print(f"# {log.path} (TTL {log.ttl_days:g} days; * = excluded now, ! = dated in the future)")
            for e in entries:
                star = "!" if is_future(e, now) else "*" if log.is_active(e, now) else " "
                print(f"{star} {e.node:<16} {e.time:%Y-%m-%d %H:%M}Z  {printable(e.user):<10} "
                      f"{printable(e.host):<12} {printable(e.reason)}")
            print(f"{len(log.active())} node(s) excluded, {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
        elif action == "--update-bad":
            if len(rest) < 2:
                raise UserError("--update-bad needs NODE REASON")
            n = log.update(rest[0], " ".join(rest[1:]))
            print(f"updated {n} entr{'y' if n == 1 else 'ies'} for {rest[0]}")
        elif action == "--unmark-bad":
            if len(rest) != 1:
                raise UserError("--unmark-bad needs exactly one NODE")
            n = log.unmark(rest[0])
            print(f"removed {n} entr{'y' if n == 1 else 'ies'} for {rest[0]}")
        else:
            n = log.prune()
            print(f"pruned {n} entr{'y' if n == 1 else 'ies'} older than {log.ttl_days:g} days from {log.path}")
        return 0

    cmd, bad, path = build_submission(argv)
    Path("logs/slurm").mkdir(parents=True, exist_ok=True)
    print(f"Bad nodes: {len(bad)} excluded (last {log.ttl_days:g}d) - file: {path}", file=sys.stderr)
    print("           report more: isambard_sbatch --mark-bad <node> [reason]", file=sys.stderr)
    if shutil.which("sbatch") is None:
        raise UserError("sbatch not found on PATH (is this a Slurm login node?)")
    sys.stdout.flush()
    os.execvp("sbatch", cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
