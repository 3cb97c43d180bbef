"""Login-node preflight: everything that can be checked without a GPU, before anything is queued.

Each problem is one line naming every factor and the fix; ``run_preflight`` collects them all and the
launcher exits 2 when there is any. The checks: parallel layout (config/parallel.py's Layout: world size
divisibility by TP*PP*CP, expert groups by EP*ETP), the node-local rule of the cluster profile (every TP, CP and
EP*ETP group inside a node, from megatron-core's rank mapping: config/parallel.py),
batch divisibility, sequence length vs packing and the context-parallel padding rule, dataset and
checkpoint paths, tokens vs iterations, and a per-GPU memory estimate against the profile's memory.

Memory estimate (Megatron engine, BF16 weights, FP32 grads and Adam with the distributed optimizer):
  weights   = 2 B x (dense/(TP*PP) + experts/(EP*ETP*PP))
  grads     = 4 B x the same parameter count (FP32 main-grad buffer, grad_reduce_in_fp32)
  optimizer = 12 B x (dense/(TP*PP*DP*CP) + experts/(EP*ETP*PP*expert_DP)) (FP32 master, exp_avg, exp_avg_sq)
  activations: full recompute keeps one BF16 layer input per layer (s/CP/TP_sp x h x layers/PP x mbs)
               plus one layer's working set (~24 x s/CP x h bytes); without recompute ~34 x s/CP x h
               bytes per layer (Korthikanti et al., per-layer activations of a transformer block)
  logits    = 2 x 4 B x s/CP x vocab/TP (FP32 logits and their gradient in the cross-entropy)
  overhead  = 5 GB (CUDA context, NCCL buffers, allocator fragmentation)
The reference system measured 91.5 GB of 95 GB for its Nano 32K quickstart; ``docs/benchmarks.md``
compares this estimate with that measurement.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any, ClassVar

from pipeline.common import layout
from pipeline.common.errors import UserError, did_you_mean
from pipeline.common.layout import TRACKER, iter_dir, iter_dirname, iteration_of, list_iterations, read_tracker
from pipeline.common.mappings import flatten
from pipeline.common.paths import ENV_SUBMIT, IMAGE_RECORD_SUFFIX
from pipeline.config.cluster import ClusterProfile
from pipeline.config.engines import engine
from pipeline.config.kinds import EngineName, Mode
from pipeline.config.knobs import effective_knobs
from pipeline.config.loader import strip_suite_only
from pipeline.config.models import ModelSpec, recipe_mode
from pipeline.config.parallel import OVERHEAD_GB, Layout, model_shape_problems, node_local_problems
from pipeline.config.schema import TrainingConfig, field_types, in_schema
from pipeline.data.chat import tokenizer_model_name
from pipeline.data.packed_parquet import check_packed, packed_paths
from pipeline.data.packing import check_pad_multiple
from pipeline.env.runtimes import invisible_paths
from pipeline.jobs.plan import BasePlan
from pipeline.training import profiling

GB = 1e9

@dataclasses.dataclass(kw_only=True)
class Plan(BasePlan):
    """Training's plan (jobs/plan.py's base): the preflight's verdict and what it computed. Its record
    (``preflight.json``) and its text (the dry run) are the ones :meth:`as_dict` and :meth:`format` always wrote."""

    kind: str = "train"
    mode: Mode
    engine: EngineName
    peft: str | None = None  # --peft (lora): adapters on a frozen base
    gbs: int = 0
    mbs: int = 0
    grad_accum: int = 0
    seq_length: int = 0
    train_iters: int = 0
    tokens_per_iter: int = 0
    total_tokens: int = 0

    WORD: ClassVar[str] = "preflight"

    # the record's keys, in the order preflight.json has always had them (the layout's follow, then "ok")
    RECORD: ClassVar[tuple[str, ...]] = (
        "model", "mode", "engine", "cluster", "nodes", "ranks_per_node", "peft", "gbs", "mbs", "grad_accum",
        "seq_length", "train_iters", "tokens_per_iter", "total_tokens", "memory_gb", "memory_budget_gb", "problems",
        "notes", "warnings")

    def memory_phases(self) -> dict[str, float]:
        """One phase, training, of the estimate's total (``memory_gb`` holds its parts)."""
        return {"train": self.memory_gb["total"]} if "total" in self.memory_gb else {}

    def check_gpus_asked(self, asked: int, written: str) -> None:
        """The launcher starts one rank per GPU Slurm gives: another count than the plan's trains a layout the
        preflight never checked (refused at once, before the preflight's own problems)."""
        if self.profile is None or not self.profile.has_gpus or asked == self.profile.gpus_per_node:
            return
        planned = self.profile.gpus_per_node
        raise UserError(f"{written} gives {asked} GPU(s) per node, and the training plan (cluster profile "
                        f"{self.profile.name}) is for {planned}: submit with --gpus-per-node={planned} (or none: "
                        "isambard_sbatch adds the profile's); nothing was submitted")

    def pass_line(self) -> str:
        lay = self.layout
        return (f"Preflight: PASS - world {lay.world} (tp {lay.tp} pp {lay.pp} cp {lay.cp} ep {lay.ep} dp {lay.dp}), "
                f"memory estimate {self.memory_gb.get('total', 0):.1f} of {self.memory_budget_gb:g} GB")

    def as_dict(self) -> dict[str, Any]:
        d = {k: copy.deepcopy(getattr(self, k)) for k in self.RECORD}
        d.update(self.layout.as_record())  # the record keeps its flat world, tp, ..., dp
        d["ok"] = self.ok
        return d

    def format(self) -> str:
        lay = self.layout
        lines = [
            f"model {self.model} ({self.engine} engine), mode {self.mode}"
            + (f" with {self.peft} adapters (--peft {self.peft}: the base weights frozen, only the adapters train)"
               if self.peft else "") + f", cluster {self.cluster}",
            f"layout: nodes {self.nodes} x {self.ranks_per_node} ranks = world {lay.world}; tp {lay.tp} pp {lay.pp} "
            f"cp {lay.cp} ep {lay.ep} etp {lay.etp} -> dp {lay.dp}",
            f"batch: gbs {self.gbs} = mbs {self.mbs} x dp {lay.dp} x grad_accum {self.grad_accum}; "
            f"seq {self.seq_length}",
            f"tokens: {self.tokens_per_iter:,} per iteration x {self.train_iters} iterations = {self.total_tokens:,}",
        ]
        if self.memory_gb:
            parts = ", ".join(f"{k} {v}" for k, v in self.memory_gb.items() if k != "total")
            unit = engine(self.engine).rank_unit
            lines.append(f"memory estimate: {self.memory_gb['total']:.1f} GB per {unit}"
                         f" of {self.memory_budget_gb:g} GB ({parts})")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _count(cfg: TrainingConfig, key: str, value: int | None, plan: Plan) -> int:
    """A required count (typed and bounded at load): 0 and a problem when it is unset."""
    if key in cfg.invalid:
        return 0  # mistyped: already one of cfg.problems
    if value is None:
        plan.problems.append(f"{key} is not set (no recipe default for model '{plan.model}' mode '{plan.mode}'); "
                             f"set it in the YAML or with {key}=...")
        return 0
    return value  # >= 1 where set: the schema's bound


def packed_data_paths(cfg: TrainingConfig, tokenizer_name: str) -> dict[str, Path] | None:
    ds, specs = cfg.dataset, cfg.dataset.offline_packing_specs
    root = ds.dataset_root
    seq = specs.packed_sequence_size or ds.seq_length or cfg.model.seq_length
    if root is None or seq is None:
        return None
    paths = packed_paths(Path(root), tokenizer_name, specs.pad_seq_to_mult or 1, seq)
    explicit = {"train": specs.packed_train_data_path, "validation": specs.packed_val_data_path,
                "metadata": specs.packed_metadata_path}
    for k, v in explicit.items():
        if v:
            paths[k] = Path(v)
    return paths


def estimate_memory_gb(spec: ModelSpec, plan: Plan, recompute: str | None, sequence_parallel: bool,
                       local_engine: bool, peft: str | None = None) -> dict[str, float]:
    s, h, L, V = plan.seq_length, spec.hidden_size, spec.num_layers, spec.vocab_size
    if local_engine:
        # transformers Trainer, FP32 everything, AdamW: weights 4 + grads 4 + Adam 8 bytes per parameter.
        p = (spec.dense_params_b + spec.expert_params_b) * 1e9
        act: float = 34 * s * h * L * plan.mbs * 2  # FP32 activations are 2x the BF16 per-layer figure
        logits: float = 2 * 4 * s * V * plan.mbs
        return {"weights": 4 * p / GB, "grads": 4 * p / GB, "optimizer": 8 * p / GB,
                "activations": act / GB, "logits": logits / GB, "overhead": 0.5,
                "total": (16 * p + act + logits) / GB + 0.5}
    lay = plan.layout
    tp, pp, cp, ep, etp, dp = lay.tp, lay.pp, lay.cp, lay.ep, lay.etp, max(1, lay.dp)
    dense = spec.dense_params_b * 1e9 / (tp * pp)
    expert = spec.expert_params_b * 1e9 / (ep * etp * pp)
    expert_dp = max(1, plan.world // (ep * etp * pp))
    weights = 2 * (dense + expert)
    grads = 4 * (dense + expert)
    optim = 12 * (dense / (dp * cp) + expert / expert_dp)
    if peft:  # LoRA: the base weights are frozen; gradients and Adam state exist only for the small adapters
        grads = optim = 0.0
    s_local = s / cp
    sp_div = tp if sequence_parallel else 1
    layers_local = L / pp
    if recompute == "full":
        act = 2 * (s_local / sp_div) * h * layers_local * plan.mbs + 24 * s_local * h * plan.mbs
    else:
        act = 34 * s_local * h * layers_local * plan.mbs / sp_div
    logits = 2 * 4 * s_local * V / tp * plan.mbs
    parts = {"weights": weights / GB, "grads": grads / GB, "optimizer": optim / GB, "activations": act / GB,
             "logits": logits / GB, "overhead": OVERHEAD_GB}
    parts["total"] = sum(parts.values())
    return {k: round(v, 1) for k, v in parts.items()}


def run_preflight(cfg: TrainingConfig, spec: ModelSpec, mode: Mode, cluster: ClusterProfile, nodes: int,
                  path_checks: bool = True, peft: str | None = None, ft_launcher: bool = False) -> Plan:
    """``ft_launcher``: the ranks start under ft_launcher (``launch.uses_ft_launcher``: the profile's launcher,
    unless --disable-ft), which turns on Megatron's fault tolerance on the Bridge engine."""
    local = not spec.trains_on.bridge_rules  # the local engine's own, smaller set of rules
    plan = Plan(model=spec.name, mode=mode, engine=spec.engine, cluster=cluster.name, nodes=nodes,
                ranks_per_node=cluster.ranks_per_node, layout=Layout(nodes * cluster.ranks_per_node), peft=peft,
                profile=cluster, gpus_needed=None if cluster.has_gpus else 0)
    if spec.trains_on.needs_gpus and not cluster.has_gpus:
        plan.problems.append(f"model '{spec.name}' runs on the Megatron Bridge engine, which needs GPUs; cluster "
                             f"profile '{cluster.name}' has gpus_per_node=0: use --cluster with a GPU profile")
    if plan.world < 1:
        plan.problems.append(f"cluster '{cluster.name}' gives {plan.ranks_per_node} ranks per node")
        return plan
    plan.problems += cfg.problems  # values whose type does not fit their field (found at load)
    before = len(plan.problems)
    m, t = cfg.model, cfg.train
    tp = _count(cfg, "model.tensor_model_parallel_size", m.tensor_model_parallel_size, plan)
    pp = _count(cfg, "model.pipeline_model_parallel_size", m.pipeline_model_parallel_size, plan)
    cp = _count(cfg, "model.context_parallel_size", m.context_parallel_size, plan)
    ep = _count(cfg, "model.expert_model_parallel_size", m.expert_model_parallel_size, plan)
    etp = _count(cfg, "model.expert_tensor_parallel_size", m.expert_tensor_parallel_size, plan)
    gbs = plan.gbs = _count(cfg, "train.global_batch_size", t.global_batch_size, plan)
    mbs = plan.mbs = _count(cfg, "train.micro_batch_size", t.micro_batch_size, plan)
    iters = plan.train_iters = _count(cfg, "train.train_iters", t.train_iters, plan)
    seq = plan.seq_length = _count(cfg, "model.seq_length", m.seq_length, plan)
    if len(plan.problems) > before or 0 in (tp, pp, cp, ep, etp, gbs, mbs, seq):
        return plan  # a count unset, < 1 or mistyped: the checks below divide by them
    gpn = cluster.ranks_per_node
    sp = bool(m.sequence_parallel)
    lay = plan.layout = Layout(plan.world, tp, pp, cp, ep, etp)

    if not spec.trains_on.model_parallel and (tp, pp, cp, ep, etp) != (1, 1, 1, 1, 1):
        plan.problems.append(f"the local engine has no model parallelism: tp({tp}) pp({pp}) cp({cp}) ep({ep}) "
                             f"etp({etp}) must all be 1; it scales by data parallelism only")
    per_node = "gpus_per_node" if cluster.has_gpus else "procs_per_node"  # megatron-core's rules: config/parallel.py
    plan.problems += lay.problems(f" = nodes({nodes}) * {per_node}({gpn})", f"the total (--nodes x {per_node})")
    dp = max(1, lay.dp)  # the batch is checked against dp 1 when the world does not divide (a problem above)
    if cluster.has_gpus:  # every TP, CP and expert group inside one node (config/parallel.py)
        plan.problems += node_local_problems(lay, gpn, f"on '{cluster.name}'")
    # heads, KV heads, experts and layers against tp, cp, ep and pp (config/parallel.py)
    extra_model = cfg.extra.get("model")
    stages: dict = extra_model if isinstance(extra_model, dict) else {}
    first, last = (stages.get(f"num_layers_in_{k}_pipeline_stage") for k in ("first", "last"))
    plan.problems += model_shape_problems(
        spec, lay,
        sequence_parallel=None if m.sequence_parallel is None or local else sp,
        first_stage_layers=first if isinstance(first, int) and not isinstance(first, bool) else None,
        last_stage_layers=last if isinstance(last, int) and not isinstance(last, bool) else None)
    if dp and gbs % (mbs * dp):
        unit = mbs * dp
        plan.problems.append(f"train.global_batch_size({gbs}) is not divisible by micro_batch_size({mbs}) * "
                             f"data_parallel({dp}) = {unit}: use a multiple of {unit} "
                             f"(e.g. {max(unit, round(gbs / unit) * unit)})")
    elif dp:
        plan.grad_accum = gbs // (mbs * dp)

    ds, specs = cfg.dataset, cfg.dataset.offline_packing_specs
    ds_seq = ds.seq_length
    if ds_seq is not None and ds_seq != seq:
        plan.problems.append(f"dataset.seq_length({ds_seq}) != model.seq_length({seq}): set both to the same value")
    specs_set = any(v is not None for v in dataclasses.asdict(specs).values())
    if not local and specs_set and ds.enable_offline_packing is False:
        # Bridge's GPT step hands the model the packed sequences' boundaries only with offline packing on; off, each
        # pack of several documents would be one sequence, attending across its documents (Bridge refuses the pair
        # at validation, on the GPU node, after the queue)
        plan.problems.append("dataset.enable_offline_packing is false but dataset.offline_packing_specs is set: the "
                             "packed documents would reach the model without their boundaries; set "
                             "dataset.enable_offline_packing=true (or drop the packing specs)")
    packed_size = specs.packed_sequence_size
    if packed_size not in (None, -1) and packed_size != seq:
        plan.problems.append(f"dataset.offline_packing_specs.packed_sequence_size({packed_size}) != "
                             f"model.seq_length({seq}): packs must be exactly one sequence long")
    pad = specs.pad_seq_to_mult or 1
    packed = mode == "sft" or specs_set
    if packed and (cp > 1 or pad > 1):  # the CP padding rule is about packed (THD) sequences
        problem = check_pad_multiple(pad, cp, tp, sp)
        if problem:
            plan.problems.append("dataset.offline_packing_specs." + problem)
    if seq % max(1, 2 * cp if cp > 1 else 1):
        plan.problems.append(f"model.seq_length({seq}) is not divisible by 2*cp = {2 * cp}")

    _check_values(cfg, plan)
    plan.tokens_per_iter = gbs * seq
    plan.total_tokens = gbs * seq * iters
    if path_checks:
        _check_paths(cfg, spec, mode, plan, peft)
        plan.problems += _invisible_in_container(cfg, cluster)
        plan.problems += image_package_problems(cfg, spec, mode, peft, cluster)
    else:
        plan.notes.append("path checks skipped (--no-path-checks)")
    plan.notes += venv_optimizer_note(cfg, spec, cluster)

    recompute = m.recompute_granularity
    if not local and recompute == "full" and m.cuda_graph_impl in ("transformer_engine", "local"):
        # megatron-core's TransformerConfig asserts it in Bridge's validate(), on every rank after the queue
        plan.problems.append(f"model.recompute_granularity=full with model.cuda_graph_impl={m.cuda_graph_impl} (per-"
                             "module CUDA graphs, the nano pretrain recipe's): megatron-core refuses full recompute "
                             "beside them; set model.cuda_graph_impl=none, or recompute_granularity=selective")
    plan.memory_gb = estimate_memory_gb(spec, plan, recompute, sp, local, peft)
    _hazards(cfg, plan, local)
    _check_profiling(cfg, plan, local)
    _check_bridge_keys(cfg, spec, mode, peft, plan)
    _check_pretraining_data(cfg, spec, mode, peft, plan, path_checks)
    _check_suite_keys(cfg, plan)
    plan.memory_budget_gb = cluster.memory_budget_gb
    if plan.memory_budget_gb and plan.memory_gb["total"] > plan.memory_budget_gb:
        hint = ("raise cp/ep/tp (within a node) or lower micro_batch_size (full recompute is already on)"
                if recompute == "full" else
                "enable model.recompute_granularity=full, raise cp/ep/tp (within a node) or lower micro_batch_size") \
            if not local else "lower train.micro_batch_size or model.seq_length"
        per = "GPU" if cluster.has_gpus else "host"
        fits = None if local else _nodes_that_fit(spec, plan, recompute, sp, peft)
        if fits is not None:  # more data-parallel ranks shard the optimizer: name the count, then the other levers
            hint = (f"with this layout it needs --nodes {fits[0]} ({fits[1]:.1f} GB per GPU there); or " + hint)
        plan.problems.append(f"estimated memory {plan.memory_gb['total']:.1f} GB per {per}"
                             f" on {nodes} node(s) > {plan.memory_budget_gb:g} GB on '{cluster.name}' "
                             f"(weights {plan.memory_gb['weights']}, grads {plan.memory_gb['grads']}, optimizer "
                             f"{plan.memory_gb['optimizer']}, activations {plan.memory_gb['activations']}, logits "
                             f"{plan.memory_gb['logits']}): {hint}")
    if not local and cfg.checkpoint.save is None and cfg.logger.wandb_save_dir is None:
        plan.problems.append("checkpoint.save is null, so logger.wandb_save_dir must be set (W&B needs a writable "
                             "directory when no checkpoint directory exists)")
    if not local and not cfg.checkpoint.save and (ft_launcher or cfg.ft.enable_ft_package):
        # Bridge's fault_tolerance.setup raises "checkpointing save dir must be set to enable fault tolerance" on
        # every rank, after the queue; under ft_launcher each restart does it again
        why = (f"ft_launcher, the launcher of cluster profile '{cluster.name}'" if ft_launcher
               else "ft.enable_ft_package=true")
        off = "pass --disable-ft (plain torchrun)" if ft_launcher else "set ft.enable_ft_package=false"
        plan.problems.append(f"checkpoint.save is null, and fault tolerance ({why}) needs it: Megatron Bridge's "
                             f"fault-tolerance setup raises on every rank without a save directory; set "
                             f"checkpoint.save=DIR, or {off}")
    return plan


def _check_values(cfg: TrainingConfig, plan: Plan) -> None:
    """Rules between values that would fail only after the allocation starts. Each value's own bounds are the
    schema's (``config/schema._f``), checked at load: a value outside them is unset here, and already a problem."""
    o, sch = cfg.optimizer, cfg.scheduler
    if o.min_lr is not None and o.lr is not None and o.min_lr > o.lr:
        plan.problems.append(f"optimizer.min_lr={o.min_lr:g} must be <= optimizer.lr ({o.lr:g})")
    warmup = sch.lr_warmup_iters
    if warmup is not None and plan.train_iters and warmup > plan.train_iters:
        plan.notes.append(f"scheduler.lr_warmup_iters({warmup}) > train.train_iters({plan.train_iters}): the run "
                          "never leaves warm-up")


def unwritable_dir(path: Path) -> str | None:
    """Why ``path`` cannot be (or become) a writable directory, or None. Nothing is created."""
    if path.exists():
        if not path.is_dir():
            return "exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is not writable"
    parent = path
    while not parent.exists():
        if parent == parent.parent:
            return "cannot be created"
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


BRIDGE_FIELDS = Path(__file__).resolve().parents[1] / "config" / "bridge_fields.json"


@functools.lru_cache(maxsize=1)
def _bridge_fields() -> dict:
    return json.loads(BRIDGE_FIELDS.read_text())


DATA_KEYS = ("data_path", "blend", "blend_per_split")


def _check_pretraining_data(cfg: TrainingConfig, spec: ModelSpec, mode: str, peft: str | None, plan: Plan,
                            path_checks: bool) -> None:
    """Pretraining (and CPT) on Megatron Bridge reads indexed ``.bin/.idx`` data named by ``+dataset.data_path`` (or a
    blend); a recipe names none, and Bridge then trains on its mock dataset (random tokens) without a word. With path
    checks, each prefix of a data_path list must have its ``.bin`` and ``.idx``."""
    if not spec.trains_on.bridge_rules or peft or recipe_mode(mode) != "pretrain":
        return
    raw = cfg.extra.get("dataset")
    ds: dict[str, Any] = raw if isinstance(raw, dict) else {}
    given = {k: ds[k] for k in DATA_KEYS if ds.get(k) not in (None, [], "")}
    if not given:
        plan.problems.append(f"mode {mode} on Megatron Bridge reads indexed data, and none is named: set "
                             "+dataset.data_path=[PREFIX] (the .bin/.idx prefix pipeline_data_prepare.py tokenize "
                             "writes), or a blend; without it Bridge trains on mock data (random tokens)")
        return
    paths = given.get("data_path")
    if not path_checks or not isinstance(paths, list):
        return
    for prefix in (str(p) for p in paths if not _is_weight(p)):
        missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
        if missing:
            plan.problems.append(f"dataset.data_path prefix {prefix} has no {' or '.join(missing)} file: write it with "
                                 "pipeline_data_prepare.py tokenize, or fix the prefix (PATH/<name>_text_document)")


def _is_weight(value: Any) -> bool:
    """A blend list's weight (``[0.3, prefix, 0.7, prefix]``), not a prefix."""
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _check_bridge_keys(cfg: TrainingConfig, spec: ModelSpec, mode: str, peft: str | None, plan: Plan) -> None:
    """Every key and value handed to Megatron Bridge must exist on, and fit, the recipe's ConfigContainer.

    Bridge's own override code drops a key it does not know (a misspelled ``+key``, or an SFT dataset key under a
    pretrain recipe) without an error, and stores a string in an int or bool field; found by the Bridge
    harness (tests/bridge/). ``config/bridge_fields.json`` records every section, class and field kind of the
    pinned Bridge's recipes (written from the real ConfigContainer by the harness, which also checks it is
    current), so this check runs on the login node without Bridge. The values of the schema's own fields were typed
    at load (their types agree with this table: tests/unit/test_config.py); here the table types the pass-through
    ``+key`` values and says which keys the recipe's classes have at all."""
    table = _bridge_fields()
    # The local engine reads the same section and field names (our schema mirrors Bridge's): its values are
    # type-checked against the Nano recipe's fields; unknown '+' keys are only warned about there (it ignores them).
    types_only = not spec.trains_on.bridge_rules
    key = f"{'nano' if types_only else spec.name}/{recipe_mode(mode, peft)}"
    sections = table["recipes"].get(key)
    if sections is None:
        return
    classes = table["classes"]

    def walk(node: dict, fields: dict, where: str, owner: str) -> None:
        for k, v in node.items():
            dotted = f"{where}.{k}" if where else k
            if k not in fields and types_only and in_schema(dotted):
                continue  # a key of our schema: the local engine reads it (e.g. dataset_root for indexed data)
            if k not in fields:
                hint = did_you_mean(k, fields, prefix=f"{where}." if where else "")
                if dotted.split(".")[0] == "peft" and not peft:
                    hint = " (the LoRA settings apply with --peft lora)"
                if dotted in ("dataset.dataset_root", "dataset.offline_packing_specs") and "data_path" in fields:
                    hint = (" (packed SFT data is for sft; pretraining on Megatron Bridge reads indexed .bin/.idx "
                            "data: set +dataset.data_path=[PREFIX] from pipeline_data_prepare.py tokenize)")
                if types_only:  # the local engine ignores '+' keys: a key no engine knows is a typo
                    plan.problems.append(f"'{dotted}' is not a config key of either engine{hint}")
                    continue
                plan.problems.append(f"'{dotted}' is not a field of Megatron Bridge's {spec.name} "
                                     f"{recipe_mode(mode, peft)} config ({owner}){hint}: Bridge would drop it without "
                                     "an error")
                continue
            kind = fields[k]
            if kind.startswith("class:"):
                cls = kind[len("class:"):]
                if isinstance(v, dict):
                    walk(v, classes.get(cls, {}), dotted, cls)
                elif v is not None and not (dotted == "mixed_precision" and isinstance(v, str)):  # a recipe name
                    plan.problems.append(f"'{dotted}' is a section of Megatron Bridge's config ({cls}): set its "
                                         f"fields ({dotted}.FIELD=...), not {dotted}={v!r}")
                continue
            if isinstance(v, dict) or v is None or kind == "any" or in_schema(dotted):
                continue  # a schema field's value was typed at load
            ok = {"bool": isinstance(v, bool), "int": isinstance(v, int) and not isinstance(v, bool),
                  "float": isinstance(v, (int, float)) and not isinstance(v, bool), "str": isinstance(v, str)}[kind]
            if not ok:
                want = {"bool": "a boolean (true/false)", "int": "an integer", "float": "a number",
                        "str": f"a string (quote it: {dotted}='{v}')"}[kind]
                plan.problems.append(f"{dotted}={v!r} must be {want} ({owner}.{k} is {kind} in Megatron Bridge's "
                                     "config)")

    walk(strip_suite_only(cfg), sections, "", "ConfigContainer")


def _check_suite_keys(cfg: TrainingConfig, plan: Plan) -> None:
    """A ``+pipeline...`` key that is not a field: the suite-only section never reaches an engine, so it is a typo."""
    known = [k for k in field_types() if k.startswith("pipeline.")]
    for key in flatten({"pipeline": cfg.extra["pipeline"]} if "pipeline" in cfg.extra else {}):
        hint = did_you_mean(key, known) or f" (its keys: {', '.join(known)})"
        plan.problems.append(f"'{key}' is not a config key: the pipeline section is the suite's own{hint}")


def _check_profiling(cfg: TrainingConfig, plan: Plan, local: bool) -> None:
    """The profiling window and ranks (training/profiling.py): what Bridge asserts on the GPU node, and a window
    that would record nothing."""
    problems, warnings = profiling.check(cfg, train_iters=plan.train_iters, world=plan.world, local=local)
    plan.problems += problems
    plan.warnings += warnings


def _hazards(cfg: TrainingConfig, plan: Plan, local: bool) -> None:
    """The reference system's documented hazards: valid configs that are known to fail on the cluster."""
    if local:
        return
    lr = cfg.optimizer.lr
    if plan.layout.cp > 1 and lr is not None and lr >= 8e-5:
        plan.warnings.append(f"optimizer.lr={lr:g} with context_parallel_size={plan.layout.cp}: the reference "
                             "measured NaN losses at 8e-5 under context parallelism (the recipe's SFT rate is 5e-6)")
    if cfg.model.fp8 and (plan.layout.ep > 1 or plan.model in ("nano", "super")):
        plan.warnings.append(f"model.fp8={cfg.model.fp8!r} on a MoE model: the reference saw stochastic "
                             "alignment crashes in MoE routing with FP8; BF16 is the certified setting")


def _check_paths(cfg: TrainingConfig, spec: ModelSpec, mode: str, plan: Plan, peft: str | None) -> None:
    save = cfg.checkpoint.save
    if save is not None:
        problem = unwritable_dir(Path(str(save)))
        if problem:
            plan.problems.append(f"checkpoint.save {save} {problem}")
    root = cfg.dataset.dataset_root
    pad = cfg.dataset.offline_packing_specs.pad_seq_to_mult or 1

    if spec.trains_on.bridge_rules and not peft and recipe_mode(mode) == "pretrain":
        # Bridge pretraining and CPT read indexed .bin/.idx prefixes (+dataset.data_path, a blend), checked by
        # _check_pretraining_data; dataset_root is not a field of GPTDatasetConfig
        pass
    elif root is None:
        fix = ("pipeline_data_prepare.py tokenize ... for an indexed corpus" if mode != "sft" else
               "pipeline_data_prepare.py prepare --dataset ... --dataset-root DIR, then pack")
        plan.problems.append(f"dataset.dataset_root is not set: point it at a prepared dataset ({fix})")
    elif not Path(root).is_dir():
        plan.problems.append(f"dataset.dataset_root {root} does not exist: prepare it with "
                             f"python pipeline_data_prepare.py prepare --dataset ... --dataset-root {root}, "
                             "or fix the path (--no-path-checks to plan away from the cluster)")
    else:
        tok = cfg.dataset.offline_packing_specs.tokenizer_model_name or tokenizer_model_name(spec.name)
        paths = packed_data_paths(cfg, tok)
        indexed = mode != "sft" and any(Path(root).rglob("*_text_document.idx"))
        if indexed:
            plan.notes.append(f"data: Megatron indexed corpus under {root}")
        elif paths and not paths["train"].exists():
            plan.problems.append(f"packed training data {paths['train']} does not exist: run python "
                                 f"pipeline_data_prepare.py pack {root} <tokenizer> {plan.seq_length} "
                                 f"{pad}")
        elif paths:
            bad = check_packed(paths, plan.seq_length, pad)
            plan.problems += bad
            packs = None if bad else _note_epochs(paths["train"], plan)
            if spec.trains_on.bridge_rules and packs is not None and packs < plan.gbs:
                # Bridge's loader raises "Not enough train samples for a single global batch" on every rank, after
                # the queue and the model's load (data/loaders.py)
                plan.problems.append(f"packed training data {paths['train']} holds {packs} packs, fewer than one "
                                     f"global batch (train.global_batch_size={plan.gbs}): Megatron Bridge refuses "
                                     "it; prepare more data or lower train.global_batch_size")
            if spec.trains_on.bridge_rules and not bad:
                plan.problems += _validation_batch_problems(cfg, paths, plan)
    pre = cfg.checkpoint.pretrained_checkpoint
    # every rank loads it: a bad path failed four times under torchrun
    if not spec.trains_on.bridge_rules and pre is not None:

        p = Path(str(pre))
        if not p.exists():
            plan.problems.append(f"checkpoint.pretrained_checkpoint {pre} does not exist: point it at a run's "
                                 "checkpoints/ folder, an iter_NNNNNNN folder or a Hugging Face model folder")
        elif not p.is_dir() or not ((p / TRACKER).exists() or (p / "config.json").exists()):
            plan.problems.append(f"checkpoint.pretrained_checkpoint {pre} is neither a checkpoints/ folder ({TRACKER})"
                                 " nor a model folder (config.json)")
    plan.problems += _tracker_problems(cfg)
    _check_continued(cfg, plan)
    if spec.trains_on.bridge_rules and (mode in ("sft", "cpt") or peft):
        ckpt = cfg.checkpoint.pretrained_checkpoint or cfg.checkpoint.load
        if ckpt is None:
            plan.problems.append(f"mode {mode} starts from a checkpoint: set checkpoint.pretrained_checkpoint "
                                 f"(import one with: pipeline_checkpoint_convert.sh import {spec.import_hf_id})")
        elif not Path(ckpt).exists():
            plan.problems.append(f"checkpoint {ckpt} does not exist: import it with pipeline_checkpoint_convert.sh "
                                 f"import {spec.import_hf_id}, or fix checkpoint.pretrained_checkpoint")
        elif not _holds_megatron_checkpoint(Path(ckpt)):
            plan.problems.append(f"checkpoint {ckpt} holds no Megatron checkpoint (no {TRACKER}, no iter_NNNNNNN "
                                 "folder with files: an empty folder, or an import that never finished): import it "
                                 f"with pipeline_checkpoint_convert.sh import {spec.import_hf_id} --output {ckpt}, "
                                 "or fix checkpoint.pretrained_checkpoint")


MAX_NODES_SEARCHED = 512


def _nodes_that_fit(spec: ModelSpec, plan: Plan, recompute, sp: bool, peft: str | None) -> tuple[int, float] | None:
    """The fewest nodes, above the plan's, on which the same tp/pp/cp/ep/etp layout is valid, divides the global
    batch and fits the memory budget (the distributed optimizer shards over the added data-parallel ranks), with its
    estimate; None where no count up to MAX_NODES_SEARCHED does."""
    lay, gpn = plan.layout, plan.ranks_per_node
    for n in range(plan.nodes + 1, MAX_NODES_SEARCHED + 1):
        cand = Layout(n * gpn, lay.tp, lay.pp, lay.cp, lay.ep, lay.etp)
        if cand.problems("", "") or plan.gbs % (plan.mbs * max(1, cand.dp)):
            continue
        trial = dataclasses.replace(plan, nodes=n, layout=cand, problems=[], notes=[], warnings=[])
        total = estimate_memory_gb(spec, trial, recompute, sp, False, peft)["total"]
        if total <= plan.memory_budget_gb:
            return n, total
    return None


def _holds_megatron_checkpoint(path: Path) -> bool:
    """What Bridge can load from: a checkpoints folder with its tracker or an iteration folder, or an iteration
    folder itself, holding files (an empty folder passed the preflight and failed on every rank after the queue)."""
    if not path.is_dir():
        return False
    if (path / TRACKER).is_file():
        return True
    folders = [path] if iteration_of(path) is not None else [iter_dir(path, n) for n in list_iterations(path)]
    return any(f.is_dir() and any(f.iterdir()) for f in folders)


def _tracker_problems(cfg: TrainingConfig) -> list[str]:
    """A checkpoints folder the run resumes from or starts from whose ``latest_checkpointed_iteration.txt`` is not an
    iteration number, or names an iteration that is not there: every start reads it, so a corrupt one passed the
    preflight and then failed in every restart."""
    out, seen = [], set()
    ck = cfg.checkpoint
    for key, value in (("checkpoint.save", ck.save), ("checkpoint.load", ck.load),
                       ("checkpoint.pretrained_checkpoint", ck.pretrained_checkpoint)):
        if not value or not (Path(str(value)) / TRACKER).exists():
            continue
        folder = Path(str(value))
        if folder.resolve() in seen:
            continue
        seen.add(folder.resolve())
        try:
            n = read_tracker(folder)
        except UserError as exc:
            out.append(f"{key}: {exc}")
            continue
        if n is not None and not iter_dir(folder, n).is_dir():
            have = ", ".join(map(str, list_iterations(folder)[-5:])) or "none"
            out.append(f"{key}: {folder / TRACKER} names iteration {n}, but {iter_dirname(n)} does not exist "
                       f"(iterations there: {have}): write one of them into it, or remove it to start afresh")
    return out


def continues_from(cfg: TrainingConfig) -> Path | None:
    """The other run's save this run continues (``checkpoint.load`` set, not this run's save, not ``finetune``)."""
    ck = cfg.checkpoint
    if not ck.load or ck.finetune or not ck.save or Path(str(ck.load)).resolve() == Path(str(ck.save)).resolve():
        return None
    return Path(str(ck.load))


def _check_continued(cfg: TrainingConfig, plan: Plan) -> None:
    """A run continuing another's save (``checkpoint.load`` != ``save``): the iteration it continues is there."""
    src, step = continues_from(cfg), cfg.checkpoint.ckpt_step
    if src is None:
        return
    done = layout.complete_iterations(src)
    if (step is None and not done) or (step is not None and step not in done):
        what = f"iteration {step}" if step is not None else "complete checkpoint"
        plan.problems.append(f"checkpoint.load {src} holds no {what} to continue from (complete: "
                             f"{', '.join(map(str, done)) or 'none'}): run the phase it continues first, or fix "
                             "checkpoint.load / checkpoint.ckpt_step")
    elif (step or done[-1]) >= int(cfg.train.train_iters or 0):
        plan.problems.append(f"train.train_iters={cfg.train.train_iters} is not past iteration {step or done[-1]} "
                             f"of {src}, which this run continues: train_iters counts on from there (the total)")


def gpu_packages_needed(cfg: TrainingConfig, spec: ModelSpec, mode: str, peft: str | None) -> list[str]:
    """The GPU packages this job's model selects (the recipe's, :attr:`ModelSpec.gpu_packages`), DeepEP decided by the
    config's own ``model.moe_token_dispatcher_type`` where it sets one."""
    need = list(spec.gpu_packages.get(recipe_mode(mode, peft), ()))
    dispatcher = cfg.model.moe_token_dispatcher_type
    if dispatcher is not None:
        need = [p for p in need if p != "deep-ep"] + (["deep-ep"] if dispatcher == "flex" else [])
    return need


def _canonical(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


RECORD_MAX_BYTES = 4 * 2**20


def image_package_problems(cfg: TrainingConfig, spec: ModelSpec, mode: str, peft: str | None,
                           cluster: ClusterProfile) -> list[str]:
    """A container job whose model needs GPU packages (mamba-ssm and causal-conv1d for the hybrid family, DeepEP for
    the flex dispatcher, Transformer Engine) reads the image's own record of what it holds (validate's
    image-packages writes ``<image>.packages.txt`` beside the SIF, inside the container): a missing record, or one
    without a needed package, is one line here; before, the first Nano run failed in ``MambaMixer.__init__`` on
    every rank after the allocation. Read as ``name==version`` lines with the standard library (the login node's
    planner has no ``packaging``)."""
    need = gpu_packages_needed(cfg, spec, mode, peft)
    if not spec.trains_on.bridge_rules or cluster.runtime == "venv" or not need:
        return []
    sif = effective_knobs(cluster).get("PIPELINE_SIF", "")
    if not sif:
        return []
    record = Path(sif + IMAGE_RECORD_SUFFIX)
    what = f"the {spec.name} {mode}{' ' + peft if peft else ''} recipe needs {', '.join(need)}"
    if not record.exists():
        return [f"the image's package record {record} does not exist: {what}; record what the image holds with "
                f"isambard_sbatch {ENV_SUBMIT} validate (its image-packages check writes it)"]
    # a FIFO would block the planner for ever, and a record is a few KB of pip freeze lines
    if not record.is_file() or record.stat().st_size > RECORD_MAX_BYTES:
        return [f"the image's package record {record} is not a package list (not a regular file, or over "
                f"{RECORD_MAX_BYTES // 2**20} MiB): {what}; write it again with isambard_sbatch {ENV_SUBMIT} validate"]
    try:
        text = record.read_text(errors="replace")
    except OSError as exc:
        return [f"the image's package record {record} is unreadable ({exc.strerror}): {what}"]
    have = {_canonical(line.split("#", 1)[0].split("==", 1)[0]) for line in text.splitlines()
            if "==" in line.split("#", 1)[0]}
    missing = [p for p in need if _canonical(p) not in have]
    problems = []
    if missing:
        problems.append(f"the image {sif} lacks {', '.join(missing)} (its record {record}): {what}; use an image that "
                        f"has them (the NGC NeMo image does), then rerun isambard_sbatch {ENV_SUBMIT} validate")
    if distributed_optimizer(cfg) and not have & {"transformer-engine", "apex"}:
        problems.append(f"{DIST_OPT} with neither Transformer Engine nor Apex in the image {sif} (its record "
                        f"{record}): {NO_FUSED_ADAM_RESUME}; use an image with Transformer Engine (the NGC NeMo "
                        f"image), or set {DIST_OPT_OFF}")
    return problems


# megatron-core's DistributedOptimizer steps with TE's or Apex's FusedAdam; without either it falls back to torch's
# Adam, whose state_dict asserts one Adam step across a still-empty state (distrib_optimizer.py:839), which Bridge's
# checkpoint load builds before the first step (pipeline.bridge.NO_FUSED_ADAM): the run trains and
# saves, and every resume dies. Bridge's recipes turn the distributed optimizer on.
DIST_OPT = "the distributed optimizer (optimizer.use_distributed_optimizer, on in Bridge's recipes)"
DIST_OPT_OFF = "optimizer.use_distributed_optimizer=false ddp.use_distributed_optimizer=false"
NO_FUSED_ADAM_RESUME = ("megatron-core then falls back to torch's Adam, whose DistributedOptimizer cannot resume "
                        "(distrib_optimizer.py:839): the run would train and save, and die on its first resume")


def distributed_optimizer(cfg: TrainingConfig) -> bool:
    """Whether the run uses megatron-core's distributed optimizer: the config's choice, else the recipes' (on)."""
    return cfg.optimizer.use_distributed_optimizer is not False and cfg.ddp.use_distributed_optimizer is not False


def venv_optimizer_note(cfg: TrainingConfig, spec: ModelSpec, cluster: ClusterProfile) -> list[str]:
    """A venv job's packages are not visible from the login node: where it uses the distributed optimizer, the plan
    says what its resume needs (a container job's image record is read instead: image_package_problems)."""
    if not spec.trains_on.bridge_rules or cluster.runtime != "venv" or not distributed_optimizer(cfg):
        return []
    return [f"{DIST_OPT} resumes only where the job's venv has Transformer Engine or Apex (not inspected from "
            f"here): without either, {NO_FUSED_ADAM_RESUME}; set {DIST_OPT_OFF} on such a venv"]


def _invisible_in_container(cfg: TrainingConfig, cluster: ClusterProfile) -> list[str]:
    """The paths the job reads or writes, as the container will see them: one outside the checkout and every bind
    of the runtime (the profile's binds, PIPELINE_BINDS, the log and cache roots) is one line naming the bind to
    add (the binds are a fact of the cluster profile); nothing for the venv runtime."""
    specs = cfg.dataset.offline_packing_specs
    return invisible_paths(cluster, [
        ("dataset.dataset_root", cfg.dataset.dataset_root),
        ("dataset.offline_packing_specs.packed_train_data_path", specs.packed_train_data_path),
        ("dataset.offline_packing_specs.packed_val_data_path", specs.packed_val_data_path),
        ("dataset.offline_packing_specs.packed_metadata_path", specs.packed_metadata_path),
        ("checkpoint.pretrained_checkpoint", cfg.checkpoint.pretrained_checkpoint),
        ("checkpoint.load", cfg.checkpoint.load),
        ("checkpoint.save", cfg.checkpoint.save),
        ("logger.wandb_save_dir", cfg.logger.wandb_save_dir),
    ])


def _validation_batch_problems(cfg: TrainingConfig, paths: dict[str, Path], plan: Plan) -> list[str]:
    """Bridge evaluates with the training batch (validation.eval_global_batch_size defaults to it) and drops a partial
    one: a validation split of fewer packs fails its first evaluation ("drop_last=True requires at least one full
    global batch", data/samplers), at eval_interval or at the end of training, after every step has run. Nothing
    when the run does not validate (dataset.do_validation false, validation.eval_iters 0) or has no validation
    packs (Bridge then builds none)."""
    if cfg.dataset.do_validation is False or cfg.validation.eval_iters == 0 or not paths["validation"].is_file():
        return []
    try:
        import pyarrow.parquet as pq

        packs = pq.read_metadata(str(paths["validation"])).num_rows
    except Exception:
        return []  # the training file's reading already says what is wrong with the data
    if packs >= plan.gbs:
        return []
    return [f"packed validation data {paths['validation']} holds {packs} packs, fewer than one global batch "
            f"(train.global_batch_size={plan.gbs}, what Megatron Bridge evaluates with): its first evaluation fails "
            "after the training steps; prepare more validation data (pipeline_data_prepare.py --val-fraction) or set "
            "dataset.do_validation=false"]


def _note_epochs(train_path: Path, plan: Plan) -> int | None:
    """Notes how many epochs the run reads of its packs; returns the number of packs (None: unreadable)."""
    try:
        import pyarrow.parquet as pq

        packs = pq.read_metadata(str(train_path)).num_rows
    except Exception:
        plan.notes.append(f"could not read {train_path}")
        return None
    seen = plan.gbs * plan.train_iters
    plan.notes.append(f"data: {packs} packs of {plan.seq_length} tokens; {plan.train_iters} iters x gbs {plan.gbs} = "
                      f"{seen} packs = {seen / max(packs, 1):.2f} epochs")
    return int(packs)
