"""What an experiment's runs are doing: Slurm's view of each job and the run records on disk.

Sources, in order, for a job's state: ``scontrol show job`` (queued, running, and finished for MinJobAge), then
``sacct`` (accounting, when the cluster keeps it), then the jobcomp text file (``JobCompType=jobcomp/filetxt``),
then the run records alone (``TRAINING_DONE``: completed). Progress comes from the run directory
(``progress.ndjson``, ``metrics_summary.json``, the checkpoint tracker), exports from ``<iter>/hf/verification.json``
and coherence from the report JSON. The submission record (``submissions.json``: job id and log per phase) is
written by ``submit`` into ``$PIPELINE_RUNS_DIR/_experiments/<experiment>/``.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import layout, shell, yamlio
from pipeline.common.errors import UserError
from pipeline.common.io import read_json, write_json
from pipeline.evaluation.run import read_results
from pipeline.experiment.plan import Job, RunPlan, state_dir
from pipeline.experiment.spec import Experiment
from pipeline.training import goodput
from pipeline.training.records import read_progress, read_summary

FAILED_STATES = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")
DONE_STATES = ("COMPLETED", *FAILED_STATES)
LIVE_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "REQUEUE_HOLD",
               "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED")


# ---- the submission record ----------------------------------------------------------------------------------
def submissions_path(exp: Experiment) -> Path:
    return state_dir(exp) / "submissions.json"


def read_submissions(exp: Experiment) -> dict[str, Any]:
    """The submission record; a file that is not the record this tool writes is one line (UserError), never read
    as empty: that showed every run as "not submitted" and the next submit would have overwritten the record."""
    p = submissions_path(exp)
    if not p.exists():
        return {"runs": {}}
    fix = "fix it or move it aside (the job ids are also in Slurm: squeue --me); nothing was changed"
    try:
        data = read_json(p)
    except (OSError, ValueError) as exc:
        raise UserError(f"{p} is not readable JSON ({str(exc).splitlines()[0][:120]}): {fix}") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs", {}), dict):
        raise UserError(f"{p} is not a submission record (no 'runs' mapping): {fix}")
    data.setdefault("runs", {})
    for label, entry in data["runs"].items():
        jobs = entry.get("jobs") if isinstance(entry, dict) else None
        if not isinstance(jobs, dict) or not all(isinstance(j, dict) and isinstance(j.get("job_id", ""), str)
                                                 for j in jobs.values()):
            raise UserError(f"{p}: the entry of run {label!r} is malformed (expected jobs: {{phase: {{job_id, "
                            f"log}}}}): {fix}")
    return data


def record_job(exp: Experiment, label: str, job: Job, job_id: str, log: str | None, submitted_at: str) -> None:
    data = read_submissions(exp)
    entry = data["runs"].setdefault(label, {"jobs": {}})
    if entry.get("submitted_at") != submitted_at:  # a new submission of this run replaces the old record
        entry.update({"submitted_at": submitted_at, "jobs": {}})
    entry["jobs"][job.phase] = {"job_id": job_id, "log": log, "kind": job.kind, "after": job.after}
    data["experiment"] = exp.name
    data["file"] = str(exp.path)
    write_json(submissions_path(exp), data)


# ---- Slurm ---------------------------------------------------------------------------------------------------
@dataclass
class SlurmState:
    state: str
    reason: str = ""
    source: str = ""
    elapsed: str = ""


def _run(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return res.stdout if res.returncode == 0 else ""


def _fields(line: str) -> dict[str, str]:
    return {m[1]: m[2] for m in re.finditer(r"(\w+)=(\S*)", line)}


def slurm_states(job_ids: list[str]) -> dict[str, SlurmState]:
    """Each job's state from the first source that knows it."""
    out: dict[str, SlurmState] = {}
    ids = [j for j in dict.fromkeys(job_ids) if j and j.isdigit()]
    for j in ids:
        line = _run(["scontrol", "show", "job", j, "-o"]).strip()
        if line:
            f = _fields(line)
            out[j] = SlurmState(f.get("JobState", "UNKNOWN"), f.get("Reason", ""), "scontrol", f.get("RunTime", ""))
    missing = [j for j in ids if j not in out]
    if missing:
        text = _run(["sacct", "-n", "-P", "-X", "-o", "JobIDRaw,State,Elapsed", "-j", ",".join(missing)])
        for row in text.splitlines():
            parts = row.split("|")
            if len(parts) >= 3 and parts[0] in missing:
                out[parts[0]] = SlurmState(parts[1].split()[0], "", "sacct", parts[2])
    missing = [j for j in ids if j not in out]
    if missing:
        comp = _jobcomp_file()
        if comp is not None:
            try:
                lines = comp.read_text(errors="replace").splitlines()
            except OSError:
                lines = []
            for line in lines:  # the last line of a job wins (a requeued job has several)
                f = _fields(line)
                if f.get("JobId") in missing:
                    out[f["JobId"]] = SlurmState(f.get("JobState", "UNKNOWN"), "", "jobcomp")
    return out


def _jobcomp_file() -> Path | None:
    text = _run(["scontrol", "show", "config"])
    conf = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", text, flags=re.M))
    if conf.get("JobCompType") == "jobcomp/filetxt" and conf.get("JobCompLoc"):
        return Path(conf["JobCompLoc"])
    return None


# ---- run records -------------------------------------------------------------------------------------------
def progress(run_dir: Path | None) -> list[dict]:
    """progress.ndjson, one record per step, lines with wrong field types skipped (the records module reads it)."""
    return read_progress(run_dir)


def summary(run_dir: Path | None) -> dict:
    """metrics_summary.json with its fields of a wrong type left out (the records module reads it)."""
    return read_summary(run_dir)


def verified_exports(save: Path | None) -> list[int]:
    if save is None:
        return []
    out = []
    for it in layout.list_iterations(save):
        try:
            rec = read_json(layout.iter_dir(save, it) / "hf" / "verification.json")
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("verdict") == "PASS":
            out.append(it)
    return out


def coherence_summary(report: Path | None) -> dict:
    try:
        data = read_json(report) if report is not None else None
    except (OSError, ValueError):
        return {}
    results = data.get("results") if isinstance(data, dict) else None
    if not results or not isinstance(results[0], dict):
        return {}
    summ = results[0].get("summary")
    return dict(summ) if isinstance(summ, dict) else {}


@dataclass
class PhaseRow:
    label: str
    phase: str
    kind: str
    job_id: str = ""
    state: str = "not submitted"
    reason: str = ""
    step: int | None = None
    total: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    checkpoint: int | None = None
    exports: list[int] = field(default_factory=list)
    coherence: dict = field(default_factory=dict)
    run_dir: Path | None = None
    log: str | None = None
    goodput: dict | None = None  # where the run's time went so far (training/goodput.py), from its events


@dataclass
class RunStatus:
    label: str
    rows: list[PhaseRow]
    verdict: str
    removed: bool = False  # submitted, but no longer in the experiment file
    evals: list[dict] = field(default_factory=list)  # every finished evaluation of its checkpoints (run_evals)


def run_evals(rp: RunPlan) -> list[dict]:
    """The lm-eval results of a run's checkpoints (``iter_N/hf/eval/*.json``, written by ``upload-all --eval`` or
    ``pipeline_eval_harness.py``), oldest first; each with its phase and ``step`` (the iteration offset by the
    phase's start, the loss curves' axis)."""
    out, seen = [], set()
    for job in rp.jobs:
        if job.kind != "train" or job.save is None or job.save.resolve() in seen:
            continue
        seen.add(job.save.resolve())
        for s in read_results(job.save):
            out.append({**s, "phase": job.phase, "step": (s["iteration"] or 0) + job.start_iter})
    return sorted(out, key=lambda s: s["step"])


def eval_line(evals: list[dict]) -> str:
    """The latest result of a run, one line: its iteration and each task's headline metric."""
    last = evals[-1]
    tasks = "; ".join(f"{t} {h.get('metric')} {h.get('value'):.4f}" for t, h in last["tasks"].items()
                      if isinstance(h, dict) and isinstance(h.get("value"), (int, float)))
    n = len({e["step"] for e in evals})
    return f"eval (latest, {last['phase']} iter {last['iteration']}): {tasks or '-'} ({n} iteration(s) evaluated)"


def eval_columns(statuses: list[RunStatus]) -> list[str]:
    """The results CSV's evaluation columns: one per task metric any run reported (of its latest evaluation)."""
    keys = {k for s in statuses for e in s.evals for k in e["metrics"]}
    return ["eval_iteration", *(f"eval_{k.replace('/', '_')}" for k in sorted(keys))] if keys else []


def _tokens_per_s(recs: list[dict], s: dict) -> float | None:
    if s.get("tokens_per_second"):
        return float(s["tokens_per_second"])
    tail = recs[-6:]
    for a, b in zip(reversed(tail[:-1]), reversed(tail[1:])):
        dt, dtok = b.get("time", 0) - a.get("time", 0), b.get("tokens", 0) - a.get("tokens", 0)
        if isinstance(dt, (int, float)) and dt > 0 and dtok > 0:
            return round(dtok / dt, 1)
    return None


def collect(exp: Experiment, plans: list[RunPlan]) -> list[RunStatus]:
    subs = read_submissions(exp)["runs"]
    ids = [j.get("job_id", "") for rp in plans for j in (subs.get(rp.run.label) or {}).get("jobs", {}).values()]
    states = slurm_states(ids)
    out = []
    for rp in plans:
        jobs = (subs.get(rp.run.label) or {}).get("jobs", {})
        rows = []
        for job in rp.jobs:
            rec = jobs.get(job.phase) or {}
            row = PhaseRow(label=rp.run.label, phase=job.phase, kind=job.kind, job_id=rec.get("job_id", ""),
                           run_dir=job.run_dir, log=rec.get("log"), total=job.iters if job.kind == "train" else None)
            st = states.get(row.job_id)
            if st is not None:
                row.state, row.reason = st.state, st.reason
            elif row.job_id:
                row.state = "UNKNOWN"
            if job.kind == "train":
                recs, s = progress(job.run_dir), summary(job.run_dir)
                if recs:
                    row.step = recs[-1]["step"]
                    row.loss = last_loss(recs)
                    row.tokens_per_s = _tokens_per_s(recs, s)
                if job.run_dir is not None and (job.run_dir / layout.TRAINING_DONE).exists() and \
                        row.state in ("UNKNOWN", "not submitted") and row.job_id:
                    row.state = "COMPLETED"  # Slurm has forgotten the job; the run records say it finished
                if job.run_dir is not None:
                    try:
                        row.goodput = goodput.split(goodput.read_events(job.run_dir))
                    except UserError:  # not a file one can read: the board shows no goodput for it
                        row.goodput = None
                if job.save is not None and job.save.is_dir() and saves_into(job.run_dir, job.save):
                    row.checkpoint = layout.latest_complete(job.save)
                    row.exports = verified_exports(job.save)
            elif job.kind == "export":
                row.exports = verified_exports(job.save)
            elif job.kind == "coherence":
                row.coherence = coherence_summary(job.output)
            rows.append(row)
        out.append(RunStatus(label=rp.run.label, rows=rows, verdict=verdict(rows), evals=run_evals(rp)))
    return out


RUN_MARKERS = ("config.yaml", "progress.ndjson", "manifest.json")


def run_state(run_dir: Path, job_state: str | None) -> str:
    """A run's state from its records, Slurm's (when it still knows the job) taking precedence while it is live."""
    if job_state in LIVE_STATES:
        return job_state.lower()
    if (run_dir / layout.TRAINING_DONE).exists():
        return "completed"
    if (run_dir / "FAILED_NAN").exists():
        return "failed (non-finite loss)"
    status = summary(run_dir).get("status")
    if status:
        return str(status)
    return (job_state or "unknown").lower()


def run_rows(root: Path) -> list[tuple[str, str, int | None, float | None, str, int | None, str]]:
    """(run, state, step, last loss, Slurm job, latest complete checkpoint, owner) for every run directory under
    ``root`` (a folder holding a run's records), however it was submitted; a folder the reader may not read is
    listed as such, never skipped."""
    def manifest(d: Path) -> dict:
        try:
            m = read_json(d / "manifest.json")
        except (OSError, ValueError):
            return {}
        return m if isinstance(m, dict) else {}

    dirs = []
    try:
        entries = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    except OSError as exc:
        raise UserError(f"runs root {root} cannot be read ({_why(exc)}): name a folder you may read") from None
    for d in entries:
        try:
            if any((d / m).exists() for m in RUN_MARKERS):
                dirs.append(d)
        except PermissionError:
            dirs.append(d)
    def last_job(d: Path) -> str:
        """The Slurm job of the run's last launch; "" for a manifest of another shape ({"launches": 5} crashed)."""
        ls = manifest(d).get("launches")
        last = ls[-1] if isinstance(ls, list) and ls else {}
        job = last.get("slurm_job_id") if isinstance(last, dict) else None
        return str(job) if isinstance(job, (str, int)) and not isinstance(job, bool) else ""

    jobs = {d: last_job(d) for d in dirs}
    states = slurm_states([j for j in jobs.values() if j])
    rows: list[tuple[str, str, int | None, float | None, str, int | None, str]] = []
    for d in dirs:
        try:
            owner = pwd.getpwuid(d.stat().st_uid).pw_name
        except (KeyError, OSError):
            owner = "?"
        if not os.access(d, os.R_OK | os.X_OK):
            rows.append((d.name, "unreadable", None, None, "", None, owner))
            continue
        job = jobs[d]
        st = states.get(job)
        try:  # a record another user may not read, or that is not what it should be: the row says so
            recs = progress(d)
            loss = last_loss(recs)
            state = run_state(d, st.state if st else None)
        except (OSError, UserError) as exc:
            rows.append((d.name, f"unreadable ({_why(exc)})", None, None, job, None, owner))
            continue
        try:
            save = _run_save(d)
            ckpt = layout.latest_complete(save) if save is not None and save.is_dir() and saves_into(d, save) else None
        except (OSError, UserError):
            ckpt = None  # its save folder (another user's, or a tracker that is not one): no checkpoint to show
        rows.append((d.name, state, recs[-1]["step"] if recs else None,
                     round(loss, 4) if loss is not None else None, f"{job} ({st.state})" if st else job, ckpt, owner))
    return rows


def _why(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0])[:80]


def last_loss(recs: list[dict]) -> float | None:
    """The loss of the last step that logged one, non-finite ones included (recorded as text: "nan"): a run whose
    loss went NaN must not show its last finite loss."""
    for r in reversed(recs):
        v = r.get("loss")
        if v is not None:
            return float(v)
    return None


def saves_into(run_dir: Path | None, save: Path) -> bool:
    """Whether ``save``'s checkpoints are this run's: its owner record names the run (or it has none yet). A run
    refused at its save claim (the folder is another run's) must not show the other run's checkpoint."""
    try:
        owner = read_json(save / layout.OWNER_FILE)
    except (OSError, ValueError):
        return True
    if not isinstance(owner, dict) or not owner.get("run_dir") or run_dir is None:
        return True
    try:
        return Path(str(owner["run_dir"])).resolve() == Path(run_dir).resolve()
    except (OSError, RuntimeError):
        return False


def _run_save(run_dir: Path) -> Path | None:
    """The run's checkpoint.save from its config of record (config.yaml); None where it has none."""
    try:
        cfg = yamlio.read_record(run_dir / "config.yaml")
    except (OSError, ValueError, yaml.YAMLError):
        return None
    ck = cfg.get("checkpoint") if isinstance(cfg, dict) else None  # null or a scalar there crashed `runs`
    save = ck.get("save") if isinstance(ck, dict) else None
    return Path(save) if isinstance(save, str) and save else None


def removed_runs(exp: Experiment, plans: list[RunPlan]) -> list[RunStatus]:
    """Runs of the submission record that the experiment file no longer names (an axis value was edited or removed
    after ``submit``): their jobs still run and write, so they are shown from the record, with Slurm's state and the
    job's log, never hidden."""
    planned = {rp.run.label for rp in plans}
    subs = read_submissions(exp)["runs"]
    gone = [label for label in subs if label not in planned]
    states = slurm_states([j.get("job_id", "") for label in gone for j in subs[label]["jobs"].values()])
    out = []
    for label in gone:
        rows = []
        for phase, rec in subs[label]["jobs"].items():
            row = PhaseRow(label=label, phase=phase, kind=str(rec.get("kind") or "-"), job_id=rec.get("job_id", ""),
                           log=rec.get("log"))
            st = states.get(row.job_id)
            row.state, row.reason = (st.state, st.reason) if st is not None else ("UNKNOWN", "")
            rows.append(row)
        out.append(RunStatus(label=label, rows=rows, verdict=verdict(rows), removed=True))
    return out


def verdict(rows: list[PhaseRow]) -> str:
    """One line for a run's chain: done, running <phase>, or stopped at the phase that failed."""
    main = [r for r in rows if not r.phase.endswith(".upload_all")]
    if all(r.state == "not submitted" for r in main):
        return "not submitted"
    failed = next((r for r in main if r.state in FAILED_STATES), None)
    if failed is not None:
        after = [r.phase for r in main[main.index(failed) + 1:]]
        rest = f"; {', '.join(after)} will not run" if after else ""
        return f"stopped at {failed.phase} ({failed.state}, job {failed.job_id}){rest}"
    if all(r.state == "COMPLETED" for r in main):
        return "done"
    live = next((r for r in main if r.state in LIVE_STATES and r.state != "PENDING"), None)
    if live is not None:
        return f"{live.state.lower()}: {live.phase}"
    pending = next((r for r in main if r.state == "PENDING"), None)
    if pending is not None:
        return f"pending: {pending.phase}" + (f" ({pending.reason})" if pending.reason else "")
    return "unknown: " + ", ".join(f"{r.phase} {r.state}" for r in main)


def blocked_jobs(statuses: list[RunStatus]) -> list[str]:
    """Jobs left pending behind a failed phase (DependencyNeverSatisfied): submissions made before phases carried
    --kill-on-invalid-dep=yes, or a Slurm that has not cancelled them yet."""
    return [r.job_id for s in statuses if s.verdict.startswith("stopped at") for r in s.rows
            if r.state == "PENDING" and r.job_id]


def cancelled_behind(statuses: list[RunStatus]) -> list[str]:
    """Jobs Slurm cancelled because the phase they waited for failed (--kill-on-invalid-dep=yes)."""
    return [r.job_id for s in statuses if s.verdict.startswith("stopped at") for r in s.rows
            if r.state == "CANCELLED" and r.job_id]


# ---- the board ----------------------------------------------------------------------------------------------
def _f(v: Any, spec: str = "") -> str:
    if v is None or v == []:
        return "-"
    return format(v, spec) if spec else str(v)


def board(exp: Experiment, statuses: list[RunStatus], plots: dict[str, Path] | None = None) -> str:
    head = ["run", "phase", "job", "state", "step", "loss", "tok/s", "ckpt", "exports", "coherence", "goodput"]
    rows = []
    for s in statuses:
        for r in s.rows:
            coh = r.coherence
            coh_s = (f"{coh.get('num_prompts')}p empty {coh.get('empty_pct')}% rep {coh.get('repetitive_pct')}%"
                     if coh else "-")
            step = f"{_f(r.step)}/{_f(r.total)}" if r.kind == "train" else "-"
            state = r.state + (f" ({r.reason})" if r.reason and r.reason != "None" and r.state == "PENDING" else "")
            good = r.goodput.get("goodput") if r.goodput else None
            rows.append([s.label, r.phase, r.job_id or "-", state, step, _f(r.loss, ".4f"), _f(r.tokens_per_s, ".0f"),
                         _f(r.checkpoint), ",".join(map(str, r.exports)) or "-", coh_s,
                         f"{100 * good:.0f}%" if isinstance(good, (int, float)) else "-"])
    rows = [[shell.one_line(str(x)) for x in row] for row in rows]  # a value's ESC or CR never printed raw
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [f"experiment {exp.name} ({exp.path})"]
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *rows]]
    for s in statuses:
        curve = f"; loss curve {plots[s.label]}" if plots and s.label in plots else ""
        gone = ""
        if s.removed:
            logs = [r.log for r in s.rows if r.log]
            gone = " (submitted, but no longer in the experiment file" + (f"; log {logs[-1]}" if logs else "") + ")"
        lines.append(f"{s.label}: {s.verdict}{curve}{gone}")
        if s.evals:
            plot = f"; eval plot {plots[s.label + ':eval']}" if plots and s.label + ":eval" in plots else ""
            lines.append(f"  {eval_line(s.evals)}{plot}")
        for r in s.rows:
            if r.goodput:
                lines.append(f"  {r.phase} time: {goodput.line(r.goodput)}")
    if plots and "__overlay__" in plots:
        lines.append(f"loss curves of every run: {plots['__overlay__']}")
    cancelled = cancelled_behind(statuses)
    if cancelled:
        lines.append(f"{len(cancelled)} job(s) behind a phase that failed were cancelled by Slurm (their dependency "
                     f"can never be satisfied): {' '.join(cancelled)}")
    blocked = blocked_jobs(statuses)
    if blocked:
        lines.append(f"{len(blocked)} job(s) wait for a phase that failed and will never start: scancel "
                     + " ".join(blocked))
    return "\n".join(shell.one_line(line) for line in lines)


def all_finished(statuses: list[RunStatus]) -> bool:
    return all(s.verdict == "done" or s.verdict.startswith("stopped at") or s.verdict == "not submitted"
               for s in statuses)


# ---- results -------------------------------------------------------------------------------------------------
RESULT_COLUMNS = ["status", "final_loss", "best_loss", "steps", "tokens", "wall_seconds", "tokens_per_second",
                  "goodput", "submission_to_end_seconds",
                  "coherence_num_prompts", "coherence_empty_pct", "coherence_truncated_pct", "coherence_repetitive_pct",
                  "coherence_template_leak_pct", "coherence_mean_response_tokens"]


def result_row(rp: RunPlan, st: RunStatus) -> dict[str, Any]:
    """Final and best loss of the last training phase that ran, tokens and wall time over every training phase,
    and the coherence summary of the last coherence phase."""
    trains = [j for j in rp.jobs if j.kind == "train"]
    sums = [summary(j.run_dir) for j in trains]
    ran = [(j, s) for j, s in zip(trains, sums) if s]
    last = ran[-1][1] if ran else {}
    recs = progress(ran[-1][0].run_dir) if ran else []
    losses = [r["loss"] for r in recs if isinstance(r.get("loss"), (int, float))]
    row: dict[str, Any] = {
        "status": st.verdict,
        "final_loss": last.get("final_loss", losses[-1] if losses else None),
        "best_loss": last.get("best_loss", min(losses) if losses else None),
        # a phase continuing another's iteration N (its summary's start_step) trained final_step - N steps itself
        "steps": sum(int(s.get("final_step") or 0) - int(s.get("start_step") or 0) for _, s in ran) if ran else None,
        "tokens": sum(int(s.get("tokens") or 0) for _, s in ran) if ran else None,
        "wall_seconds": round(sum(float(s.get("train_seconds") or 0) for _, s in ran), 2) if ran else None,
        "tokens_per_second": last.get("tokens_per_second"),
        "goodput": (last.get("goodput") or {}).get("goodput"),
        "submission_to_end_seconds": round(sum(float((s.get("goodput") or {}).get("total_seconds") or 0)
                                               for _, s in ran), 2) if ran else None,
    }
    coh = next((r.coherence for r in reversed(st.rows) if r.kind == "coherence" and r.coherence), {})
    for k in ("num_prompts", "empty_pct", "truncated_pct", "repetitive_pct", "template_leak_pct",
              "mean_response_tokens"):
        row[f"coherence_{k}"] = coh.get(k)
    latest: dict[str, float] = {}
    for e in st.evals:  # each metric from the latest evaluation that reported it
        latest.update(e["metrics"])
    if st.evals:
        row["eval_iteration"] = st.evals[-1]["iteration"]
        row.update({f"eval_{k.replace('/', '_')}": v for k, v in latest.items()})
    return row
