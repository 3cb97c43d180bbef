# IMPORT SHIM (Bridge harness only): a stand-in for Triton so that megatron-core modules that define
# Triton kernels at import time can be imported on CPU. The kernels are never launched; calling one
# raises. No test assertion may rest on anything this shim provides.
__version__ = "0.0.0+harness-shim"


def jit(fn=None, **_kwargs):
    if fn is None:
        return lambda f: f
    return fn


def autotune(configs=(), key=(), **_kwargs):
    """Keeps the configs on the kernel, as Triton's Autotuner does (mamba-ssm reads ``kernel.configs`` at import)."""
    def wrap(fn):
        fn.configs = list(configs)
        return fn
    return wrap


heuristics = lambda *a, **k: (lambda f: f)  # noqa: E731


class Config:
    """triton.Config's fields as Triton defines them (mamba-ssm's modules prune their autotune configs by num_warps
    at import)."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = dict(args[0]) if args else dict(kwargs.get("kwargs") or {})  # the meta-parameters
        self.num_warps = kwargs.get("num_warps", 4)
        self.num_stages = kwargs.get("num_stages", 3)
        self.num_ctas = kwargs.get("num_ctas", 1)
        self.maxnreg = kwargs.get("maxnreg")
        self.pre_hook = kwargs.get("pre_hook")


def set_allocator(_fn):
    """Triton's scratch allocator hook (mamba-ssm's Mamba-3 kernels register one at import); nothing allocates."""


def cdiv(a, b):
    return -(-a // b)


def next_power_of_2(n):
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
