# IMPORT SHIM (Bridge harness only): not Megatron Bridge, not its dependencies. It exists only so that
# `import megatron.bridge` succeeds on a CPU-only Python 3.11 machine. No test assertion may rest on
# anything this directory provides. The megatron_cpu tier chains it (tests/megatron_cpu/standin), so each scoped
# stand-in below is classified as the tier's stand-ins are (tests/unit/test_standin_kinds.py checks it):
#
#   [kernel]  triton: megatron-core's MoE and SSM op modules, and mamba-ssm's and causal-conv1d's Triton modules,
#             define Triton GPU kernels at import; the tier runs their torch paths or their libraries' references
#             (a kernel called through the stand-in runs as plain Python, never as Triton)
#   [kernel]  transformer_engine: Bridge's LoRA module imports TE's layer classes for its TE-layer branches; the
#             tier's layers are megatron-core's local (torch) ones
#   [kernel]  selective_scan_cuda, causal_conv1d_cuda: mamba-ssm's and causal-conv1d's CUDA extensions (the tier
#             installs both with their CUDA builds skipped), imported unguarded by their packages' interfaces; each
#             kernel megatron-core calls through them is mapped onto its library's reference
#             (tests/megatron_cpu/standin/mamba_standin.py), and calling the extension itself raises
#   [image]   multistorageclient, ryml, PIL, diffusers, modelopt: packages the cluster's image holds
#             (3rdparty/image-packages.txt: multi-storage-client, rapidyaml, pillow, diffusers, nvidia-modelopt), that
#             Bridge's and energon's modules import at module level for paths the tier does not run (object storage,
#             energon's YAML and image loaders, the diffusion models, quantization and distillation): on the
#             cluster each is the real package; here it is not installed
import builtins
import os
import sys
import typing

# 1. Megatron Bridge 0.6.2 declares Python >=3.12 and uses `typing.override` (new in 3.12); on 3.11 the
#    harness backports it from typing_extensions (same semantics: it only sets __override__).
if not hasattr(typing, "override"):
    from typing_extensions import override as _override

    typing.override = _override

# 2. Scoped stand-ins (directory _scoped/): a few modules of megatron-core / Bridge import a GPU-only
#    package unguarded (no try/except) at module level, only to define kernels or classes that never run
#    on CPU. Exactly those importers (table below) get the stand-in; everyone else, torch and the rest of
#    megatron-core included, still sees the package as not installed (torch probes `import triton`;
#    megatron-core probes `import transformer_engine` to choose TE or local layer specs). The stand-ins
#    are never left in sys.modules.
_SCOPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scoped")
_SCOPED = {
    # Triton kernels defined at import time (MoE paged stash, SSM ops).
    "triton": ("megatron.core.transformer.moe.ops.", "megatron.core.ssm.ops.", "mamba_ssm.ops.triton.",
               "causal_conv1d.causal_conv1d_varlen"),
    # mamba-ssm's and causal-conv1d's CUDA extensions (built only with their kernels; the tier installs both with
    # the kernel builds skipped), imported unguarded by their packages' interfaces.
    "selective_scan_cuda": ("mamba_ssm.ops.selective_scan_interface",),
    "causal_conv1d_cuda": ("causal_conv1d.cpp_functions",),
    # Bridge's LoRA module imports TE's pytorch API at module level (used only in TE-layer branches).
    "transformer_engine": ("megatron.bridge.peft.lora_layers",),
    # megatron-energon (Bridge's multimodal loader, imported by Bridge unguarded): its storage and
    # image/YAML backends.
    "multistorageclient": ("megatron.energon.",),
    "ryml": ("megatron.energon.",),
    "PIL": ("megatron.energon.", "megatron.bridge."),
    # Bridge's diffusion models (Flux, Wan), imported by megatron.bridge at package import.
    "diffusers": ("megatron.bridge.diffusion.",),
    # NVIDIA Model Optimizer (quantization/distillation), imported by Bridge's training modules.
    "modelopt": ("megatron.bridge.",),
}
# The container twin (tests/twin) has the real packages but Transformer Engine: PIPELINE_SHIM_ONLY names the
# stand-ins it takes (comma-separated); every other package is imported for real there.
if os.environ.get("PIPELINE_SHIM_ONLY") is not None:
    _SCOPED = {k: v for k, v in _SCOPED.items() if k in os.environ["PIPELINE_SHIM_ONLY"].split(",")}
_real_import = builtins.__import__


def _matches(name, top):
    return name == top or name.startswith(top + ".")


def _harness_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0:
        top = name.partition(".")[0]
        importers = _SCOPED.get(top)
        if importers and (globals or {}).get("__name__", "").startswith(importers):
            saved = {k: sys.modules.pop(k) for k in list(sys.modules) if _matches(k, top)}
            sys.path.insert(0, _SCOPED_DIR)
            try:
                return _real_import(name, globals, locals, fromlist, level)
            finally:
                sys.path.remove(_SCOPED_DIR)
                for k in [k for k in sys.modules if _matches(k, top)]:
                    del sys.modules[k]
                sys.modules.update(saved)
    return _real_import(name, globals, locals, fromlist, level)


builtins.__import__ = _harness_import
