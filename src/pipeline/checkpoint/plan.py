"""Plans of the GPU jobs other than training (export, upload-all, import; coherence builds on them in
``coherence/plan.py``), made the way training's ``LaunchRequest -> LaunchPlan`` is: before anything is queued, from
the model's registry facts, the checkpoint, the cluster profile and the allocation.

A plan (``JobPlan``, on the plan base of every job: ``jobs/plan.py``) holds the world size and placement (nodes,
ranks per node, the launch line), the parallel layout with
Megatron's rules and the node-local rule (``config/parallel.py``), and a memory estimate per GPU for each phase the
job runs; ``problems`` lists, one line each, what makes the job unable to run (the command exits 2 with them, and
``isambard_sbatch`` refuses the submission). Light on purpose: it imports nothing heavier than the training
preflight (no torch, no transformers, no Megatron), because it runs on the login node's planner environment.

Memory per GPU (BF16 weights, 2 bytes per parameter):
  megatron  the rank's weight share: dense / (tp x pp) + experts / (etp x ep x pp), the forward's FP32 logits
            (4 B x tokens x vocab / tp) and the 5 GB overhead (CUDA context, NCCL buffers, fragmentation)
  export    the Megatron share plus one gathered tensor at a time (the largest is an expert stack: ~2 GB)
  hf side   the whole model on one GPU when it fits, else spread over the node's GPUs (device_map="auto")
The phases of an export run one after the other (the Megatron side is freed before the HF side loads), so the
job needs the largest of them, not their sum.

A LoRA (PEFT) iteration exports in one process (``checkpoint/export.py`` refuses more ranks): Bridge's
export_adapter_ckpt builds the base in float32 on the host, peft merges the adapters into the HF base in float32 there
(with a copy of its weights to check the merge changed some), then the Megatron base + adapters verify on one GPU:
  host      8 B x parameters (the float32 HF base and its copy) + the overhead
  GPU       the megatron and hf phases above at tp = pp = ep = 1
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import bridge
from pipeline.common import layout, paths
from pipeline.common.errors import UserError
from pipeline.common.io import folder_problem
from pipeline.common.layout import output_folder_problem
from pipeline.config.cluster import ClusterProfile, resolve_profile
from pipeline.config.engines import LOCAL, MEGATRON_BRIDGE, Engine, engine_of_checkpoint
from pipeline.config.job_env import job_env
from pipeline.config.models import REGISTRY, ModelSpec, spec_for
from pipeline.config.parallel import (
    OVERHEAD_GB,
    Layout,
    model_shape_problems,
    node_local_problems,
    shape_fixes,
    weight_gb_per_gpu,
)
from pipeline.env.runtimes import invisible_paths
from pipeline.jobs.plan import BasePlan
from pipeline.slurm.allocation import current, planned_nodes, rendezvous

GATHER_GB = 2.0  # export: the largest tensor gathered to one rank before it is written
VERIFY_TOKENS = 64  # the verification prompts are a few short sentences


@dataclass(kw_only=True)
class JobPlan(BasePlan):
    """What a GPU job other than training will run, where, and whether it fits (``jobs/plan.py``'s base, with the
    phases its job runs in ``memory_gb``). Its ``--dry-run`` text is the base's; its ``--dry-run --json`` keeps the
    keys its users read (``job``, ``world_size``, ``procs_per_node``, ``gpus_per_node``, ``host_memory_gb``)."""

    engine: str = "megatron"  # the checkpoint's format (megatron, local) or the generation backend (hf, endpoint)
    host_memory_gb: float | None = None  # jobs that work in host memory (import)

    def as_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {"job": self.kind, "model": self.model, "engine": self.engine, "cluster": self.cluster,
                "world_size": self.world, "nodes": self.nodes, "procs_per_node": self.ranks_per_node,
                **{k: v for k, v in lay.as_record().items() if k != "world"},
                "memory_per_gpu_gb": self.memory_per_gpu_gb, "memory_gb": self.memory_gb,
                "memory_budget_gb": self.memory_budget_gb, "host_memory_gb": self.host_memory_gb,
                "gpus_per_node": self.gpus_per_node,
                "env": self.env, "launch": self.launch, "ok": self.ok, "problems": self.problems, "notes": self.notes}

    def detail_lines(self) -> list[str]:
        return [] if self.host_memory_gb is None else [f"  host memory: {self.host_memory_gb:.1f} GB"]


def print_plan(plan: JobPlan, as_json: bool) -> int:
    """The dry run's output; 2 when the plan has problems (each also an ``error:`` line on stderr)."""
    print(json.dumps(plan.as_dict(), indent=2) if as_json else plan.format())
    for p in plan.problems:
        print(f"error: {p}", file=sys.stderr)
    return 0 if plan.ok else 2


def refuse(plan: JobPlan) -> None:
    """Exit 2 with one ``error:`` line per problem of a plan that cannot run (before anything starts)."""
    if plan.problems:
        for p in plan.problems[:-1]:
            print(f"error: {p}", file=sys.stderr)
        raise UserError(plan.problems[-1])


def local_path(name: str) -> bool:
    """A model argument that names a folder rather than a hub id (ORG/NAME): absolute, relative or existing."""
    return name.startswith(("/", ".")) or Path(name).exists()


def cluster_and_nodes(nodes: int | None, cluster: str | None = None) -> tuple[ClusterProfile, int, bool]:
    """The cluster profile (--cluster, else PIPELINE_CLUSTER, else local_cpu), the node count (--nodes, else the
    allocation's) and whether the count was given (outside an allocation it stands for Slurm's --nodes)."""
    try:
        alloc = current()
    except ValueError as exc:  # SLURM_JOB_NUM_NODES=abc, a broken SLURM_JOB_NODELIST
        raise UserError(f"the Slurm environment is malformed: {exc}") from None
    count = planned_nodes(nodes, alloc)
    return resolve_profile(cluster), count, nodes is not None or alloc.in_slurm


def check_gpus_on_node(plan: JobPlan) -> None:
    """Inside an allocation: a plan that places more ranks on a node than it has GPUs is refused (local rank N
    would have no device), as training refuses a profile that disagrees with the allocation."""
    gpus = current().gpus_on_node
    if gpus is not None and plan.world > 1 and plan.ranks_per_node > gpus:
        plan.problems.append(f"the plan places {plan.ranks_per_node} ranks on each node, and the allocation has "
                             f"{gpus} GPU(s) per node: submit with --gpus-per-node={plan.ranks_per_node}")


# ---- memory ------------------------------------------------------------------------------------------------
def megatron_gb(spec: ModelSpec, lay: Layout, tokens: int) -> float:
    logits = 4 * tokens * spec.vocab_size / lay.tp / 1e9
    return weight_gb_per_gpu(spec.dense_params_b, spec.expert_params_b, lay) + logits + OVERHEAD_GB


def hf_gb(total_params_b: float, gpus: int, budget: float, tokens: int, vocab: int) -> tuple[float, int]:
    """(GB per GPU, GPUs used) of a BF16 Hugging Face model: one GPU when it fits, else the node's GPUs."""
    whole = 2 * total_params_b + 4 * tokens * vocab / 1e9 + OVERHEAD_GB
    if not budget or whole <= budget or gpus <= 1:
        return whole, 1
    return 2 * total_params_b / gpus + 4 * tokens * vocab / 1e9 + OVERHEAD_GB, gpus


def job_world(tp: int, pp: int, ep: int, etp: int = 1) -> int:
    """The ranks of a layout whose data-parallel size is the smallest that forms the expert groups: expert
    parallelism folds onto the ranks of a pipeline stage (world = pp x lcm(tp, ep x etp)); it does not multiply
    the world size as tp x pp x ep did."""
    return pp * math.lcm(tp, ep * etp)


def placement(world: int, gpn: int) -> tuple[int, int, str | None]:
    """(nodes, processes per node, problem): full nodes, or one partly used node."""
    if gpn < 1:
        return 1, world, None
    if world <= gpn:
        return 1, world, None
    if world % gpn:
        return math.ceil(world / gpn), gpn, (f"world size {world} does not fill whole nodes of {gpn} GPUs: use a "
                                             f"layout whose world size is a multiple of {gpn}")
    return world // gpn, gpn, None


def layouts_by_size(spec: ModelSpec, gpn: int, max_world: int) -> list[Layout]:
    """Candidate inference layouts (etp 1), smallest world first, expert parallelism before tensor parallelism."""
    pows = [p for p in (1, 2, 4, 8, 16) if p <= max(1, gpn)]
    pps = [p for p in range(1, 33) if spec.num_layers == 0 or p <= spec.num_layers]
    eps = pows if spec.expert_params_b else [1]
    out = {}
    for tp in pows:
        for ep in eps:
            for pp in pps:
                w = job_world(tp, pp, ep)
                if w <= max_world:
                    out[(tp, pp, ep)] = Layout(w, tp=tp, pp=pp, ep=ep, etp=1)
    # fewest nodes, then no pipeline split (a forward across stages is the slow path), then no tensor split
    return sorted(out.values(), key=lambda lay: (placement(lay.world, gpn)[0], lay.pp, lay.tp, lay.world))


def fitting_layout(spec: ModelSpec, cluster: ClusterProfile, need, max_world: int = 256) -> Layout | None:
    """The smallest layout that is node-local, fills whole nodes and whose ``need(layout)`` GB per GPU fits."""
    gpn = cluster.ranks_per_node
    for lay in layouts_by_size(spec, gpn, max_world):
        if lay.problems() or node_local_problems(lay, gpn, "") or placement(lay.world, gpn)[2] or \
                model_shape_problems(spec, lay):
            continue
        if not cluster.memory_budget_gb or need(lay) <= cluster.memory_budget_gb:
            return lay
    return None


def runnable_near(spec: ModelSpec, lay: Layout, cluster: ClusterProfile, need, max_world: int = 256) -> Layout | None:
    """The nearest layout to ``lay`` that keeps the model's shape rules and, like ``fitting_layout``'s, is
    node-local, fills whole nodes and fits ``need(layout)`` GB per GPU (None: none near)."""
    gpn = cluster.ranks_per_node
    for c in shape_fixes(spec, lay):
        cand = Layout(job_world(c.tp, c.pp, c.ep), tp=c.tp, pp=c.pp, ep=c.ep, etp=1)
        if cand.world > max_world or cand.problems() or node_local_problems(cand, gpn, "") or \
                placement(cand.world, gpn)[2] or model_shape_problems(spec, cand):
            continue
        if not cluster.memory_budget_gb or need(cand) <= cluster.memory_budget_gb:
            return cand
    return None


def shape_problems_with_fix(spec: ModelSpec | None, lay: Layout, cluster: ClusterProfile, need,
                            max_world: int = 256) -> list[str]:
    """``model_shape_problems`` for a generation or conversion layout; the last line names the nearest layout that
    runs (its flags and nodes)."""
    if spec is None:
        return []
    out = model_shape_problems(spec, lay)
    near = runnable_near(spec, lay, cluster, need, max_world) if out else None
    if near is not None:
        out[-1] += (f"; the nearest layout that runs: {layout_flags(near)} on "
                    f"{placement(near.world, cluster.ranks_per_node)[0]} node(s)")
    return out


def layout_flags(lay: Layout) -> str:
    return f"--tp {lay.tp} --pp {lay.pp} --ep {lay.ep}"


# ---- export / upload-all -----------------------------------------------------------------------------------
def _engine(ckpt_dir: Path, iteration: int | None, spec: ModelSpec | None, profile: ClusterProfile,
            notes: list[str], problems: list[str], strict: bool) -> Engine:
    """The engine that wrote the checkpoint; one not written yet (a job that waits for training) is the model's
    engine: the local engine for a registry local model or on a profile without GPUs, else Megatron Bridge.
    ``strict`` (an export that runs now): a checkpoint that cannot be exported is a problem, not a note."""
    why = f"{ckpt_dir} does not exist yet"
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        problems.append(f"checkpoint directory {ckpt_dir} is not a directory")
    elif iteration is not None and iteration < 0:
        problems.append(f"--iteration {iteration} must be >= 0")
    elif ckpt_dir.is_dir():
        try:
            eng = engine_of_checkpoint(layout.engine_of(layout.resolve_iteration(ckpt_dir, iteration)))
            if eng is not None:
                return eng
        except UserError as exc:
            why = str(exc)
            if strict:
                problems.append(why)
    elif strict:
        problems.append(f"checkpoint directory {ckpt_dir} does not exist")
    planned = LOCAL if not profile.has_gpus else spec.trains_on if spec is not None else MEGATRON_BRIDGE
    notes.append(f"{why}: planned as a {planned.checkpoint_label} checkpoint")
    return planned


@dataclass(frozen=True)
class ExportJob:
    """An export or upload-all command as its planner reads it (``cli/checkpoint.ConvertRequest.export_job``):
    which checkpoint, into which Hugging Face model, on which layout, nodes and cluster. ``argv``: the command line
    the planned job runs; ``inputs_later``: the job waits for the training that writes ``ckpt_dir``; ``strict``: no
    --not-strict."""

    ckpt_dir: Path
    hf_model: str
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    iteration: int | None = None
    nodes: int | None = None
    cluster: str | None = None
    job: str = "export"
    argv: tuple[str, ...] = ()
    inputs_later: bool = False
    strict: bool = True
    push_to_hub: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "ckpt_dir", Path(self.ckpt_dir))
        object.__setattr__(self, "argv", tuple(self.argv))
        for flag, v in (("--tp", self.tp), ("--pp", self.pp), ("--ep", self.ep)):
            if v is not None and v < 1:
                raise UserError(f"{flag} {v} must be >= 1")

    @property
    def layout_given(self) -> bool:
        return any(v is not None for v in (self.tp, self.pp, self.ep))

    @property
    def module(self) -> list[str]:
        return ["-m", "pipeline.cli.checkpoint", *self.argv]


def plan_export(req: ExportJob) -> JobPlan:
    """One iteration to Hugging Face on one node, verified: Megatron exports run one rank per GPU with the
    model's reference layout (EP = the node's GPUs for an MoE) unless --tp/--pp/--ep are given. A strict export
    (no --not-strict) is refused for a model with MTP layers (SFT and LoRA train none)."""
    profile, n_nodes, _ = cluster_and_nodes(req.nodes, req.cluster)
    spec = spec_for(req.hf_model)
    notes: list[str] = []
    found: list[str] = []
    engine = _engine(req.ckpt_dir, req.iteration, spec, profile, notes, found,
                     strict=req.job == "export" and not req.inputs_later)
    found += invisible_paths(profile, [("checkpoint directory", req.ckpt_dir),
                                       *([("--hf-model", req.hf_model)] if local_path(req.hf_model) else [])])
    _hub_lines(req, profile, notes, found)
    if not engine.megatron_checkpoint:
        return _plan_local_export(req, profile, notes, found)
    peft = _peft_iteration(req.ckpt_dir, req.iteration)
    lay = _export_layout(req, spec, profile, peft, notes, found)
    gpn = profile.ranks_per_node
    plan = JobPlan(kind=req.job, model=req.hf_model, cluster=profile.name, profile=profile, nodes=1,
                   ranks_per_node=lay.world if gpn < 1 else min(lay.world, gpn), layout=lay,
                   memory_budget_gb=profile.memory_budget_gb, notes=notes, problems=found, env=job_env(profile.env))
    plan.problems += _export_layout_problems(req, spec, profile, lay, n_nodes)
    plan.launch = ["python", *req.module] if lay.world == 1 else \
        ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={lay.world}", *req.module]
    check_gpus_on_node(plan)
    if spec is None:
        plan.notes.append(f"{req.hf_model} is not in the model registry: no size facts, memory not estimated")
        return plan
    if peft is not None:
        return _plan_lora_export(plan, spec, profile, peft.iter_path, req.hf_model, _export_need(spec, profile))
    return _size_export(plan, spec, profile)


def _hub_lines(req: ExportJob, profile: ClusterProfile, notes: list[str], problems: list[str]) -> None:
    """--push-to-hub refused where the hub is unreachable, else said where each iteration goes; upload-all without
    it says it pushes nothing (the reference's "Upload all iterations": here the hub is opt-in)."""
    if req.push_to_hub:
        hub_problem = hub_offline_problem(profile)
        if hub_problem:
            problems.append(hub_problem)
        else:
            notes.append(f"--push-to-hub: each iteration goes to <token's user>/"
                         f"{hub_repo_name(req.ckpt_dir, 'iter_NNNNNNN')} (private); the token and its write access "
                         "are checked before converting")
    elif req.job == "upload-all":
        notes.append("upload-all converts each iteration to <iteration>/hf/ on this filesystem and pushes nothing "
                     "to the Hugging Face Hub: add --push-to-hub to upload each one")


def _plan_local_export(req: ExportJob, profile: ClusterProfile, notes: list[str], found: list[str]) -> JobPlan:
    """A local-engine checkpoint: one process on the CPU, no parallel layout."""
    plan = JobPlan(kind=req.job, model=req.hf_model, cluster=profile.name, profile=profile, nodes=1, ranks_per_node=1,
                   layout=Layout(1), engine=LOCAL.checkpoint_format, gpus_needed=0, problems=found,
                   env=job_env(profile.env),
                   launch=["python", *req.module], notes=notes + ["local-engine checkpoint: one process, CPU"])
    if any(v not in (None, 1) for v in (req.tp, req.pp, req.ep)):
        plan.problems.append(f"--tp/--pp/--ep apply to Megatron checkpoints; {req.ckpt_dir} is a local-engine "
                             "checkpoint")
    return plan


def _export_layout(req: ExportJob, spec: ModelSpec | None, profile: ClusterProfile, peft, notes: list[str],
                   problems: list[str]) -> Layout:
    """The layout a Megatron export runs: one process for a LoRA iteration, the flags given, else the reference's
    (experts over the node's GPUs, no tensor or pipeline split)."""
    tp, pp, ep = req.tp, req.pp, req.ep
    gpn = profile.ranks_per_node
    if peft is not None:  # one process: Bridge's export_adapter_ckpt and peft's merge (export.py refuses more)
        asked = Layout(job_world(tp or 1, pp or 1, ep or 1), tp=tp or 1, pp=pp or 1, ep=ep or 1, etp=1)
        if asked.world > 1:
            problems.append(f"{peft.iter_path} is a LoRA iteration, which exports in one process: "
                            f"{layout_flags(asked)} (world {asked.world}) cannot run it; drop --tp/--pp/--ep")
        tp, pp, ep = 1, 1, 1
        notes.append(f"{peft.what}: it exports in one process (Bridge's export_adapter_ckpt, then peft's merge into "
                     f"{req.hf_model} in float32 on the host), verified on one GPU")
    elif req.layout_given or spec is None:
        tp, pp, ep = tp or 1, pp or 1, ep or 1
    else:
        tp, pp, ep = 1, 1, (gpn if spec.expert_params_b and gpn > 0 else 1)
        notes.append(f"layout: the model's default for an export on '{profile.name}' (ep {ep} on one node); "
                     "--tp/--pp/--ep change it")
    return Layout(job_world(tp, pp, ep), tp=tp, pp=pp, ep=ep, etp=1)


def _export_layout_problems(req: ExportJob, spec: ModelSpec | None, profile: ClusterProfile, lay: Layout,
                            n_nodes: int) -> list[str]:
    """What keeps a Megatron export from running on its layout: no GPUs, Megatron's rules, the node-local rule,
    the model's shape, more ranks than one node holds, more than one node, a strict export of MTP layers."""
    gpn = profile.ranks_per_node
    out: list[str] = []
    if not profile.has_gpus:
        out.append(f"a Megatron checkpoint exports on GPUs; cluster profile '{profile.name}' has none "
                   "(select a GPU profile: PIPELINE_CLUSTER=isambard_gh200)")
    out += lay.problems()
    out += node_local_problems(lay, gpn, f"on '{profile.name}'")
    out += shape_problems_with_fix(spec, lay, profile, _export_need(spec, profile), max_world=max(gpn, 1))
    if profile.has_gpus and lay.world > gpn:
        out.append(f"an export runs on one node: world {lay.world} (tp {lay.tp} x pp {lay.pp} with ep {lay.ep}) > "
                   f"{gpn} GPUs per node on '{profile.name}'")
    if n_nodes > 1:
        out.append(f"an export runs on one node, and {n_nodes} were asked for: submit it with --nodes=1 "
                   "(the other nodes would idle)")
    if req.strict and spec is not None and spec.mtp_layers:
        out.append(f"{req.hf_model} has MTP layers, which SFT and LoRA do not train: a strict export drops "
                   "the shards holding the MTP keys, lm_head.weight with them (fatal for generation): "
                   "add --not-strict")
    return out


def _export_need(spec: ModelSpec | None, profile: ClusterProfile):
    """GB per GPU an export needs on a candidate layout: the largest of its phases (they run one after another)."""
    return lambda cand: max(_export_phases(spec, cand, profile).values()) if spec else 0.0


def _size_export(plan: JobPlan, spec: ModelSpec, profile: ClusterProfile) -> JobPlan:
    """The export's memory by phase, and a layout that fits one node when the plan's does not."""
    need = _export_need(spec, profile)
    plan.memory_gb = _export_phases(spec, plan.layout, profile)
    if profile.memory_budget_gb and plan.memory_per_gpu_gb > profile.memory_budget_gb:
        fit = fitting_layout(spec, profile, need, max_world=max(profile.ranks_per_node, 1))
        fix = f": use {layout_flags(fit)} ({need(fit):.1f} GB)" if fit else " and no one-node layout fits"
        plan.problems.append(f"estimated {plan.memory_per_gpu_gb:.1f} GB per GPU > {profile.memory_budget_gb:g} GB "
                             f"on '{profile.name}' ({_phases(plan.memory_gb)}){fix}")
    return plan


def _peft_iteration(ckpt_dir: Path, iteration: int | None):
    """The PEFT facts (``bridge.PeftIteration``) of the iteration an export would read, or None: a whole checkpoint,
    or none to read yet (a job waiting for training; the export itself refuses a world above 1 then)."""
    try:
        return bridge.peft_iteration(layout.resolve_iteration(ckpt_dir, iteration)) if ckpt_dir.is_dir() else None
    except (UserError, OSError, ValueError):
        return None


def lora_export_memory(spec: ModelSpec, profile: ClusterProfile) -> tuple[dict[str, float], float]:
    """(GB per GPU by phase, GB of host memory) of a LoRA export: one process (the module docstring's rule)."""
    gpu = _export_phases(spec, Layout(1), profile)
    return ({"verify_megatron": gpu["verify_megatron"], "verify_hf": gpu["verify_hf"]},
            round(8 * spec.total_params_b + OVERHEAD_GB, 1))


def _plan_lora_export(plan: JobPlan, spec: ModelSpec, profile: ClusterProfile, iter_path: Path, hf_model: str,
                      need) -> JobPlan:
    """A LoRA iteration's export: one process, sized on one GPU and the node's host memory; one that does not fit is
    one line naming what it needs, what the profile has, and the model sizes one process fits."""
    plan.memory_gb, plan.host_memory_gb = lora_export_memory(spec, profile)
    gpu_budget, host_budget = profile.memory_budget_gb, profile.host_memory_gb
    gpu, host = plan.memory_per_gpu_gb, plan.host_memory_gb
    if (not gpu_budget or gpu <= gpu_budget) and (not host_budget or host <= host_budget):
        return plan
    # the largest model one process fits: 2 B a parameter on the GPU, 8 B on the host, each over its fixed part
    fixed_gpu = megatron_gb(spec, Layout(1), VERIFY_TOKENS) - 2 * spec.total_params_b  # logits + overhead
    limits = [(gpu_budget - fixed_gpu) / 2] if gpu_budget else []
    limits += [(host_budget - OVERHEAD_GB) / 8] if host_budget else []
    fits = [s for s in REGISTRY.values() if s.trains_on.needs_gpus and s.total_params_b
            and s.total_params_b <= min(limits)]
    examples = ", ".join(f"{s.name}: {max(lora_export_memory(s, profile)[0].values()):.1f} GB per GPU, "
                         f"~{lora_export_memory(s, profile)[1]:.0f} GB of host memory" for s in fits)
    full = fitting_layout(spec, profile, need, max_world=max(profile.ranks_per_node, 1))
    plan.problems.append(
        f"{iter_path} is a LoRA iteration, which exports in one process (Bridge's export_adapter_ckpt, then peft's "
        f"merge into {hf_model} in float32 on the host): it needs {gpu:.1f} GB on one GPU and ~{host:.0f} GB of host "
        f"memory, and '{profile.name}' has {gpu_budget:g} GB per GPU and {host_budget:g} GB per node; one process "
        f"fits models up to {math.floor(min(limits)):d}B parameters" + (f" ({examples})" if examples else "") +
        f", {spec.name} has {spec.total_params_b:g}B" +
        (f" (its full-weight iterations export with {layout_flags(full)})" if full else ""))
    return plan


def hub_offline_problem(profile: ClusterProfile) -> str | None:
    """--push-to-hub where the hub is not reachable (HF_HUB_OFFLINE=1 exported, else the profile's hub_offline)
    is refused at planning, not after the conversion."""
    env = os.environ.get("HF_HUB_OFFLINE")
    offline = env.strip().lower() in ("1", "true", "yes", "on") if env is not None else profile.hub_offline
    if not offline:
        return None
    why = "HF_HUB_OFFLINE=1" if env is not None else f"cluster profile '{profile.name}' is offline (hub_offline)"
    return f"--push-to-hub needs the Hugging Face hub, and {why}: drop --push-to-hub or run where the hub is reachable"


def hub_repo_name(ckpt_dir: Path, iter_name: str) -> str:
    """The hub repo (under the token's user) an iteration is pushed to: ``<run name>-iter_NNNNNNN``. The run name is
    the checkpoint folder's, or its parent's under the default layout (``<run>/checkpoints``), so runs never share
    a repo."""
    p = Path(ckpt_dir).resolve() if not Path(ckpt_dir).is_absolute() else Path(ckpt_dir)
    run = p.parent.name if p.name in ("checkpoints", "ckpts", "checkpoint") and p.parent.name else p.name
    return f"{run or 'checkpoint'}-{iter_name}"


def _export_phases(spec: ModelSpec, lay: Layout, profile: ClusterProfile) -> dict[str, float]:
    mega = megatron_gb(spec, lay, VERIFY_TOKENS)
    hf, _ = hf_gb(spec.total_params_b, max(1, profile.ranks_per_node), profile.memory_budget_gb, VERIFY_TOKENS,
                  spec.vocab_size)
    return {"export": round(mega + GATHER_GB, 1), "verify_megatron": round(mega, 1), "verify_hf": round(hf, 1)}


def _phases(mem: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in mem.items())


# ---- import ------------------------------------------------------------------------------------------------
def import_target(hf_id: str, output: Path | None, profile: ClusterProfile) -> tuple[str, Path, bool]:
    """(the hub id fetched, the output folder, Megatron or local engine). A registry name fetches the model the
    shipped config starts from (Nano: its -Base-BF16 model); the default output is ``<megatron_models_dir>/<HF
    name>``, the folder the shipped configs' ``checkpoint.pretrained_checkpoint`` reads."""
    spec = spec_for(hf_id)
    megatron = (spec.trains_on if spec is not None else MEGATRON_BRIDGE).megatron_checkpoint
    fetch = (spec.import_hf_id if hf_id == spec.name else hf_id) if spec is not None and megatron else hf_id
    if output is not None:
        return fetch, Path(output), megatron
    if not megatron:
        return fetch, models_root(profile, False) / hf_id.replace("/", "__"), False
    return fetch, models_root(profile, True) / fetch.split("/")[-1], True


def models_root(profile: ClusterProfile, megatron: bool) -> Path:
    """The shared folder the imports' default outputs are made in (one model's folder each)."""
    if not megatron:
        return paths.models_dir() / "local"
    return Path(profile.megatron_models_dir) if profile.megatron_models_dir else \
        paths.models_dir() / "megatron_bridges" / "models"


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def torchrun_line(module: list[str], world: int, nodes: int, procs: int, argv: list[str], port: int,
                  rdzv_id: str) -> list[str]:
    """The per-node launcher: standalone on one node; across nodes, a c10d rendezvous on the allocation's first
    node (each node's torchrun gives its processes a contiguous block of global ranks)."""
    if nodes == 1:
        return ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={world}", *module, *argv]

    alloc = current()
    host, rdzv_port = rendezvous(alloc, port)
    return ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={procs}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{rdzv_port}", f"--rdzv-id={alloc.job_id or rdzv_id}", *module, *argv]


def import_gb(spec: ModelSpec, lay: Layout) -> float:
    """GB per GPU of a model-parallel import: the rank's shard of the BF16 weights + the overhead (the HF tensors
    are read one at a time from safetensors)."""
    return round(weight_gb_per_gpu(spec.dense_params_b, spec.expert_params_b, lay) + OVERHEAD_GB, 1)


def import_layout(spec: ModelSpec, profile: ClusterProfile, nodes: int) -> Layout | None:
    """The layout of a model-parallel import on ``nodes`` nodes: every GPU of them used (an idle node buys
    nothing), node-local, the model's shape rules kept, and the shard fitting a GPU; smallest pipeline split, then
    smallest tensor split (``layouts_by_size``'s order)."""
    gpn = profile.ranks_per_node
    for lay in layouts_by_size(spec, gpn, nodes * gpn):
        if lay.world != nodes * gpn or lay.problems() or node_local_problems(lay, gpn, "") or \
                placement(lay.world, gpn)[2] or model_shape_problems(spec, lay):
            continue
        if not profile.memory_budget_gb or import_gb(spec, lay) <= profile.memory_budget_gb:
            return lay
    return None


def plan_import(hf_id: str, output: Path | None = None, *, nodes: int | None = None, cluster: str | None = None,
                argv: list[str] | None = None, tp: int | None = None, pp: int | None = None,
                ep: int | None = None, force: bool = False) -> JobPlan:
    """Hugging Face -> Megatron. One process on one node by default: Bridge's import_ckpt builds the model on the
    host (CPU initialisation) and saves it once. A model whose single-process import hangs (Super; the reference:
    always torchrun) or an explicit --tp/--pp/--ep imports model-parallel under torchrun, one rank per GPU, each
    building and saving its shard: on the allocation's nodes (the reference's --nodes=4 for Super), its GPU memory
    per rank and its host memory per node checked."""
    profile, n_nodes, _ = cluster_and_nodes(nodes, cluster)
    for flag, v in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if v is not None and v < 1:
            raise UserError(f"{flag} {v} must be >= 1")
    fetch, out, megatron = import_target(hf_id, output, profile)
    spec = spec_for(fetch)
    module = ["-m", "pipeline.cli.checkpoint", *(argv or [])]
    writer = MEGATRON_BRIDGE if megatron else LOCAL
    plan = JobPlan(kind="import", model=fetch, cluster=profile.name, profile=profile, nodes=1, ranks_per_node=1,
                   layout=Layout(1), engine=writer.checkpoint_format, gpus_needed=None if writer.needs_gpus else 0,
                   env=job_env(profile.env), launch=["python", *module])
    plan.notes.append(f"output: {out}")
    root = models_root(profile, megatron)
    if Path(out).resolve() == root.resolve():
        plan.problems.append(f"--output {out} is the shared models folder itself: give the model's own folder "
                             f"(the default: {root / fetch.split('/')[-1]})")
    else:  # before anything is deleted: absent, empty, or ours with --force (the job checks again)
        problem = output_folder_problem(out, force=force, what="import output")
        if problem:
            plan.problems.append(problem)
        elif folder_problem(out):  # a file in the way, an unwritable folder: the job failed after the model loaded
            plan.problems.append(f"import output {out}: {folder_problem(out)}")
    if spec is None and not Path(fetch).is_dir() and not HUB_ID.fullmatch(fetch):  # planned OK, failed in the job
        plan.problems.append(f"{fetch!r} is neither a registry model, a Hugging Face hub id (ORG/NAME) nor a local "
                             "model folder")
    if fetch != hf_id:
        plan.notes.append(f"{hf_id} imports {fetch} (the model the shipped {hf_id} config starts from)")
    given = any(v is not None for v in (tp, pp, ep))
    if not megatron:
        if given:
            plan.problems.append(f"--tp/--pp/--ep apply to a Megatron import; {fetch} imports as a local-engine "
                                 "checkpoint (one process)")
        return plan
    parallel = given or (spec is not None and not spec.single_process_import)
    if not parallel:
        if n_nodes > 1:
            plan.problems.append(f"import runs on one node, and {n_nodes} were asked for: isambard_sbatch --nodes=1 "
                                 f"{paths.CHECKPOINT_SUBMIT} import {shlex.quote(hf_id)}")
        if spec is not None:
            # the Megatron model built in host memory in the import's dtype (BF16, 2 bytes a parameter; CPU
            # initialisation) + the overhead; the HF weights stream from safetensors
            plan.host_memory_gb = round(2 * spec.total_params_b + OVERHEAD_GB, 1)
            _check_host_memory(plan, profile)
        return plan
    return _plan_parallel_import(plan, spec, profile, n_nodes, (tp, pp, ep) if given else None, module)


def _plan_parallel_import(plan: JobPlan, spec: ModelSpec | None, profile: ClusterProfile, n_nodes: int,
                          layout: tuple[int | None, ...] | None, module: list[str]) -> JobPlan:
    gpn = profile.ranks_per_node
    if not profile.has_gpus:
        plan.problems.append(f"a model-parallel import runs one rank per GPU; cluster profile '{profile.name}' has "
                             "none (select a GPU profile: PIPELINE_CLUSTER=isambard_gh200)")
        return plan
    if layout is not None:
        tp, pp, ep = (v or 1 for v in layout)
        lay = Layout(job_world(tp, pp, ep), tp=tp, pp=pp, ep=ep, etp=1)
    else:
        assert spec is not None
        found = import_layout(spec, profile, n_nodes)
        if found is None:
            fit = next((k for k in range(1, 65) if import_layout(spec, profile, k)), None)
            plan.problems.append(f"no import layout of {spec.hf_id} uses every GPU of {n_nodes} node(s) x {gpn} "
                                 f"and fits {profile.memory_budget_gb:g} GB per GPU" +
                                 (f": submit it with --nodes={fit}" if fit else ""))
            return plan
        lay = found
        plan.notes.append(f"layout: every GPU of the {n_nodes} node(s) ({layout_flags(lay)}); a single-process "
                          f"import of {spec.hf_id} hangs while loading (the reference: always torchrun)")
    nodes, procs, fill = placement(lay.world, gpn)
    plan.layout, plan.nodes, plan.ranks_per_node = lay, nodes, procs
    plan.memory_budget_gb = profile.memory_budget_gb
    plan.problems += lay.problems()
    plan.problems += node_local_problems(lay, gpn, f"on '{profile.name}'")
    if fill:
        plan.problems.append(fill)
    if nodes != n_nodes:
        plan.problems.append(f"the import's layout ({layout_flags(lay)}, world {lay.world}) runs on {nodes} "
                             f"node(s), and {n_nodes} were asked for: submit it with --nodes={nodes}")
    flags = [] if layout is not None else ["--tp", str(lay.tp), "--pp", str(lay.pp), "--ep", str(lay.ep)]
    plan.launch = torchrun_line(module, lay.world, nodes, procs, flags, profile.rdzv_port, "import") \
        if lay.world > 1 else ["python", *module, *flags]
    check_gpus_on_node(plan)
    if spec is None:
        plan.notes.append(f"{plan.model} is not in the model registry: no size facts, memory not estimated")
        return plan
    plan.problems += shape_problems_with_fix(spec, lay, profile, lambda cand: import_gb(spec, cand),
                                             max_world=max(nodes * gpn, 1))
    plan.memory_gb = {"import": import_gb(spec, lay)}
    if profile.memory_budget_gb and plan.memory_per_gpu_gb > profile.memory_budget_gb:
        plan.problems.append(f"estimated {plan.memory_per_gpu_gb:.1f} GB per GPU > {profile.memory_budget_gb:g} GB "
                             f"on '{profile.name}' (import {plan.memory_per_gpu_gb:.1f}): use more nodes or "
                             "--tp/--pp/--ep")
    # host memory per node: each rank stages its shards on the host while torch_dist writes them + its process
    plan.host_memory_gb = round(procs * (weight_gb_per_gpu(spec.dense_params_b, spec.expert_params_b, lay) +
                                         OVERHEAD_GB), 1)
    _check_host_memory(plan, profile, "per node ")
    return plan


def _check_host_memory(plan: JobPlan, profile: ClusterProfile, per: str = "") -> None:
    if profile.host_memory_gb and plan.host_memory_gb is not None and plan.host_memory_gb > profile.host_memory_gb:
        plan.problems.append(f"import needs ~{plan.host_memory_gb:.0f} GB of host memory {per}> "
                             f"{profile.host_memory_gb:g} GB on '{profile.name}'")
