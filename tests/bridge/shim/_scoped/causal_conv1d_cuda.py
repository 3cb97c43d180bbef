# IMPORT SHIM (Bridge harness only): a stand-in for causal-conv1d's CUDA extension, which its cpp_functions module
# imports unguarded. Its kernels never run here: the megatron_cpu tier maps causal_conv1d_fn onto causal-conv1d's own
# reference (tests/megatron_cpu/standin). Calling anything here raises. No test assertion may rest on this shim.


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise RuntimeError(f"causal_conv1d_cuda.{name}: a CUDA kernel, not built on this CPU-only machine")
