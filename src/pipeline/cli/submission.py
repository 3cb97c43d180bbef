"""isambard_sbatch's checks of a pipeline job before anything is queued, so that a mistake is one line now and not a
failed job after the queue wait. Each job's arguments go through its own pipeline's parser and checks: the data
CLI's (cli/data.py ``check_submission``), the checkpoint and coherence CLIs' parsers and plans (``plan_from_argv``)
and the training launcher's preflight (cli/train.py ``plan_from_argv``). The data check and the option handling
need only the standard library; the plans need the pipeline venv or the login node's planner.

``inputs_later`` (a ``--dependency`` submission): the job waits for another, whose outputs are this job's inputs;
their existence is then checked by the job itself, and only the shape of the arguments here."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.common.argv import flag_values
from pipeline.common.errors import UserError
from pipeline.common.paths import (
    CHECKPOINT_SUBMIT,
    COHERENCE_SUBMIT,
    DATA_SUBMIT,
    ENV_SUBMIT,
    EVAL_SUBMIT,
    TRAINING_SUBMIT,
)
from pipeline.config.cluster import DEFAULT_PROFILE, load_cluster
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
# the job script -> its pipeline's CLI, whose plan_from_argv parses the job's arguments and plans it
GPU_JOB_SCRIPTS = {CHECKPOINT_SUBMIT: "pipeline.cli.checkpoint", COHERENCE_SUBMIT: "pipeline.cli.coherence",
                   EVAL_SUBMIT: "pipeline.cli.evaluation"}
PIPELINE_SCRIPTS = (TRAINING_SUBMIT, DATA_SUBMIT, ENV_SUBMIT, *GPU_JOB_SCRIPTS)


@dataclass(frozen=True)
class JobCheck:
    """What checking a job found out: a training run's name and the cluster profile its plan resolved (None where
    no training plan was made here)."""

    run_name: str | None = None
    cluster: Any = None  # config.cluster.ClusterProfile of the training plan


def check_job(script: str, script_args: list[str], opts: list[str], required: bool = True) -> JobCheck:
    """Every check of one job before it is queued (UserError, one line per problem): the data and environment jobs'
    arguments, the checkpoint and coherence jobs' plans, the training job's preflight. ``opts``: the submission's
    sbatch options (a --dependency leaves the inputs to the job); ``required`` False (--no-preflight): a plan that
    cannot be made here is skipped with a warning."""
    inputs_later = option_value(opts, "--dependency", "-d") is not None
    name = Path(script).name
    if name in PIPELINE_SCRIPTS:
        refuse_placement_options(script, opts)
    submit_checks(script, script_args, inputs_later=inputs_later,
                  nodes=node_count(opts, script) if name == DATA_SUBMIT else 1)
    if name in GPU_JOB_SCRIPTS:
        gpu_job_plan(script, script_args, opts, required=required, inputs_later=inputs_later)
    if name == TRAINING_SUBMIT:
        check_signal_lead(script, opts)
        launch = training_preflight(script_args, opts, required=required, script=script)
        if launch is not None:
            run = launch.cfg.logger.wandb_exp_name
            return JobCheck(run_name=str(run) if run else None, cluster=launch.cluster)
    return JobCheck()


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


def check_training_gpus(launch, opts: list[str], script: str | None) -> None:
    """The GPUs per node a training submission asks for, in any form sbatch takes, against the plan's: the launcher
    starts one rank per GPU Slurm gives, so another count trains a layout the preflight never checked."""
    if not launch.cluster.has_gpus:
        return
    asked = gpus_per_node_asked(opts, script, launch.nodes)
    planned = launch.cluster.gpus_per_node
    if asked is not None and asked[0] != planned:
        raise UserError(f"{asked[1]} gives {asked[0]} GPU(s) per node, and the training plan (cluster profile "
                        f"{launch.cluster.name}) is for {planned}: submit with --gpus-per-node={planned} (or none: "
                        "isambard_sbatch adds the profile's); nothing was submitted")


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


def gpu_job_plan(script: str, script_args: list[str], opts: list[str], required: bool = True,
                 inputs_later: bool = False) -> None:
    """The plan of a checkpoint or coherence submission (checkpoint/plan.py, coherence/plan.py), made here as the
    job would make it: a layout that cannot run, a node count the job cannot use or a model that does not fit is
    refused (UserError, one line per problem) before the queue wait. Needs the pipeline venv or the login node's
    planner, as the training preflight does."""
    nodes = node_count(opts, script)
    try:
        cli = importlib.import_module(GPU_JOB_SCRIPTS[Path(script).name])
    except ImportError as exc:
        if required:
            raise UserError(f"the {Path(script).name} plan cannot be checked here: no pipeline venv or login-node "
                            f"planner ({exc}); {planner_fix()} (or pass --no-preflight to "
                            "queue without the checks); nothing was submitted") from None
        print(f"warning: plan check skipped (--no-preflight): {exc}", file=sys.stderr)
        return
    try:  # the job's own parser and plan: a usage mistake is the pipeline's own one line
        plan = cli.plan_from_argv(list(script_args), nodes, inputs_later=inputs_later)
    except UserError as exc:
        raise UserError(f"{Path(script).name}: {exc}") from None
    asked = gpus_per_node_asked(opts, script, nodes)  # every form: --gpus-per-node, --gres=gpu:N, --gpus/-G N
    if asked is not None and asked[0] < plan.gpus_per_node:
        plan.problems.append(f"the {plan.kind} plan ({plan.engine}) uses {plan.gpus_per_node} GPU(s) per node, and "
                             f"{asked[1]} gives {asked[0]}: submit with --gpus-per-node={plan.gpus_per_node}"
                             f" (the plan: {plan.kind} ... --dry-run)")
    if not plan.ok:
        raise UserError("\n".join(plan.problems) + f"\nplan: {len(plan.problems)} problem(s); nothing was submitted")
    memory = (f"memory estimate {plan.memory_per_gpu_gb:.1f} GB per GPU" if plan.memory_per_gpu_gb > 0 else
              "memory not estimated (no size facts of the model yet: an export still to be written, or a model "
              "the registry does not know; the job checks it when it starts)")
    print(f"Plan: PASS - {plan.kind}: world {plan.world} on {plan.nodes} node(s) (tp {plan.layout.tp} pp "
          f"{plan.layout.pp} ep {plan.layout.ep}), {memory}", file=sys.stderr)


def training_preflight(script_args: list[str], opts: list[str], required: bool = True, script: str | None = None):
    """Run the training preflight for a pipeline_training_submit.sbatch submission; UserError on failure.
    Returns the launch plan (``training.launch.LaunchPlan``: the run's name, its cluster profile), or None when
    the preflight could not run here: that is refused (UserError naming the command that creates the login-node
    planner) unless ``required`` is False (``--no-preflight``).

    The job's own words (CONFIG MODEL MODE, launcher flags, Hydra overrides) are parsed once, by the launcher's
    parser, into a ``LaunchRequest``, as the job's launcher will parse them; what the submission adds (the node
    count, the path checks a dependent job leaves to itself, the cluster) is set on the request, not appended to an
    argv for the parser to read again."""
    if len(script_args) < 3:
        raise UserError(f"{TRAINING_SUBMIT} needs CONFIG MODEL MODE [launcher flags] [overrides]")
    nodes = node_count(opts)  # the training script's header sets no --nodes
    config, model, mode, *rest = script_args
    cluster = os.environ.get("PIPELINE_CLUSTER")
    try:
        from pipeline.cli.train import parse_job_args  # the pipeline environment: not there on a bare login node
        from pipeline.training.launch import plan_launch

        request = parse_job_args(config, model, mode, rest)
        if option_value(opts, "--dependency", "-d") is not None:
            # a job that waits for another leaves its inputs (the previous phase's checkpoint) to the job, whose
            # launcher checks them when it starts, as submit_checks does for the other pipelines
            request = dataclasses.replace(request, path_checks=False)
        if request.nodes is not None and option_value(opts, "--nodes", "-N") is not None \
                and request.nodes != nodes:
            raise UserError(f"the launcher's --nodes {request.nodes} and sbatch's --nodes={nodes} disagree: the job "
                            "would plan one node count on an allocation of another; give the count once, to sbatch")
        request = dataclasses.replace(request, nodes=request.nodes or nodes,
                                      cluster=request.cluster or cluster or None)
        launch = plan_launch(request)
    except ImportError as exc:  # a login node without the pipeline venv or the planner (the container posture)
        if required:
            # The container runtime's login node gets the planner; a venv machine gets the venv itself.
            fix = (planner_fix(cluster)
                   if os.environ.get("PIPELINE_RUNTIME") == "apptainer" else
                   "create the pipeline venv with: bash pipeline_env_setup.sh")
            raise UserError(f"the training preflight cannot run here: no pipeline venv or login-node planner "
                            f"({exc}); {fix} (or pass --no-preflight to queue without the checks); nothing was "
                            "submitted") from None
        print(f"warning: preflight skipped (--no-preflight): the pipeline environment is not available here "
              f"({exc}); the job checks its config when it starts", file=sys.stderr)
        return None
    check_training_gpus(launch, opts, script)
    plan = launch.preflight
    if not plan.ok:
        raise UserError("\n".join(plan.problems)
                        + f"\npreflight: {len(plan.problems)} problem(s); nothing was submitted")
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    lay = plan.layout
    print(f"Preflight: PASS - world {lay.world} (tp {lay.tp} pp {lay.pp} cp {lay.cp} ep {lay.ep} dp {lay.dp}), "
          f"memory estimate {plan.memory_gb.get('total', 0):.1f} of {plan.memory_budget_gb:g} GB", file=sys.stderr)
    return launch


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
