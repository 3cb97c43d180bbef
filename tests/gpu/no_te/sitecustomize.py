# NO-TRANSFORMER-ENGINE SHIM (the GPU ready check only, tests/gpu/device_check.sh; nothing of the suite imports it).
# device_check.sh puts this folder on PYTHONPATH only when `import transformer_engine` fails: a GPU Python with CUDA
# torch but without Transformer Engine (and maybe without Bridge's other unguarded GPU-only imports). On the cluster
# container (TE installed) it is never used. The model code runs on the GPU for real; only these change:
#
#   1. tests/bridge/shim/sitecustomize.py, chained first (read its header): scoped stand-ins for the packages
#      megatron-core / Bridge import unguarded at module level. Here PIPELINE_SHIM_ONLY (when not already set) names
#      only those this Python cannot find (importlib.util.find_spec), so a real triton, PIL... is used where present.
#   2. megatron.bridge.models.gpt_provider.transformer_engine_layer_spec -> Bridge's own local_layer_spec: Bridge's
#      default GPT layer spec is always the TE one; megatron-core's local spec is the same math in torch.
#   3. GPTModelProvider.finalize with the kernel fusions off: apply_rope_fusion, masked_softmax_fusion,
#      gradient_accumulation_fusion and persist_layer_norm are apex / TE kernels (absent here);
#      bias_activation_fusion, bias_dropout_fusion and cross_entropy_loss_fusion are megatron-core's jit_fuser
#      (torch.compile) kernels, which need Inductor's toolchain (Triton and a C compiler) that a bare GPU Python
#      need not have. The check tests the suite's flow on the GPU, not these kernels.
#
# Nothing of tests/megatron_cpu/standin is used: its other patches map CUDA calls onto the CPU.
import builtins
import importlib.util
import os
import runpy
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_BRIDGE_SHIM = os.path.join(_HERE, "..", "..", "bridge", "shim", "sitecustomize.py")
_STANDINS = ("triton", "transformer_engine", "multistorageclient", "ryml", "PIL", "diffusers", "modelopt")

if "PIPELINE_SHIM_ONLY" not in os.environ:
    os.environ["PIPELINE_SHIM_ONLY"] = ",".join(n for n in _STANDINS if importlib.util.find_spec(n) is None)
runpy.run_path(_BRIDGE_SHIM)

PATCHED: list[str] = []
_FUSIONS = ("apply_rope_fusion", "masked_softmax_fusion", "gradient_accumulation_fusion", "persist_layer_norm",
            "bias_activation_fusion", "bias_dropout_fusion", "cross_entropy_loss_fusion")
_PROVIDER = "megatron.bridge.models.gpt_provider"


def _patch_provider(m) -> None:
    m.transformer_engine_layer_spec = m.local_layer_spec
    PATCHED.append(f"{_PROVIDER}.transformer_engine_layer_spec -> local_layer_spec")
    finalize = m.GPTModelProvider.finalize

    def _finalize(self):
        for f in _FUSIONS:
            if getattr(self, f, False):
                setattr(self, f, False)
        return finalize(self)

    m.GPTModelProvider.finalize = _finalize
    PATCHED.append("GPTModelProvider.finalize (fusions off)")


_pending = {_PROVIDER: _patch_provider}
_prev_import = builtins.__import__


def _no_te_import(name, globals=None, locals=None, fromlist=(), level=0):
    mod = _prev_import(name, globals, locals, fromlist, level)
    if _pending:
        for key in [k for k in _pending if k in sys.modules]:
            spec = getattr(sys.modules[key], "__spec__", None)
            if not getattr(spec, "_initializing", False):  # once the module has finished loading
                _pending.pop(key)(sys.modules[key])
    return mod


builtins.__import__ = _no_te_import
