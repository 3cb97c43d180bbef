# CUDA STAND-IN FOR BRIDGE'S TRAINING LOOP (the megatron_cpu tier only, and only with MEGATRON_CPU_TRAINING=1:
# sitecustomize.py imports it then). It maps the CUDA-only calls that stop Megatron Bridge's pretrain() on a CPU
# process (gloo, no GPU) onto the CPU, so the suite's engine runs Bridge's real setup, training loop, exit-signal
# save-and-exit, checkpoint save/load and NaN check. Every patched call, and why:
#
#   megatron.bridge.training.setup.initialize_megatron -> the same with allow_no_cuda=True: Bridge's own switch
#         for a CPU process (initialize.py:89 asserts torch.cuda.is_available() otherwise); with gloo
#         (dist.distributed_backend=gloo) and torch.cuda.device_count() == 0 Bridge takes its own CPU branches
#         (no set_device, no CUDA RNG seeding)
#   torch.<factory>(..., device="cuda") in the Bridge/megatron-core training modules listed in _SCOPED_TORCH only
#         -> device "cpu": those modules make their small bookkeeping tensors (start time, loss sums, exit flags)
#         on "cuda" by name; the factories elsewhere (torch itself, transformers) are untouched
#   megatron.bridge.training.initialize.compile_helpers -> megatron-core's own helpers.cpp (the dataset index
#         builder) compiled for this Python by the same g++ line as megatron-core's Makefile (pybind11's headers
#         from torch), into MEGATRON_CPU_HELPERS_DIR (default /tmp/megatron_cpu_helpers), once per source; and
#         megatron.core.datasets.helpers_cpp imported from there on every rank. Not CUDA: the harness venv is
#         Python 3.11 and megatron-core 0.19.2's wheel ships helpers_cpp for CPython 3.12 only and no Makefile, so
#         its compile_helpers (core/datasets/utils.py:27, "make -C", initialize.py:147) fails and exits
#   megatron.bridge.training.initialize._warmup_jit_function -> a no-op: it runs the JIT-fused bias+GeLU/SwiGLU and
#         bias+dropout+add on random "cuda" tensors only to warm their compile caches, and throws the results away
#         (initialize.py:884, from set_jit_fusion_options, setup.py:276); the fusions are off here (the tier's
#         GPTModelProvider.finalize), so the model never calls those functions
#   megatron.bridge.training.initialize._set_random_seed -> the same, then, with no CUDA device, the one call it
#         skips then (initialize.py:869, "if torch.cuda.device_count() > 0"): tensor_parallel.
#         model_parallel_cuda_manual_seed with the same seed and ranks, so the model-parallel RNG tracker has its
#         states (on the CPU generator: sitecustomize's RNG stand-ins); a GPU run seeds it there, and
#         megatron-core's weight init forks it (layers.py:177, _initialize_affine_weight_gpu)
#   torch.nn.Module.cuda(device) -> the module itself, unchanged, on a process without CUDA: Bridge's get_model
#         moves each model chunk to the current device (model_provider.py:689); on a CPU process the tensors are
#         already where they will run
#   torch.cuda.Stream / current_stream / stream(...) / Event -> one in-order CPU "stream" whose waits and
#         records do nothing, and a null context: megatron-core's DDP wrapper builds its buffers inside a side
#         stream (training/models/dist_utils.py:303) and the grad/param buffers order their collectives with
#         stream waits; on a CPU process every op runs in program order, so there is nothing to wait for
#   torch.Tensor.cuda(...) -> the tensor itself on a process without CUDA (as torch.nn.Module.cuda): Bridge's
#         get_batch (gpt_step.py:266), megatron-core's broadcast_data (tensor_parallel/data.py:84) and the
#         optimizer's state load (optimizer.py:586) move CPU tensors to "the GPU"
#   torch.Tensor.type() (no argument) -> "torch.cuda.<T>Tensor" for a CPU tensor, only while megatron-core's mixed-
#         precision optimizers sort their parameters (DistributedOptimizer._build_model_and_main_param_groups
#         distrib_optimizer.py:401/466, DistributedOptimizer.__init__ :758, Float16OptimizerWithFloat16Params.
#         __init__ optimizer.py:1009/1028) and while clip_grad_by_total_norm_fp32 asserts its fp32 grads
#         (clip_grads.py:174, as optimizer.py names it): they tell 16-bit from 32-bit parameters by the CUDA
#         type's name and refuse any other; the dtype is the real one, only the device word is mapped
#
# And one import (not CUDA, an absent package), in the harness shim's way (scoped to its one importer, never left
# in sys.modules):
#   nvidia_resiliency_ext.inprocess.CallWrapper, for megatron.bridge.training.pretrain only -> a stand-in class:
#         pretrain.py:19 imports it unguarded for a type annotation; its one user, in-process restart
#         (inprocess_restart.enabled), is off
#
# Left as it is: megatron-core's RNG tracker logs "CPU RNG state changed within GPU RNG context" at each weight
# init (tensor_parallel/random.py), since its "CUDA" generator is the CPU one here (sitecustomize's RNG stand-ins).
# Not stood in (a test-side setting instead, tests/megatron_cpu/test_bridge_pretrain_cpu.py): megatron-core's
# DistributedOptimizer with torch's Adam cannot load a checkpoint (distrib_optimizer.py:839).
import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import types

import torch
from sitecustomize import PATCHED, _after_import, _cpu, _patch

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "zeros_like",
              "ones_like", "empty_like", "full_like", "as_tensor")


class _CpuFactoriesTorch:
    """``torch`` as one training module sees it: the tensor factories with a CUDA device make the tensor on the CPU,
    everything else is torch itself."""

    def __init__(self, where: str):
        self._where = where  # the module it stands in for (repr, debugging)

    def __repr__(self):
        return f"<torch, CUDA factories on the CPU, for {self._where}>"

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args, _f=value, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu(kwargs["device"])
                return _f(*args, **kwargs)
            return factory
        return value


_SCOPED_TORCH = (  # the modules that name "cuda" in a factory on the training path (setup: in _patch_setup)
    "megatron.core.optimizer.grad_scaler", "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer", "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.rerun_state_machine", "megatron.core.utils", "megatron.core.tensor_parallel.data",
    "megatron.core.dist_checkpointing.exchange_utils", "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.bridge.training.checkpointing", "megatron.bridge.training.eval", "megatron.bridge.training.train",
    "megatron.bridge.training.utils.train_utils", "megatron.bridge.data.loaders",
)


def _scope_torch(m):
    _patch(m, "torch", _CpuFactoriesTorch(m.__name__), f"{m.__name__}: torch.<factory>(device='cuda')")


_OWN_PATCH = {"megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.optimizer"}
for _name in _SCOPED_TORCH:
    if _name not in _OWN_PATCH:
        _after_import(_name, _scope_torch)


def _patch_setup(m):
    init = m.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return init(*args, **kwargs)

    _patch(m, "initialize_megatron", initialize_megatron,
           "megatron.bridge.training.setup.initialize_megatron(allow_no_cuda=True)")
    _scope_torch(m)


_after_import("megatron.bridge.training.setup", _patch_setup)


class _CallWrapper:
    """Stand-in for nvidia_resiliency_ext.inprocess.CallWrapper (an annotation in pretrain.py; never made)."""


_NVRX = {"nvidia_resiliency_ext", "nvidia_resiliency_ext.inprocess"}
_prev_import = builtins.__import__


def _training_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name in _NVRX and (globals or {}).get("__name__") == "megatron.bridge.training.pretrain":
        mod = types.ModuleType("nvidia_resiliency_ext.inprocess")
        mod.CallWrapper = _CallWrapper
        if name == "nvidia_resiliency_ext":
            pkg = types.ModuleType("nvidia_resiliency_ext")
            pkg.inprocess = mod
            return pkg
        return mod
    return _prev_import(name, globals, locals, fromlist, level)


builtins.__import__ = _training_import
PATCHED.append("nvidia_resiliency_ext.inprocess.CallWrapper (for megatron.bridge.training.pretrain)")


# ---- megatron-core's dataset helpers (helpers.cpp) for this Python --------------------------------------------
_HELPERS = "megatron.core.datasets.helpers_cpp"


def _helpers_source() -> str:
    spec = importlib.util.find_spec("megatron.core.datasets")
    return os.path.join(os.path.dirname(spec.origin), "helpers.cpp")


def _helpers_path() -> str:
    """MEGATRON_CPU_HELPERS_DIR/<the source's digest>/helpers_cpp<this Python's suffix>: one build per source."""
    import hashlib

    with open(_helpers_source(), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    folder = os.environ.get("MEGATRON_CPU_HELPERS_DIR", "/tmp/megatron_cpu_helpers")
    return os.path.join(folder, digest, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))


def _compile_helpers() -> None:
    """megatron-core's Makefile (g++ -O3 -Wall -shared -std=c++11 -fPIC, pybind11 includes) on its helpers.cpp."""
    out = _helpers_path()
    if os.path.exists(out):
        return
    src = _helpers_source()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"
    cmd = ["g++", "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
           f"-I{os.path.join(os.path.dirname(torch.__file__), 'include')}", src, "-o", tmp]
    if subprocess.run(cmd).returncode != 0:
        sys.exit("training stand-in: megatron-core's helpers.cpp did not compile")
    os.replace(tmp, out)  # atomic: a rank never loads a half-written library


class _HelpersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _HELPERS:
            return None
        if not os.path.exists(_helpers_path()):
            _compile_helpers()
        return importlib.util.spec_from_file_location(
            fullname, _helpers_path(), loader=importlib.machinery.ExtensionFileLoader(fullname, _helpers_path()))


sys.meta_path.insert(0, _HelpersFinder())


def _patch_initialize(m):
    _patch(m, "compile_helpers", _compile_helpers,
           "megatron.bridge.training.initialize.compile_helpers (helpers.cpp for this Python)")
    seed_fn = m._set_random_seed

    def _set_random_seed(seed_, data_parallel_random_init=False, te_rng_tracker=False, inference_rng_tracker=False,
                         use_cudagraphable_rng=False, *, pg_collection):
        seed_fn(seed_, data_parallel_random_init, te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng,
                pg_collection=pg_collection)
        if torch.cuda.device_count() == 0:  # the branch Bridge skips without a GPU, as it is written there
            current_rank = torch.distributed.get_rank()
            seed = seed_ + 100 * torch.distributed.get_group_rank(pg_collection.pp, current_rank)
            if data_parallel_random_init:
                seed += 10 * torch.distributed.get_group_rank(pg_collection.dp, current_rank)
            m.tensor_parallel.model_parallel_cuda_manual_seed(
                seed, te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng,
                tp_rank=m.get_pg_rank(pg_collection.tp), ep_rank=m.get_pg_rank(pg_collection.ep),
                etp_rank=m.get_pg_rank(pg_collection.expt_tp))

    _patch(m, "_set_random_seed", _set_random_seed,
           "megatron.bridge.training.initialize._set_random_seed (+ the model-parallel RNG tracker's seed)")
    _patch(m, "_warmup_jit_function", lambda model_config, micro_batch_size: None,
           "megatron.bridge.training.initialize._warmup_jit_function (a no-op)")


_after_import("megatron.bridge.training.initialize", _patch_initialize)

class _CpuStream:
    """The one in-order stream of a CPU process (torch.cuda.Stream's calls megatron-core makes, as no-ops)."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device, self.priority = torch.device("cpu"), priority

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuEvent:
    """torch.cuda.Event on a CPU process: every op before it is done when it is recorded."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        self._t = None

    def record(self, stream=None):
        import time
        self._t = time.perf_counter()

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1000.0 * ((end._t or 0.0) - (self._t or 0.0))


_STREAM = _CpuStream()
_patch(torch.cuda, "Stream", _CpuStream, "torch.cuda.Stream (the CPU's one stream)")
_patch(torch.cuda, "Event", _CpuEvent, "torch.cuda.Event (recorded in program order)")
_patch(torch.cuda, "current_stream", lambda device=None: _STREAM, "torch.cuda.current_stream")
_patch(torch.cuda, "default_stream", lambda device=None: _STREAM, "torch.cuda.default_stream")
_patch(torch.cuda, "stream", lambda stream=None: _STREAM, "torch.cuda.stream (a null context)")

_module_cuda = torch.nn.Module.cuda


def _module_cuda_standin(self, device=None):
    return self if not torch.cuda.is_available() else _module_cuda(self, device)


_tensor_cuda = torch.Tensor.cuda


def _tensor_cuda_standin(self, *args, **kwargs):
    return self if not torch.cuda.is_available() else _tensor_cuda(self, *args, **kwargs)


_patch(torch.Tensor, "cuda", _tensor_cuda_standin, "torch.Tensor.cuda (the tensor itself, without CUDA)")

_tensor_type = torch.Tensor.type


def _cuda_type_name(self, *args, **kwargs):
    name = _tensor_type(self, *args, **kwargs)
    if not args and not kwargs and self.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
        return "torch.cuda." + name[len("torch."):]
    return name


def _with_cuda_type_names(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        torch.Tensor.type = _cuda_type_name
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = _tensor_type
    return wrapper


def _patch_distrib_optimizer(m):
    cls = m.DistributedOptimizer
    build = cls.__dict__["_build_model_and_main_param_groups"].__func__
    _patch(cls, "_build_model_and_main_param_groups", classmethod(_with_cuda_type_names(build)),
           "DistributedOptimizer._build_model_and_main_param_groups (Tensor.type() CUDA names)")
    _patch(cls, "__init__", _with_cuda_type_names(cls.__init__), "DistributedOptimizer.__init__ (Tensor.type())")
    _scope_torch(m)


def _patch_optimizer(m):
    cls = m.Float16OptimizerWithFloat16Params
    _patch(cls, "__init__", _with_cuda_type_names(cls.__init__),
           "Float16OptimizerWithFloat16Params.__init__ (Tensor.type() CUDA names)")
    _patch(m, "clip_grad_by_total_norm_fp32", _with_cuda_type_names(m.clip_grad_by_total_norm_fp32),
           "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32 (Tensor.type() CUDA names)")
    _scope_torch(m)


_patch(torch.nn.Module, "cuda", _module_cuda_standin, "torch.nn.Module.cuda (the module itself, without CUDA)")

_after_import("megatron.core.optimizer.distrib_optimizer", _patch_distrib_optimizer)
_after_import("megatron.core.optimizer.optimizer", _patch_optimizer)
