"""The training config, typed: one dataclass per ``ConfigContainer`` section the suite sets or reads, plus ``pipeline``.

Sections and field names mirror Megatron Bridge's ``ConfigContainer``, so one override (``train.train_iters=200``)
means the same on both engines. ``None`` means "keep the recipe's value" (unset). Loading
(:func:`pipeline.config.loader.load_config`: recipe defaults < YAML < Hydra overrides) ends in
:meth:`TrainingConfig.from_dict`, which checks every value against its field's type and collects one line per
mistyped value (``train.train_iters='abc' must be an integer``) for the preflight to report with the rest. A key
that is not a field fails at load with a hint; Hydra's ``+key=value`` adds one the schema does not know: it is kept
in :attr:`TrainingConfig.extra`, passed through to Megatron Bridge and checked against Bridge's own field table by
the preflight (the local engine warns that it ignores it).

Suite-only keys, stripped before the config reaches Megatron Bridge: the ``pipeline`` section (cluster profile,
local-engine options) and ``dataset.dataset_name``. ``tests/unit/test_config.py`` checks every field's type against
the pinned Bridge's field table (``bridge_fields.json``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

INT_MAX = 2**62  # larger counts are typos (and overflow Megatron's int64 arithmetic)


SEED_MAX = 2**32 - 1  # numpy's and the data loader's seeds are unsigned 32-bit: -1 failed in every restart
BATCH_MAX = 2**24  # sequences per step; past it a batch size is a typo (2**62 planned as a grad_accum of 2**61)
ENV_ENTRY_MAX = 128 * 1024  # Linux's MAX_ARG_STRLEN: one NAME=value string of a process's environment
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _f(doc: str, default: Any = None, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
       lt: float | None = None, nonempty: bool = False) -> Any:
    """A config field: its default (``None``: keep the recipe's), a one-line description, and for some the bounds a
    set value must keep (``ge``/``gt`` below, ``le``/``lt`` above: inclusive or not) or that a string may not be
    empty. Every bound of a single field lives here, checked at load (:func:`check_range`); the preflight checks only
    rules between fields."""
    meta: dict[str, Any] = {"doc": doc}
    low = (ge, False) if ge is not None else (gt, True) if gt is not None else None
    high = (le, False) if le is not None else (lt, True) if lt is not None else None
    if low is not None or high is not None:
        meta["bounds"] = (low, high)
    if nonempty:
        meta["nonempty"] = True
    return field(default=default, metadata=meta)


def bounds_of(f: dataclasses.Field) -> tuple[tuple[float, bool] | None, tuple[float, bool] | None]:
    """A field's (low, high) bounds, each (value, open) or None."""
    return f.metadata.get("bounds", (None, None))


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def check_range(f: dataclasses.Field, value: Any, key: str) -> str | None:
    """Why a value of the right type is outside its field's bounds (one line), or None."""
    low, high = bounds_of(f)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        below = low is not None and (value <= low[0] if low[1] else value < low[0])
        above = high is not None and (value >= high[0] if high[1] else value > high[0])
        if below or above:
            if high is None and low is not None:
                return f"{key}={_show(value)} must be {'>' if low[1] else '>='} {_num(low[0])}"
            if low is None and high is not None:
                return f"{key}={_show(value)} must be {'<' if high[1] else '<='} {_num(high[0])}"
            assert low is not None and high is not None
            return (f"{key}={_show(value)} is out of range {'(' if low[1] else '['}{_num(low[0])}, "
                    f"{_num(high[0])}{')' if high[1] else ']'}")
    if f.metadata.get("nonempty") and isinstance(value, str) and not value.strip():
        return f"{key}={value!r} is empty: name one (or leave it unset)"
    return None


@dataclass
class ModelConfig:
    seq_length: int | None = _f("sequence length in tokens (the model's context for this run)", ge=1)
    tensor_model_parallel_size: int | None = _f("tensor parallelism (TP): ranks that split each layer's matmuls", ge=1)
    pipeline_model_parallel_size: int | None = _f("pipeline parallelism (PP): stages the layers are cut into", ge=1)
    virtual_pipeline_model_parallel_size: int | None = _f("interleaved pipeline: model chunks per pipeline stage", ge=1)
    context_parallel_size: int | None = _f("context parallelism (CP): ranks that split each sequence", ge=1)
    expert_model_parallel_size: int | None = _f("expert parallelism (EP): ranks the MoE experts are spread over", ge=1)
    expert_tensor_parallel_size: int | None = _f("tensor parallelism inside each expert (ETP)", ge=1)
    sequence_parallel: bool | None = _f("shard layer-norm and dropout activations over the TP group")
    recompute_granularity: Literal["full", "selective"] | None = _f("activation recomputation: full or selective")
    recompute_method: Literal["uniform", "block"] | None = _f("how full recomputation picks layers")
    recompute_num_layers: int | None = _f("layers per recomputation unit (full recomputation)", ge=1)
    recompute_modules: Any = _f("modules to recompute (selective), e.g. [moe, mlp]")
    cuda_graph_impl: Literal["none", "transformer_engine", "local", "full_iteration"] | None = _f(
        "CUDA graphs: none, per-module (transformer_engine, local) or the whole iteration; per-module graphs refuse "
        "full recompute")
    moe_permute_fusion: bool | None = _f("fused token permutation in the MoE dispatcher")
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] | None = _f("MoE token dispatcher")
    moe_grouped_gemm: bool | None = _f("grouped GEMM for the experts")
    gradient_accumulation_fusion: bool | None = _f("fuse weight-gradient accumulation into the GEMM (needs APEX/TE)")
    cross_entropy_loss_fusion: bool | None = _f("fused cross-entropy kernel")
    calculate_per_token_loss: bool | None = _f("average the loss over tokens rather than sequences")
    bf16: bool | None = _f("BF16 parameters and compute")
    fp8: str | None = _f("FP8 recipe (e.g. hybrid, e4m3); unset: no FP8")
    cp_comm_type: Any = _f("context-parallel communication (p2p, a2a, allgather; or one per layer)")
    attention_backend: Any = _f("attention kernel backend (Transformer Engine's choice when unset)")


@dataclass
class TrainConfig:
    train_iters: int | None = _f("optimizer steps to run", ge=1)
    global_batch_size: int | None = _f("sequences per optimizer step, over all data-parallel ranks", ge=1,
                                       le=BATCH_MAX)
    micro_batch_size: int | None = _f("sequences per rank per forward/backward pass", ge=1, le=BATCH_MAX)
    exit_signal_handler: bool | None = _f("checkpoint and exit on the exit signal (the launcher sets it for Bridge)")
    exit_duration_in_mins: int | None = _f("checkpoint and exit after this many minutes", ge=1)
    manual_gc: bool | None = _f("run Python's garbage collector only every manual_gc_interval steps")
    manual_gc_interval: int | None = _f("steps between manual garbage collections")


@dataclass
class ValidationConfig:
    eval_interval: int | None = _f("steps between validation passes (0: none)", ge=0)
    eval_iters: int | None = _f("validation batches per pass", ge=0)


@dataclass
class OptimizerConfig:
    optimizer: str | None = _f("optimizer name (adam, sgd)")
    lr: float | None = _f("peak learning rate", gt=0)
    min_lr: float | None = _f("learning rate at the end of the decay", ge=0)
    weight_decay: float | None = _f("decoupled weight decay", ge=0)
    adam_beta1: float | None = _f("Adam's first-moment decay", ge=0, lt=1)
    adam_beta2: float | None = _f("Adam's second-moment decay", ge=0, lt=1)
    adam_eps: float | None = _f("Adam's epsilon", ge=0)
    clip_grad: float | None = _f("gradient-norm clipping threshold (0: off)", ge=0)
    use_distributed_optimizer: bool | None = _f("shard the optimizer state over data-parallel ranks")


@dataclass
class SchedulerConfig:
    lr_warmup_iters: int | None = _f("linear warm-up steps", ge=0)
    lr_decay_iters: int | None = _f("iteration the decay ends at (default train_iters)", ge=1)
    lr_decay_style: str | None = _f("decay shape (cosine, linear, constant, WSD, ...)")
    lr_wsd_decay_iters: int | None = _f("WSD: iterations of the final decay (the cooldown), ending at lr_decay_iters")
    lr_wsd_decay_style: str | None = _f("WSD: shape of the final decay (linear, cosine, minus_sqrt, exponential)")
    override_opt_param_scheduler: bool | None = _f("a loaded checkpoint's schedule gives way to this config's "
                                                   "(the launcher sets it when continuing another run's save)")
    use_checkpoint_opt_param_scheduler: bool | None = _f("keep a loaded checkpoint's schedule, not this config's")
    start_weight_decay: float | None = _f("weight decay at the start of its schedule")
    end_weight_decay: float | None = _f("weight decay at the end of its schedule")


@dataclass
class PackingSpecs:
    packed_sequence_size: int | None = _f("tokens per pack (must equal model.seq_length; -1: no packing)")
    pad_seq_to_mult: int | None = _f("pad each packed document to a multiple of this (context parallelism)", ge=1)
    tokenizer_model_name: str | None = _f("tokenizer folder name the packed files are stored under")
    packed_train_data_path: str | None = _f("explicit packed training Parquet (default: under dataset_root)")
    packed_val_data_path: str | None = _f("explicit packed validation Parquet")
    packed_metadata_path: str | None = _f("explicit packing metadata JSON")
    pad_cu_seqlens: bool | None = _f("pad cu_seqlens to a fixed length (CUDA graphs)")


@dataclass
class DatasetConfig:
    dataset_name: str | None = _f("where the data came from (suite-only: documentation, stripped for Bridge)")
    dataset_root: str | None = _f("prepared dataset folder (pipeline_data_prepare.py prepare --dataset-root)")
    seq_length: int | None = _f("sequence length of the data (must equal model.seq_length)")
    seed: int | None = _f("data shuffling seed", ge=0, le=SEED_MAX)
    num_workers: int | None = _f("data-loader worker processes per rank", ge=0)
    do_validation: bool | None = _f("build the validation split")
    do_test: bool | None = _f("build the test split")
    enable_offline_packing: bool | None = _f("read pre-packed sequences (with their document boundaries)")
    offline_packing_specs: PackingSpecs = field(default_factory=PackingSpecs,
                                                metadata={"doc": "where the packed SFT data is and how it was packed"})


@dataclass
class CheckpointConfig:
    save: str | None = _f("checkpoint folder this run writes (iter_NNNNNNN + the tracker)")
    load: str | None = _f("checkpoint folder to resume from (default: save); another run's save: continue it "
                          "(weights, optimizer, iteration), into this run's own save")
    ckpt_step: int | None = _f("the iteration of checkpoint.load to continue from (default: its latest)")
    load_optim: bool | None = _f("load the optimizer state with checkpoint.load")
    load_rng: bool | None = _f("load the RNG state with checkpoint.load")
    finetune: bool | None = _f("load checkpoint.load's weights only (iteration 0, fresh optimizer)")
    pretrained_checkpoint: str | None = _f("weights to start from (a checkpoints/ folder, iter_ folder or HF model)")
    save_interval: int | None = _f("steps between checkpoints", ge=1)
    save_optim: bool | None = _f("save the optimizer state")
    save_rng: bool | None = _f("save the RNG state")
    ckpt_format: str | None = _f("checkpoint format (torch_dist, ...)")
    async_save: bool | None = _f("write checkpoints in the background")


@dataclass
class LoggerConfig:
    log_interval: int | None = _f("steps between log lines", ge=1)
    wandb_project: str | None = _f("W&B project (unset: no W&B on Bridge)")
    wandb_entity: str | None = _f("W&B entity (team or user)")
    wandb_exp_name: str | None = _f("run name: the W&B run and the run directory under PIPELINE_RUNS_DIR",
                                    nonempty=True)
    wandb_save_dir: str | None = _f("where W&B writes its files")
    tensorboard_dir: str | None = _f("TensorBoard event folder")


@dataclass
class TokenizerConfig:
    tokenizer_type: str | None = _f("Megatron tokenizer type (HuggingFaceTokenizer, ...)")
    tokenizer_model: str | None = _f("tokenizer name or folder")


@dataclass
class RngConfig:
    seed: int | None = _f("model-initialisation and dropout seed", ge=0, le=SEED_MAX)


@dataclass
class DdpConfig:
    use_distributed_optimizer: bool | None = _f("shard the optimizer state (distributed optimizer)")
    grad_reduce_in_fp32: bool | None = _f("reduce gradients in FP32")
    overlap_grad_reduce: bool | None = _f("overlap the gradient reduce-scatter with the backward pass")
    overlap_param_gather: bool | None = _f("overlap the parameter all-gather with the forward pass")
    check_for_nan_in_grad: bool | None = _f("fail on a NaN gradient")


@dataclass
class FtConfig:
    enable_ft_package: bool | None = _f("NVRx fault tolerance inside Megatron (set under ft_launcher)")
    calc_ft_timeouts: bool | None = _f("let NVRx learn the section timeouts")


@dataclass
class PeftConfig:
    dim: int | None = _f("LoRA rank", ge=1)
    alpha: int | None = _f("LoRA scaling numerator")
    dropout: float | None = _f("LoRA dropout", ge=0, lt=1)
    target_modules: Any = _f("modules LoRA adapts, e.g. [linear_qkv, linear_proj]")


@dataclass
class DistConfig:
    distributed_timeout_minutes: int | None = _f("collective timeout (NCCL) in minutes", ge=1)


@dataclass
class ProfilingConfig:
    """Megatron Bridge 0.6.2's ``ProfilingConfig`` (megatron.bridge.training.config), field for field; the local
    engine honours the PyTorch-profiler ones on the same steps (pipeline.training.profiling, docs/profiling.md)."""

    use_pytorch_profiler: bool | None = _f("record a torch.profiler trace of the step window (Bridge default false)")
    profile_step_start: int | None = _f("first step the torch profiler records (1-based, as progress.ndjson counts; "
                                        "Bridge default 10)", ge=0)
    profile_step_end: int | None = _f("the step after the last one recorded: steps start .. end-1, as Bridge's "
                                      "torch-profiler schedule records them (Bridge default 12)", ge=0)
    profile_ranks: list[int] | None = _f("global ranks that record (Bridge default [0]; [] = every rank)")
    record_memory_history: bool | None = _f("memory over the window: CUDA's allocator history and a snapshot, on "
                                            "CPU the profiler's profile_memory (Bridge default false)")
    memory_snapshot_path: str | None = _f("CUDA memory snapshot pickle, _RANK added before the extension "
                                          "(local default <run_dir>/torch_profile/memory_snapshot.pickle)")
    pytorch_profiler_collect_shapes: bool | None = _f("record operator input shapes in the torch trace")
    pytorch_profiler_collect_callstack: bool | None = _f("record Python call stacks in the torch trace")
    use_nsys_profiler: bool | None = _f("Megatron Bridge under nsys: cudaProfilerStart/Stop at the window "
                                        "(GPU only; not with use_pytorch_profiler)")
    record_shapes: bool | None = _f("nsys: record shapes in the NVTX ranges (emit_nvtx)")
    nvtx_ranges: bool | None = _f("nsys: Megatron's NVTX range annotations")


@dataclass
class LocalEngineConfig:
    dtype: Literal["float32", "bfloat16", "float16"] = _f("local engine weight dtype (CPU: float32)", "float32")
    autocast: Literal["off", "bf16", "auto"] = _f(
        "bf16 autocast of the forward (weights, grads and optimizer stay in dtype); auto: on a CUDA GPU that computes "
        "bf16 (torch.cuda.is_bf16_supported) and on a CPU that does natively (AMX or AVX512-BF16), off elsewhere",
        "off")
    gradient_checkpointing: bool = _f("recompute activations in the backward pass", False)
    # Fault injection for the tests (training/engines/local.py, training/fault_tolerance.py).
    fault_inject_nan_step: int | None = _f("the loss becomes NaN from this step on (tests)")
    fault_inject_hang_step: int | None = _f("rank 0 stops making progress at this step, first attempt only (tests)")
    fault_inject_step_sleep: float | None = _f("every step this many seconds slower (tests)", ge=0)
    fault_inject_resume_shift: int | None = _f("a resume reads the data this many steps off (tests)")


@dataclass
class PipelineConfig:
    cluster: str | None = _f("cluster profile name under configs/cluster/ (or a profile YAML path)", nonempty=True)
    local: LocalEngineConfig = field(default_factory=LocalEngineConfig, metadata={"doc": "local-engine options"})


@dataclass
class TrainingConfig:
    """The resolved training config: typed sections, Bridge pass-through keys in :attr:`extra`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    rng: RngConfig = field(default_factory=RngConfig)
    ddp: DdpConfig = field(default_factory=DdpConfig)
    ft: FtConfig = field(default_factory=FtConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    mixed_precision: Any = _f("Bridge's mixed-precision recipe (a name such as bf16_mixed, or its fields)")
    env_vars: dict[str, str] = field(default_factory=dict, metadata={"doc": "environment variables for the ranks "
                                                                            "(strings or numbers)"})
    pipeline: PipelineConfig = field(default_factory=PipelineConfig, metadata={"doc": "suite-only settings"})
    # Not config fields: what loading found beside the schema.
    extra: dict[str, Any] = field(default_factory=dict, metadata={"internal": True})
    """Keys added with ``+key=value`` that are not fields (nested like the config): passed through to Bridge."""
    problems: list[str] = field(default_factory=list, metadata={"internal": True})
    """One line per value whose type does not fit its field (the field is left unset)."""
    invalid: set[str] = field(default_factory=set, metadata={"internal": True})
    """The dotted keys of those values (the preflight does not also report them as unset)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingConfig:
        """The typed config of a resolved dict (every key known or passed through; see the module docstring)."""
        problems: list[str] = []
        invalid: set[str] = set()
        extra: dict[str, Any] = {}
        cfg = _build(cls, data, "", problems, invalid, extra)
        cfg.extra, cfg.problems, cfg.invalid = extra, problems, invalid
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The config of record (``config.yaml``): every field, with the pass-through keys in place."""
        return _merge_extra(_as_dict(self), self.extra)


# ---- building a typed config from a dict ------------------------------------------------------------------
def _is_internal(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("internal"))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return tp


def _show(value: Any) -> str:
    """``repr(value)``, shortened (a 400-digit number is not worth a screen; a 5000-digit one has no decimal form)."""
    try:
        text = repr(value)
    except ValueError:  # Python refuses int -> str past 4300 digits
        return f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
    return text if len(text) <= 60 else text[:40] + f"...<{len(text)} characters>"


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _number_hint(value: Any) -> str:
    """Why a value that looks like a number is a string: an ``${oc.env:...}`` interpolation, or quotes."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return (" (it is the string " + repr(value) + ": an ${oc.env:VAR} value is a string; wrap it as "
                "${oc.decode:${oc.env:VAR}}, or drop the quotes)")
    return ""


def check_value(tp: Any, value: Any, key: str) -> str | None:
    """Why ``value`` does not fit a field of type ``tp`` (one line naming the key), or None."""
    tp = _strip_optional(tp)
    if value is None or tp is Any:
        return None
    shown = _show(value)
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if value in choices and not isinstance(value, bool):
            return None
        hint = " (YAML reads off/on/yes/no unquoted as booleans: quote the word)" if isinstance(value, bool) else ""
        return f"{key}={shown} is not one of {', '.join(map(str, choices))}{hint}"
    if tp is bool:
        return None if isinstance(value, bool) else f"{key}={shown} must be a boolean (true/false)"
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key}={shown} must be an integer{_number_hint(value)}"
        return f"{key}={shown} is out of range" if abs(value) > INT_MAX else None
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{key}={shown} must be a number{_number_hint(value)}"
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an integer too large for a float
            return f"{key}={shown} is out of range"
        return None if finite else f"{key}={shown} must be a finite number"
    if tp is str:
        if isinstance(value, str):
            return None
        if isinstance(value, (dict, list)):
            return f"{key}={shown} must be a string, not a {'mapping' if isinstance(value, dict) else 'list'}"
        return f"{key}={shown} must be a string (quote it: {key}='{value}')"
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            return f"{key}={shown} must be a list, e.g. {key}=[0,1]"
        for i, v in enumerate(value):
            problem = check_value(item, v, f"{key}[{i}]")
            if problem:
                return problem
        return None
    if typing.get_origin(tp) is dict:
        if not isinstance(value, dict):
            return f"{key}={shown} must be a mapping"
        if typing.get_args(tp)[1:] == (str,):  # environment variables: names and scalar values
            for k, v in value.items():
                if not isinstance(k, str) or not ENV_NAME.fullmatch(k):
                    return (f"{key}: {_show(k)} is not a variable name (letters, digits and _, not starting with a "
                            "digit; no '=' or NUL)")
                if v is None or isinstance(v, (dict, list)):
                    return f"{key}.{k}={_show(v)} must be a string or a number"
                try:
                    text = v if isinstance(v, str) else str(v)
                except ValueError:  # an integer past Python's 4300-digit conversion limit
                    return f"{key}.{k}={_show(v)} is too long for an environment variable"
                if "\0" in text:
                    return f"{key}.{k}: the value holds a NUL byte, which no environment variable can carry"
                if len(f"{k}={text}".encode(errors="surrogatepass")) >= ENV_ENTRY_MAX:
                    return (f"{key}.{k}: the value is {len(text.encode(errors='surrogatepass'))} bytes; one variable "
                            f"(NAME=value) must stay under {ENV_ENTRY_MAX} bytes (Linux's MAX_ARG_STRLEN), or no "
                            "rank can start")
        return None
    raise TypeError(f"config field {key} has a type the loader does not check: {tp!r}")


def _build(cls: type, data: dict[str, Any], where: str, problems: list[str], invalid: set[str],
           extra: dict[str, Any]) -> Any:
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not _is_internal(f)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{where}{name}"
        f = fields.get(name)
        if f is None:
            extra[name] = value  # a '+key' the schema does not know: Bridge's to judge (the preflight checks it)
            continue
        tp = hints[name]
        if value is None and (f.default_factory is not dataclasses.MISSING or not _is_optional(tp)):
            continue  # a cleared section, mapping or non-optional value: its default
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(f"'{key}' is a section, not a value")
                invalid.add(key)
                continue
            sub: dict[str, Any] = {}
            kwargs[name] = _build(tp, value, key + ".", problems, invalid, sub)
            if sub:
                extra[name] = sub
            continue
        problem = check_value(tp, value, key) or check_range(f, value, key)
        if problem:
            problems.append(problem)
            invalid.add(key)
            continue
        kwargs[name] = value
    return cls(**kwargs)


def _as_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if _is_internal(f):
            continue
        v = getattr(obj, f.name)
        out[f.name] = _as_dict(v) if dataclasses.is_dataclass(v) else _copy(v)
    return out


def _copy(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_copy(x) for x in v]
    return v


def _merge_extra(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge_extra(base[k], v)
        else:
            base[k] = _copy(v)
    return base


def schema_dict(cls: type = TrainingConfig) -> dict[str, Any]:
    """The schema as a nested dict of defaults (what the loader merges into and takes its key hints from)."""
    out: dict[str, Any] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if _is_internal(f):
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out[f.name] = schema_dict(tp)  # type: ignore[arg-type]
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = f.default
    return out


def _walk(cls: type, where: str = ""):
    """Every field of ``cls`` and of its sections, depth first: ``(dotted key, field, type, is a section)``."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if _is_internal(f):
            continue
        tp, key = hints[f.name], f"{where}{f.name}"
        section = isinstance(tp, type) and dataclasses.is_dataclass(tp)
        yield key, f, tp, section
        if section:
            yield from _walk(tp, key + ".")


def field_types(cls: type = TrainingConfig) -> dict[str, Any]:
    """Every leaf field's dotted key and type (sections expanded)."""
    return {key: tp for key, _, tp, section in _walk(cls) if not section}


def field_docs(cls: type = TrainingConfig) -> dict[str, str]:
    """Every field's dotted key and its one-line description."""
    return {key: str(f.metadata.get("doc", "")) for key, f, _, _ in _walk(cls)}


def bridge_kind(tp: Any) -> str:
    """The kind Megatron Bridge's field table (``bridge_fields.json``) records for a field of type ``tp``."""
    tp = _strip_optional(tp)
    if typing.get_origin(tp) is Literal:
        return "str" if all(isinstance(c, str) for c in typing.get_args(tp)) else "any"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(tp, "any")


def in_schema(dotted: str) -> bool:
    """Whether ``dotted`` names a field (or a section) of the schema."""
    return dotted in _keys()


@functools.cache
def _keys() -> frozenset[str]:
    return frozenset(field_docs())


# Suite-only keys: never handed to Megatron Bridge.
SUITE_ONLY = (("pipeline",), ("dataset", "dataset_name"))
