"""pipeline_coherence_test.py MODEL [--compare MODEL2 ...] [options]

Generates responses to 8 diverse prompts (or --prompts FILE) and reports a table of prompt, response,
response length and empty flag, plus summary metrics that catch more than emptiness (truncation at the
token limit, repetition loops, chat-template artefacts). Results go to W&B (offline without an API key)
and to JSON + Markdown beside the model (MODEL/coherence/, or --output-dir).

Backends: hf (local HF directory or hub id), endpoint (a running OpenAI-compatible server:
--endpoint-url URL or --discovery-file FILE), megatron (a Megatron checkpoint, GPUs; --hf-model ID).
Exit code 1 when any response is empty (a broken model), unless --allow-empty.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline import bridge
from pipeline.checkpoint.plan import JobPlan, print_plan, refuse
from pipeline.cli.parser import Parser, path_arg
from pipeline.coherence.plan import plan_coherence
from pipeline.coherence.run import BACKENDS, CoherenceRun, megatron_iteration, run
from pipeline.common.argv import strip_options
from pipeline.common.errors import cli_main
from pipeline.common.log import setup_logging
from pipeline.config.job_env import apply_job_env
from pipeline.jobs.registry import Placement


def build_parser() -> Parser:
    p = Parser(prog="pipeline_coherence_test.py", description=__doc__)
    p.add_argument("model", help="HF directory or hub id (hf), served model id (endpoint), Megatron ckpt (megatron)")
    p.add_argument("--compare", action="append", default=[], metavar="MODEL",
                   help="another model to run on the same prompts, side by side in one report (repeatable)")
    p.add_argument("--backend", choices=BACKENDS, default="hf")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", type=Path, help="prompt file: one per line, a JSON list, or JSONL with 'prompt'")
    p.add_argument("--reasoning", action="store_true", help="enable thinking in chat templates that support it")
    p.add_argument("--endpoint-url", help="base URL of an OpenAI-compatible server (endpoint backend)")
    p.add_argument("--discovery-file", type=Path, help="file a serving job writes with its URL (endpoint backend)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="endpoint backend: seconds per request (default 120)")
    p.add_argument("--deadline", type=float,
                   help="endpoint backend: seconds for the whole run (default: --timeout x the number of prompts)")
    p.add_argument("--hf-model", help="HF id of a Megatron checkpoint's architecture (megatron backend)")
    p.add_argument("--tp", type=int, help="megatron backend: tensor parallel size (default: the smallest layout "
                   "that fits the model, from --hf-model's registry facts)")
    p.add_argument("--pp", type=int, help="megatron backend: pipeline stages (the layout may span nodes)")
    p.add_argument("--ep", type=int, help="megatron backend: expert parallel size (folds onto the ranks of a "
                   "pipeline stage; every expert group stays inside a node)")
    p.add_argument("--iteration", type=int,
                   help="megatron backend: the iteration of a checkpoint root (default: latest complete)")
    p.add_argument("--output-dir", type=path_arg, help="default: MODEL/coherence/ for a local model")
    p.add_argument("--wandb-project", help="W&B project (default: COHERENCE_WANDB_PROJECT, else the cluster "
                   "profile's coherence_wandb_project)")
    p.add_argument("--wandb-entity", help="W&B entity (default: WANDB_ENTITY, else the cluster profile's "
                   "wandb_entity, else the key's default)")
    p.add_argument("--no-wandb", action="store_true")
    p.add_argument("--allow-empty", action="store_true", help="exit 0 even when a response is empty")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (world size, nodes, layout, memory per GPU, launch line) and exit; 2 when it "
                        "cannot run. Needs no GPU, container or Megatron Bridge (the login node's planner)")
    p.add_argument("--nodes", type=int, help="with --dry-run outside an allocation: the node count Slurm will give")
    p.add_argument("--json", action="store_true", help="with --dry-run: the plan as one JSON object")
    return p


PLAN_FLAGS = ("--dry-run", "--json")


@dataclass(frozen=True)
class Request:
    """A coherence command line as read: the run, the words the job runs with (the plan flags and --nodes taken out:
    its launch line), the node count given (--nodes) and the dry run's flags."""

    run: CoherenceRun
    argv: tuple[str, ...]
    nodes: int | None = None
    dry_run: bool = False
    as_json: bool = False


def parse_job(argv: list[str]) -> Request:
    """The registry's parser (jobs/registry.py), and the command line's: the words -> the request (checked)."""
    args = vars(build_parser().parse_args(argv))
    dry_run, given_nodes, as_json = args.pop("dry_run"), args.pop("nodes"), args.pop("json")
    cfg = CoherenceRun(**args)
    cfg.check()
    return Request(cfg, tuple(strip_options(argv, PLAN_FLAGS, ("--nodes",))), given_nodes, dry_run, as_json)


def plan_request(req: Request, nodes: int | None = None, inputs_later: bool = False,
                 cluster: str | None = None) -> JobPlan:
    """The request's plan (``nodes``: Slurm's count when --nodes is not given, else the allocation's; ``cluster``:
    the profile, else PIPELINE_CLUSTER's)."""
    return plan_coherence(req.run, nodes=req.nodes if req.nodes is not None else nodes, cluster=cluster,
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
    refuse(plan)
    # The cluster profile's env for this process (the hf and endpoint backends, a one-rank megatron run), the
    # torchrun it execs on each node and the ranks: before anything initialises torch.distributed / NCCL.
    apply_job_env(plan.env)
    lay = plan.layout
    cfg = dataclasses.replace(cfg, tp=lay.tp, pp=lay.pp, ep=lay.ep)
    if plan.world > 1 and "LOCAL_RANK" not in os.environ:
        megatron_iteration(cfg.model, cfg.iteration)  # a bad path fails here, before any rank starts
        bridge.require_bridge("the megatron backend")
        print("launching: " + " ".join(plan.launch), flush=True)
        os.execvp(plan.launch[0], plan.launch)
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
