"""pipeline_training_launch.sh CONFIG --model M --mode MODE [flags] [hydra overrides...]

Resolves the config (recipe defaults < YAML < overrides), runs the preflight, writes the run records
and replaces itself with the distributed launcher (torchrun, or ft_launcher for fault tolerance).
Launcher flags start with ``--``; every other argument after the config is a Hydra override.

  --model M            registry name (nano, super, smollm2-135m, tiny-nemotronh-moe, tiny-qwen3-moe)
  --mode MODE          pretrain | cpt | sft
  --peft lora          parameter-efficient fine-tuning (LoRA)
  --disable-ft         plain torchrun instead of ft_launcher
  --dry-run            print the plan, the resolved config, the launch command and the sbatch line; exit
  --nodes N            plan for N nodes (default: the allocation's SLURM_JOB_NUM_NODES, else 1)
  --cluster NAME       cluster profile (configs/cluster/NAME.yaml); default: the config's pipeline.cluster
  --no-path-checks     skip dataset/checkpoint existence checks (planning away from the cluster)
  --max-restarts K     launcher restarts after a failure (default: the cluster profile's)
  --run-dir DIR        run records + checkpoints (default: $PIPELINE_RUNS_DIR/<logger.wandb_exp_name>)
  --allow-config-change  continue a run directory whose recorded config differs (default: refused, exit 2)

pipeline_training_launch.sh --list   the models (engine, recipe per mode, Hugging Face id), the modes and every
                                     shipped training config, one line each (the config's own first header line)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import textwrap
from pathlib import Path

import yaml

from pipeline.cli.parser import Parser, name_arg, run_dir_arg
from pipeline.common import paths
from pipeline.common.errors import UserError, cli_main
from pipeline.common.log import setup_logging
from pipeline.common.mappings import drop_unset
from pipeline.config.job_env import env_words
from pipeline.config.kinds import MODES
from pipeline.config.models import REGISTRY, recipe_mode
from pipeline.jobs.registry import Placement
from pipeline.training import records
from pipeline.training.launch import (
    LaunchPlan,
    LaunchRequest,
    check_placement,
    fan_out_command,
    needs_fan_out,
    plan_launch,
    profile_lines,
)
from pipeline.training.preflight import Plan


def build_parser() -> Parser:
    p = Parser(prog="pipeline_training_launch.sh", description=__doc__)
    p.add_argument("config")
    p.add_argument("--model", required=True)
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--peft", choices=["lora"])
    p.add_argument("--disable-ft", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--nodes", type=int)
    p.add_argument("--cluster", type=name_arg)
    p.add_argument("--no-path-checks", action="store_true")
    p.add_argument("--max-restarts", type=int)
    p.add_argument("--run-dir", type=run_dir_arg)
    p.add_argument("--allow-config-change", action="store_true")
    return p


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Launcher flags (and their values) vs Hydra overrides (everything else after the config)."""
    parser = build_parser()
    takes_value = {a for act in parser._actions for a in act.option_strings if act.nargs is None
                   and not isinstance(act, (argparse._StoreTrueAction, argparse._HelpAction))}
    flags: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") or a == "-h":
            flags.append(a)
            if a in takes_value and "=" not in a and i + 1 < len(argv):
                flags.append(argv[i + 1])
                i += 1
        elif not flags and not overrides and not a.startswith(("+", "~")) and "=" not in a:
            flags.append(a)  # the config path
        else:
            overrides.append(a)
        i += 1
    return flags, overrides


def parse_request(argv: list[str]) -> tuple[LaunchRequest, bool]:
    """The launcher's command line -> (the request, whether it is a dry run)."""
    flags, overrides = split_args(argv)
    a = build_parser().parse_args(flags)
    return LaunchRequest(config=a.config, model=a.model, mode=a.mode, overrides=tuple(overrides), peft=a.peft,
                         disable_ft=a.disable_ft, nodes=a.nodes, cluster=a.cluster, path_checks=not a.no_path_checks,
                         max_restarts=a.max_restarts, run_dir=a.run_dir,
                         allow_config_change=a.allow_config_change), a.dry_run


def parse_job_args(config: str, model: str, mode: str, rest: list[str]) -> LaunchRequest:
    """A training job's words (``pipeline_training_submit.sbatch CONFIG MODEL MODE [flags] [overrides]``) as the job's
    launcher reads them (the batch script passes them on as ``CONFIG --model MODEL --mode MODE ...``)."""
    return parse_request([config, "--model", model, "--mode", mode, *rest])[0]


def parse_job(args: list[str]) -> LaunchRequest:
    """The registry's parser (jobs/registry.py): ``pipeline_training_submit.sbatch``'s words -> the request."""
    if len(args) < 3:
        raise UserError(f"{paths.TRAINING_SUBMIT} needs CONFIG MODEL MODE [launcher flags] [overrides]")
    config, model, mode, *rest = args
    return parse_job_args(config, model, mode, rest)


def plan_job(request: LaunchRequest, placement: Placement) -> Plan:
    """The registry's planner: the request placed as a submission places it (Slurm's node count, the cluster
    profile; a job that waits for another leaves its inputs, the previous phase's checkpoint, to its launcher, which
    checks them when it starts) -> the training plan (``launch.preflight``, the plan base's)."""
    if placement.inputs_later:
        request = dataclasses.replace(request, path_checks=False)
    placement.check_own_nodes(request.nodes, "the launcher's")
    request = dataclasses.replace(request, nodes=request.nodes or placement.nodes,
                                  cluster=request.cluster or placement.cluster)
    return plan_launch(request).preflight


def plan_from_argv(argv: list[str]) -> LaunchPlan:
    """The launcher's command line -> its plan (the dry run's, preflight included)."""
    return plan_launch(parse_request(argv)[0])


def print_dry_run(plan: LaunchPlan) -> None:
    print("== cluster profile ==")
    print(profile_lines(plan.cluster))
    print("== resolved config (set values; the full one is written to <run_dir>/config.yaml) ==")
    print(yaml.safe_dump(drop_unset(plan.cfg.to_dict()), sort_keys=False).rstrip())
    print("== launch command (per node) ==")  # NAME=value first: what it sets (cluster profile env < env_vars)
    print(" ".join([*env_words(plan.env), *(shlex.quote(c) for c in plan.command())]))
    print("== sbatch line ==")
    print(plan.sbatch_line())


MODE_HELP = {"pretrain": "from random weights on indexed (.bin/.idx) text",
             "cpt": "continued pretraining: the pretrain recipe from a checkpoint (checkpoint.pretrained_checkpoint)",
             "sft": "supervised fine-tuning on packed chat data (--peft lora: LoRA adapters only)"}
SHIPPED_CONFIG_DIRS = ("quickstart", "smoke", "cluster_runs", "local")


def listing() -> list[str]:
    """What --list prints: models, modes and shipped configs, one line each."""
    out = ["models:"]
    for spec in REGISTRY.values():
        if spec.recipe_module:
            recipes = ", ".join(f"{m}: {spec.recipe_module}.{spec.recipe_function.format(mode=recipe_mode(m))}"
                                for m in MODES if spec.recipe_function)
            engine = f"Megatron Bridge ({recipes})"
        else:
            engine = "local engine (transformers' Trainer)"
        out.append(f"  {spec.name:<20} {spec.description}; {engine}; {spec.hf_id}")
    out.append("modes:")
    out += [f"  {m:<20} {MODE_HELP.get(m, '')}" for m in MODES]
    out.append("shipped configs (bash pipeline_training_launch.sh CONFIG --model M --mode MODE --dry-run ...):")
    root = paths.repo_root()

    for sub in SHIPPED_CONFIG_DIRS:
        for f in sorted((root / "configs" / sub).glob("*.yaml")):
            lines = textwrap.wrap(header_summary(f.read_text()), 118 - 57, break_on_hyphens=False) or [""]
            out.append(f"  {f.relative_to(root)!s:<54} {lines[0]}")
            out += [" " * 57 + ln for ln in lines[1:]]
    return out


def header_summary(text: str) -> str:
    """A config's description for --list: the first paragraph of its header comment, whole (its first line alone
    cut sentences in two), a closing ':' that introduced what follows made a full stop."""
    para: list[str] = []
    for ln in text.splitlines():
        if not ln.startswith("#") or not ln.lstrip("#").strip():
            if para or not ln.startswith("#"):
                break
            continue
        para.append(ln.lstrip("#").strip())
    summary = " ".join(para)
    return summary[:-1] + "." if summary.endswith(":") else summary


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv == ["--list"]:
        print("\n".join(listing()))
        return 0
    setup_logging()
    request, dry_run = parse_request(argv)
    plan = plan_launch(request)
    if not plan.preflight.ok:
        for p in plan.preflight.problems:
            print(f"error: {p}", file=sys.stderr)
        print(f"preflight: {len(plan.preflight.problems)} problem(s); nothing was launched", file=sys.stderr)
        return 2
    if not dry_run:
        check_placement(request, plan.alloc, plan.nodes)  # before anything is printed as passed or written
    cmd = plan.command()
    print("== preflight: PASS ==")
    print(plan.preflight.format())
    if dry_run:
        print_dry_run(plan)
        return 0
    if needs_fan_out(plan.alloc):
        # By hand inside a multi-node salloc: this shell runs on one node only. Start the launcher on every node
        # of the allocation (each then finds its node rank and the rendezvous), instead of waiting for ever.
        fan = fan_out_command(argv)
        print(f"{plan.alloc.nodes}-node allocation and no job step: starting every node with: "
              + " ".join(shlex.quote(c) for c in fan), flush=True)
        os.execvp(fan[0], fan)
    run_dir = plan.run_dir
    records.claim_run_dir(Path(run_dir))  # held by torchrun after the exec below; refused if another run writes
    if plan.alloc.node_rank == 0:
        records.write_launch_records(run_dir, cfg=plan.cfg, spec=plan.spec, mode=request.mode, peft=request.peft,
                                     cluster=plan.cluster, alloc=plan.alloc, nodes=plan.nodes, plan=plan.preflight,
                                     command=["pipeline_training_launch.sh", *argv], launch_cmd=cmd,
                                     view=plan.view)
    else:
        records.wait_for_records(run_dir)
    env = plan.launch_environ()
    print(f"run directory: {run_dir}", flush=True)
    print("launching: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    try:
        os.execvpe(cmd[0], cmd, env)
    except FileNotFoundError:
        raise UserError(f"{cmd[0]} not found on PATH: is the environment active? "
                        f"(bash pipeline_env_setup.sh; on the cluster the container provides ft_launcher)") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
