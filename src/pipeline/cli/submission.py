"""isambard_sbatch's checks of a pipeline job before anything is queued, so that a mistake is one line now and not a
failed job after the queue wait. The job is looked up in the job registry (``jobs/registry.py``) by its batch script
and first word: the data and environment jobs' arguments go through their own checks (the data CLI's
``check_submission``, which needs only the standard library), and every other job is planned by call: its own parser
reads its words into a request and its planner returns a plan on the plan base (``jobs/plan.py``; training's
preflight included), whose problems refuse the submission. The plans need the pipeline venv or the login node's
planner.

``inputs_later`` (a ``--dependency`` submission): the job waits for another, whose outputs are this job's inputs;
their existence is then checked by the job itself, and only the shape of the arguments here."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.common.argv import flag_values
from pipeline.common.errors import UserError
from pipeline.common.paths import DATA_SUBMIT, ENV_SUBMIT, TRAINING_SUBMIT
from pipeline.config.cluster import DEFAULT_PROFILE, load_cluster
from pipeline.jobs import registry
from pipeline.jobs.plan import BasePlan
from pipeline.slurm.sbatch_options import (  # check_signal_lead: its home is the slurm layer (experiments plan it)
    check_signal_lead,
    gpus_per_node_asked,
    node_count,
    option_value,
    submitted_value,
)

DATA_ACTIONS = ("prepare", "tokenize", "pack")
ENV_ACTIONS = ("setup", "validate")  # pipeline_env_submit.sbatch runs pipeline_env_setup.sh (bash: no parser here)
PLANNER_SETUP = "bash pipeline_env_setup.sh --only planner"


def planner_fix(cluster: str | None = None) -> str:
    """The command that gives this user a login-node planner, naming where it goes (PIPELINE_PLANNER_VENV); a
    teammate's planner this user cannot run (isambard_sbatch sets PIPELINE_PLANNER_UNUSABLE) gets one of their own."""
    cluster = cluster if cluster is not None else os.environ.get("PIPELINE_CLUSTER")
    prefix = f"PIPELINE_CLUSTER={cluster} " if cluster else ""
    venv = os.environ.get("PIPELINE_PLANNER_VENV", "")
    unusable = os.environ.get("PIPELINE_PLANNER_UNUSABLE")
    if unusable:
        return (f"the planner at {venv} (PIPELINE_PLANNER_VENV) cannot be run by you: its Python {unusable} is not "
                f"yours to run; make your own with: PIPELINE_PLANNER_VENV=$HOME/.cache/pipeline/planner {prefix}"
                f"{PLANNER_SETUP}, and export that PIPELINE_PLANNER_VENV")
    where = f" (it is made at PIPELINE_PLANNER_VENV={venv})" if venv else ""
    return f"create the planner with: {prefix}{PLANNER_SETUP}{where}"
PIPELINE_SCRIPTS = registry.SCRIPTS  # every shipped batch script (jobs/registry.py)


@dataclass(frozen=True)
class JobCheck:
    """What checking a job found out: a training run's name and the cluster profile its plan resolved (None where
    no training plan was made here)."""

    run_name: str | None = None
    cluster: Any = None  # config.cluster.ClusterProfile of the training plan


def check_job(script: str, script_args: list[str], opts: list[str], required: bool = True) -> JobCheck:
    """Every check of one job before it is queued (UserError, one line per problem), the job looked up in the
    registry (jobs/registry.py) by its batch script and first word: the data and environment jobs' arguments, the
    plan of every other (training's preflight included). ``opts``: the submission's sbatch options (a --dependency
    leaves the inputs to the job); ``required`` False (--no-preflight): a plan that cannot be made here is skipped
    with a warning."""
    job = registry.resolve(script, script_args)
    if job is None:
        return JobCheck()  # not one of the suite's scripts: isambard_sbatch submits it with the bad nodes excluded
    inputs_later = option_value(opts, "--dependency", "-d") is not None
    refuse_placement_options(script, opts)
    if not job.planned:
        submit_checks(script, script_args, inputs_later=inputs_later,
                      nodes=node_count(opts, script) if job.script == DATA_SUBMIT else 1)
        return JobCheck()
    if job.requeues:
        check_signal_lead(script, opts)
    plan = plan_job(job, script, script_args, opts, required=required, inputs_later=inputs_later)
    if plan is None:
        return JobCheck()
    if not plan.ok:
        raise plan.refusal()
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(plan.pass_line(), file=sys.stderr)
    return JobCheck(run_name=plan.run_name, cluster=plan.profile if job.kind == "train" else None)


def plan_job(job: registry.JobSpec, script: str, script_args: list[str], opts: list[str], required: bool = True,
             inputs_later: bool = False) -> BasePlan | None:
    """The plan of a submission (its problems listed, not raised), made here as the job would make it: the job's own
    parser reads its words into its request (a usage mistake: UserError, one line), and its planner places it as
    the submission does (Slurm's node count, PIPELINE_CLUSTER, ``inputs_later``); the GPUs per node the submission
    asks for, in any form sbatch takes, are compared with the plan's. None where the planner cannot run here and
    ``required`` is False (--no-preflight). Needs the pipeline venv or the login node's planner."""
    name = Path(script).name
    placement = registry.Placement(nodes=node_count(opts, script),
                                   nodes_named=submitted_value(opts, script, "--nodes", "-N") is not None,
                                   cluster=os.environ.get("PIPELINE_CLUSTER") or None, inputs_later=inputs_later)
    try:  # the job's own parser and plan: a usage mistake is the pipeline's own one line
        planner = registry.load(job)
        plan: BasePlan = planner.plan_job(planner.parse_job(list(script_args)), placement)
    except UserError as exc:
        raise UserError(str(exc) if job.kind == "train" else f"{name}: {exc}") from None
    except ImportError as exc:  # a login node without the pipeline venv or the planner (the container posture)
        if required:
            raise UserError(f"{planner_missing(job, exc)} (or pass --no-preflight to queue without the checks); "
                            "nothing was submitted") from None
        print(f"warning: {planner_skipped(job, exc)}", file=sys.stderr)
        return None
    # every form: --gpus-per-node, --gres=gpu:N, --gpus/-G N (a total over the nodes Slurm allocates)
    asked = gpus_per_node_asked(opts, script, placement.nodes)
    if asked is not None:
        plan.check_gpus_asked(*asked)
    return plan


def planner_skipped(job: registry.JobSpec, exc: ImportError) -> str:
    if job.kind == "train":
        return (f"preflight skipped (--no-preflight): the pipeline environment is not available here ({exc}); the "
                "job checks its config when it starts")
    return f"plan check skipped (--no-preflight): {exc}"


def planner_missing(job: registry.JobSpec, exc: ImportError) -> str:
    """Why a job's plan cannot be made here, and the fix: a container runtime's login node gets the planner, a venv
    machine the venv itself (training); the other plans name the planner."""
    if job.kind == "train":
        fix = (planner_fix() if os.environ.get("PIPELINE_RUNTIME") == "apptainer" else
               "create the pipeline venv with: bash pipeline_env_setup.sh")
        return f"the training preflight cannot run here: no pipeline venv or login-node planner ({exc}); {fix}"
    return (f"the {Path(job.script).name} plan cannot be checked here: no pipeline venv or login-node planner "
            f"({exc}); {planner_fix()}")


ENV_OF = {"--array": "SBATCH_ARRAY_INX"}  # sbatch's input environment variable of an option (man sbatch)


def refuse_placement_options(script: str, opts: list[str]) -> None:
    """sbatch options a pipeline job script cannot honour: ``--chdir`` (the scripts' ``#SBATCH --output=logs/...`` is
    relative to it, so the job fails before it writes a log when the directory has no logs/slurm) and ``--array``
    (every task of the array would run the same job: several trainings writing one run directory)."""
    name = Path(script).name
    for names, why in ((("--chdir", "-D"), "the job's log (#SBATCH --output=logs/slurm/...) and the checkout are "
                        "relative to the submit directory; submit from the directory to work in instead"),
                       (("--array", "-a"), "every array task would run this same job (one run directory, one output "
                        "path); submit one job per run (an experiment file sweeps values)")):
        # sbatch's input variables count as the options (else SBATCH_ARRAY_INX would get past the refusal)
        value = submitted_value(opts, script, *names, env=ENV_OF.get(names[0]))
        if value is not None:
            raise UserError(f"{names[0]}={value} is not supported for {name}: {why}")


def submit_checks(script: str, args: list[str], inputs_later: bool = False, nodes: int = 1) -> None:
    """The cheap checks of a data or environment submission (UserError naming the job script); a data job on
    ``nodes`` > 1 also prints how its corpus is split (``data.check_submission``)."""
    name = Path(script).name
    if name == ENV_SUBMIT:
        if not args or args[0] not in ENV_ACTIONS:
            raise UserError(f"{name}: the action must be setup or validate (got {args[0] if args else 'none'!r})")
    elif name == DATA_SUBMIT:
        from pipeline.cli import data

        # the job script's own mapping: any other first argument is the reference's positional pack-only form
        argv = list(args) if args and args[0] in DATA_ACTIONS else ["pack", *args]
        try:
            data.check_submission(argv, inputs_later=inputs_later, nodes=nodes)
        except UserError as exc:
            raise UserError(f"{name}: {exc}") from None


def run_job_name(run_name: str | None, config: str) -> str:
    """The Slurm job name of a training run: ``training-<run>``. The auto-requeue chain's singleton key is the
    job name, so two runs' chains never block each other."""
    base = run_name or Path(config).stem
    return "training-" + (re.sub(r"[^A-Za-z0-9._-]", "_", base)[:100] or "run")


def submission_profile(script: str | None, script_args: list[str]):
    """The cluster profile of a submission whose training plan could not be made here (``--no-preflight`` on a
    login node without the planner; a planned training job takes its plan's profile), in the training launcher's
    order: a training job's ``--cluster NAME``, else PIPELINE_CLUSTER (which pipeline_env_config.env's knobs came
    from), else a training config's ``pipeline.cluster`` (read without YAML: there is no venv), else local_cpu."""
    given = flag_values(script_args, "--cluster")  # the last one wins, as in the launcher's parser
    name = (given[-1] if given else None) or os.environ.get("PIPELINE_CLUSTER")
    if not name and script is not None and Path(script).name == TRAINING_SUBMIT and script_args:
        try:
            text = Path(script_args[0]).read_text(errors="replace")
        except OSError:
            text = ""
        m = re.search(r"^pipeline:[ \t]*(?:#.*)?\n(?:[ \t]+.*\n|[ \t]*#.*\n|[ \t]*\n)*?[ \t]+cluster:[ \t]*"
                      r"[\"']?([A-Za-z0-9_.-]+)", text, re.M)
        name = m.group(1) if m and m.group(1) != "null" else None
    return load_cluster(name or DEFAULT_PROFILE)
