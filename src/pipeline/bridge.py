"""Megatron Bridge: the ONLY module of the suite that imports ``megatron.bridge`` (and ``megatron.core``).

Low level on purpose: it imports nothing of the suite above ``pipeline.config`` and ``pipeline.common``, and
every ``megatron.*`` import happens inside a function, so the rest of the suite imports, runs and is tested
where Megatron Bridge cannot even be imported (it needs Transformer Engine, which needs CUDA). Callers:

  training/engines/megatron_bridge.py   build_config + run_training (the GPU engine: records, signals, markers)
  checkpoint/export.py                  export_to_hf + MegatronCausalLM (the one publish-and-verify flow)
                                        import_from_hf (HF -> Megatron)
  coherence/backends.py                 generate (the ``megatron`` backend)

Every function that reads a checkpoint takes the exact iteration directory (``<save>/iter_NNNNNNN``) resolved
by ``pipeline.common.layout``, never the checkpoint root: given a root, Bridge's ``load_megatron_model``
takes the highest-numbered ``iter_*`` folder, which may be a later iteration than the one asked for or one
still being written.

``BRIDGE_API`` lists every module, function, class and keyword argument used here;
``tests/unit/test_bridge_conformance.py`` checks each against the pinned wheel's source, and the Bridge
harness (``tests/bridge/``) runs ``build_config`` on Bridge's real recipe and override code on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import logging
import os
import shutil
import socket
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import layout, yamlio
from pipeline.common.eos import end_ids
from pipeline.common.errors import UserError, exc_line
from pipeline.config.loader import strip_suite_only
from pipeline.config.models import get_model
from pipeline.config.schema import TrainingConfig

_AB = "megatron.bridge.models.conversion.auto_bridge"
# (module, qualified name, keyword arguments we pass) - checked against the pinned wheel's source.
BRIDGE_API: list[tuple[str, str, tuple[str, ...]]] = [
    ("megatron.bridge.training.pretrain", "pretrain", ("config", "forward_step_func", "callbacks")),
    ("megatron.bridge.training.finetune", "finetune", ("config", "forward_step_func", "callbacks")),
    ("megatron.bridge.training.gpt_step", "forward_step", ()),
    ("megatron.bridge.training.callbacks", "Callback", ()),
    ("megatron.bridge.training.callbacks", "Callback.on_train_step_end", ("context",)),
    ("megatron.bridge.training.callbacks", "Callback.on_train_step_start", ("context",)),
    ("megatron.bridge.training.callbacks", "Callback.on_checkpoint_save", ("context",)),
    ("megatron.bridge.training.utils.omegaconf_utils", "process_config_with_overrides",
     ("config", "cli_overrides")),
    ("megatron.bridge.training.utils.omegaconf_utils", "create_omegaconf_dict_config", ("config_container",)),
    ("megatron.bridge.training.utils.omegaconf_utils", "parse_hydra_overrides", ("cfg", "overrides")),
    ("megatron.bridge.training.utils.omegaconf_utils", "apply_overrides",
     ("config_obj", "overrides_dict", "excluded_fields")),
    ("megatron.bridge.training.config", "ConfigContainer", ()),
    ("megatron.bridge.training.config", "FaultToleranceConfig", ()),
    (_AB, "AutoBridge", ()),
    (_AB, "AutoBridge.from_hf_pretrained", ("path",)),
    (_AB, "AutoBridge.import_ckpt", ("hf_model_id", "megatron_path")),
    (_AB, "AutoBridge.to_megatron_provider", ("load_weights",)),
    (_AB, "AutoBridge.save_megatron_model", ("model", "path", "hf_tokenizer_path", "hf_tokenizer_kwargs",
                                             "low_memory_save")),
    ("megatron.bridge.models.model_provider", "ModelProviderMixin.provide_distributed_model",
     ("wrap_with_ddp", "use_cpu_initialization")),
    (_AB, "AutoBridge.export_ckpt", ("megatron_path", "hf_path", "strict")),
    (_AB, "AutoBridge.load_megatron_model", ("path", "mp_overrides")),
    (_AB, "AutoBridge.save_hf_pretrained", ("model", "path", "strict")),
    (_AB, "AutoBridge.export_adapter_ckpt", ("peft_checkpoint", "output_path", "show_progress")),
    ("megatron.bridge.peft.lora", "LoRA", ()),
    ("megatron.bridge.training.checkpointing", "_generate_model_state_dict", ()),
    ("megatron.bridge.training.checkpointing", "apply_peft_adapter_filter_to_state_dict", ()),
    ("megatron.bridge.models.model_provider", "ModelParallelKwargs", ()),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_nano", "nemotron_3_nano_pretrain_config", ()),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_nano", "nemotron_3_nano_sft_config", ()),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_nano", "nemotron_3_nano_peft_config", ("peft_scheme",)),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_super", "nemotron_3_super_pretrain_config", ()),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_super", "nemotron_3_super_sft_config", ()),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_super", "nemotron_3_super_peft_config", ("peft_scheme",)),
    ("megatron.bridge.recipes.gpt.vanilla_gpt", "vanilla_gpt_pretrain_config", ()),
]


# megatron-core names used here (generation across pipeline stages, the model-parallel groups), checked against the
# pinned megatron-core wheel's source by tests/unit/test_bridge_conformance.py.
_SCHED = "megatron.core.pipeline_parallel.schedules"
_MIXER_MODULE = "megatron.core.ssm.mamba_mixer"
_FB_KWARGS = ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length", "micro_batch_size",
              "forward_only")
CORE_API: list[tuple[str, str, tuple[str, ...]]] = [
    ("megatron.core.pipeline_parallel", "get_forward_backward_func", ()),
    (_SCHED, "forward_backward_no_pipelining", _FB_KWARGS),
    (_SCHED, "forward_backward_pipelining_without_interleaving", _FB_KWARGS),
    ("megatron.core.parallel_state", "initialize_model_parallel",
     ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
      "expert_tensor_parallel_size")),
    ("megatron.core.parallel_state", "model_parallel_is_initialized", ()),
    ("megatron.core.parallel_state", "get_expert_tensor_parallel_world_size", ()),
    ("megatron.core.parallel_state", "is_pipeline_last_stage", ()),
    ("megatron.core.parallel_state", "get_pipeline_model_parallel_last_rank", ()),
    ("megatron.core.parallel_state", "get_pipeline_model_parallel_group", ()),
    ("megatron.core.tensor_parallel", "gather_from_tensor_model_parallel_region", ()),
    ("megatron.core.dist_checkpointing", "load", ()),
    (_MIXER_MODULE, "_check_mamba_sequence_packing_support", ("for_inference_not_training",)),
]


def _import(module: str, name: str):
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def require_bridge(what: str) -> None:
    """A one-line error where Megatron Bridge cannot be imported (no Transformer Engine / CUDA)."""
    try:
        importlib.import_module("megatron.bridge")
    except ImportError as exc:
        raise UserError(f"{what} needs Megatron Bridge, which cannot be imported here ({exc}); run it on the GPU "
                        "cluster inside the container (PIPELINE_RUNTIME=apptainer)") from None


def import_version(module: str) -> str:
    """``module __version__`` after importing it: ``megatron.core``, ``megatron.bridge`` or ``transformer_engine``
    (the container's GPU stack; ``env/validate.py`` checks them through this function)."""
    if module.split(".")[0] not in ("megatron", "transformer_engine"):
        raise ValueError(f"{module} is not part of the Megatron stack")
    m = importlib.import_module(module)
    return f"{module} {getattr(m, '__version__', '?')}"


@dataclass(frozen=True)
class GpuPackage:
    """A GPU package the shipped recipes select: imported as ``module`` (and its ``attr``, where one class of it is
    what the recipe uses), needed by ``users`` (model/mode pairs) for ``why``."""

    module: str
    attr: str | None
    why: str
    users: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module


# The (model, mode) pairs whose recipes the suite ships configs for: what validate --run-training proves the image
# can run before the first training.
SHIPPED_RECIPES = (("nano", "pretrain"), ("nano", "sft"), ("super", "sft"))


def recipe_gpu_packages(recipes: Sequence[tuple[str, str]] = SHIPPED_RECIPES) -> list[GpuPackage]:
    """The GPU packages that Bridge's recipes select for their models, read from the ``ConfigContainer`` each recipe
    builds (Bridge's own code; the Nano and Super recipes read their model's Hugging Face config): Transformer
    Engine for the layer specs (and its GroupedLinear where the experts use grouped GEMM), mamba-ssm and
    causal-conv1d for a pattern with Mamba layers, DeepEP (its Buffer or HybridEPBuffer) for the flex token
    dispatcher."""
    found: dict[tuple[str, str | None], tuple[str, list[str]]] = {}

    def need(module: str, attr: str | None, why: str, user: str) -> None:
        found.setdefault((module, attr), (why, []))[1].append(user)

    for model, mode in recipes:
        spec = get_model(model)
        if spec.recipe_module is None:
            continue
        m = _import(spec.recipe_module, spec.recipe_name(mode))().model
        user = f"{model} {mode}"
        need("transformer_engine", None, "the recipes' layer specs (attention, MLP, norms)", user)
        pattern = str(getattr(m, "hybrid_layer_pattern", None) or getattr(m, "hybrid_override_pattern", None) or "")
        if "M" in pattern:
            need("mamba_ssm", None, "Mamba layers (selective scan, gated RMSNorm)", user)
            need("causal_conv1d", None, "Mamba layers' causal convolution", user)
        if getattr(m, "num_moe_experts", None):
            if getattr(m, "moe_grouped_gemm", False):
                need("transformer_engine.pytorch", "GroupedLinear", "MoE experts' grouped GEMM", user)
            if getattr(m, "moe_token_dispatcher_type", None) == "flex":
                backend = getattr(m, "moe_flex_dispatcher_backend", None) or "deepep"
                attr = "HybridEPBuffer" if backend == "hybridep" else "Buffer"
                need("deep_ep", attr, f"the flex MoE token dispatcher ({backend})", user)
    return [GpuPackage(module, attr, why, tuple(users)) for (module, attr), (why, users) in found.items()]


# What megatron-core itself imports of each Mamba package (megatron/core/ssm/mamba_mixer.py, 0.19.2), name by name:
# it wraps these imports in try/except ImportError and sets HAVE_MAMBA_SSM = False (causal_conv1d_fn = None) on any
# failure of a submodule, so `import mamba_ssm` succeeding proves nothing, and the run fails only in
# MambaMixer.__init__, on every rank after the queue.
CORE_IMPORTS: dict[str, tuple[tuple[str, str], ...]] = {
    "mamba_ssm": (("mamba_ssm.ops.triton.layernorm_gated", "RMSNorm"),
                  ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
                  ("mamba_ssm.ops.triton.ssd_combined", "mamba_split_conv1d_scan_combined")),
    "causal_conv1d": (("causal_conv1d", "causal_conv1d_fn"),
                      ("causal_conv1d.causal_conv1d_varlen", "causal_conv1d_varlen_states")),
}
_MIXER = _MIXER_MODULE


def import_gpu_package(pkg: GpuPackage) -> str:
    """``pkg``'s version after importing it (and reading its ``attr``) and every name megatron-core imports of it
    (:data:`CORE_IMPORTS`); for the Mamba packages, megatron-core's own verdict after its own imports
    (``HAVE_MAMBA_SSM``, ``causal_conv1d_fn``) and its own version rule for packed training
    (``_check_mamba_sequence_packing_support``). Raises ImportError/AttributeError naming what failed."""
    m = importlib.import_module(pkg.module)
    if pkg.attr:
        getattr(m, pkg.attr)
    for module, name in CORE_IMPORTS.get(pkg.module, ()):
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ImportError(f"megatron-core imports {module}.{name}: {exc_line(exc)}") from exc
    if pkg.module in CORE_IMPORTS:
        if not _import(_MIXER, "HAVE_MAMBA_SSM") or _import(_MIXER, "causal_conv1d_fn") is None:
            raise ImportError("megatron-core's mamba_mixer found no Mamba kernels (HAVE_MAMBA_SSM false or "
                              "causal_conv1d_fn None) after its own imports")
        ok, why = _import(_MIXER, "_check_mamba_sequence_packing_support")(for_inference_not_training=False)
        if not ok:
            raise ImportError(f"megatron-core's rule for packed training: {why}")
    top = importlib.import_module(pkg.module.split(".")[0])
    return f"{pkg.name} {getattr(top, '__version__', '?')}"


def _check_iteration_dir(iter_path: Path) -> Path:
    """Refuse a checkpoint root: Bridge would pick its highest ``iter_*`` folder, not the one we resolved."""
    iter_path = Path(iter_path)
    if not layout.is_iteration_dir(iter_path):
        raise ValueError(f"{iter_path} is not an iteration directory (iter_NNNNNNN); resolve it with "
                         "pipeline.common.layout.resolve_iteration")
    return iter_path


# ---- training config --------------------------------------------------------------------------------------
_OC = "megatron.bridge.training.utils.omegaconf_utils"


def bridge_overrides(cfg: TrainingConfig) -> dict[str, Any]:
    """The values handed to Bridge: our resolved config without suite-only keys and without unset values (so the
    recipe keeps its own)."""
    return strip_suite_only(cfg)


def bridge_overrides_yaml(cfg: TrainingConfig) -> str:
    """:func:`bridge_overrides` as YAML (what the records and the dry run show)."""
    return yamlio.dump(bridge_overrides(cfg), sort_keys=False)  # '1e3' stays a string for OmegaConf


def _touches(overrides: Sequence[str], section: str) -> bool:
    """Whether a Hydra override (``[+~]section.key=value``) names a key of ``section``."""
    return any(o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] == section for o in overrides)


def build_config(cfg: TrainingConfig, model: str, mode: str, peft: str | None, extra_overrides: Sequence[str] = ()):
    """Bridge's recipe -> ``ConfigContainer`` with our resolved values, then ``extra_overrides`` (Hydra grammar),
    applied in memory by Bridge's own override functions: the steps of its ``process_config_with_overrides`` (the
    recipe as OmegaConf, merged with our values, Hydra overrides, applied back onto the dataclasses with the
    callables it set aside restored), without writing our values to a YAML file for it to read back. A section
    the recipe leaves None that our values or the overrides name (``ft``: under ft_launcher, or a YAML ``ft:``)
    gets Bridge's own dataclass first."""
    from omegaconf import OmegaConf

    spec = get_model(model)
    if spec.recipe_module is None:
        raise UserError(f"model {model} has no Megatron Bridge recipe (a local-engine model): train it with the "
                        "local engine")
    recipe = _import(spec.recipe_module, spec.recipe_name(mode, peft))
    container = recipe(peft_scheme=peft) if peft else recipe()
    ours = bridge_overrides(cfg)
    if getattr(container, "ft", None) is None and (ours.get("ft") or _touches(extra_overrides, "ft")):
        # The recipes leave ``ft`` None: an override of ``ft.x`` fails ("Could not override"), and our ``ft:``
        # values would land as a plain dict, which Bridge's setup cannot read. Bridge's own section first.
        container.ft = _import("megatron.bridge.training.config", "FaultToleranceConfig")()
    conf, excluded = _import(_OC, "create_omegaconf_dict_config")(config_container=container)
    conf = OmegaConf.merge(conf, OmegaConf.create(ours))
    if extra_overrides:
        conf = _import(_OC, "parse_hydra_overrides")(cfg=conf, overrides=list(extra_overrides))
    _import(_OC, "apply_overrides")(config_obj=container, overrides_dict=OmegaConf.to_container(conf, resolve=True),
                                    excluded_fields=excluded)
    one_data_source(container.dataset, _named_dataset_fields(ours, extra_overrides))
    return container


# ---- one data source --------------------------------------------------------------------------------------
def data_source_groups(dataset) -> list[tuple[str, ...]]:
    """The data sources of a Bridge dataset config, read from its own dataclass fields, each a tuple of the fields
    that belong to it: Bridge's text-SFT config (``GPTSFTDatasetConfig``) has the local source ``dataset_root`` and
    the Hugging Face source, every field named ``hf_*`` (the source, its validation and test sets, output root,
    validation proportion, rewrite: what its ``validate()`` calls the HF "split and materialization settings");
    its GPT config has ``data_path``, ``blend`` and ``blend_per_split`` (``finalize()`` reads ``blend`` first, so a
    recipe's blend would win over our ``data_path`` without a word). A field the class does not have is no group."""
    names = [f.name for f in dataclasses.fields(dataset)]
    single = ("dataset_root", "data_path", "blend", "blend_per_split")
    groups: list[tuple[str, ...]] = [(n,) for n in single if n in names]
    hf = tuple(n for n in names if n.startswith("hf_"))
    return [*groups, hf] if hf else groups


def _field_default(dataset, name: str):
    f = next(f for f in dataclasses.fields(dataset) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _named_dataset_fields(ours: dict[str, Any], extra_overrides: Sequence[str]) -> set[str]:
    """The dataset fields our values set, and those a Hydra override sets (``[+]dataset.X...=v``; ``~`` deletes)."""
    named = set((ours.get("dataset") or {}).keys())
    for o in extra_overrides:
        key = o.split("=", 1)[0]
        if key.startswith("~") or "=" not in o:
            continue
        parts = key.lstrip("+").split(".")
        if len(parts) >= 2 and parts[0] == "dataset":
            named.add(parts[1])
    return named


def one_data_source(dataset, named: set[str]) -> list[str]:
    """Our data source replaces the recipe's whole: where our config (``named``: the dataset fields it sets) names
    one source of :func:`data_source_groups`, every field of every other source goes back to its dataclass default
    (None; ``hf_rewrite`` False). The recipes' SFT dataset is SQuAD (``hf_dataset``, validation proportion 0.1): left
    beside our ``dataset_root``, Bridge's own validation refuses the pair on every rank after the queue. Two sources
    named by us is one line. Returns the fields cleared (what the dry run can say)."""
    groups = data_source_groups(dataset)
    ours = [g for g in groups if named.intersection(g)]
    if len(ours) > 1:
        shown = " and ".join("dataset." + sorted(named.intersection(g))[0] for g in ours)
        raise UserError(f"{shown} are two data sources: name one (the other is the recipe's to drop)")
    if not ours:
        return []  # the recipe's own source stays (a config that names none runs what the recipe names)
    cleared = []
    for group in groups:
        if group is ours[0]:
            continue
        for name in group:
            default = _field_default(dataset, name)
            if getattr(dataset, name) != default:
                setattr(dataset, name, default)
                cleared.append(name)
    return cleared


# ---- training ---------------------------------------------------------------------------------------------
StepHook = Callable[[int, dict[str, float]], None]
IterationHook = Callable[[int], None]


def _to_float(v: Any) -> float | None:
    try:
        return float(v.item() if hasattr(v, "item") else v)
    except (TypeError, ValueError):
        return None


class StepRecords:
    """The suite's Bridge callback: Bridge's ``CallbackManager`` calls these on every rank (``make_callback`` gives
    it Bridge's ``Callback`` base, imported only when Bridge is there). Iterations count 1..N, as Megatron's log,
    ``iter_NNNNNNN`` and the local engine do: ``on_step_start(iteration)`` before the step that makes
    ``iteration``; ``on_step(iteration, metrics)`` after it, with the reduced losses, the grad norm and the learning
    rate as plain floats; ``on_save(iteration)`` once the checkpoint of ``iteration`` is saved.

    Bridge's ``train_state.step`` counts the steps done: train.py fires on_train_step_start and on_train_step_end
    before its ``train_state.step += 1``, so the step in hand is ``step + 1``. A save fires on_checkpoint_save with
    the live state only: at once after a synchronous save (``step`` is the saved iteration), but with
    ``checkpoint.async_save`` at the save's finalisation, steps later; checkpointing.save_checkpoint runs the
    finalize function that writes the tracker (rank 0) and a barrier before it, so the tracker names the
    iteration saved."""

    def __init__(self, on_step: StepHook | None = None, on_step_start: IterationHook | None = None,
                 on_save: IterationHook | None = None):
        self.on_step, self.on_step_start, self.on_save = on_step, on_step_start, on_save

    def on_train_step_start(self, context) -> None:
        if self.on_step_start is not None:
            self.on_step_start(int(context.state.train_state.step) + 1)

    def on_checkpoint_save(self, context) -> None:
        if self.on_save is not None:
            self.on_save(_saved_iteration(context))

    def on_train_step_end(self, context) -> None:
        if self.on_step is None:
            return
        metrics: dict[str, float] = {}
        for k, v in (context.loss_dict or {}).items():
            f = _to_float(v)
            if f is not None:
                metrics["loss" if k == "lm loss" else k.replace(" ", "_")] = f
        if context.grad_norm is not None:
            metrics["grad_norm"] = float(context.grad_norm)
        if context.optimizer is not None and getattr(context.optimizer, "param_groups", None):
            metrics["learning_rate"] = float(context.optimizer.param_groups[0]["lr"])
        self.on_step(int(context.state.train_state.step) + 1, metrics)


def _saved_iteration(context) -> int:
    """The iteration an ``on_checkpoint_save`` is for (see :class:`StepRecords`)."""
    step = int(context.state.train_state.step)
    ckpt = getattr(context.state.cfg, "checkpoint", None)
    if ckpt is None or not getattr(ckpt, "async_save", False) or not getattr(ckpt, "save", None):
        return step
    try:
        saved = layout.read_tracker(Path(ckpt.save))
    except UserError:  # unreadable or not a number: the step, as with no tracker
        return step
    return step if saved is None else saved


def make_callback(on_step: StepHook | None = None, on_step_start: IterationHook | None = None,
                  on_save: IterationHook | None = None):
    """A :class:`StepRecords` that is a Bridge ``Callback`` (what ``pretrain(callbacks=[...])`` takes)."""
    Callback = _import("megatron.bridge.training.callbacks", "Callback")
    cls = type("StepRecordsCallback", (StepRecords, Callback), {})
    return cls(on_step=on_step, on_step_start=on_step_start, on_save=on_save)


def run_training(container, *, pretrain: bool, on_step: StepHook | None = None,
                 on_step_start: IterationHook | None = None, on_save: IterationHook | None = None) -> None:
    """``pretrain()`` (random init) or ``finetune()`` (from a checkpoint) with Bridge's GPT forward step and, when a
    hook is given, the :class:`StepRecords` callback."""
    forward_step = _import("megatron.bridge.training.gpt_step", "forward_step")
    callbacks = []
    if on_step is not None or on_step_start is not None or on_save is not None:
        callbacks.append(make_callback(on_step=on_step, on_step_start=on_step_start, on_save=on_save))
    run = _import("megatron.bridge.training.pretrain" if pretrain else "megatron.bridge.training.finetune",
                  "pretrain" if pretrain else "finetune")
    run(config=container, forward_step_func=forward_step, callbacks=callbacks or None)


# megatron-core's NaN/Inf checks (check_for_nan_in_loss, ddp.check_for_nan_in_grad) go through
# RerunStateMachine.validate_result, which with reruns disabled (Bridge's default rerun_mode) raises
# RuntimeError(f"Rank {r}, node {n}, device {d}, iteration {i}: Unexpected result {result} (message='{message}')")
# with messages "found NaN in local forward loss calculation" / "found Inf in ..." (bridge/training/losses.py) and
# "found NaN in local grad norm for bucket #..." / "found Inf in ..." (core/distributed/param_and_grad_buffer.py).
_NONFINITE = ("(message='found NaN in ", "(message='found Inf in ")


def is_nonfinite_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is megatron-core stopping on a NaN or Inf loss or gradient norm."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and "Unexpected result" in text and any(m in text for m in _NONFINITE)


# ---- the cluster's own check: a few iterations of the Bridge engine (validate --run-training) ---------------
def smoke_overrides(run_dir: Path, *, world: int, tp: int, iters: int) -> list[str]:
    """Bridge's minimal GPT recipe shrunk to 2 layers x 256 on mock data (random tokens: Megatron's
    MockGPTDataset, since the recipe names no blend), random init, ``iters`` steps, one checkpoint at the end."""
    dp = world // tp
    return ["model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=1024",
            "model.num_attention_heads=4", "model.seq_length=256", f"model.tensor_model_parallel_size={tp}",
            "dataset.seq_length=256", f"train.train_iters={iters}", "train.micro_batch_size=1",
            f"train.global_batch_size={2 * dp}", "validation.eval_iters=0", f"validation.eval_interval={iters}",
            "scheduler.lr_warmup_iters=0", f"scheduler.lr_decay_iters={iters}", "logger.log_interval=1",
            f"logger.tensorboard_dir={run_dir / 'tb'}", f"checkpoint.save={run_dir / 'checkpoints'}",
            f"checkpoint.save_interval={iters}"]


# Why the smoke run turns the recipe's distributed optimizer off where megatron-core has neither Transformer Engine's
# nor Apex's FusedAdam (a bare GPU Python; never the cluster's container): megatron-core 0.19.2 then falls back to
# torch's Adam, whose DistributedOptimizer.state_dict asserts one Adam step across a still-empty optimizer state
# (distrib_optimizer.py:839), which Bridge's checkpoint load builds before the first step: the resume dies.
NO_FUSED_ADAM = ("megatron-core found neither Transformer Engine's nor Apex's FusedAdam: its torch-Adam fallback "
                 "cannot resume a DistributedOptimizer (distrib_optimizer.py:839)")


def fused_adam_available() -> bool:
    """Whether megatron-core's DistributedOptimizer runs on TE's or Apex's FusedAdam here (its own import rule)."""
    return bool(_import("megatron.core.optimizer.distrib_optimizer", "HAVE_APEX_OR_TE"))


def smoke_config(run_dir: Path, *, world: int, tp: int = 1, iters: int = 4, extra_overrides: Sequence[str] = ()):
    """The ``ConfigContainer`` of the smoke run: Bridge's own recipe and override code (buildable on CPU);
    ``extra_overrides`` after the smoke's own (``pipeline.training.engines.smoke``: save-and-exit and resume).
    Without a FusedAdam (:data:`NO_FUSED_ADAM`) the distributed optimizer is off unless an override sets it."""
    if world % tp:
        raise UserError(f"{world} GPUs do not divide into tensor-parallel groups of {tp}")
    recipe = _import("megatron.bridge.recipes.gpt.vanilla_gpt", "vanilla_gpt_pretrain_config")
    process = _import("megatron.bridge.training.utils.omegaconf_utils", "process_config_with_overrides")
    extra = {o.split("=", 1)[0] for o in extra_overrides}  # one value per key: an extra one replaces the smoke's
    own = smoke_overrides(Path(run_dir), world=world, tp=tp, iters=iters)
    if not fused_adam_available():
        own += ["ddp.use_distributed_optimizer=false", "optimizer.use_distributed_optimizer=false"]
    base = [o for o in own if o.split("=", 1)[0] not in extra]
    return process(config=recipe(), cli_overrides=[*base, *extra_overrides])


# ---- PEFT (LoRA) iterations -------------------------------------------------------------------------------
RUN_CONFIG = "run_config.yaml"  # Bridge's record of the run, in every iteration directory it writes
LORA_TARGET = "megatron.bridge.peft.lora.LoRA"
# The LoRA settings Bridge's export_adapter_ckpt reads back from run_config.yaml (auto_bridge.py): the source side
# of the verification builds its adapters from the same ones.
_LORA_KEYS = ("target_modules", "exclude_modules", "dim", "alpha", "dropout", "dropout_position",
              "normalize_moe_lora", "share_expert_adapters")


@dataclass(frozen=True)
class PeftIteration:
    """A Bridge PEFT iteration: its ``run_config.yaml`` has a ``peft:`` section, and Bridge saved only the adapter
    weights (``apply_peft_adapter_filter_to_state_dict``): the base model is the run's
    ``checkpoint.pretrained_checkpoint``."""

    iter_path: Path
    target: str  # the peft section's ``_target_`` (Bridge's class: LORA_TARGET, DoRA, ...)
    pretrained_checkpoint: str | None
    settings: dict[str, Any] = field(default_factory=dict)
    ckpt_step: int | None = None  # checkpoint.ckpt_step: the base iteration the run loaded, where the run pinned it

    @property
    def is_lora(self) -> bool:
        return self.target == LORA_TARGET

    @property
    def what(self) -> str:
        kind = "LoRA" if self.is_lora else f"PEFT ({self.target or 'no _target_'})"
        return f"{self.iter_path} is a {kind} iteration (Bridge saved only its adapter weights)"


def read_run_config(iter_path: Path) -> dict[str, Any] | None:
    """An iteration's ``run_config.yaml`` as a mapping (None where there is none; one line where it is unreadable)."""
    f = Path(iter_path) / RUN_CONFIG
    if not f.is_file():
        return None
    try:
        cfg = yamlio.read_record(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{f} is unreadable ({exc_line(exc)}): it is Bridge's record of the run") from None
    return cfg if isinstance(cfg, dict) else None


def peft_iteration(iter_path: Path) -> PeftIteration | None:
    """The PEFT facts of an iteration directory, or None for a whole-model checkpoint (no ``peft:`` section: an
    import, a pretraining or SFT save, a local-engine iteration)."""
    cfg = read_run_config(iter_path)
    peft = cfg.get("peft") if cfg else None
    if not cfg or not isinstance(peft, dict):
        return None
    ckpt = cfg.get("checkpoint")
    pre = ckpt.get("pretrained_checkpoint") if isinstance(ckpt, dict) else None
    step = ckpt.get("ckpt_step") if isinstance(ckpt, dict) else None
    return PeftIteration(Path(iter_path), str(peft.get("_target_") or ""), str(pre) if pre else None,
                         {k: peft[k] for k in _LORA_KEYS if k in peft},
                         step if isinstance(step, int) and not isinstance(step, bool) else None)


def hf_import_source(iter_path: Path) -> str | None:
    """The Hugging Face model an iteration was imported from by Bridge (``import_ckpt`` writes a run_config.yaml with
    ``model.hf_model_id`` and no ``train:`` or ``peft:`` section), or None: not an import (a trained save, whose
    weights are not the HF model's any more, a PEFT save, no run_config)."""
    cfg = read_run_config(iter_path)
    if not cfg or cfg.get("train") is not None or cfg.get("peft") is not None:
        return None
    model = cfg.get("model")
    hf_id = model.get("hf_model_id") if isinstance(model, dict) else None
    return str(hf_id) if hf_id else None


def generation_refusal(peft: PeftIteration, hf_model: str | None) -> str:
    """The one line refusing Megatron generation from a PEFT iteration, naming the export to run instead."""
    it = peft.iter_path
    known = layout.iteration_of(it)
    n = "N" if known is None else known
    return (f"{peft.what}; the megatron backend generates from whole checkpoints only: export it "
            f"(python -m pipeline.cli.checkpoint export {it.parent} --iteration {n} --hf-model "
            f"{hf_model or 'HF_MODEL'} --reasoning|--no-reasoning, which merges the adapters into the base) and run "
            f"coherence on {it / 'hf'} with --backend hf")


def export_lora_adapter(iter_path: Path, adapter_path: Path, *, hf_model: str) -> None:
    """A LoRA iteration -> a Hugging Face PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) with Bridge's ``export_adapter_ckpt``: one process, the base from ``hf_model`` on
    CPU in float32, the LoRA structure from the iteration's run_config.yaml, the adapter weights from exactly
    ``iter_path``."""
    iter_path = _check_iteration_dir(iter_path)
    bridge = _import(_AB, "AutoBridge").from_hf_pretrained(hf_model)
    bridge.export_adapter_ckpt(peft_checkpoint=str(iter_path), output_path=str(adapter_path), show_progress=False)


def _load_lora_adapters(models: list, iter_path: Path, settings: dict[str, Any]) -> list:
    """Bridge's LoRA transform on a loaded base model, then the adapter weights of ``iter_path`` loaded into it the
    way Bridge's ``export_adapter_ckpt`` does (the model's sharded state dict filtered to the adapters, read with
    megatron-core's dist_checkpointing): base + adapters, as the PEFT run trained them."""
    lora = _import("megatron.bridge.peft.lora", "LoRA")(**settings)
    models = lora(models, training=False)
    ck = "megatron.bridge.training.checkpointing"
    sharded = _import(ck, "apply_peft_adapter_filter_to_state_dict")(
        _import(ck, "_generate_model_state_dict")(models, {}), lora)
    loaded = _import("megatron.core.dist_checkpointing", "load")(sharded, str(iter_path))
    keys = ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]
    for key, model in zip(keys, models):
        want = set(sharded.get(key, {}))
        if not want:
            raise UserError(f"{iter_path}: Bridge's LoRA ({settings}) matched no module of the base model")
        res = model.load_state_dict(loaded[key], strict=False)
        if res.unexpected_keys:
            raise UserError(f"{iter_path}: adapter weights the base model has no place for: {res.unexpected_keys[:3]}")
    return models


# ---- checkpoints ------------------------------------------------------------------------------------------
def _device():
    """This rank's device: its GPU under torchrun (``LOCAL_RANK``), else the CPU (the megatron_cpu test tier)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _init_model_parallel(tp: int, pp: int, ep: int, etp: int = 1, seed: int = 0) -> bool:
    """The process group (one rank per GPU under torchrun; a world of one otherwise) and Megatron's model-parallel
    groups, then Megatron's model-parallel RNG (``model_parallel_cuda_manual_seed``), before any model is built.

    The seeding is not optional: Bridge's provider seeds only when it initialises the groups itself, and with the
    groups already there it skips that, so Nemotron-H's ``MambaMixer.__init__`` (and every attention forward, which
    forks the tracker for dropout) fails with "cuda rng state model-parallel-rng is not added".
    A world of one gets a live context too: Bridge's ``load_megatron_model`` would otherwise load inside a temporary
    one and tear its groups down before the model runs. ``etp`` 1: the expert grid is folded onto the ranks of a
    pipeline stage (world = pp x lcm(tp, ep x etp), the plan's layout, ``config/parallel.py``); Megatron's default
    etp = tp would need tp x ep ranks per stage. NCCL on GPUs, gloo without CUDA. Returns True when it created the
    process group (the caller may tear it down with :func:`_destroy_model_parallel`)."""
    import torch
    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        kwargs: dict[str, Any] = {}
        if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:  # by hand, not under torchrun
            # (a batch script may export MASTER_ADDR/WORLD_SIZE for a multi-node job: not this process's world)
            kwargs = {"init_method": f"tcp://127.0.0.1:{_free_port()}", "world_size": 1, "rank": 0}
        dist.init_process_group(backend="nccl" if cuda else "gloo", **kwargs)
        created = True
    ps = importlib.import_module("megatron.core.parallel_state")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        _import("megatron.core.tensor_parallel", "model_parallel_cuda_manual_seed")(seed)
    return created


def _destroy_model_parallel() -> None:
    import torch.distributed as dist

    importlib.import_module("megatron.core.parallel_state").destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mp_overrides(tp: int, pp: int, ep: int, etp: int = 1) -> dict[str, int]:
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "expert_model_parallel_size": ep,
            "expert_tensor_parallel_size": etp}


def export_to_hf(iter_path: Path, hf_path: Path, *, hf_model: str, strict: bool, tp: int = 1, pp: int = 1,
                 ep: int = 1) -> None:
    """Megatron iteration directory -> Hugging Face directory with AutoBridge (exactly ``iter_path``).

    One process (TP=PP=EP=1): ``AutoBridge.export_ckpt``, which loads on CPU under its own gloo context.
    Model-parallel (one torchrun rank per GPU): every rank loads its shard with the layout overrides and
    ``save_hf_pretrained`` gathers and writes the HF files (rank 0 writes)."""
    iter_path = _check_iteration_dir(iter_path)
    AutoBridge = _import(_AB, "AutoBridge")
    bridge = AutoBridge.from_hf_pretrained(hf_model)
    if tp * pp * ep == 1:
        bridge.export_ckpt(megatron_path=str(iter_path), hf_path=str(hf_path), strict=strict)
        return
    _init_model_parallel(tp, pp, ep)
    models = bridge.load_megatron_model(str(iter_path), mp_overrides=_mp_overrides(tp, pp, ep), wrap_with_ddp=False)
    bridge.save_hf_pretrained(model=models, path=str(hf_path), strict=strict)


# Bridge's conversion says only this, as a warning, when a Megatron weight gets no Hugging Face tensor on import:
# the weight keeps its random initialisation and the import "succeeds" (model_bridge.build_conversion_tasks)
_CONVERSION_LOGGER = "megatron.bridge.models.conversion.model_bridge"
_UNLOADED = ("WARNING: Can't find", "WARNING: No mapping found")


class _Unloaded(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(_UNLOADED):
            self.lines.append(msg.removeprefix("WARNING: "))


@contextlib.contextmanager
def _watch_unloaded_weights():
    """The Megatron weights Bridge's conversion leaves unloaded (its warnings, collected on this rank whatever the
    rank's log level), as a list filled while the block runs."""
    handler, logger = _Unloaded(), logging.getLogger(_CONVERSION_LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _refuse_unloaded(hf_id: str, lines: list[str]) -> None:
    """Every rank raises together when any rank's conversion left a weight unloaded (a rank alone would leave the
    others waiting at the next barrier)."""
    import torch
    import torch.distributed as dist

    count = torch.tensor([len(lines)], dtype=torch.long, device=_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if int(count.item()):
        shown = "; ".join(lines[:3]) or "on another rank"
        raise UserError(f"{hf_id}: Megatron Bridge found no Hugging Face tensor for {int(count.item())} Megatron "
                        f"weight(s), which would keep their random initialisation ({shown}); the import is refused "
                        "and nothing is written (is the checkpoint in the Hub's naming for its architecture?)")


def import_from_hf(hf_id: str, output: Path, *, tp: int = 1, pp: int = 1, ep: int = 1) -> Path:
    """Hugging Face -> a Megatron ``torch_dist`` checkpoint at ``output``, written beside it and moved into place
    whole (a killed import leaves no half checkpoint where the configs look).

    One process (tp = pp = ep = 1): ``AutoBridge.import_ckpt`` builds the whole model in host memory (CPU
    initialisation). Model-parallel (one torchrun rank per GPU, the plan's layout): every rank builds
    its shard (``to_megatron_provider(load_weights=True)`` with the layout set, ``provide_distributed_model``: each
    rank reads only its slices of the HF safetensors) and ``save_megatron_model`` writes each rank's shards of one
    checkpoint, which any layout loads (torch_dist reshards). Our own seeded groups first
    (:func:`_init_model_parallel`): without a process group Bridge's provider makes one with ``torch.cuda.set_device``
    + NCCL, which a machine without CUDA cannot."""
    import torch.distributed as dist

    AutoBridge = _import(_AB, "AutoBridge")
    own = _init_model_parallel(tp, pp, ep)
    rank0 = dist.get_rank() == 0
    staging = output.parent / f".{output.name}.importing"
    try:
        if rank0:
            shutil.rmtree(staging, ignore_errors=True)  # what a killed import left
            staging.parent.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        with _watch_unloaded_weights() as unloaded:
            if tp * pp * ep == 1 and dist.get_world_size() == 1:
                AutoBridge.import_ckpt(hf_model_id=hf_id, megatron_path=str(staging))
            else:
                bridge = AutoBridge.from_hf_pretrained(hf_id)
                provider = bridge.to_megatron_provider(load_weights=True)
                for key, value in _mp_overrides(tp, pp, ep).items():
                    setattr(provider, key, value)
                provider.finalize()
                # GPU ranks build their shard on their device; CPU ranks (gloo) build it on the host
                models = provider.provide_distributed_model(wrap_with_ddp=False,
                                                            use_cpu_initialization=_device().type == "cpu")
                kwargs = getattr(bridge._model_bridge, "get_hf_tokenizer_kwargs", lambda: None)() or {}
                bridge.save_megatron_model(models, str(staging), hf_tokenizer_path=hf_id,
                                           hf_tokenizer_kwargs=kwargs, low_memory_save=True)
        try:
            _refuse_unloaded(hf_id, unloaded)
        except UserError:
            if rank0:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        dist.barrier()
        if rank0:
            if output.exists():
                shutil.rmtree(output)  # --force (the CLI refuses an existing checkpoint without it)
            os.replace(staging, output)
        dist.barrier()
    finally:
        if own:
            _destroy_model_parallel()
    return output


class MegatronCausalLM:
    """Just enough of a causal-LM interface over a Megatron iteration for ``checkpoint.verify.logits_for``: the source
    side of the export verification (GPU).

    Loaded on the export's own model-parallel layout (``tp``/``pp``/``ep``; one torchrun rank per GPU when their
    product is > 1, reusing the model-parallel state ``_init_model_parallel`` set up for the export), not TP=1 on one
    GPU: Nemotron 3 Super at TP=1 is ~240 GB, a GPU holds 95. Every rank must call it with the same inputs (the
    forward is collective). The logits come back whole on every rank, on CPU, float32, cut to the Hugging Face
    vocabulary (Megatron pads it): gathered over TP, and with PP run through Megatron's forward-only pipeline schedule
    and broadcast from the last stage. ``release()`` frees the model's GPU memory before the export is loaded."""

    def __init__(self, iter_path: Path, hf_model: str, hf_config, *, tp: int = 1, pp: int = 1, ep: int = 1,
                 lora_base: Path | None = None):
        """``lora_base``: ``iter_path`` is a LoRA iteration and this is its base iteration: the model is the base
        with Bridge's LoRA transform and the iteration's adapter weights (:func:`_load_lora_adapters`)."""
        iter_path = _check_iteration_dir(iter_path)
        self.tp, self.pp, self.ep = tp, pp, ep
        overrides: dict[str, Any] = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                     "expert_model_parallel_size": ep, "sequence_parallel": False}
        # a no-op where the export already initialised it; at a world of one, a live context of our own
        self._own_context = _init_model_parallel(tp, pp, ep)
        try:
            ps = importlib.import_module("megatron.core.parallel_state")  # the model matches the groups' expert TP
            overrides["expert_tensor_parallel_size"] = ps.get_expert_tensor_parallel_world_size()
            AutoBridge = _import(_AB, "AutoBridge")
            bridge = AutoBridge.from_hf_pretrained(hf_model)
            if lora_base is None:
                self.models = bridge.load_megatron_model(str(iter_path), mp_overrides=overrides, wrap_with_ddp=False)
            else:
                peft = peft_iteration(iter_path)
                if peft is None or not peft.is_lora:
                    raise UserError(f"{iter_path} is not a LoRA iteration")
                base = bridge.load_megatron_model(str(_check_iteration_dir(lora_base)), mp_overrides=overrides,
                                                  wrap_with_ddp=False)
                self.models = _load_lora_adapters(base, iter_path, peft.settings)
        except BaseException:  # a failed load must not leave our process group behind (a later export in this
            if self._own_context:  # process, e.g. upload-all's next iteration, would initialise it twice)
                _destroy_model_parallel()
            raise
        self.config = hf_config

    def _forward(self, ids, pos):
        """The last stage's logits ``[1, seq, vocab / tp]`` (None on other pipeline stages)."""
        import torch

        if self.pp == 1:
            with torch.no_grad():
                return self.models[0](input_ids=ids, position_ids=pos, attention_mask=None)

        def step(data_iterator, model):
            i, p = next(data_iterator)
            return model(input_ids=i, position_ids=p, attention_mask=None), lambda out, non_loss_data=True: out

        schedule = _import("megatron.core.pipeline_parallel", "get_forward_backward_func")()
        with torch.no_grad():
            outs = schedule(forward_step_func=step, data_iterator=iter([(ids, pos)]), model=self.models,
                            num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=1, forward_only=True,
                            collect_non_loss_data=True)
        ps = importlib.import_module("megatron.core.parallel_state")
        return outs[0] if ps.is_pipeline_last_stage() else None

    def __call__(self, input_ids, labels=None):
        import torch

        ids = input_ids.to(_device())
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        logits = self._forward(ids, pos)
        if logits is not None and self.tp > 1:  # vocab-parallel output layer: each TP rank holds a slice
            gather = _import("megatron.core.tensor_parallel", "gather_from_tensor_model_parallel_region")
            logits = gather(logits)
        if self.pp > 1:  # the last stage has the logits: broadcast shape, then values, along the pipeline
            import torch.distributed as dist

            ps = importlib.import_module("megatron.core.parallel_state")
            group, src = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
            shape = torch.tensor(list(logits.shape) if logits is not None else [0, 0, 0], device=ids.device)
            dist.broadcast(shape, src=src, group=group)
            logits = (logits.float().contiguous() if logits is not None else
                      torch.empty(*shape.tolist(), dtype=torch.float32, device=ids.device))
            dist.broadcast(logits, src=src, group=group)
        logits = logits[..., : self.config.vocab_size].float().cpu()
        out = types.SimpleNamespace(logits=logits)
        if labels is not None:
            out.loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:].cpu())
        return out

    def eval(self):
        for m in self.models:
            m.eval()
        return self

    def release(self) -> None:
        """Drop the Megatron model and return its GPU memory, so the export can be loaded on the same GPUs."""
        import torch

        self.models = []
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self._own_context:
            _destroy_model_parallel()
            self._own_context = False


def _next_token_fn(models, tp: int, pp: int):
    """``next_token(ids) -> int`` on every rank: one forward of ``ids`` through Megatron's own schedule
    (``get_forward_backward_func``, forward only; across pipeline stages it sends the activations point to point),
    the greedy token taken on the last stage from the full vocabulary (gathered over tensor-parallel ranks when the
    output layer is vocab-parallel) and broadcast to the other stages of its pipeline group."""
    import torch
    import torch.distributed as dist

    ps = importlib.import_module("megatron.core.parallel_state")
    fb = _import("megatron.core.pipeline_parallel", "get_forward_backward_func")()
    gather = _import("megatron.core.tensor_parallel", "gather_from_tensor_model_parallel_region")
    inner = getattr(models[0], "module", models[0])
    parallel_output = bool(getattr(inner, "parallel_output", True))

    def step(data_iterator, model):
        tokens = next(data_iterator)
        pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        return model(input_ids=tokens, position_ids=pos, attention_mask=None), None  # no loss: keep the logits

    def next_token(ids) -> int:
        out = fb(forward_step_func=step, data_iterator=iter([ids]), model=models, num_microbatches=1,
                 seq_length=ids.shape[1], micro_batch_size=1, forward_only=True)
        nxt = torch.zeros(1, dtype=torch.long, device=ids.device)
        if ps.is_pipeline_last_stage():
            logits = out[0][:, -1].float()  # [batch, vocab / tp] at the last position
            if tp > 1 and parallel_output:
                logits = gather(logits)
            nxt[0] = int(logits[0].argmax())
        if dist.get_world_size() > 1:
            # one token for the whole world, from the global last rank (on the last pipeline stage: pipeline stages
            # are megatron-core's outermost rank dimension): expert- and data-parallel replicas must not pick their
            # own (a replica that stopped early would leave the others waiting in the next all-to-all)
            dist.broadcast(nxt, src=dist.get_world_size() - 1)
        return int(nxt.item())

    return next_token


def greedy_decode(next_token: Callable[[Any], int], ids, max_tokens: int, stop: frozenset[int]
                  ) -> tuple[list[int], bool]:
    """Up to ``max_tokens`` greedy tokens after ``ids`` (a [1, n] tensor); the first one in ``stop`` ends the
    generation (not kept). Returns (the new tokens, finished by itself)."""
    import torch

    new: list[int] = []
    for _ in range(max_tokens):
        nxt = next_token(ids)
        if nxt in stop:
            return new, True
        new.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=ids.device)], dim=1)
    return new, False


def model_layout(models, tp: int, pp: int, ep: int) -> dict[str, Any]:
    """What a loaded Megatron model runs on, read from the model itself: the parallel sizes, the world, and for an
    MoE model its routed experts, how many this rank holds and the token dispatcher its MoE layers built (the
    class, not the config's wish)."""
    import torch.distributed as dist

    inner = getattr(models[0], "module", models[0])
    cfg = getattr(inner, "config", None)
    out: dict[str, Any] = {"tp": tp, "pp": pp, "ep": ep,
                           "world": dist.get_world_size() if dist.is_initialized() else 1}
    experts = int(getattr(cfg, "num_moe_experts", None) or 0)
    if experts:
        dispatcher = next((type(m.token_dispatcher).__name__ for m in inner.modules()
                           if hasattr(m, "token_dispatcher")), None)
        out.update(experts=experts, experts_per_rank=experts // ep,
                   moe_token_dispatcher_type=getattr(cfg, "moe_token_dispatcher_type", None),
                   moe_dispatcher=dispatcher)
    return out


def generate(iter_path: Path, hf_model: str, prompts: list[str], max_tokens: int, *, tp: int, pp: int, ep: int,
             reasoning: bool, on_layout: Callable[[dict[str, Any]], None] | None = None
             ) -> list[tuple[str, int, bool]]:
    """Greedy generation straight from a Megatron iteration: one rank per GPU under torchrun when the layout has
    more than one rank (world = pp x lcm(tp, ep), across nodes when it needs them), every rank feeding the same
    prompt. Returns (text, generated tokens, finished by itself) per prompt; every rank returns the same.
    ``on_layout`` gets :func:`model_layout` of the loaded model before the first prompt."""
    iter_path = _check_iteration_dir(iter_path)
    peft = peft_iteration(iter_path)
    if peft is not None:  # Bridge saved only the adapters: load_megatron_model would ask for the whole model
        raise UserError(generation_refusal(peft, hf_model))
    import torch
    from transformers import AutoTokenizer

    own_context = _init_model_parallel(tp, pp, ep)  # at a world of one too: the model runs in a live context
    try:
        AutoBridge = _import(_AB, "AutoBridge")
        bridge = AutoBridge.from_hf_pretrained(hf_model)
        models = bridge.load_megatron_model(str(iter_path), mp_overrides=_mp_overrides(tp, pp, ep), wrap_with_ddp=False)
        for m in models:
            m.eval()
        if on_layout is not None:
            on_layout(model_layout(models, tp, pp, ep))
        tok = AutoTokenizer.from_pretrained(hf_model)
        stop = end_ids(hf_model, tok)  # the hf backend's end ids: the generation config's and the tokenizer's
        next_token = _next_token_fn(models, tp, pp)
        device = _device()
        out = []
        for prompt in prompts:
            # transformers 5 returns a BatchEncoding here, not a tensor: take its input_ids, on this rank's device
            enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True, return_tensors="pt",
                                          enable_thinking=reasoning)
            with torch.no_grad():
                new, finished = greedy_decode(next_token, enc["input_ids"].to(device), max_tokens, stop)
            out.append((tok.decode(new, skip_special_tokens=True).strip(), len(new), finished))
        del models
    finally:
        if own_context and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            _destroy_model_parallel()
    return out
