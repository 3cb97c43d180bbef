"""The job registry: every kind of job the suite submits, the batch script that runs it and the module that parses and
plans it. ``isambard_sbatch`` and the experiment layer look a job up here, by its batch script and first word, and
call its planner; nothing else maps a script name to a pipeline.

A planned kind's module (``module``) has two functions, both pure of Slurm:

  parse_job(args)              the job's own words (the batch script's arguments) -> its request object, read by the
                               job's own parser (a usage mistake: UserError, one line)
  plan_job(request, placement) -> its plan, a ``jobs.plan.BasePlan`` (problems listed, never raised)

``Placement`` is what a submission adds to the job's words: Slurm's node count, the cluster profile, and whether the
job waits for another whose outputs are its inputs. The data and environment jobs are not planned (their checks need
only the standard library: ``cli/submission.submit_checks``), so a bare login node checks them too.

This module imports only the standard library and ``pipeline.common``: ``isambard_sbatch`` reads it on a login node
with no pipeline environment, and the planners are imported only when a job is planned (``load``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from pipeline.common.errors import UserError
from pipeline.common.paths import (
    CHECKPOINT_SUBMIT,
    COHERENCE_SUBMIT,
    DATA_SUBMIT,
    ENV_SUBMIT,
    EVAL_SUBMIT,
    TRAINING_SUBMIT,
)


@dataclass(frozen=True)
class Placement:
    """What a submission adds to a job's own words: Slurm's node count (``nodes``; ``nodes_named``: the submission or
    the script's header gives it, else it is sbatch's default of one), the cluster profile (None: the job's own
    --cluster, else its default) and ``inputs_later`` (a --dependency job: the paths it reads are an earlier job's
    outputs, checked by the job when it starts)."""

    nodes: int = 1
    nodes_named: bool = False
    cluster: str | None = None
    inputs_later: bool = False

    def check_own_nodes(self, own: int | None, whose: str) -> None:
        """A job's own --nodes (``whose``: "the launcher's") against the allocation's count: the job plans and runs
        on its own count inside an allocation of another (the launch refuses it when it starts, or waits for nodes
        that are not there), so a submission that disagrees is refused (UserError, one line)."""
        if own is None or own == self.nodes:
            return
        sbatch = f"sbatch's --nodes={self.nodes}" + ("" if self.nodes_named else
                                                     " (its default: neither the command line nor the script sets it)")
        raise UserError(f"{whose} --nodes {own} and {sbatch} disagree: the job would plan one node count on an "
                        f"allocation of another; give the count once, to sbatch (--nodes={own})")


@dataclass(frozen=True)
class JobSpec:
    """One kind of job: its name, the batch script that runs it, the script's first words that select it (empty:
    the script runs this kind only), the module that parses and plans it (None: checked, not planned) and the command
    that runs it by hand inside ``salloc``."""

    kind: str
    script: str
    actions: tuple[str, ...]
    module: str | None
    by_hand: str
    requeues: bool = False  # its batch script saves and requeues itself on a pre-limit signal (--signal=B:USR1@S)

    @property
    def planned(self) -> bool:
        return self.module is not None


JOBS: tuple[JobSpec, ...] = (
    JobSpec("train", TRAINING_SUBMIT, (), "pipeline.cli.train", "pipeline_training_launch.sh", requeues=True),
    JobSpec("export", CHECKPOINT_SUBMIT, ("export",), "pipeline.cli.checkpoint", "pipeline_checkpoint_convert.sh"),
    JobSpec("import", CHECKPOINT_SUBMIT, ("import",), "pipeline.cli.checkpoint", "pipeline_checkpoint_convert.sh"),
    JobSpec("upload-all", CHECKPOINT_SUBMIT, ("upload-all",), "pipeline.cli.checkpoint",
            "pipeline_checkpoint_convert.sh"),
    JobSpec("coherence", COHERENCE_SUBMIT, (), "pipeline.cli.coherence", "pipeline_coherence_test.py"),
    JobSpec("evaluate", EVAL_SUBMIT, (), "pipeline.cli.evaluation", "pipeline_eval_harness.py"),
    JobSpec("data", DATA_SUBMIT, ("prepare", "tokenize", "pack"), None, "pipeline_data_prepare.py"),
    JobSpec("env", ENV_SUBMIT, ("setup", "validate"), None, "pipeline_env_setup.sh"),
)
BY_KIND = {j.kind: j for j in JOBS}
SCRIPTS: tuple[str, ...] = tuple(dict.fromkeys(j.script for j in JOBS))  # every shipped batch script


def resolve(script: str, args: list[str] | tuple[str, ...] = ()) -> JobSpec | None:
    """The kind of job a submission of ``script`` (a path or name) with ``args`` runs; None for a script that is not
    one of the suite's (isambard_sbatch submits any script). A script of several kinds is resolved by its first word;
    one it does not know resolves to the script's first kind, whose parser then says what it takes."""
    name = Path(script).name
    kinds = [j for j in JOBS if j.script == name]
    if not kinds:
        return None
    first = args[0] if args else None
    return next((j for j in kinds if first in j.actions), kinds[0])


def load(job: JobSpec) -> ModuleType:
    """The module that parses and plans ``job`` (ImportError where the pipeline environment or the login node's
    planner is missing: the caller says how to make one)."""
    if job.module is None:
        raise ValueError(f"the {job.kind} job is checked, not planned")
    return importlib.import_module(job.module)
