"""pipeline_experiment.py - sweeps and multi-phase chains of training runs on Slurm, from one experiment file.

  list    EXPERIMENT [--all]                 the runs, their names and the fields that differ (--all: every override)
  render  EXPERIMENT [--only NAME]           the exact isambard_sbatch lines and each training phase's resolved
                                             config; nothing is submitted
  submit  EXPERIMENT [--only NAME] [--relock] [--allow-config-change]
                                             preflight every selected run (config, preflight, lock, run directory,
                                             jobs still queued); if one fails nothing is submitted. Then lock each
                                             run and submit its phases, chained with --dependency=afterok
  status  EXPERIMENT [--only NAME] [--watch [SECONDS]] [--no-plots]
                                             Slurm state, step/total, last loss, tokens/s, latest checkpoint,
                                             verified exports and coherence per phase; loss-curve PNGs
  csv     EXPERIMENT [--changed] [--output FILE]
                                             one row per run: its fields (--changed: only those that differ)
                                             and final/best loss, steps, tokens, wall time, coherence metrics
  runs    [ROOT]                             every run directory under ROOT (default $PIPELINE_RUNS_DIR), however it
                                             was submitted: state, step, last loss, Slurm job, checkpoint, owner

EXPERIMENT is a YAML file (see configs/experiments/ and docs/experiments.md): a base (config,
model, mode, nodes, flags, overrides), axes of Hydra overrides (grid: product; zip: lists taken together),
computed values (OmegaConf interpolation, ${calc:'...'} for arithmetic) and phases (pretrain -> cooldown ->
export -> coherence). Run NAME is a label from `list` (or <experiment>.<label>); --only may be repeated.

Locks: submit writes <experiment dir>/locks/<experiment>/<label>.lock.yaml with every phase's resolved config and
the code revision; a later submit of a run whose plan differs from its lock is refused with the changed keys
(--relock accepts the change). A run directory that holds another config is never resumed or called finished
(--allow-config-change continues it with the new config). Records, plots and the CSV are written to
$PIPELINE_RUNS_DIR/_experiments/<experiment>/.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pipeline.cli import submission
from pipeline.cli.parser import Parser, watch_seconds
from pipeline.common import paths, shell
from pipeline.common.errors import UserError, cli_main
from pipeline.common.io import write_output_text
from pipeline.common.locks import exclusive_lock
from pipeline.common.mappings import drop_unset
from pipeline.experiment import locks, spec
from pipeline.experiment import plan as planning
from pipeline.experiment import status as board
from pipeline.experiment.plots import write_eval_plots, write_plots
from pipeline.jobs import registry


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = Parser(prog="pipeline_experiment.py", description=__doc__, formatter_class=fmt)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_, description=help_, formatter_class=fmt)
        s.add_argument("experiment", type=Path, help="the experiment YAML file")
        return s

    s = add("list", "the runs of an experiment and the fields that differ")
    s.add_argument("--all", action="store_true", help="every override of each run, not only the differing fields")
    s = add("render", "the exact isambard_sbatch lines and resolved configs; nothing is submitted")
    s.add_argument("--only", action="append", metavar="NAME", help="one run (repeatable)")
    s.add_argument("--no-configs", action="store_true", help="only the isambard_sbatch lines")
    s = add("submit", "preflight every run, then lock and submit them (nothing if one fails)")
    s.add_argument("--only", action="append", metavar="NAME", help="one run (repeatable)")
    s.add_argument("--relock", action="store_true", help="accept a run's change against its lock and rewrite the lock")
    s.add_argument("--allow-config-change", action="store_true",
                   help="continue a run directory that holds another config (passed to the training launcher)")
    s = add("status", "the status board of every run; loss-curve PNGs")
    s.add_argument("--only", action="append", metavar="NAME", help="one run (repeatable)")
    s.add_argument("--watch", nargs="?", type=watch_seconds, const=10.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 10) until every run has finished or stopped")
    s.add_argument("--no-plots", action="store_true", help="do not write the loss-curve PNGs")
    r = sub.add_parser("runs", help="every run under a runs root, however it was submitted",
                       description="every run directory under ROOT (default: $PIPELINE_RUNS_DIR): its state, step, "
                       "last loss, Slurm job and latest complete checkpoint, whether it was submitted by an "
                       "experiment, isambard_sbatch or by hand; a shared root's runs of other users are shown where "
                       "readable",
                       formatter_class=fmt)
    r.add_argument("root", type=Path, nargs="?", help="a runs root (default: $PIPELINE_RUNS_DIR)")
    s = add("csv", "one row per run: its fields and results")
    s.add_argument("--changed", action="store_true", help="only the fields that differ between runs")
    s.add_argument("--output", type=Path, help="default: $PIPELINE_RUNS_DIR/_experiments/<experiment>/results.csv")
    return p


def _load(path: Path) -> spec.Experiment:
    return spec.load(path, root=paths.repo_root())


# ---- list ----------------------------------------------------------------------------------------------------
def cmd_list(exp: spec.Experiment, show_all: bool) -> int:
    print(f"experiment {exp.name}: {len(exp.runs)} run(s), phases {' -> '.join(p.name for p in exp.phases)}")
    for run in exp.runs:
        fields = run.overrides if show_all else run.values
        shown = " ".join(spec.render_override(k, v) for k, v in fields.items()) or "(base)"
        names = ", ".join(exp.run_name(run, p) for p in exp.phases if p.kind == "train")
        print(shell.one_line(f"{run.label:<30} {shown}   [{names}]"))  # a value's ESC or CR never printed raw
    return 0


# ---- the chain's GPU jobs ------------------------------------------------------------------------------------
GPU_JOB_KINDS = ("export", "coherence", "upload-all")


def plan_gpu_jobs(plans: list[planning.RunPlan]) -> None:
    """Plan each export, upload-all and coherence job of every chain now, as isambard_sbatch plans it when the job is
    queued: looked up in the job registry by its batch script and planned by call (``submission.plan_job``: its
    layout, nodes, memory and the model's conversion rules); their inputs are an earlier job's outputs, so their
    paths are left to the job. What a plan refuses becomes that job's problems (the plan's own list; a usage mistake
    in its words is one line): render shows them, and submit queues a chain whole or not at all."""
    for rp in plans:
        for job in rp.jobs:
            if job.kind not in GPU_JOB_KINDS or not job.args or job.problems:
                continue
            kind = registry.resolve(job.script, job.args)
            assert kind is not None and kind.planned, job.script  # the experiment writes only the suite's scripts
            try:
                plan = submission.plan_job(kind, job.script, list(job.args), list(job.sbatch), required=True,
                                           inputs_later=True)
            except UserError as exc:
                job.problems += [ln for ln in str(exc).splitlines() if ln]
                continue
            if plan is not None:
                job.problems += plan.problems


# ---- runs: every run directory under a root ----------------------------------------------------------------------
def cmd_runs(root: Path) -> int:
    try:
        is_dir = root.is_dir()
    except OSError as exc:  # a folder above it this user may not enter
        raise UserError(f"runs root {root} cannot be read ({exc.strerror or exc}): name a folder you may "
                        "read") from None
    if not is_dir:
        raise UserError(f"runs root {root} is not a folder (set PIPELINE_RUNS_DIR, or name one)")
    rows = board.run_rows(root)
    print(f"runs under {root}: {len(rows)}")
    if rows:
        header = ("run", "state", "step", "loss", "job", "checkpoint", "owner")
        # each cell one line, control characters escaped (a run folder's name is never printed raw)
        table = [header, *[tuple("-" if v in (None, "") else shell.one_line(str(v)) for v in r) for r in rows]]
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        for r in table:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


# ---- render --------------------------------------------------------------------------------------------------
def cmd_render(exp: spec.Experiment, only: list[str] | None, no_configs: bool) -> int:
    plans = planning.plan_experiment(exp, exp.select(only))
    plan_gpu_jobs(plans)
    lock_problems = 0
    # Every line printed here is run as a script (the user pipes it to bash): each comment is one line whatever the
    # values hold, each word quoted on one line (common/shell.py; a swept value's newline once ran as a command).
    print(shell.comment(f"experiment {exp.name} ({exp.path}): {len(plans)} run(s); run from {paths.repo_root()}"))
    for rp in plans:
        print("\n" + shell.comment(f"run {rp.run.label}: " + (" ".join(spec.render_override(k, v)
                                                                      for k, v in rp.run.values.items()) or "(base)")))
        for line in planning.render_lines(exp, rp):
            print(line)
        drift = locks.check(exp, rp, relock=False) if all(j.args for j in rp.jobs) else None
        if drift:  # submit refuses it (without --relock): render says so beside the lines
            lock_problems += 1
            print(shell.comment(f"{rp.run.label}: submit refuses: {drift}"))
        if no_configs:
            continue
        for job in rp.jobs:
            if job.cfg is not None:
                print(shell.comment(f"resolved config of {job.phase} ({job.run_dir}/config.yaml, set values):"))
                text = yaml.safe_dump(drop_unset(job.cfg), sort_keys=False).rstrip()
                print("\n".join(shell.comment("  " + x) for x in text.split("\n")))
    problems = sum(len(rp.problems) for rp in plans) + lock_problems
    if problems:
        print(f"\n# {problems} problem(s): submit would refuse (the 'submit refuses' lines)")
    return 0


# ---- submit --------------------------------------------------------------------------------------------------
def _live_jobs(exp: spec.Experiment, labels: list[str]) -> dict[str, list[str]]:
    subs = board.read_submissions(exp)["runs"]
    ids = {label: [j.get("job_id", "") for j in (subs.get(label) or {}).get("jobs", {}).values()] for label in labels}
    states = board.slurm_states([i for v in ids.values() for i in v])
    return {label: [f"{i} ({states[i].state})" for i in v if i in states and states[i].state in board.LIVE_STATES]
            for label, v in ids.items()}


def _sbatch(argv: list[str]) -> tuple[str, str | None]:
    """Run isambard_sbatch --parsable; (job id, log path)."""
    root = paths.repo_root()
    res = subprocess.run([str(root / "isambard_sbatch"), "--parsable", *argv], cwd=root, capture_output=True,
                         text=True, timeout=600)
    if res.returncode != 0:  # the first error line is the reason; the last is only a count ("plan: 1 problem(s)")
        lines = res.stderr.strip().splitlines() or ["(no output)"]
        reason = next((ln.removeprefix("error: ") for ln in lines if ln.startswith("error: ")), lines[-1])
        raise UserError(f"isambard_sbatch exited {res.returncode}: {reason}")
    m = re.match(r"\s*(\d+)", res.stdout)
    if not m:
        raise UserError(f"isambard_sbatch printed no job id: {res.stdout.strip()[:200]}")
    log = re.search(r"job \d+: log (\S+)", res.stderr)
    return m.group(1), log.group(1) if log else None


def cmd_submit(exp: spec.Experiment, only: list[str] | None, relock: bool, allow_change: bool) -> int:
    runs = exp.select(only)
    plans = planning.plan_experiment(exp, runs, allow_config_change=allow_change)
    plan_gpu_jobs(plans)
    live = _live_jobs(exp, [r.label for r in runs])
    problems = []
    for rp in plans:
        problems += [f"{rp.run.label}: {p}" for p in rp.problems]
        plannable = all(j.args for j in rp.jobs)
        lock_problem = locks.check(exp, rp, relock) if plannable else None
        if lock_problem:
            problems.append(f"{rp.run.label}: {lock_problem}")
        if live.get(rp.run.label):
            problems.append(f"{rp.run.label}: already queued or running: job(s) {', '.join(live[rp.run.label])}; "
                            "wait for them or scancel them first")
    if problems:
        raise UserError("\n".join(problems) + f"\npreflight: {len(problems)} problem(s) in {len(plans)} run(s); "
                        "nothing was submitted")
    print(f"preflight: PASS ({len(plans)} run(s), {sum(len(rp.jobs) for rp in plans)} job(s))")
    for rp in plans:
        stamp = dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")
        ids: dict[str, str] = {}
        for job in rp.jobs:
            if job.pre_create is not None:
                job.pre_create.mkdir(parents=True, exist_ok=True)
            dep = ids.get(job.after) if job.after else None
            try:
                job_id, log = _sbatch(job.submit_argv(dep_job=dep))
            except UserError as exc:
                raise UserError(f"{rp.run.label}: {job.phase}: {exc} (jobs submitted before it: "
                                f"{' '.join(ids.values()) or 'none'}; status shows them)") from None
            if not ids:  # the lock records what was queued: written once the run's first job is
                written = locks.write(exp, rp, force=relock)
                if written:
                    print(f"{rp.run.label}: locked {written}")
            ids[job.phase] = job_id
            board.record_job(exp, rp.run.label, job, job_id, log, stamp)
            after = f" after {job.after} ({job.dep_type}:{dep})" if dep else ""
            print(f"{rp.run.label}: {job.phase}: job {job_id}{after}; log {log or '-'}")
    print(f"status: python pipeline_experiment.py status {exp.path}")
    return 0


# ---- status ----------------------------------------------------------------------------------------------------
def cmd_status(exp: spec.Experiment, only: list[str] | None, watch: float | None, no_plots: bool) -> int:
    plans = planning.plan_experiment(exp, exp.select(only), allow_config_change=True)
    while True:
        statuses = board.collect(exp, plans)
        if not only:  # a run submitted and since edited out of the file still runs: shown, never hidden
            statuses += board.removed_runs(exp, plans)
        plots = {}
        if not no_plots:
            plots = write_plots(exp, plans)
            plots.update(write_eval_plots(exp, statuses))
        text = board.board(exp, statuses, plots)
        if watch is not None and sys.stdout.isatty():
            print("\033[2J\033[H", end="")
        stamp = time.strftime("%H:%M:%S")
        print(text if watch is None else f"{text}\n(updated {stamp}; every {watch:g} s; Ctrl-C to stop)", flush=True)
        if watch is None or board.all_finished(statuses):
            return 0
        time.sleep(max(1.0, watch))


# ---- csv -------------------------------------------------------------------------------------------------------
def cmd_csv(exp: spec.Experiment, changed: bool, output: Path | None) -> int:
    plans = planning.plan_experiment(exp, allow_config_change=True)
    statuses = board.collect(exp, plans)
    keys = list(dict.fromkeys(k for rp in plans for k in (rp.run.values if changed else rp.run.overrides)))
    buf = io.StringIO()
    w = csv.writer(buf)
    columns = [*board.RESULT_COLUMNS, *board.eval_columns(statuses)]  # one column per task metric evaluated
    w.writerow(["run", *keys, *columns])
    for rp, st in zip(plans, statuses):
        fields = rp.run.values if changed else rp.run.overrides
        res = board.result_row(rp, st)
        w.writerow([rp.run.label, *(fields.get(k, "") for k in keys), *("" if res.get(c) is None else res[c]
                                                                          for c in columns)])
    out = output or planning.state_dir(exp) / ("results.changed.csv" if changed else "results.csv")
    write_output_text(out, buf.getvalue())
    print(f"{len(plans)} row(s) -> {out}", file=sys.stderr if str(out) == "/dev/stdout" else sys.stdout)
    return 0


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("PIPELINE_ROOT", str(paths.repo_root()))
    if args.command == "runs":
        return cmd_runs(args.root or paths.runs_dir())
    exp = _load(args.experiment)
    if args.command == "list":
        return cmd_list(exp, args.all)
    if args.command == "render":
        return cmd_render(exp, args.only, args.no_configs)
    if args.command == "submit":
        # One submit of an experiment at a time: its locks and its record of submitted jobs are read, then written.
        state = planning.state_dir(exp)
        state.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(state / ".submit.lock", f"experiment {exp.name} (a submit is running)"):
            return cmd_submit(exp, args.only, args.relock, args.allow_config_change)
    if args.command == "status":
        return cmd_status(exp, args.only, args.watch, args.no_plots)
    return cmd_csv(exp, args.changed, args.output)
