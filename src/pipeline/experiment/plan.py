"""An experiment's runs as Slurm jobs: each phase of each run resolved to one ``isambard_sbatch`` line.

A training phase is the training launcher's own plan (``plan_from_args``: recipe < YAML < overrides, the run
directory, the preflight), so its resolved config is exactly the one the job will record. Later phases take
their inputs from the planned outputs of the phase they start from (``from``):

  train <- train      init: continue (default): ``checkpoint.load=<save> checkpoint.ckpt_step=N`` (N: ``iteration``,
                      default the last): its optimizer, scheduler and iteration count go on, ``train.train_iters``
                      (set by ``tokens``) counting on from N, checkpoints in the phase's own save;
                      init: weights: ``checkpoint.pretrained_checkpoint=<save>/iter_N``, iterations from 1
  export <- train     ``export <save> --iteration <its last iteration>``, published as ``<save>/iter_N/hf``
  coherence <- export ``<save>/iter_N/hf`` (or the iteration directory itself, from a training phase)

and wait for it with ``--dependency=afterok:<job>``, so a failed phase stops the chain. Their inputs do not exist
until the parent job has run: isambard_sbatch checks only the shape of a dependent submission's arguments and
leaves the paths to the job (``submit_checks(inputs_later=True)``). ``upload_all`` rides along a training phase
as ``upload-all --poll`` with ``--dependency=after:<job>`` (it starts when training starts).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.common import layout, paths, shell
from pipeline.common.argv import flag_value, has_flag
from pipeline.common.errors import UserError
from pipeline.common.paths import CHECKPOINT_SUBMIT, COHERENCE_SUBMIT, TRAINING_SUBMIT
from pipeline.config.kinds import JobKind
from pipeline.config.models import get_model
from pipeline.experiment.spec import Experiment, Phase, Run, render_override
from pipeline.slurm.sbatch_options import check_signal_lead, script_directives
from pipeline.training.launch import LaunchRequest, plan_launch
from pipeline.training.records import check_run_identity

STATE_DIR = "_experiments"  # $PIPELINE_RUNS_DIR/_experiments/<experiment>/: submissions, plots, results


def state_dir(exp: Experiment) -> Path:
    return paths.runs_dir() / STATE_DIR / exp.name


def lock_dir(exp: Experiment) -> Path:
    """Locks live beside the experiment file (``locks/<experiment>/<label>.lock.yaml``): commit them with it."""
    return exp.path.parent / "locks" / exp.name


@dataclass
class Job:
    phase: str                   # the phase name ("<phase>.upload_all" for the rider)
    kind: JobKind
    script: str
    args: list[str]
    sbatch: list[str]
    after: str | None = None     # the phase this job waits for
    dep_type: str = "afterok"
    run_name: str | None = None  # training: run directory / W&B name
    run_dir: Path | None = None
    save: Path | None = None
    iters: int | None = None
    start_iter: int = 0          # where this phase's logged steps sit in the run's history (the plots' offset)
    continues: int | None = None  # a training phase continuing another's iteration N (init: continue): N
    cfg: dict | None = None
    output: Path | None = None   # export: the published hf/; coherence: the report JSON
    identity_diff: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    pre_create: Path | None = None  # a directory isambard_sbatch's checks need before queueing (the rider's)

    def submit_argv(self, dep_job: str | None = None) -> list[str]:
        """isambard_sbatch's arguments (without the program name)."""
        opts = list(self.sbatch)
        if self.after is not None:
            opts.insert(0, f"--dependency={self.dep_type}:{dep_job if dep_job is not None else '$JOB'}")
            # a phase whose dependency can never be satisfied (the previous phase failed) is cancelled by Slurm,
            # not left pending for ever (DependencyNeverSatisfied)
            opts.insert(1, "--kill-on-invalid-dep=yes")
        return [*opts, self.script, *self.args]

    def saved_iterations(self) -> list[int]:
        """The iterations a training phase will checkpoint: multiples of save_interval and the last one."""
        if self.iters is None:
            return []
        every = int(((self.cfg or {}).get("checkpoint") or {}).get("save_interval") or self.iters)
        first = self.continues or 0  # a continuing phase's iterations (and saves) count on from N
        return sorted({*(i for i in range(every, self.iters + 1, max(1, every)) if i > first), self.iters})


@dataclass
class RunPlan:
    run: Run
    jobs: list[Job]

    @property
    def problems(self) -> list[str]:
        return [f"{j.phase}: {p}" for j in self.jobs for p in j.problems]

    def job(self, phase: str) -> Job | None:
        return next((j for j in self.jobs if j.phase == phase), None)


def _merge_opts(*groups: list[str] | tuple[str, ...]) -> list[str]:
    """sbatch options, a later ``--name[=value]`` replacing an earlier one of the same name."""
    out: list[str] = []
    for group in groups:
        for opt in group:
            name = opt.split("=", 1)[0]
            if name.startswith("--"):
                out = [o for o in out if o.split("=", 1)[0] != name]
            out.append(opt)
    return out


def _directives(script: str) -> list[str]:
    return script_directives(str(paths.repo_root() / script))


def _cluster(exp: Experiment) -> str | None:
    """The cluster profile the runs are planned for: base.cluster, else a --cluster in base.flags; both differing is
    refused (the job would run on the flag's)."""
    flag = flag_value(exp.base.flags, "--cluster")
    if exp.base.cluster and flag and flag != exp.base.cluster:
        raise UserError(f"base.cluster {exp.base.cluster!r} and base.flags --cluster {flag!r} differ: give one")
    return exp.base.cluster or flag


def _max_restarts(exp: Experiment) -> int | None:
    value = flag_value(exp.base.flags, "--max-restarts")
    return int(value) if value is not None else None


def _pipeline_flags(exp: Experiment) -> list[str]:
    flags = list(exp.base.flags)
    if exp.base.cluster and not has_flag(flags, "--cluster"):
        flags += ["--cluster", exp.base.cluster]
    return flags


def plan_run(exp: Experiment, run: Run, allow_config_change: bool = False) -> RunPlan:
    """Every job of one run, in submission order; a problem is recorded on its job, never raised."""
    jobs: list[Job] = []
    by_phase: dict[str, Job] = {}
    for phase in exp.phases:
        src = by_phase.get(phase.start) if phase.start else None
        if phase.start and (src is None or not src.args or src.iters is None):
            job = Job(phase=phase.name, kind=phase.kind, script="", args=[], sbatch=[], after=phase.start)
            job.problems.append(f"cannot be planned: phase {phase.start!r}, which it starts from, could not be planned")
        elif phase.kind == "train":
            job = _train_job(exp, run, phase, src, allow_config_change)
        elif src is None:  # spec.py refuses an export or coherence phase without 'from'
            raise ValueError(f"phase {phase.name!r}: a {phase.kind} phase starts from another")
        elif phase.kind == "export":
            job = _export_job(exp, run, phase, src)
        else:
            job = _coherence_job(exp, run, phase, src)
        jobs.append(job)
        by_phase[phase.name] = job
        if phase.kind == "train" and phase.upload_all is not None and job.args:
            jobs.append(_upload_all_job(exp, run, phase, job))
    return RunPlan(run=run, jobs=jobs)


def _train_argv(exp: Experiment, overrides: dict[str, Any], name: str) -> list[str]:
    return [*_pipeline_flags(exp), *(render_override(k, v) for k, v in overrides.items()),
            f"logger.wandb_exp_name={name}"]


def _train_job(exp: Experiment, run: Run, phase: Phase, src: Job | None, allow_config_change: bool) -> Job:
    name = exp.run_name(run, phase)
    ov = {**run.overrides, **run.phase_overrides.get(phase.name, {})}  # spec.py resolved ${exp.*} in them
    job = Job(phase=phase.name, kind="train", script=TRAINING_SUBMIT, args=[], run_name=name,
              sbatch=_merge_opts([f"--nodes={run.node_count(exp.base)}"], exp.base.sbatch, phase.sbatch),
              after=src.phase if src else None)

    try:  # every phase's time limit against the pre-limit save signal, before any is queued (else
        # a later phase's --time=5 is refused by isambard_sbatch after the first phase has been queued)
        check_signal_lead(str(paths.repo_root() / TRAINING_SUBMIT), job.sbatch)
    except UserError as exc:
        job.problems.append(str(exc))
    if src is not None:
        if src.save is None:  # (that phase's own problem says so too)
            job.problems.append(f"phase {src.phase!r} saves no checkpoints (checkpoint.save is null)")
            return job
        it = src.iters if phase.iteration in (None, "last") else int(phase.iteration)
        saved = src.saved_iterations()
        if it is None or it not in saved:
            job.problems.append(f"iteration {it} of phase {src.phase!r} is never saved (it saves "
                                f"{', '.join(map(str, saved[:10]))}): pick one of those or change its "
                                "checkpoint.save_interval")
            return job
        if phase.init == "weights":
            ov["checkpoint.pretrained_checkpoint"] = str(layout.iter_dir(src.save, it))
            job.start_iter = src.start_iter + it
        else:
            if (src.cfg or {}).get("checkpoint", {}).get("save_optim") is False:
                job.problems.append(f"init: continue needs the optimizer state, and phase {src.phase!r} saves none "
                                    "(checkpoint.save_optim: false): use init: weights, or let it save the optimizer")
                return job
            ov["checkpoint.load"], ov["checkpoint.ckpt_step"] = str(src.save), it
            job.start_iter, job.continues = src.start_iter, it

    def resolve(overrides: dict[str, Any]):
        words = [*(render_override(k, v) for k, v in overrides.items()), f"logger.wandb_exp_name={name}"]
        req = LaunchRequest(config=exp.base.config, model=exp.base.model, mode=exp.base.mode, overrides=tuple(words),
                            disable_ft="--disable-ft" in exp.base.flags, nodes=run.node_count(exp.base),
                            cluster=_cluster(exp),
                            peft=flag_value(exp.base.flags, "--peft"), allow_config_change=True,
                            max_restarts=_max_restarts(exp),
                            # a phase after another starts from its checkpoint, which exists once that phase ran:
                            # its launcher checks the paths when the job starts (isambard_sbatch does the same)
                            path_checks=src is None)
        launch = plan_launch(req)
        return launch.cfg, launch.run_dir, launch.preflight, {"model": launch.spec.name, "mode": req.mode,
                                                              "peft": req.peft}

    try:
        with _at_root():
            cfg, run_dir, plan, identity = resolve(ov)
            if phase.tokens is not None:
                gbs, seq = cfg.train.global_batch_size, cfg.model.seq_length
                if gbs and seq:  # unset or mistyped: the preflight names it
                    ov["train.train_iters"] = (job.continues or 0) + max(1, math.ceil(phase.tokens / (gbs * seq)))
                    cfg, run_dir, plan, identity = resolve(ov)
    except UserError as exc:
        job.problems.append(str(exc).splitlines()[0])
        return job
    job.cfg, job.run_dir = cfg.to_dict(), Path(run_dir)
    job.save = Path(cfg.checkpoint.save) if cfg.checkpoint.save else None
    job.iters = cfg.train.train_iters
    if src is not None and job.continues is not None and (job.iters or 0) <= job.continues:
        job.problems.append(f"train.train_iters={job.iters} is not past iteration {job.continues} of phase "
                            f"{src.phase!r}, which this phase continues: train_iters counts on from there (the "
                            "total); give the phase tokens: or a larger train.train_iters")
    job.args = [exp.base.config, exp.base.model, exp.base.mode, *_train_argv(exp, ov, name)]
    if allow_config_change:
        job.args.insert(3, "--allow-config-change")
    job.problems += list(plan.problems)
    job.identity_diff = check_run_identity(job.run_dir, cfg, allow_change=True, launch=identity)
    if job.identity_diff and not allow_config_change:
        keys = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(job.identity_diff.items())[:6])
        job.problems.append(f"run directory {job.run_dir} holds a run with a different config ({keys}): it is not "
                            "resumed or finished with this one; rename the experiment or the run's axis values, or "
                            "pass --allow-config-change to continue it with the new config")
    if job.save is None and any(p.start == phase.name for p in exp.phases):
        job.problems.append("checkpoint.save is null, but a later phase starts from this phase's checkpoints")
    return job


def _hf_reasoning(exp: Experiment, args: tuple[str, ...]) -> list[str]:
    out = []
    if not has_flag(args, "--hf-model"):
        out += ["--hf-model", get_model(exp.base.model).hf_id]
    if not has_flag(args, "--reasoning", "--no-reasoning"):
        out.append("--no-reasoning")
    return out


def _export_job(exp: Experiment, run: Run, phase: Phase, src: Job) -> Job:
    job = Job(phase=phase.name, kind="export", script=CHECKPOINT_SUBMIT, args=[], after=src.phase,
              sbatch=_merge_opts(_directives(CHECKPOINT_SUBMIT), exp.base.sbatch, phase.sbatch,
                                 [f"--job-name=checkpoint-{exp.name}.{run.label}.{phase.name}"]))
    if src.save is None or src.iters is None:  # (plan_run passes a phase that was planned: iters is set)
        job.problems.append(f"phase {src.phase!r} saves no checkpoints (checkpoint.save is null)")
        return job
    if "--iteration" in phase.args:
        job.problems.append("the export's iteration is the last one of the phase it starts from; leave out --iteration")
        return job
    job.save, job.iters, job.start_iter = src.save, src.iters, src.start_iter
    job.args = ["export", str(src.save), *_hf_reasoning(exp, phase.args), "--iteration", str(src.iters), *phase.args]
    job.output = layout.iter_dir(src.save, src.iters) / "hf"
    return job


def _coherence_job(exp: Experiment, run: Run, phase: Phase, src: Job) -> Job:
    job = Job(phase=phase.name, kind="coherence", script=COHERENCE_SUBMIT, args=[], after=src.phase,
              sbatch=_merge_opts(_directives(COHERENCE_SUBMIT), exp.base.sbatch, phase.sbatch,
                                 [f"--job-name=coherence-{exp.name}.{run.label}.{phase.name}"]))
    if src.save is None or src.iters is None:
        job.problems.append(f"phase {src.phase!r} produces no model to test")
        return job
    model = src.output if src.kind == "export" else layout.iter_dir(src.save, src.iters)
    if model is None:  # plan_run passes only an export that was planned, which has its output
        raise ValueError(f"phase {src.phase!r} has no output to test")
    job.save, job.iters = src.save, src.iters
    job.args = [str(model), *phase.args]
    backend = flag_value(phase.args, "--backend") or "hf"
    out_dir = flag_value(phase.args, "--output-dir")
    job.output = (Path(out_dir) if out_dir else Path(model) / "coherence") / f"coherence_{backend}.json"
    return job


def _upload_all_job(exp: Experiment, run: Run, phase: Phase, train: Job) -> Job:
    args = phase.upload_all or ()
    name, sbatch = f"{phase.name}.upload_all", _merge_opts(exp.base.sbatch, phase.sbatch)
    if train.save is None:  # the line would have read "upload-all None" and polled a folder named None
        job = Job(phase=name, kind="upload-all", script=CHECKPOINT_SUBMIT, args=[], sbatch=sbatch, after=phase.name)
        job.problems.append(f"phase {phase.name!r} saves no checkpoints (checkpoint.save is null): upload-all has "
                            "nothing to convert; set checkpoint.save or drop upload_all")
        return job
    return Job(phase=name, kind="upload-all", script=CHECKPOINT_SUBMIT,
               args=["upload-all", str(train.save), *_hf_reasoning(exp, args), "--poll", *args],
               sbatch=sbatch, after=phase.name, dep_type="after",
               save=train.save, iters=train.iters, pre_create=train.save)



class _at_root:
    """Relative config paths are relative to the repository root, as in every pipeline command."""

    def __enter__(self):
        self.prev = os.getcwd()
        os.chdir(paths.repo_root())

    def __exit__(self, *exc):
        os.chdir(self.prev)


def plan_experiment(exp: Experiment, runs: list[Run] | None = None, allow_config_change: bool = False) -> list[RunPlan]:
    plans = [plan_run(exp, r, allow_config_change) for r in (exp.runs if runs is None else runs)]
    shared_saves(plans)
    return plans


def shared_saves(plans: list[RunPlan]) -> None:
    """Two training jobs (of two runs, or two phases) whose ``checkpoint.save`` resolves to one directory would
    overwrite each other, and the later would resume from the earlier's weights: a problem on each, in one line
    naming both (the launcher refuses the same through the save's owner record)."""
    first: dict[Path, tuple[str, Job]] = {}
    for rp in plans:
        for job in rp.jobs:
            if job.kind != "train" or job.save is None or job.run_dir is None:
                continue
            key = job.save.resolve()
            label = f"{rp.run.label}/{job.phase} ({job.run_dir})"
            if key in first and first[key][1].run_dir != job.run_dir:
                other, ojob = first[key]
                line = (f"checkpoint.save {key} is shared by runs {other} and {label}: each run needs its own "
                        "(make checkpoint.save depend on the run, e.g. under its run directory)")
                job.problems.append(line)
                if line not in ojob.problems:
                    ojob.problems.append(line)
            else:
                first.setdefault(key, (label, job))


def render_lines(exp: Experiment, rp: RunPlan) -> list[str]:
    """The exact shell lines that submit one run's chain (``--parsable`` ids in JOB_<n> variables)."""
    out: list[str] = []
    var: dict[str, str] = {}
    for i, job in enumerate(rp.jobs, 1):
        if job.problems:
            out.append(shell.comment(f"{job.phase}: submit refuses: {'; '.join(job.problems)}"))
        if not job.args:
            continue
        dep = f"${{{var[job.after]}%%;*}}" if job.after in var else None
        argv = job.submit_argv(dep_job="DEP" if dep else None)
        # one physical line whatever the values hold (common/shell.py)
        words = [shell.quote(w) for w in ["isambard_sbatch", "--parsable", *argv]]
        if dep:  # the dependency is the first option (Job.submit_argv); replaced by position, not by a text search
            assert argv[0] == f"--dependency={job.dep_type}:DEP", argv[0]  # a text search rewrites a user's option
            words[2] = f'"--dependency={job.dep_type}:{dep}"'
        line = " ".join(words)
        if job.pre_create is not None:
            out.append(f"mkdir -p {shell.quote(str(job.pre_create))}")
        name = f"JOB_{i}"
        var[job.phase] = name
        out.append(f"{name}=$({line})  {shell.comment(job.phase)}")
    return out


