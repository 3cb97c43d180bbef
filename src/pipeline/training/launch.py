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
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from pipeline.common.errors import UserError, cli_main
from pipeline.config.cluster import ClusterProfile, load_cluster
from pipeline.config.loader import get, load_config
from pipeline.config.models import ModelSpec, get_model
from pipeline.slurm.allocation import Allocation, current, rendezvous

MODES = ("pretrain", "cpt", "sft")
ROOT = Path(os.environ.get("PIPELINE_ROOT") or Path(__file__).resolve().parents[3])


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise UserError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pipeline_training_launch.sh", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter, add_help=True)
    p.add_argument("config")
    p.add_argument("--model", required=True)
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--peft", choices=["lora"])
    p.add_argument("--disable-ft", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--nodes", type=int)
    p.add_argument("--cluster")
    p.add_argument("--no-path-checks", action="store_true")
    p.add_argument("--max-restarts", type=int)
    p.add_argument("--run-dir", type=Path)
    return p


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Launcher flags (and their values) vs Hydra overrides (everything else after the config)."""
    parser = build_parser()
    takes_value = {a for act in parser._actions for a in act.option_strings if act.nargs is None
                   and not isinstance(act, (argparse._StoreTrueAction, argparse._HelpAction))}
    flags, overrides = [], []
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


def resolve_cluster(args, cfg: dict, spec: ModelSpec) -> ClusterProfile:
    name = args.cluster or os.environ.get("PIPELINE_CLUSTER") or get(cfg, "pipeline.cluster") \
        or ("local_cpu" if spec.is_local else None)
    if name is None:
        raise UserError("no cluster profile: the config names none (pipeline.cluster) and --cluster was not given")
    return load_cluster(name)


def default_run_dir(cfg: dict, config_path: str) -> Path:
    raw = get(cfg, "logger.wandb_exp_name")
    if raw is not None and str(raw).strip() == "":
        raise UserError("logger.wandb_exp_name is empty: give the run a name (or leave it unset to use the config's)")
    name = str(raw or Path(config_path).stem)
    if name in (".", "..") or "/" in name or "\0" in name or len(name.encode()) > 200:
        raise UserError(f"logger.wandb_exp_name={name[:60]!r}{'...' if len(name) > 60 else ''} cannot name a run "
                        "directory (no '/', not '.' or '..', at most 200 bytes)")
    return Path(os.environ.get("PIPELINE_RUNS_DIR") or ROOT / "runs") / name


def finalize_config(cfg: dict, spec: ModelSpec, run_dir: Path, config_path: str) -> dict:
    """Fill what the engines need and the config left unset (recorded in the resolved config).

    Megatron Bridge engine: ``train.exit_signal_handler`` is switched on (unless the config says otherwise), so
    the pre-limit request reaches Megatron's own handler, which checkpoints at the next step and exits; and
    ``checkpoint.load`` defaults to ``checkpoint.save``, so a requeued job resumes its own run."""
    if not spec.is_local and get(cfg, "train.exit_signal_handler") is None:
        cfg["train"]["exit_signal_handler"] = True
    if not spec.is_local and get(cfg, "checkpoint.save") and get(cfg, "checkpoint.load") is None:
        # The recipes leave checkpoint.load unset: a requeued or restarted job would then start again from
        # pretrained_checkpoint (or from scratch) and overwrite its own iterations. Megatron resumes from `load`
        # when it holds a checkpoint and falls back to pretrained_checkpoint when it does not.
        cfg["checkpoint"]["load"] = get(cfg, "checkpoint.save")
    if spec.is_local:
        if get(cfg, "checkpoint.save") is None:
            cfg["checkpoint"]["save"] = str(run_dir / "checkpoints")
        if get(cfg, "logger.wandb_exp_name") is None:
            cfg["logger"]["wandb_exp_name"] = Path(config_path).stem
        if get(cfg, "logger.wandb_project") is None:
            cfg["logger"]["wandb_project"] = os.environ.get("WANDB_PROJECT", "pipeline-local")
        if get(cfg, "logger.wandb_save_dir") is None:
            cfg["logger"]["wandb_save_dir"] = os.environ.get("WANDB_DIR") or str(ROOT)
    return cfg


def launch_command(spec: ModelSpec, cluster: ClusterProfile, alloc: Allocation, nodes: int, run_dir: Path,
                   disable_ft: bool, max_restarts: int) -> list[str]:
    """torchrun / ft_launcher command line (pure function of its inputs)."""
    use_ft = (not disable_ft) and cluster.launcher == "ft_launcher"
    cmd = ["ft_launcher" if use_ft else "torchrun"]
    if alloc.in_slurm or nodes > 1:
        host, port = rendezvous(alloc, cluster.rdzv_port)
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={alloc.job_id or 'local'}",
                f"--nnodes={nodes}", f"--node-rank={alloc.node_rank}"]
    else:
        cmd += ["--standalone", "--nnodes=1"]
    cmd += [f"--nproc-per-node={cluster.ranks_per_node}", f"--max-restarts={max_restarts}"]
    if use_ft:
        cmd += [f"--ft-rank_section_timeouts={cluster.ft_section_timeouts}",
                f"--ft-rank_out_of_section_timeout={cluster.ft_out_of_section_timeout}"]
    cmd += ["-m", "pipeline.training.run", "--run-dir", str(run_dir)]
    return cmd


def needs_fan_out(alloc: Allocation, env: dict[str, str] | None = None) -> bool:
    """A multi-node allocation seen from outside any job step (a shell in ``salloc``): one node only is running."""
    env = os.environ if env is None else env
    return alloc.in_slurm and alloc.nodes > 1 and not env.get("SLURM_STEP_ID")


def fan_out_command(argv: list[str]) -> list[str]:
    """The exact srun line that starts this launcher once per node of the allocation."""
    return ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", str(ROOT / "pipeline_training_launch.sh"),
            *argv]


def _set_values(d: dict) -> dict:
    """The config without unset (None) values and empty sections, for display."""
    out = {}
    for k, v in d.items():
        v = _set_values(v) if isinstance(v, dict) else v
        if v is not None and v != {}:
            out[k] = v
    return out


def sbatch_line(config: str, model: str, mode: str, nodes: int, flags: list[str], overrides: list[str],
                cluster: ClusterProfile | None = None) -> str:
    """The isambard_sbatch command that submits this run. With a cluster profile: the profile is selected for the
    job (PIPELINE_CLUSTER=NAME, unless it already is), and a comment line names the Slurm options isambard_sbatch
    adds from it and the runtime, image and bad-node log the job gets."""
    env, note = [], ""
    if cluster is not None:
        from pipeline.config.cluster import effective_knobs, profile_sbatch_options, script_directives

        if os.environ.get("PIPELINE_CLUSTER") != cluster.name:
            env = [f"PIPELINE_CLUSTER={shlex.quote(cluster.name)}"]
        opts = profile_sbatch_options(cluster, [f"--nodes={nodes}"],
                                      script_directives(str(ROOT / "pipeline_training_submit.sbatch")))
        k = effective_knobs(cluster)
        note = (f"\n# isambard_sbatch adds from cluster profile {cluster.name}: {' '.join(opts) or '(nothing)'}; the job "
                f"runs with runtime {k['PIPELINE_RUNTIME']}, image {shlex.quote(k['PIPELINE_SIF'])}, bad-node log "
                f"{shlex.quote(os.environ.get('BAD_NODES_LOG') or k['PIPELINE_BAD_NODES_LOG'])}, partition "
                f"{cluster.partition or '(cluster default)'}, gpus per node {cluster.gpus_per_node} "
                "(exported variables win)")
    parts = ["isambard_sbatch", f"--nodes={nodes}", "pipeline_training_submit.sbatch", config, model, mode, *flags,
             *overrides]
    return " ".join([*env, *(shlex.quote(p) for p in parts)]) + note


def profile_lines(cluster: ClusterProfile) -> str:
    """The cluster profile's facts for the dry run: what the job runs in and where Slurm places it."""
    from pipeline.config.cluster import effective_knobs, user_set

    k, mine = effective_knobs(cluster), user_set(dict(os.environ))
    src = lambda key: " (exported)" if key in mine else ""
    bad_log = os.environ.get("BAD_NODES_LOG")
    return "\n".join([
        f"cluster profile: {cluster.name} ({cluster.description})" if cluster.description else
        f"cluster profile: {cluster.name}",
        f"runtime: {k['PIPELINE_RUNTIME']}{src('PIPELINE_RUNTIME')}",
        f"image: {k['PIPELINE_SIF']}{src('PIPELINE_SIF')}",
        f"bad-node log: {bad_log + ' (BAD_NODES_LOG)' if bad_log else k['PIPELINE_BAD_NODES_LOG']}"
        f"{'' if bad_log else src('PIPELINE_BAD_NODES_LOG')}",
        f"log dir: {k['PIPELINE_LOG_DIR']}{src('PIPELINE_LOG_DIR')}; cache dir: {k['PIPELINE_CACHE_DIR']}"
        f"{src('PIPELINE_CACHE_DIR')}",
        f"slurm: partition {cluster.partition or '(cluster default)'}, account {cluster.account or '(user default)'}, "
        f"gpus per node {cluster.gpus_per_node}, time limit {cluster.time_limit or '(Slurm default)'} (when the "
        f"script sets none), "
        f"exclusive {'yes' if cluster.exclusive else 'no'}",
    ])


def plan_from_args(argv: list[str]):
    flags, overrides = split_args(argv)
    args = build_parser().parse_args(flags)
    spec = get_model(args.model)
    if args.peft and spec.is_local:
        raise UserError("--peft lora runs on the Megatron Bridge engine; the local engine trains full weights")
    alloc = current()
    if args.nodes is not None and args.nodes < 1:
        raise UserError(f"--nodes {args.nodes} must be >= 1")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise UserError(f"--max-restarts {args.max_restarts} must be >= 0")
    nodes = args.nodes or alloc.nodes or 1
    cfg = load_config(args.config, overrides, spec.recipe_defaults(args.mode, args.peft))
    cluster = resolve_cluster(args, cfg, spec)
    if alloc.gpus_on_node is not None and cluster.has_gpus and alloc.gpus_on_node != cluster.gpus_per_node:
        raise UserError(f"the allocation has {alloc.gpus_on_node} GPUs per node but cluster profile "
                        f"'{cluster.name}' says {cluster.gpus_per_node}: use --cluster or --gpus-per-node")
    run_dir = (args.run_dir or default_run_dir(cfg, args.config)).resolve()
    from pipeline.training.preflight import unwritable_dir

    problem = unwritable_dir(run_dir)
    if problem:
        raise UserError(f"run directory {run_dir} {problem} (--run-dir, or PIPELINE_RUNS_DIR)")
    cfg = finalize_config(cfg, spec, run_dir, args.config)
    from pipeline.training.preflight import run_preflight

    plan = run_preflight(cfg, spec, args.mode, cluster, nodes, path_checks=not args.no_path_checks, peft=args.peft)
    return args, spec, cluster, alloc, nodes, cfg, run_dir, plan, overrides


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    from pipeline.common.log import setup_logging
    from pipeline.training import records
    from pipeline.training.preflight import format_plan

    setup_logging()
    args, spec, cluster, alloc, nodes, cfg, run_dir, plan, overrides = plan_from_args(argv)
    if not plan.ok:
        for p in plan.problems:
            print(f"error: {p}", file=sys.stderr)
        print(f"preflight: {len(plan.problems)} problem(s); nothing was launched", file=sys.stderr)
        return 2
    restarts = cluster.max_restarts if args.max_restarts is None else args.max_restarts
    cmd = launch_command(spec, cluster, alloc, nodes, run_dir, args.disable_ft, restarts)
    launcher_flags = ["--disable-ft"] if args.disable_ft else []
    if args.peft:
        launcher_flags += ["--peft", args.peft]
    print("== preflight: PASS ==")
    print(format_plan(plan))
    if args.dry_run:
        import yaml

        print("== cluster profile ==")
        print(profile_lines(cluster))
        print("== resolved config (set values; the full one is written to <run_dir>/config.yaml) ==")
        print(yaml.safe_dump(_set_values(cfg), sort_keys=False).rstrip())
        print("== launch command (per node) ==")
        print(" ".join(shlex.quote(c) for c in cmd))
        print("== sbatch line ==")
        print(sbatch_line(args.config, args.model, args.mode, nodes, launcher_flags, overrides, cluster))
        return 0
    if needs_fan_out(alloc):
        # By hand inside a multi-node salloc: this shell runs on one node only. Start the launcher on every node
        # of the allocation (each then finds its node rank and the rendezvous), instead of waiting for ever.
        fan = fan_out_command(argv)
        print(f"{alloc.nodes}-node allocation and no job step: starting every node with: "
              + " ".join(shlex.quote(c) for c in fan), flush=True)
        os.execvp(fan[0], fan)
    if alloc.node_rank == 0:
        records.write_launch_records(run_dir, cfg=cfg, spec=spec, mode=args.mode, peft=args.peft, cluster=cluster,
                                     alloc=alloc, nodes=nodes, plan=plan, command=["pipeline_training_launch.sh", *argv],
                                     launch_cmd=cmd)
    else:
        records.wait_for_records(run_dir)
    env = dict(os.environ)
    env.update(cluster.env)
    env.update({str(k): str(v) for k, v in (get(cfg, "env_vars") or {}).items()})
    env["PIPELINE_RUN_DIR"] = str(run_dir)
    env["PIPELINE_LAUNCHER"] = cmd[0]
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
