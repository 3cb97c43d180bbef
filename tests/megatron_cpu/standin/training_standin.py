# CUDA STAND-IN FOR BRIDGE'S TRAINING LOOP (the megatron_cpu tier only, and only with MEGATRON_CPU_TRAINING=1:
# sitecustomize.py imports it then). It maps the CUDA-only calls that stop Megatron Bridge's pretrain() on a CPU
# process (gloo, no GPU) onto the CPU, so the suite's engine runs Bridge's real setup, training loop, exit-signal
# save-and-exit, checkpoint save/load and NaN check. The tier's rule (sitecustomize.py's header; decision 90): each
# patch is [cuda] (a CUDA call mapped onto the CPU) or [kernel] (a GPU kernel mapped onto its library's reference
# implementation). Every patched call, its kind, and why:
#
#   [cuda]    megatron.bridge.training.setup.initialize_megatron -> the same with allow_no_cuda=True: Bridge's own
#             switch for a CPU process (initialize.py:89 asserts torch.cuda.is_available() otherwise); with gloo
#             (dist.distributed_backend=gloo) and torch.cuda.device_count() == 0 Bridge takes its own CPU branches
#             (no set_device, no CUDA RNG seeding)
#   [cuda]    torch.<factory>(..., device="cuda") in the Bridge/megatron-core training modules listed in
#             _SCOPED_TORCH only -> device "cpu": those modules make their small bookkeeping tensors (start time,
#             loss sums, exit flags) on "cuda" by name, and Bridge's JIT warm-up (initialize.py:886,
#             _warmup_jit_function) its random inputs: the warm-up then runs megatron-core's torch.compile'd
#             bias+GeLU/SwiGLU and bias+dropout+add for real, on the CPU (Inductor's C++ backend); the factories
#             elsewhere (torch itself, transformers) are untouched
#   [cuda]    megatron.bridge.training.initialize._set_random_seed -> the same, then, with no CUDA device, the one
#             call it skips then (initialize.py:869, "if torch.cuda.device_count() > 0"): tensor_parallel.
#             model_parallel_cuda_manual_seed with the same seed and ranks, so the model-parallel RNG tracker has
#             its states (on the CPU generator: sitecustomize's RNG stand-ins); a GPU run seeds it there, and
#             megatron-core's weight init forks it (layers.py:177, _initialize_affine_weight_gpu)
#   [cuda]    torch.nn.Module.cuda(device) -> the module itself, unchanged, on a process without CUDA: Bridge's
#             get_model moves each model chunk to the current device (model_provider.py:689); on a CPU process the
#             tensors are already where they will run
#   [cuda]    torch.cuda.Stream / current_stream / default_stream / stream(...) / Event -> one in-order CPU
#             "stream" whose waits and records do nothing, and a null context: megatron-core's DDP wrapper builds
#             its buffers inside a side stream (training/models/dist_utils.py:303) and the grad/param buffers order
#             their collectives with stream waits; on a CPU process every op runs in program order
#   [cuda]    torch.Tensor.cuda(...) -> the tensor itself on a process without CUDA (as torch.nn.Module.cuda):
#             Bridge's get_batch (gpt_step.py:266), megatron-core's broadcast_data (tensor_parallel/data.py:84) and
#             the optimizer's state load (optimizer.py:586) move CPU tensors to "the GPU"
#   [cuda]    torch.Tensor.type() (no argument) -> "torch.cuda.<T>Tensor" for a CPU tensor, only while
#             megatron-core's mixed-precision optimizers sort their parameters (DistributedOptimizer.
#             _build_model_and_main_param_groups distrib_optimizer.py:401/466, DistributedOptimizer.__init__ :758,
#             Float16OptimizerWithFloat16Params.__init__ optimizer.py:1009/1028) and while
#             clip_grad_by_total_norm_fp32 asserts its fp32 grads (clip_grads.py:174): they tell 16-bit from 32-bit
#             parameters by the CUDA type's name; the dtype is the real one, only the device word is mapped
#   [kernel]  megatron.core.transformer.dot_product_attention.DotProductAttention.forward with packed sequences
#             (PackedSeqParams, qkv_format "thd": what Bridge's finetune step builds from the packs' cu_seqlens) ->
#             megatron-core's own unfused attention on the same tokens with the packs' document boundaries as its
#             mask (causal inside each cu_seqlens segment, nothing across): on the cluster TE's fused attention
#             (TEDotProductAttention) computes exactly that from cu_seqlens; megatron-core's local attention refuses
#             packed_seq_params. Real tokens' outputs equal attention over each document alone (the tier's
#             test_packed_attention_equals_each_document_alone); the rotary embedding's per-document positions
#             (apply_rotary_pos_emb's THD path) run for real
#
# Not stood in, run for real (decision 90): megatron-core's compile_helpers() (`make -C megatron/core/datasets`,
# initialize.py:147) finds the harness's prebuilt helpers up to date through the Makefile every install of
# megatron-core gets (src/pipeline/env/overlay.py); Bridge's unguarded `nvidia_resiliency_ext.inprocess` import
# (pretrain.py:19) loads the image's NVRx 0.6.0, installed in the harness (tests/bridge/megatron.txt).
# Left as it is: megatron-core's RNG tracker logs "CPU RNG state changed within GPU RNG context" at each weight
# init (tensor_parallel/random.py), since its "CUDA" generator is the CPU one here (sitecustomize's RNG stand-ins).
# Not stood in (the product's rule instead, pipeline.bridge.smoke_config): megatron-core's DistributedOptimizer
# with torch's Adam (no TE or Apex FusedAdam, as here) cannot load a checkpoint (distrib_optimizer.py:839).
import torch
from sitecustomize import _after_import, _cpu, _patch

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
    "megatron.bridge.training.utils.train_utils", "megatron.bridge.data.loaders", "megatron.bridge.training.initialize",
)


def _scope_torch(m):
    _patch(m, "torch", _CpuFactoriesTorch(m.__name__), f"{m.__name__}: torch.<factory>(device='cuda')", "cuda")


_OWN_PATCH = {"megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.optimizer",
              "megatron.bridge.training.initialize"}
for _name in _SCOPED_TORCH:
    if _name not in _OWN_PATCH:
        _after_import(_name, _scope_torch)


def _patch_setup(m):
    init = m.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return init(*args, **kwargs)

    _patch(m, "initialize_megatron", initialize_megatron,
           "megatron.bridge.training.setup.initialize_megatron(allow_no_cuda=True)", "cuda")
    _scope_torch(m)


_after_import("megatron.bridge.training.setup", _patch_setup)


def _patch_initialize(m):
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
           "megatron.bridge.training.initialize._set_random_seed (+ the model-parallel RNG tracker's seed)", "cuda")
    _scope_torch(m)  # the JIT warm-up's inputs (device="cuda") on the CPU: the warm-up itself runs for real


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
_patch(torch.cuda, "Stream", _CpuStream, "torch.cuda.Stream (the CPU's one stream)", "cuda")
_patch(torch.cuda, "Event", _CpuEvent, "torch.cuda.Event (recorded in program order)", "cuda")
_patch(torch.cuda, "current_stream", lambda device=None: _STREAM, "torch.cuda.current_stream", "cuda")
_patch(torch.cuda, "default_stream", lambda device=None: _STREAM, "torch.cuda.default_stream", "cuda")
_patch(torch.cuda, "stream", lambda stream=None: _STREAM, "torch.cuda.stream (a null context)", "cuda")

_module_cuda = torch.nn.Module.cuda


def _module_cuda_standin(self, device=None):
    return self if not torch.cuda.is_available() else _module_cuda(self, device)


_tensor_cuda = torch.Tensor.cuda


def _tensor_cuda_standin(self, *args, **kwargs):
    return self if not torch.cuda.is_available() else _tensor_cuda(self, *args, **kwargs)


_patch(torch.Tensor, "cuda", _tensor_cuda_standin, "torch.Tensor.cuda (the tensor itself, without CUDA)", "cuda")

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
           "DistributedOptimizer._build_model_and_main_param_groups (Tensor.type() CUDA names)", "cuda")
    _patch(cls, "__init__", _with_cuda_type_names(cls.__init__), "DistributedOptimizer.__init__ (Tensor.type())",
           "cuda")
    _scope_torch(m)


def _patch_optimizer(m):
    cls = m.Float16OptimizerWithFloat16Params
    _patch(cls, "__init__", _with_cuda_type_names(cls.__init__),
           "Float16OptimizerWithFloat16Params.__init__ (Tensor.type() CUDA names)", "cuda")
    _patch(m, "clip_grad_by_total_norm_fp32", _with_cuda_type_names(m.clip_grad_by_total_norm_fp32),
           "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32 (Tensor.type() CUDA names)", "cuda")
    _scope_torch(m)


_patch(torch.nn.Module, "cuda", _module_cuda_standin, "torch.nn.Module.cuda (the module itself, without CUDA)",
       "cuda")

_after_import("megatron.core.optimizer.distrib_optimizer", _patch_distrib_optimizer)
_after_import("megatron.core.optimizer.optimizer", _patch_optimizer)


def packed_mask(cu_seqlens, t: int):
    """[1, 1, t, t] attention mask (True: masked, megatron-core's convention) of ``t`` packed tokens whose documents
    the ``cu_seqlens`` offsets bound: each token attends to itself and the tokens before it in its own document."""
    pos = torch.arange(t)
    doc = torch.bucketize(pos, cu_seqlens.to(torch.long).flatten()[1:], right=True)
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    return (~allowed)[None, None]


def _patch_dot_product_attention(m):
    from megatron.core.transformer.enums import AttnMaskType

    cls = m.DotProductAttention
    forward = cls.forward

    def _forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                 packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        p = packed_seq_params
        cu = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
        # THD: [t, heads, dim]; megatron-core's attention takes [s, b=1, heads, dim] and returns [s, 1, hidden]
        mask = packed_mask(cu, query.size(0))
        return forward(self, query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, AttnMaskType.arbitrary,
                       attention_bias, None)

    _patch(cls, "forward", _forward, "DotProductAttention.forward (packed THD: the documents' causal mask)", "kernel")


_after_import("megatron.core.transformer.dot_product_attention", _patch_dot_product_attention)
