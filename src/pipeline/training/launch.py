"""Training launch, typed: a :class:`LaunchRequest` (what the user asked for) becomes a :class:`LaunchPlan` (the
resolved config, the cluster profile, the allocation, the run directory and the preflight's verdict), validated once;
the command line (:mod:`pipeline.cli.train`), ``isambard_sbatch``'s submit-time check and the experiment layer all
read the same plan. The pure pieces (launch command, srun fan-out, the sbatch line) are functions of their inputs.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.common import paths
from pipeline.common.errors import UserError
from pipeline.config.cluster import ClusterProfile, resolve_profile
from pipeline.config.job_env import job_env, job_environ
from pipeline.config.kinds import MODES, is_mode
from pipeline.config.knobs import effective_knobs, user_set
from pipeline.config.launchers import Launcher
from pipeline.config.loader import load_config
from pipeline.config.models import ModelSpec, get_model
from pipeline.config.schema import TrainingConfig
from pipeline.slurm.allocation import Allocation, current, planned_nodes, rendezvous
from pipeline.slurm.sbatch_options import directive_value, profile_sbatch_options, script_directives
from pipeline.training.preflight import Plan, continues_from, run_preflight, unwritable_dir
from pipeline.training.records import check_run_identity, check_save_owner
from pipeline.training.views import RunView, build_view


@dataclass(frozen=True)
class LaunchRequest:
    """A training launch as asked for: the config, the model, the mode, launcher options and Hydra overrides."""

    config: str
    model: str
    mode: str
    overrides: tuple[str, ...] = ()
    peft: str | None = None
    disable_ft: bool = False
    nodes: int | None = None
    cluster: str | None = None
    path_checks: bool = True
    max_restarts: int | None = None
    run_dir: Path | None = None
    allow_config_change: bool = False  # continue a run directory that recorded another config

    @property
    def launcher_flags(self) -> list[str]:
        """The flags that reproduce this request on pipeline_training_submit.sbatch."""
        return (["--disable-ft"] if self.disable_ft else []) + (["--peft", self.peft] if self.peft else [])


@dataclass(frozen=True)
class LaunchPlan:
    """A request resolved and checked once: everything the launcher, the records and the engines need."""

    request: LaunchRequest
    spec: ModelSpec
    cluster: ClusterProfile
    alloc: Allocation
    nodes: int
    cfg: TrainingConfig = field(repr=False)
    run_dir: Path
    preflight: Plan
    view: RunView | None = None  # the typed view the engines read; None when the preflight failed

    @property
    def max_restarts(self) -> int:
        r = self.request.max_restarts
        return self.cluster.max_restarts if r is None else r

    @property
    def env(self) -> dict[str, str]:
        """What the launch sets for the ranks on top of the node's environment: the cluster profile's env, then the
        config's env_vars (which win) - the rule of every GPU job (:func:`pipeline.config.job_env.job_env`)."""
        return job_env(self.cluster.env, self.cfg.env_vars)

    @property
    def launcher(self) -> Launcher:
        """How each node starts its ranks: the profile's launcher, plain torchrun with --disable-ft."""
        return self.cluster.launcher_for(self.request.disable_ft)

    def launch_environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment the launcher is exec'd with: ``base`` (this process's) with :attr:`env` on top, the run
        directory, and the launcher's name (``PIPELINE_LAUNCHER``: the ranks turn on NVRx fault tolerance when it is
        ft_launcher; the launch line's first word is nsys under Nsight Systems, so it is not that)."""
        env = job_environ(self.cluster.env, base, extra=self.cfg.env_vars)  # the same rule as every GPU job's
        env["PIPELINE_RUN_DIR"] = str(self.run_dir)
        env["PIPELINE_LAUNCHER"] = self.launcher.name
        return env

    def command(self) -> list[str]:
        """The per-node torchrun / ft_launcher command line (the plan's ``launch``, made once when it was planned)."""
        if self.preflight.launch:
            return list(self.preflight.launch)
        nsys = bool(self.cfg.profiling.use_nsys_profiler) and self.spec.trains_on.nsys
        return launch_command(self.spec, self.cluster, self.alloc, self.nodes, self.run_dir, self.request.disable_ft,
                              self.max_restarts, nsys=nsys)

    def sbatch_line(self) -> str:
        req = self.request
        return sbatch_line(req.config, req.model, req.mode, self.nodes, req.launcher_flags, list(req.overrides),
                           self.cluster)


def plan_launch(req: LaunchRequest) -> LaunchPlan:
    """Resolve (recipe defaults < YAML < overrides), place (cluster profile, allocation, run directory) and run the
    preflight. A request that cannot be planned raises UserError; a plan whose preflight failed has
    ``preflight.ok == False`` and its problems listed."""
    if not is_mode(req.mode):
        raise UserError(f"--mode {req.mode!r} is not one of {', '.join(MODES)}")
    spec = get_model(req.model)
    if req.peft and not spec.trains_on.adapters:
        raise UserError("--peft lora runs on the Megatron Bridge engine; the local engine trains full weights")
    alloc = current()
    nodes = planned_nodes(req.nodes, alloc)
    if req.max_restarts is not None and req.max_restarts < 0:
        raise UserError(f"--max-restarts {req.max_restarts} must be >= 0")
    cfg = load_config(req.config, list(req.overrides), spec.recipe_defaults(req.mode, req.peft))
    cluster = resolve_profile(req.cluster, cfg.pipeline.cluster, default=spec.trains_on.default_cluster)
    if alloc.gpus_on_node is not None and cluster.has_gpus and alloc.gpus_on_node != cluster.gpus_per_node:
        raise UserError(f"the allocation has {alloc.gpus_on_node} GPUs per node but cluster profile "
                        f"'{cluster.name}' says {cluster.gpus_per_node}: use --cluster or --gpus-per-node")
    run_dir = (req.run_dir or default_run_dir(cfg, req.config)).resolve()
    problem = unwritable_dir(run_dir)
    if problem:
        raise UserError(f"run directory {run_dir} {problem} (--run-dir, or PIPELINE_RUNS_DIR)")
    cfg = finalize_config(cfg, spec, run_dir, req.config)

    check_run_identity(run_dir, cfg, allow_change=req.allow_config_change,  # another config never resumes a run,
                       launch={"model": spec.name, "mode": req.mode, "peft": req.peft})  # nor another model
    check_save_owner(cfg.checkpoint.save, run_dir, cfg, allow_change=req.allow_config_change)  # nor another's save
    preflight = run_preflight(cfg, spec, req.mode, cluster, nodes, path_checks=req.path_checks, peft=req.peft,
                              ft_launcher=uses_ft_launcher(cluster, req.disable_ft))
    view = build_view(cfg, spec, req.mode, preflight) if preflight.ok else None
    plan = LaunchPlan(req, spec, cluster, alloc, nodes, cfg, run_dir, preflight, view)
    preflight.env = plan.env  # the plan base's launch facts (jobs/plan.py), as every job's plan has them
    preflight.run_name = str(cfg.logger.wandb_exp_name) if cfg.logger.wandb_exp_name else None
    if preflight.ok:  # a refused plan launches nothing
        preflight.launch = plan.command()
    return plan


def check_placement(req: LaunchRequest, alloc: Allocation, nodes: int) -> None:
    """A real launch (not a dry run, not a submission's plan) runs on the nodes it is on: outside any allocation one
    machine (``--nodes 2`` waited for ever for a second node that nothing starts), inside one the allocation's count
    (``--nodes`` would override Slurm's and the rendezvous would wait for nodes that are not there, or leave some
    out)."""
    if not alloc.in_slurm and nodes > 1:
        raise UserError(f"--nodes {nodes} outside any Slurm allocation: nothing starts the other {nodes - 1} node(s) "
                        f"and the launch would wait for them for ever; submit it (isambard_sbatch --nodes={nodes} "
                        f"{paths.TRAINING_SUBMIT} ...), run it inside an allocation of that size, or plan it "
                        "with --dry-run")
    if alloc.in_slurm and req.nodes is not None and req.nodes != alloc.nodes:
        raise UserError(f"--nodes {req.nodes} inside Slurm job {alloc.job_id}, which has {alloc.nodes} node(s): the "
                        "node count comes from the allocation; drop --nodes (or allocate that many)")


def default_run_dir(cfg: TrainingConfig, config_path: str) -> Path:
    name = str(cfg.logger.wandb_exp_name or Path(config_path).stem)  # an empty one is unset: the schema refuses it
    if name in (".", "..") or "/" in name or "\0" in name or len(name.encode()) > 200:
        raise UserError(f"logger.wandb_exp_name={name[:60]!r}{'...' if len(name) > 60 else ''} cannot name a run "
                        "directory (no '/', not '.' or '..', at most 200 bytes)")
    return paths.runs_dir() / name


def finalize_config(cfg: TrainingConfig, spec: ModelSpec, run_dir: Path, config_path: str) -> TrainingConfig:
    """Fill what the engines need and the config left unset (recorded in the resolved config).

    Megatron Bridge engine: ``train.exit_signal_handler`` is switched on (unless the config says otherwise), so
    the pre-limit request reaches Megatron's own handler, which checkpoints at the next step and exits; and
    ``checkpoint.load`` defaults to ``checkpoint.save``, so a requeued job resumes its own run. Both engines: a run
    whose ``checkpoint.load`` is another run's save continues it (``records.start_point``) under this config's LR
    schedule (``scheduler.override_opt_param_scheduler``, unless ``use_checkpoint_opt_param_scheduler``)."""
    ckpt, logger = cfg.checkpoint, cfg.logger
    if spec.trains_on.megatron_resume and cfg.train.exit_signal_handler is None:
        cfg.train.exit_signal_handler = True
    if spec.trains_on.megatron_resume and ckpt.save and ckpt.load is None:
        # The recipes leave checkpoint.load unset: a requeued or restarted job would then start again from
        # pretrained_checkpoint (or from scratch) and overwrite its own iterations. Megatron resumes from `load`
        # when it holds a checkpoint and falls back to pretrained_checkpoint when it does not.
        ckpt.load = ckpt.save
    if not spec.trains_on.bridge_rules:  # no recipe: the launch sets what one would
        if ckpt.save is None:
            ckpt.save = str(run_dir / "checkpoints")
        if logger.wandb_exp_name is None:
            logger.wandb_exp_name = Path(config_path).stem
        if logger.wandb_project is None:
            logger.wandb_project = os.environ.get("WANDB_PROJECT", "pipeline-local")
        if logger.wandb_save_dir is None:
            logger.wandb_save_dir = os.environ.get("WANDB_DIR") or str(paths.repo_root())

    sched = cfg.scheduler
    if continues_from(cfg) is not None and sched.override_opt_param_scheduler is None \
            and not sched.use_checkpoint_opt_param_scheduler:
        # Continuing another run's save (a cooldown phase): its iteration count and optimizer go on, under this
        # config's schedule; without the override Megatron asserts that the checkpoint's schedule equals ours.
        sched.override_opt_param_scheduler = True
    return cfg


def uses_ft_launcher(cluster: ClusterProfile, disable_ft: bool) -> bool:
    """Whether the ranks start under ft_launcher (fault tolerance): the profile's launcher, unless --disable-ft."""
    return cluster.launcher_for(disable_ft).fault_tolerance


def nsys_prefix(run_dir: Path, node_rank: int) -> list[str]:
    """Nsight Systems around the node's launcher, as Megatron Bridge's profiling docs run it: nothing is recorded
    until Bridge calls cudaProfilerStart at profiling.profile_step_start on the ranks of profiling.profile_ranks, and
    recording stops at its cudaProfilerStop; NVTX and CUDA traced, no CPU sampling; one report per node under the
    run directory (<run_dir>/nsys/node<N>.nsys-rep), replaced by a relaunch's."""
    return ["nsys", "profile", "-s", "none", "-t", "nvtx,cuda", "-o", str(Path(run_dir) / "nsys" / f"node{node_rank}"),
            "--force-overwrite", "true", "--capture-range=cudaProfilerApi", "--capture-range-end=stop"]


def launch_command(spec: ModelSpec, cluster: ClusterProfile, alloc: Allocation, nodes: int, run_dir: Path,
                   disable_ft: bool, max_restarts: int, nsys: bool = False) -> list[str]:
    """torchrun / ft_launcher command line (pure function of its inputs); ``nsys``: under Nsight Systems
    (profiling.use_nsys_profiler on the Bridge engine, :func:`nsys_prefix`)."""
    rdzv = None
    if alloc.in_slurm or nodes > 1:
        host, port = rendezvous(alloc, cluster.rdzv_port)
        rdzv = (host, port, alloc.job_id or "local", nodes, alloc.node_rank)
    cmd = cluster.launcher_for(disable_ft).argv(
        nproc=cluster.ranks_per_node, max_restarts=max_restarts, rendezvous=rdzv,
        ft_section_timeouts=cluster.ft_section_timeouts, ft_out_of_section_timeout=cluster.ft_out_of_section_timeout,
        prefix=nsys_prefix(run_dir, alloc.node_rank) if nsys else [])
    return [*cmd, "-m", "pipeline.training.run", "--run-dir", str(run_dir)]


def needs_fan_out(alloc: Allocation, env: Mapping[str, str] | None = None) -> bool:
    """A multi-node allocation seen from outside any job step (a shell in ``salloc``): one node only is running."""
    env = os.environ if env is None else env
    return alloc.in_slurm and alloc.nodes > 1 and not env.get("SLURM_STEP_ID")


def fan_out_command(argv: list[str]) -> list[str]:
    """The exact srun line that starts this launcher once per node of the allocation."""
    return ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash",
            str(paths.repo_root() / "pipeline_training_launch.sh"), *argv]


def sbatch_line(config: str, model: str, mode: str, nodes: int, flags: list[str], overrides: list[str],
                cluster: ClusterProfile | None = None) -> str:
    """The isambard_sbatch command that submits this run. With a cluster profile: the profile is selected for the
    job (PIPELINE_CLUSTER=NAME, unless it already is), and a comment line names the Slurm options isambard_sbatch
    adds from it and the runtime, image and bad-node log the job gets."""
    env, note = [], ""
    if cluster is not None:
        if os.environ.get("PIPELINE_CLUSTER") != cluster.name:
            env = [f"PIPELINE_CLUSTER={shlex.quote(cluster.name)}"]
        script = str(paths.repo_root() / paths.TRAINING_SUBMIT)
        opts = profile_sbatch_options(cluster, [f"--nodes={nodes}"], script_directives(script))
        log = (directive_value(script, "--output", "-o") or "slurm-%j.out").replace("%j", "<jobid>")
        k = effective_knobs(cluster)
        note = (f"\n# isambard_sbatch adds from cluster profile {cluster.name}: {' '.join(opts) or '(nothing)'}; "
                f"the job runs with runtime {k['PIPELINE_RUNTIME']}, image {shlex.quote(k['PIPELINE_SIF'])}, "
                f"bad-node log {shlex.quote(os.environ.get('BAD_NODES_LOG') or k['PIPELINE_BAD_NODES_LOG'])}, "
                f"partition {cluster.partition or '(cluster default)'}, gpus per node {cluster.gpus_per_node} "
                f"(exported variables win); its log: {log}")
    parts = ["isambard_sbatch", f"--nodes={nodes}", paths.TRAINING_SUBMIT, config, model, mode, *flags, *overrides]
    return " ".join([*env, *(shlex.quote(p) for p in parts)]) + note


def profile_lines(cluster: ClusterProfile) -> str:
    """The cluster profile's facts for the dry run: what the job runs in and where Slurm places it."""
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
