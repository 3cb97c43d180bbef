"""Bridge harness driver: runs INSIDE the harness venv (tests/bridge/setup_env.sh), with PYTHONPATH =
tests/bridge/shim + src. Reads one JSON request on stdin, runs Megatron Bridge's real code for each
operation, prints one JSON answer on the last line of stdout. Called by tests/bridge/test_bridge_harness.py.

Request: {"ops": [{"op": NAME, ...}, ...]}; answer: {"results": [{"op": NAME, ...}, ...]}. An operation
that raises reports {"error": "Type: message", "where": "file:line"} instead of stopping the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path


def _norm(v):
    """A container value in the shape YAML gives it (tuples -> lists, enums/dtypes/callables -> str)."""
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    if isinstance(v, enum.Enum):
        return v.value
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if dataclasses.is_dataclass(v):
        return {f.name: _norm(getattr(v, f.name)) for f in dataclasses.fields(v)}
    return str(v)


def _leaves(d, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in tb if "megatron" in f.filename or "omegaconf" in f.filename] or tb
    f = frames[-1]
    return f"{f.filename.split('site-packages/')[-1].split('megatron-site/')[-1]}:{f.lineno}"


def _err(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {str(exc)[:2000]}", "where": _where(exc)}


# ---- a: build_config ------------------------------------------------------------------------------------
def op_build_config(req: dict) -> dict:
    """pipeline.bridge.build_config on the real recipe + process_config_with_overrides; then every leaf of
    the YAML our side hands Bridge (bridge_overrides_yaml) is read back from the ConfigContainer with a
    getattr chain."""
    import yaml

    from pipeline import bridge as pb
    from pipeline.config.schema import TrainingConfig

    cfg = TrainingConfig.from_dict(req["cfg"])  # as a rank reads config.yaml (records.load_run)
    container = pb.build_config(cfg, req["model"], req["mode"], req.get("peft"), req.get("extra_overrides", []))
    sent = yaml.safe_load(pb.bridge_overrides_yaml(cfg)) or {}
    checked, mismatches = [], []
    for path, expected in _leaves(sent):
        obj, missing = container, None
        for part in path:
            if isinstance(obj, dict) and part in obj:
                obj = obj[part]
            elif hasattr(obj, part):
                obj = getattr(obj, part)
            else:
                missing = part
                break
        dotted = ".".join(path)
        if missing is not None:
            mismatches.append({"key": dotted, "expected": expected, "actual": f"<no attribute {missing!r}>"})
            continue
        actual = _norm(obj)
        exp = _norm(expected)
        if isinstance(exp, (int, float)) and isinstance(actual, (int, float)) and not isinstance(exp, bool):
            ok = float(exp) == float(actual)
        else:
            ok = exp == actual
        (checked if ok else mismatches).append({"key": dotted, "expected": exp, "actual": actual})
    return {
        "recipe": type(container).__name__,
        # Bridge's own GPT step: whether it hands the model the packed sequences' boundaries (cu_seqlens from the
        # packed Parquet's seq_start_id) or treats each pack as one sequence (attention across its documents)
        "packed_seq_metadata": bool(_bridge_function("megatron.bridge.training.gpt_step",
                                                     "_uses_packed_sequence_metadata")(container)),
        "checked": [c["key"] for c in checked],
        "mismatches": mismatches,
        "container_types": {k: type(getattr(container, k)).__name__
                            for k in ("model", "dataset", "peft", "ft", "profiling")},
        "extra": {k: _norm(_getattr_path(container, k)) for k in req.get("read_back", [])},
        # Bridge's own validation of a section (its finalize(), which ConfigContainer.validate() calls)
        "finalized": {k: _finalize(getattr(container, k)) for k in req.get("finalize", [])},
        # where the Bridge engine looks for each rank's trace, read from this real container
        "bridge_trace": {str(r): _bridge_trace(container, r) for r in req.get("trace_ranks", [])},
        # Bridge's own validation of the whole container (what setup() runs on every rank before anything else)
        **({"validated": _validate(container, int(req["validate_world"]))} if req.get("validate_world") else {}),
    }


# TransformerConfig.__post_init__ (megatron-core 0.19.2) raises "... is not available. Please install TE" for these
TE_KERNEL_SWITCHES = ("model.apply_rope_fusion", "model.moe_permute_fusion")
# The GPU of the shipped cluster profile (configs/cluster/isambard_gh200.yaml), as torch.cuda.get_device_properties
# describes it on a compute node there
GH200 = type("GH200Properties", (), {"name": "NVIDIA GH200 120GB", "major": 9, "minor": 0,
                                     "total_memory": 95 * 2**30, "multi_processor_count": 132})()


def _validate(container, world: int) -> dict:
    """Bridge's ``runtime_config_update`` (the first thing its ``pretrain()`` does, and so ``finetune()``: the
    recipe's environment defaults, the mixed-precision string resolved and applied, the data-parallel size, then
    ``ConfigContainer.validate()``) on a copy of ``container``, as rank 0 of a job of ``world`` ranks runs it
    (``get_world_size_safe`` reads WORLD_SIZE). Reports Bridge's exception, whatever it is."""
    import copy

    from megatron.bridge.training.config import runtime_config_update
    saved = dict(os.environ)
    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    c = copy.deepcopy(container)
    # What megatron-core's TransformerConfig refuses where Transformer Engine is absent (this venv; never the
    # cluster's image): each is a fused CUDA kernel whose unfused torch path is megatron-core's own reference. Each
    # switch the config turns on is turned off on the copy, and listed in the answer.
    te_kernels = [k for k in TE_KERNEL_SWITCHES if getattr(getattr(c, k.split(".")[0]), k.split(".")[1], False)]
    for k in te_kernels:
        setattr(getattr(c, k.split(".")[0]), k.split(".")[1], False)
    # Not validated here, and named: megatron-core's OptimizerConfig.__post_init__ (the optimizer section's finalize)
    # imports TE's FusedAdam for the precision-aware optimizer (Super's recipe) and raises without it; turning the
    # switch off instead changes what it checks (main_params_dtype). The section's finalize is skipped on the copy.
    not_validated = []
    if getattr(c.optimizer, "use_precision_aware_optimizer", False):
        c.optimizer.finalize = lambda: None
        not_validated.append("optimizer.finalize (use_precision_aware_optimizer: Transformer Engine's FusedAdam)")
    # [cuda] Bridge's flex-dispatcher check reads GPU 0's architecture (torch.cuda.get_device_properties(0)): here it
    # reads the shipped cluster's GPU (isambard_gh200: GH200, Hopper, sm_90), as it would on a compute node there.
    import torch

    real_props = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device=None: GH200
    try:
        runtime_config_update(c)
    except Exception as exc:
        return {"ok": False, **_err(exc), "trace": traceback.format_exc()[-3000:], "te_kernels_off": te_kernels,
                "not_validated": not_validated}
    finally:
        torch.cuda.get_device_properties = real_props
        os.environ.clear()
        os.environ.update(saved)
    return {"ok": True, "dataset": type(c.dataset).__name__, "te_kernels_off": te_kernels,
            "not_validated": not_validated,
            "sources": {k: _norm(getattr(c.dataset, k, None))
                        for k in ("dataset_root", "hf_dataset", "hf_validation_proportion", "data_path", "blend")}}


def _bridge_trace(container, rank: int):
    from pipeline.training.engines.megatron_bridge import bridge_trace

    path = bridge_trace(container, rank)
    return None if path is None else str(path)


def _finalize(section) -> dict:
    try:
        section.finalize()
    except Exception as exc:
        return {"ok": False, **_err(exc)}
    return {"ok": True}


def _bridge_function(module: str, name: str):
    """One function of a Bridge module, executed from the installed wheel's source on its own: importing all of
    gpt_step pulls in Bridge's training stack (Transformer Engine, distillation), which the CPU harness cannot load;
    this function reads only the ConfigContainer."""
    import ast
    import importlib.util

    path = importlib.util.find_spec(module.rsplit(".", 1)[0]).submodule_search_locations[0]
    src = open(f"{path}/{module.rsplit('.', 1)[1]}.py").read()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), f"{module}.{name}", "exec"), ns)
    return ns[name]


def _getattr_path(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# ---- c: misspelled / wrong-type keys ----------------------------------------------------------------------
def op_overrides(req: dict) -> dict:
    """Bridge's own process_config_with_overrides on a real recipe container with each override alone:
    does it raise (where, what), or what value lands in the container?"""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from pipeline import bridge as pb
    from pipeline.config.models import get_model

    spec = get_model(req["model"])
    recipe = pb._import(spec.recipe_module, spec.recipe_name(req["mode"], None))
    out = []
    for case in req["cases"]:
        container = recipe()
        res = {"case": case}
        try:
            if "yaml" in case:
                with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
                    f.write(case["yaml"])
                try:
                    process_config_with_overrides(container, config_filepath=f.name)
                finally:
                    os.unlink(f.name)
            else:
                process_config_with_overrides(container, cli_overrides=case["cli"])
            res["raised"] = False
            res["read_back"] = {k: _norm(_getattr_path(container, k)) if _has_path(container, k) else "<absent>"
                                for k in case.get("read_back", [])}
        except Exception as exc:
            res["raised"] = True
            res.update(_err(exc))
        out.append(res)
    return {"cases": out}


def _has_path(obj, dotted):
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


# ---- d: checkpoint path resolution --------------------------------------------------------------------------
def op_load_paths(req: dict) -> dict:
    """AutoBridge.load_megatron_model's real path resolution; only the loader it hands the path to
    (megatron.bridge.training.model_load_save.load_megatron_model) is replaced by a recorder."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.training import model_load_save

    calls = []

    def recorder(path, *args, **kwargs):
        calls.append(path)
        return ["<model>"]

    model_load_save.load_megatron_model = recorder
    bridge = AutoBridge.from_hf_pretrained(req["hf_model"])
    handed = {}
    for label, path in req["paths"].items():
        calls.clear()
        bridge.load_megatron_model(path, wrap_with_ddp=False)
        handed[label] = calls[-1]
    return {"handed": handed}


# ---- e: HF -> Megatron -> HF round trip ---------------------------------------------------------------------
def op_roundtrip(req: dict) -> dict:
    """A tiny Llama: HF weights -> Megatron (import_ckpt's path: to_megatron_model on CPU, gloo world of 1)
    -> Megatron torch_dist checkpoint -> HF (export_ckpt) and compare every tensor; plus logits of the
    Megatron model vs the HF model on the same tokens."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    work = Path(req["workdir"])
    hf_dir, meg_dir, back_dir = work / "hf", work / "megatron", work / "hf_back"
    torch.manual_seed(0)
    cfg = LlamaConfig(**req["llama"])
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    hf.save_pretrained(hf_dir)
    steps, res = [], {}

    from megatron.bridge import AutoBridge

    def step(name, fn):
        try:
            r = fn()
            steps.append({"step": name, "ok": True})
            return r
        except Exception as exc:
            steps.append({"step": name, "ok": False, **_err(exc), "trace": traceback.format_exc()[-3000:]})
            raise

    try:
        step("AutoBridge.import_ckpt (as shipped)", lambda: AutoBridge.import_ckpt(str(hf_dir), str(meg_dir)))
    except Exception:
        pass
    try:
        if not meg_dir.exists():
            # import_ckpt's own calls (to_megatron_provider -> finalize -> provide_distributed_model(
            # wrap_with_ddp=False, use_cpu_initialization=True) -> save_megatron_model), with the one change
            # CPU needs: the TE-only fusions off. A gloo world of one, Megatron's model-parallel groups of 1.
            from megatron.core import parallel_state as ps

            if not dist.is_initialized():
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{req.get('port', 29517)}",
                                        rank=0, world_size=1)
            ps.initialize_model_parallel(1, 1)
            bridge = AutoBridge.from_hf_pretrained(str(hf_dir))
            provider = bridge.to_megatron_provider(load_weights=True)
            provider.apply_rope_fusion = False
            for fused in ("gradient_accumulation_fusion", "persist_layer_norm", "masked_softmax_fusion",
                          "bias_activation_fusion", "bias_dropout_fusion", "cross_entropy_loss_fusion"):
                if getattr(provider, fused, False):
                    res.setdefault("fusions_turned_off", []).append(fused)
                    setattr(provider, fused, False)
            # Bridge's default_layer_spec is always the TE spec; Bridge ships local_layer_spec for no-TE.
            from megatron.bridge.models.gpt_provider import local_layer_spec

            res["default_layer_spec"] = getattr(provider.transformer_layer_spec, "__name__", "?")
            provider.transformer_layer_spec = local_layer_spec
            step("finalize", provider.finalize)
            models = step("provide_distributed_model(cpu)", lambda: provider.provide_distributed_model(
                wrap_with_ddp=False, use_cpu_initialization=True, init_model_with_meta_device=False))
            m = models[0].eval()
            ids = torch.tensor([list(range(3, 3 + req.get("tokens", 12)))])
            try:  # logits: Megatron on CPU vs HF (megatron-core's RoPE moves inv_freq to CUDA unconditionally)
                with torch.no_grad():
                    pos = torch.arange(ids.shape[1]).unsqueeze(0)
                    mlog = step("megatron forward", lambda: m(input_ids=ids, position_ids=pos, attention_mask=None))
                    hlog = hf(input_ids=ids).logits
                res["logits_max_abs_diff"] = float((mlog.float() - hlog.float()).abs().max())
            except Exception:
                pass
            # In memory, Megatron -> HF with Bridge's real conversion (export_ckpt's inner step), every tensor.
            exported = step("export_hf_weights(cpu)", lambda: dict(
                (name, t.detach().clone()) for name, t in bridge.export_hf_weights(models, cpu=True,
                                                                                   show_progress=False)))
            a = hf.state_dict()
            res["inmemory_tensors"] = len(a)
            res["inmemory_missing"] = sorted(set(a) - set(exported))
            res["inmemory_unexpected"] = sorted(set(exported) - set(a))
            res["inmemory_unequal"] = [k for k in a if k in exported and not torch.equal(a[k], exported[k].to(a[k].dtype))]
            try:
                step("save_megatron_model", lambda: bridge.save_megatron_model(models, str(meg_dir)))
            except Exception:
                pass
            ps.destroy_model_parallel()
            dist.destroy_process_group()
        if not meg_dir.exists():
            raise RuntimeError("no Megatron checkpoint was written; export_ckpt not attempted")
        res["megatron_files"] = sorted(str(p.relative_to(meg_dir)) for p in meg_dir.rglob("*") if p.is_file())[:40]
        bridge = AutoBridge.from_hf_pretrained(str(hf_dir))
        step("export_ckpt", lambda: bridge.export_ckpt(str(meg_dir), str(back_dir), strict=True))
        back = AutoModelForCausalLM.from_pretrained(back_dir, dtype=torch.float32)
        a, b = hf.state_dict(), back.state_dict()
        res["tensors"] = len(a)
        res["missing"] = sorted(set(a) - set(b))
        res["unexpected"] = sorted(set(b) - set(a))
        res["max_abs_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a if k in b)
        res["unequal"] = [k for k in a if k in b and not torch.equal(a[k], b[k])]
    except Exception:
        pass
    res["steps"] = steps
    if dist.is_initialized():
        dist.destroy_process_group()
    return res


# ---- the recorded field table the login-node preflight checks keys and types against ---------------------
def _kind(annotation) -> str:
    """bool | int | float | str | any, from a dataclass field's annotation (a string under postponed evaluation)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    text = text.replace("typing.", "").replace(" ", "")
    for wrap in ("Optional[",):
        if text.startswith(wrap) and text.endswith("]"):
            text = text[len(wrap):-1]
    parts = [t for t in text.split("|") if t not in ("None", "NoneType")]
    return parts[0] if len(parts) == 1 and parts[0] in ("bool", "int", "float", "str") else "any"


def _dataclass_in(hint):
    """The dataclass type in an annotation like ``X``, ``X | None``, ``Optional[X]`` (else None)."""
    import typing

    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg
    return None


def _fields_of(cls, value, classes: dict) -> str:
    """Record ``cls``'s fields in ``classes`` (once per class name); a field holding a dataclass (its value's
    type, or the dataclass its annotation names when the value is None) is recorded as ``class:Name``."""
    import typing

    name = cls.__name__
    if name in classes:
        return name
    table: dict[str, str] = {}
    classes[name] = table
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        hints = {}
    for f in dataclasses.fields(cls):
        v = getattr(value, f.name, None) if value is not None else None
        sub = type(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else _dataclass_in(hints.get(f.name))
        table[f.name] = ("class:" + _fields_of(sub, v if type(v) is sub else None, classes)) if sub \
            else _kind(f.type)
    return name


def _sections(container, classes: dict) -> dict:
    import typing

    hints = typing.get_type_hints(type(container))
    out = {}
    for f in dataclasses.fields(container):
        v = getattr(container, f.name)
        sub = type(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else _dataclass_in(hints.get(f.name))
        out[f.name] = ("class:" + _fields_of(sub, v if type(v) is sub else None, classes)) if sub else _kind(f.type)
    return out


def op_fields(req: dict) -> dict:
    """For each Bridge model and recipe mode: the ConfigContainer's sections and, per dataclass, every field with
    its kind. Written to src/pipeline/config/bridge_fields.json; the harness checks the file equals this."""
    from pipeline import bridge as pb
    from pipeline.config.models import REGISTRY

    classes: dict = {}
    recipes: dict = {}
    for spec in REGISTRY.values():
        if not spec.trains_on.bridge_rules:
            continue
        for rmode, peft in (("pretrain", None), ("sft", None), ("peft", "lora")):
            recipe = pb._import(spec.recipe_module, spec.recipe_function.format(mode=rmode))
            container = recipe(peft_scheme=peft) if peft else recipe()
            recipes[f"{spec.name}/{rmode}"] = _sections(container, classes)
    return {"table": {"bridge": "megatron-bridge==0.6.2", "recipes": recipes,
                      "classes": {k: dict(sorted(v.items())) for k, v in sorted(classes.items())}}}


# ---- f: our packed Parquet through Bridge's own packed-SFT reader and collate ----------------------------------
def op_packed_read(req: dict) -> dict:
    """Bridge's GPTSFTPackedParquetDataset + collate_fn on our file: for every pack, the label ids Bridge trains on
    (loss_mask 1), cut at its cu_seqlens (one list per packed sequence). The tokenizer stands in with the ids Bridge
    reads from it (eos_id: padding and its eos masking)."""
    import types

    import torch
    from megatron.bridge.data.packing.parquet import GPTSFTPackedParquetDataset

    tok = types.SimpleNamespace(eos_id=req["eos_id"], bos_id=req.get("bos_id"), pad_id=req["eos_id"],
                                space_sensitive=False)
    ds = GPTSFTPackedParquetDataset(file_path=req["path"], tokenizer=tok, max_seq_length=req["seq_length"],
                                    prompt_template="{input} {output}", label_key="output", truncation_field="input")
    seqs = []
    for i in range(len(ds)):
        b = ds.collate_fn([ds[i]])
        labels, mask = b["labels"][0], b["loss_mask"][0]
        cu = b["cu_seqlens_q"][0].tolist()
        for a, e in zip(cu[:-1], cu[1:]):
            if e > a:
                seqs.append(labels[a:e][mask[a:e] > 0].to(torch.int64).tolist())
    return {"rows": len(ds), "sequences": seqs}


# ---- g: the suite's Bridge callback through Bridge's real callback machinery (issue 32, items 4 and 6) ----------
def op_step_records(req: dict) -> dict:
    """The engine's RankHooks (built before pretrain(), as run_rank does) behind pipeline.bridge.make_callback, fired
    through Bridge's real CallbackManager (normalize_callbacks, as pretrain() builds it) with real CallbackContext,
    GlobalState and TrainState, in the order bridge/training/train.py fires them:

        while global_state.train_state.step < train_config.train_iters:
            checkpoint_manager.finalize_async_saves(state=global_state, blocking=False)
            ...
            if should_fire(callback_manager, "on_train_step_start"):
                callback_manager.fire("on_train_step_start", CallbackContext(state=global_state, ...))
            ... = wrapped_train_step(...)
            if should_fire(callback_manager, "on_train_step_end"):
                callback_manager.fire("on_train_step_end", CallbackContext(..., loss_dict=loss_dict, grad_norm=...))
            ...
            global_state.train_state.step += 1
            ...
            should_exit = checkpoint_and_decide_exit(...)   # signal -> save, exit; step % save_interval -> save
            if should_exit:
                break
        if not should_exit: ... save_checkpoint_and_time(...)   # the final save (step % save_interval != 0)
        checkpoint_manager.finalize_async_saves(state=global_state, blocking=True, terminate=True)

    ``global_state.cfg = config`` is Bridge's own setup step that installs its DistributedSignalHandler
    (state.py, the cfg setter), and checkpoint_and_decide_exit's test is the real
    ``state.signal_handler.signals_received()``. checkpointing.save_checkpoint adds, in this order,
    train_state_finalize_fn (rank 0 writes the tracker) and fire_callback ("on_checkpoint_save") to the save's
    AsyncRequest when checkpoint.async_save (run at finalisation), else calls them at once; the real AsyncRequest
    holds them here.

    Stand-ins for CUDA-only calls: the train step (a loss of 3.0 - 0.1 * step, grad norm 1.0), the optimizer (its
    param_groups), the checkpoint writer (an empty iter_* folder; the tracker through the suite's layout helper) and
    the async worker's completion (a save is finalised two steps after it was scheduled)."""
    import time
    import types

    import torch
    from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config
    from megatron.bridge.training.callbacks import CallbackContext, normalize_callbacks, should_fire
    from megatron.bridge.training.state import GlobalState, TrainState
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    from pipeline import bridge as pb
    from pipeline.common import layout
    from pipeline.training import goodput, records
    from pipeline.training.engines.megatron_bridge import RankHooks

    run_dir = Path(req["run_dir"])
    save = run_dir / "checkpoints"
    iters, interval = req["iters"], req.get("save_interval")
    config = vanilla_gpt_pretrain_config()
    config.train.train_iters = iters
    config.train.exit_signal_handler = True
    config.checkpoint.save, config.checkpoint.save_interval = str(save), interval
    config.checkpoint.async_save = bool(req.get("async_save"))
    if req.get("request_early"):  # the time-limit request is already there when the rank starts
        (run_dir / records.SAVE_AND_EXIT).write_text("")
    progress = records.ProgressLog(run_dir, tokens_per_step=8, writer=True)
    hooks = RankHooks(run_dir, config, progress, writer=True, poll=0.05)
    time.sleep(0.5)  # pretrain()'s setup before the state gets its config (model, optimizer, data)
    fired_before_handler = hooks.watcher.fired.is_set()

    gs = GlobalState()
    gs.cfg = config  # installs Bridge's DistributedSignalHandler for train.exit_signal
    gs.train_state = TrainState()
    manager = normalize_callbacks([pb.make_callback(on_step=hooks.step_end, on_step_start=hooks.step_start,
                                                    on_save=hooks.save)])
    optimizer = types.SimpleNamespace(param_groups=[{"lr": 1e-4, "is_decoupled_lr": False}])

    def ctx(**kw):
        return CallbackContext(state=gs, model=[], user_state=manager.user_state, optimizer=optimizer, **kw)

    pending: list = []

    def save_checkpoint():
        step = gs.train_state.step
        layout.iter_dir(save, step).mkdir(parents=True, exist_ok=True)

        def train_state_finalize_fn():
            layout.write_tracker(save, step)

        def fire_callback():
            manager.fire("on_checkpoint_save", CallbackContext(state=gs, model=[], user_state=manager.user_state,
                                                               optimizer=optimizer))

        if config.checkpoint.async_save:
            request = AsyncRequest(async_fn=None, async_fn_args=(), finalize_fns=[])
            request.add_finalize_fn(train_state_finalize_fn)
            if should_fire(manager, "on_checkpoint_save"):
                request.add_finalize_fn(fire_callback)
            pending.append((step, request))
        else:
            train_state_finalize_fn()
            if should_fire(manager, "on_checkpoint_save"):
                fire_callback()

    def finalize_async_saves(blocking: bool):
        while pending and (blocking or gs.train_state.step - pending[0][0] >= 2):
            for fn in pending.pop(0)[1].finalize_fns:
                fn()

    should_exit = False
    while gs.train_state.step < iters:
        finalize_async_saves(blocking=False)
        if should_fire(manager, "on_train_step_start"):
            manager.fire("on_train_step_start", ctx())
        t0 = time.monotonic()  # the step's compute: long enough for the watcher's poll
        while req.get("request_early") and not hooks.watcher.fired.is_set() and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        time.sleep(0.05)
        loss = torch.tensor(3.0 - 0.1 * gs.train_state.step)
        if should_fire(manager, "on_train_step_end"):
            manager.fire("on_train_step_end", ctx(loss_dict={"lm loss": loss}, grad_norm=1.0, skipped_iter=False))
        gs.train_state.step += 1
        if any(gs.signal_handler.signals_received()):  # checkpoint_and_decide_exit
            save_checkpoint()
            should_exit = True
            break
        if interval and gs.train_state.step % interval == 0:
            save_checkpoint()
    if not should_exit and gs.train_state.step != 0 and interval != 0 and (
            interval is None or gs.train_state.step % interval != 0):
        save_checkpoint()
    finalize_async_saves(blocking=True)
    hooks.stop()
    return {"fired_before_handler": fired_before_handler, "should_exit": should_exit,
            "progress_steps": [r["step"] for r in progress.records()],
            "events": [[e["event"], e.get("step")] for e in goodput.read_events(run_dir)
                       if e["event"] in ("step", "save")],
            "tracker": layout.read_tracker(save)}


# ---- h: megatron-core's own NaN/Inf error, as the engine sees it (issue 32, item 7) ----------------------------
def op_nan_message(req: dict) -> dict:
    """Bridge's real masked_next_token_loss (the GPT step's loss function) on a NaN and an Inf loss, through
    megatron-core's real RerunStateMachine (reruns disabled, Bridge's default): the RuntimeError it raises, and
    whether pipeline.bridge.is_nonfinite_failure recognises it. Stand-in for a CUDA-only call:
    torch.cuda.current_device (validate_result puts the device in its message; CPU torch has none) returns 0."""
    import torch
    from megatron.bridge.training.losses import masked_next_token_loss

    from pipeline import bridge as pb

    torch.cuda.current_device = lambda: 0
    out = {}
    for name, bad in (("nan", float("nan")), ("inf", float("inf")), ("finite", 1.0)):
        try:
            masked_next_token_loss(torch.ones(4), torch.tensor([1.0, bad, 2.0, 3.0]))
            out[name] = {"raised": False}
        except Exception as exc:
            out[name] = {"raised": True, "type": type(exc).__name__, "message": str(exc),
                         "recognised": pb.is_nonfinite_failure(exc)}
    return out


# ---- j: Bridge's torch-profiler schedule: which steps it records (issue 35) ------------------------------------
def op_profiling_window(req: dict) -> dict:
    """Bridge 0.6.2's own profiler functions (megatron/bridge/training/profiling.py: initialize_pytorch_profiler,
    handle_profiling_step, handle_profiling_stop) in train.py's order: prof.start() before the loop; per iteration
    handle_profiling_step(step) at its start, the step's work (here a range named after the 1-based iteration and
    a tiny matmul, a stand-in for train_step), step += 1, handle_profiling_stop(step). The trace Bridge's handler
    writes (<tensorboard_dir>/../torch_profile/rank-0.json.gz) is read back for the iterations it holds."""
    import gzip

    import torch
    import torch.distributed as dist
    from megatron.bridge.training.config import ProfilingConfig
    from megatron.bridge.training.profiling import (
        handle_profiling_step,
        handle_profiling_stop,
        initialize_pytorch_profiler,
    )

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{req['port']}", rank=0, world_size=1)
    out = []
    for w in req["windows"]:
        cfg = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=w["start"], profile_step_end=w["end"],
                              profile_ranks=[0])
        cfg.finalize()
        tb = Path(w["tensorboard_dir"])
        prof = initialize_pytorch_profiler(cfg, str(tb))
        prof.start()
        step = 0
        while step < req["iters"]:
            handle_profiling_step(cfg, step, 0, prof)
            with torch.profiler.record_function(f"iteration_{step + 1}"):
                torch.ones(8, 8) @ torch.ones(8, 8)
            step += 1
            handle_profiling_stop(cfg, step, 0, prof, None)
        trace = tb / ".." / "torch_profile" / "rank-0.json.gz"
        recorded = []
        if trace.is_file():
            with gzip.open(trace, "rt") as f:
                events = json.load(f)["traceEvents"]
            recorded = sorted({int(e["name"].split("_")[1]) for e in events
                               if str(e.get("name", "")).startswith("iteration_")})
        out.append({"start": w["start"], "end": w["end"], "recorded": recorded, "trace": os.path.normpath(trace),
                    "written": trace.is_file()})
    return {"windows": out}


# ---- k: megatron-core's hybrid layer allocation and head rules, against the planner's statement of them (issue 34) -
def op_shape_rules(req: dict) -> dict:
    """megatron-core 0.19.2's own select_pipeline_segment (models/hybrid/hybrid_layer_allocation.py) for each case
    (pattern, pp, first/last stage layers) on every pipeline rank: the layers each rank builds, or the error it raises.
    A stand-in pipeline group answers torch.distributed.get_rank / get_world_size for it (no process group on CPU),
    and the per-stage log lines are silenced. And TransformerConfig.__post_init__ on each (heads, KV heads, tp)."""
    import torch
    from megatron.core.models.hybrid import hybrid_layer_allocation as hla
    from megatron.core.transformer.transformer_config import TransformerConfig

    class Group:
        def __init__(self, rank, size):
            self.rank, self.size = rank, size

    real_rank, real_size = torch.distributed.get_rank, torch.distributed.get_world_size
    torch.distributed.get_rank = lambda g=None: g.rank if isinstance(g, Group) else real_rank(g)
    torch.distributed.get_world_size = lambda g=None: g.size if isinstance(g, Group) else real_size(g)
    hla.log_on_each_pipeline_stage = hla.log_single_rank = lambda *a, **k: None
    splits = []
    try:
        for case in req["splits"]:
            ranks, error = [], None
            for r in range(case["pp"]):
                try:
                    layers, offset = hla.select_pipeline_segment(case["pattern"], Group(r, case["pp"]), None,
                                                                 first_stage_layers=case.get("first"),
                                                                 last_stage_layers=case.get("last"))
                    ranks.append([offset, len(layers)])
                except ValueError as exc:
                    error = str(exc)
                    break
            splits.append({**case, "ranks": None if error else ranks, "error": error})
    finally:
        torch.distributed.get_rank, torch.distributed.get_world_size = real_rank, real_size
    heads = []
    for case in req["heads"]:
        try:
            TransformerConfig(num_layers=4, hidden_size=case["heads"] * 8, num_attention_heads=case["heads"],
                              num_query_groups=case["kv"], tensor_model_parallel_size=case["tp"],
                              use_cpu_initialization=True)
            heads.append({**case, "error": None})
        except ValueError as exc:
            heads.append({**case, "error": str(exc)})
    return {"splits": splits, "heads": heads}


def op_data_source(req: dict) -> dict:
    """pipeline.bridge.one_data_source on the real recipe's dataset config (``model``/``mode``), for each case's named
    fields (``named``; ``set``: values to give the dataset first, as a base config would): the fields cleared, the
    sources left, and Bridge's own ``validate()`` of the dataset section after it (its ``finalize()`` for GPT)."""
    import copy

    from pipeline import bridge as pb
    from pipeline.common.errors import UserError
    from pipeline.config.models import get_model

    spec = get_model(req["model"])
    base = pb._import(spec.recipe_module, spec.recipe_name(req["mode"], None))().dataset
    out = {"groups": [list(g) for g in pb.data_source_groups(base)], "cases": []}
    for case in req["cases"]:
        ds = copy.deepcopy(base)
        for k, v in case.get("set", {}).items():
            if k == "hf_dataset":
                from megatron.bridge.data.sources.hf import HFDatasetSourceConfig

                v = HFDatasetSourceConfig(**v)
            setattr(ds, k, v)
        try:
            cleared = pb.one_data_source(ds, set(case["named"]))
        except UserError as exc:
            out["cases"].append({"refused": str(exc)})
            continue
        check = ds.validate if hasattr(ds, "validate") else ds.finalize
        try:
            check()
            valid = None
        except Exception as exc:
            valid = _err(exc)["error"]
        out["cases"].append({"cleared": cleared, "invalid": valid,
                             "left": {n: _norm(getattr(ds, n)) for g in pb.data_source_groups(ds) for n in g}})
    return out


def op_gpu_packages(req: dict) -> dict:
    """pipeline.bridge.recipe_gpu_packages on the real recipes, per (model, mode): the top-level modules selected."""
    from pipeline import bridge as pb

    out = {}
    for model, mode in req["recipes"]:
        out[f"{model} {mode}"] = sorted({p.module.split(".")[0] for p in pb.recipe_gpu_packages([(model, mode)])})
    return {"packages": out}


OPS = {"data_source": op_data_source, "gpu_packages": op_gpu_packages, "fields": op_fields, "build_config": op_build_config, "overrides": op_overrides, "load_paths": op_load_paths,
       "roundtrip": op_roundtrip, "packed_read": op_packed_read, "step_records": op_step_records,
       "nan_message": op_nan_message, "profiling_window": op_profiling_window, "shape_rules": op_shape_rules}


def main() -> int:
    req = json.load(sys.stdin)
    results = []
    for o in req["ops"]:
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                r = OPS[o["op"]](o)
        except Exception as exc:
            r = {**_err(exc), "trace": traceback.format_exc()[-4000:]}
        r["op"] = o["op"]
        r["id"] = o.get("id")
        results.append(r)
        sys.stderr.write(log.getvalue()[-2000:])
    print(json.dumps({"results": results}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
