"""pipeline_eval_harness.py MODEL [--tasks T1,T2] [--num-fewshot N] [--batch-size B] [--limit N] [options]

Benchmark evaluation of a Hugging Face export with lm-evaluation-harness (its Python API: simple_evaluate on its
HFLM model class). Results go beside the model (MODEL/eval/<tasks>.json: the harness's own result format plus our
summary, written atomically) and to W&B (offline without an API key): the headline metric of each task as a
series over the iteration, a table per iteration. One line per task in the log.

Tasks: the local task pipeline_smoke (data in the checkout: checks the path, not model quality), a folder of your
own task YAMLs (--tasks-path DIR), or the harness's built-in tasks where the cluster profile's hub is online; a
task whose data this machine cannot reach is refused before any model loads.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoint.plan import JobPlan, print_plan, refuse
from pipeline.cli.parser import Parser, path_arg
from pipeline.common.argv import strip_options
from pipeline.common.errors import cli_main
from pipeline.common.log import setup_logging
from pipeline.config.job_env import apply_job_env
from pipeline.evaluation.plan import plan_evaluate
from pipeline.evaluation.run import EvalRun, run
from pipeline.evaluation.tasks import SMOKE_TASK
from pipeline.jobs.registry import Placement


def _limit(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None


def add_eval_options(p: Parser) -> None:
    """The evaluation options (also upload-all's, after its --eval TASKS)."""
    p.add_argument("--tasks-path", action="append", type=Path, default=[], metavar="DIR",
                   help="a folder of lm-eval task YAMLs to add (repeatable)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples per question (default: each task's own)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=_limit, help="examples per task (a fraction in (0, 1): of each task's)")


def device_arg(value: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``: another word would run the evaluation on the CPU and exit 0."""
    # ASCII digits without a leading zero: \d would take non-ASCII digits ("cuda:١") and cuda:00
    if not re.fullmatch(r"cpu|cuda(:(0|[1-9][0-9]{0,2}))?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: use cpu, cuda or cuda:N")
    return value


def build_parser() -> Parser:
    p = Parser(prog="pipeline_eval_harness.py", description=__doc__)
    p.add_argument("model", help="a Hugging Face export (an iteration's hf/) or hub id")
    p.add_argument("--tasks", default=SMOKE_TASK, help=f"comma-separated task names (default {SMOKE_TASK})")
    add_eval_options(p)
    p.add_argument("--device", type=device_arg, help="cpu, cuda or cuda:N (default: cuda when present, else cpu)")
    p.add_argument("--output-dir", type=path_arg, help="default: MODEL/eval/")
    p.add_argument("--wandb-project", default=os.environ.get("EVAL_WANDB_PROJECT", "pipeline-evals"))
    p.add_argument("--no-wandb", action="store_true")
    p.add_argument("--force", action="store_true", help="replace earlier results of these tasks measured with other "
                   "settings (limit, few-shot, task folders); without it such a run is refused")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (GPUs, memory per GPU, launch line, the tasks' data) and exit; 2 when it "
                        "cannot run. Needs no GPU or container (the login node's planner)")
    p.add_argument("--nodes", type=int, help="with --dry-run outside an allocation: the node count Slurm will give")
    p.add_argument("--json", action="store_true", help="with --dry-run: the plan as one JSON object")
    return p


PLAN_FLAGS = ("--dry-run", "--json")


@dataclass(frozen=True)
class Request:
    """A evaluation command line as read: the run, the words the job runs with (the plan flags and --nodes taken out:
    its launch line), the node count given (--nodes) and the dry run's flags."""

    run: EvalRun
    argv: tuple[str, ...]
    nodes: int | None = None
    dry_run: bool = False
    as_json: bool = False


def parse_job(argv: list[str]) -> Request:
    """The registry's parser (jobs/registry.py), and the command line's: the words -> the request (checked)."""
    args = vars(build_parser().parse_args(argv))
    dry_run, given_nodes, as_json = args.pop("dry_run"), args.pop("nodes"), args.pop("json")
    args["tasks_path"] = tuple(args["tasks_path"])
    cfg = EvalRun(**args)
    cfg.check()
    return Request(cfg, tuple(strip_options(argv, PLAN_FLAGS, ("--nodes",))), given_nodes, dry_run, as_json)


def plan_request(req: Request, nodes: int | None = None, inputs_later: bool = False,
                 cluster: str | None = None) -> JobPlan:
    """The request's plan (``nodes``: Slurm's count when --nodes is not given, else the allocation's; ``cluster``:
    the profile, else PIPELINE_CLUSTER's)."""
    return plan_evaluate(req.run, nodes=req.nodes if req.nodes is not None else nodes, cluster=cluster,
                         argv=list(req.argv), inputs_later=inputs_later)


def plan_job(req: Request, placement: Placement) -> JobPlan:
    """The registry's planner: the request placed as a submission places it (its own --nodes, a dry run's
    option, must be the allocation's)."""
    placement.check_own_nodes(req.nodes, "the job's")
    return plan_request(req, placement.nodes, placement.inputs_later, placement.cluster)


def plan_from_argv(argv: list[str], nodes: int | None = None, inputs_later: bool = False) -> JobPlan:
    """The plan of a command line (a dry run's)."""
    return plan_request(parse_job(argv), nodes, inputs_later)


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    req = parse_job(argv)
    cfg, dry_run, as_json = req.run, req.dry_run, req.as_json
    plan = plan_request(req)
    setup_logging(quiet=cfg.quiet)
    if dry_run:
        return print_plan(plan, as_json)
    refuse(plan)  # before any model loads: an unreachable task's data, a missing model, a model that does not fit
    apply_job_env(plan.env)
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
