# CUDA STAND-IN (the megatron_cpu test tier only; nothing of the suite imports it). It maps the handful of
# CUDA-only calls that stop megatron-core's and Megatron Bridge's model code on a CPU process onto the CPU, so the
# suite's own pipeline.bridge functions run Megatron's real model, parallel-state, checkpoint and conversion code
# on gloo. The tier's rule (decision 90; tests/unit/test_standin_kinds.py refuses any other kind): a stand-in either
#   [cuda]    maps a CUDA call onto the CPU (the same operation, on the CPU device), or
#   [kernel]  maps a GPU kernel onto its library's own reference implementation (the same math in torch).
# Anything else that fails on CPU is a finding to fix in the product (or to show impossible on the cluster), never
# a stand-in. Every patched call, its kind, and why:
#
#   [cuda]    torch.cuda.current_device()  -> "cpu": megatron-core asks it for the device of its global memory
#             buffer (dot_product_attention.py) and of RoPE's inv_freq (rotary_pos_embedding.py: moved
#             unconditionally)
#   [cuda]    torch.cuda.get_rng_state / set_rng_state / manual_seed (and torch.cuda.random's) -> the CPU
#             generator's state and seed: the model-parallel RNG tracker (tensor_parallel/random.py) forks CUDA
#             generator states
#   [cuda]    megatron.core.tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state -> the same, for the
#             tracker's own helpers (they index torch.cuda.default_generators)
#   [cuda]    megatron.core.transformer.utils.get_default_causal_mask -> the same mask built on the CPU (it
#             hard-codes device="cuda")
#   [cuda]    torch.zeros(..., device="cuda") in megatron.core.pipeline_parallel.schedules only -> device "cpu":
#             the schedules make their token counter on "cuda" by name
#   [cuda]    torch.cuda.synchronize() -> a no-op (nothing is queued on a CPU)
#   [kernel]  megatron.bridge.models.gpt_provider.transformer_engine_layer_spec -> Bridge's own local_layer_spec:
#             Bridge's default layer spec is always the Transformer Engine one (CUDA kernels); megatron-core's
#             local spec is the same math in torch
#   [kernel]  megatron.bridge.peft.utils.HAVE_TE, megatron.bridge.peft.module_matcher.HAVE_TE, HAVE_TE_COL_LINEAR,
#             HAVE_TE_LN_COL_LINEAR, HAVE_TE_ROW_LINEAR -> False: the layers are the local spec's (above), never
#             TE's; without Transformer Engine megatron-core still defines its TE classes over a MagicMock
#             (extensions/transformer_engine.py), so Bridge's LoRA transform would call isinstance(m, <MagicMock>)
#   [kernel]  GPTModelProvider.finalize: the CUDA-kernel fusions off (apply_rope_fusion, masked_softmax_fusion,
#             bias_activation_fusion, bias_dropout_fusion, gradient_accumulation_fusion, persist_layer_norm,
#             cross_entropy_loss_fusion): each is an apex/TE/Triton kernel; megatron-core's unfused path is its
#             reference in torch
#
# torch.cuda.is_available() stays False: code that chooses a device by it (the suite's, Bridge's) takes its CPU
# branch for real. The tier's sitecustomize chains the Bridge harness's import shim first (tests/bridge/shim: GPU
# kernel packages, Transformer Engine and Triton, and packages the image has, scoped to their unguarded importers;
# read its header). Bridge's training loop has its own stand-in, training_standin.py, and the hybrid family's
# Mamba kernels theirs, mamba_standin.py, under the same rule.
import os
import runpy

_BRIDGE_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bridge", "shim",
                            "sitecustomize.py")
runpy.run_path(_BRIDGE_SHIM)

import builtins  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

PATCHED: list[tuple[str, str]] = []  # (what was patched, its kind: "cuda" or "kernel"; see the header)
KINDS = ("cuda", "kernel")


def _patch(owner, name, value, label, kind):
    if kind not in KINDS:
        raise ValueError(f"stand-in {label}: kind {kind!r} is not one of {KINDS} (the tier's rule, in the header)")
    setattr(owner, name, value)
    PATCHED.append((label, kind))


def _cpu(device):
    if device is None:
        return device
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


_patch(torch.cuda, "current_device", lambda: "cpu", "torch.cuda.current_device", "cuda")
_patch(torch.cuda, "synchronize", lambda device=None: None, "torch.cuda.synchronize", "cuda")
_patch(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state(), "torch.cuda.get_rng_state", "cuda")
_patch(torch.cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state),
       "torch.cuda.set_rng_state", "cuda")
_patch(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed), "torch.cuda.manual_seed", "cuda")
_patch(torch.cuda.random, "get_rng_state", torch.cuda.get_rng_state, "torch.cuda.random.get_rng_state", "cuda")
_patch(torch.cuda.random, "set_rng_state", torch.cuda.set_rng_state, "torch.cuda.random.set_rng_state", "cuda")
_patch(torch.cuda.random, "manual_seed", torch.cuda.manual_seed, "torch.cuda.random.manual_seed", "cuda")

class _CpuTorch:
    """``torch`` as megatron-core's pipeline schedules see it: ``torch.zeros(..., device="cuda")`` made on the CPU,
    everything else torch itself (scoped to that one module: patching torch's own factories globally broke the
    meta-device loading of transformers)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return torch.zeros(*args, **kwargs)


def _after_import(module_name, fn):
    """Run ``fn(module)`` once ``module_name`` is imported (megatron is imported lazily by the suite)."""
    pending[module_name] = fn


pending: dict = {}


def _patch_random(m):
    _patch(m, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False:
           torch.get_rng_state().clone() if clone else torch.get_rng_state(),
           "megatron.core.tensor_parallel.random._get_cuda_rng_state", "cuda")
    _patch(m, "_set_cuda_rng_state", lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state),
           "megatron.core.tensor_parallel.random._set_cuda_rng_state", "cuda")


def _patch_tutils(m):
    _patch(m, "get_default_causal_mask", lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool(),
           "megatron.core.transformer.utils.get_default_causal_mask", "cuda")


_FUSIONS = ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
            "gradient_accumulation_fusion", "persist_layer_norm", "cross_entropy_loss_fusion")


def _patch_provider(m):
    _patch(m, "transformer_engine_layer_spec", m.local_layer_spec,
           "megatron.bridge.models.gpt_provider.transformer_engine_layer_spec", "kernel")
    finalize = m.GPTModelProvider.finalize

    def _finalize(self):
        for f in _FUSIONS:
            if getattr(self, f, False):
                setattr(self, f, False)
        return finalize(self)

    _patch(m.GPTModelProvider, "finalize", _finalize, "GPTModelProvider.finalize (CUDA fusions off)", "kernel")


def _patch_peft_utils(m):
    _patch(m, "HAVE_TE", False, "megatron.bridge.peft.utils.HAVE_TE", "kernel")


def _patch_module_matcher(m):
    for name in ("HAVE_TE", "HAVE_TE_COL_LINEAR", "HAVE_TE_LN_COL_LINEAR", "HAVE_TE_ROW_LINEAR"):
        _patch(m, name, False, f"megatron.bridge.peft.module_matcher.{name}", "kernel")


def _patch_schedules(m):
    _patch(m, "torch", _CpuTorch(), "megatron.core.pipeline_parallel.schedules: torch.zeros(device='cuda')", "cuda")


_after_import("megatron.core.tensor_parallel.random", _patch_random)
_after_import("megatron.core.pipeline_parallel.schedules", _patch_schedules)
_after_import("megatron.core.transformer.utils", _patch_tutils)
_after_import("megatron.bridge.models.gpt_provider", _patch_provider)
_after_import("megatron.bridge.peft.utils", _patch_peft_utils)
_after_import("megatron.bridge.peft.module_matcher", _patch_module_matcher)

# The hybrid (Mamba) family's kernels: their own stand-ins, each onto its library's reference (mamba_standin.py).
import mamba_standin  # noqa: E402

for _module, _hook in mamba_standin.HOOKS.items():
    _after_import(_module, _hook)

_prev_import = builtins.__import__


def _standin_import(name, globals=None, locals=None, fromlist=(), level=0):
    mod = _prev_import(name, globals, locals, fromlist, level)
    if pending:
        for key in [k for k in pending if k in sys.modules]:
            spec = getattr(sys.modules[key], "__spec__", None)
            if not getattr(spec, "_initializing", False):  # only once the module has finished loading
                pending.pop(key)(sys.modules[key])
    return mod


builtins.__import__ = _standin_import

# Bridge's training loop (pretrain()): its own stand-in, only when asked (tests/megatron_cpu/standin/training_standin.py).
if os.environ.get("MEGATRON_CPU_TRAINING") == "1":
    import training_standin  # noqa: F401
