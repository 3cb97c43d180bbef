# IMPORT SHIM (Bridge harness only): a stand-in for mamba-ssm's Mamba-1 selective-scan CUDA extension, which
# mamba_ssm's package init imports unguarded (ops/selective_scan_interface.py). The Mamba-2 mixers of the hybrid
# models never call it; calling anything here raises. No test assertion may rest on anything this shim provides.


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise RuntimeError(f"selective_scan_cuda.{name}: a CUDA kernel, not built on this CPU-only machine")
