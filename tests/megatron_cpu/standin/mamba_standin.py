# KERNEL STAND-INS FOR THE HYBRID (MAMBA) FAMILY (the megatron_cpu test tier only; loaded by sitecustomize.py). The
# tier installs mamba-ssm and causal-conv1d from their sdists with the CUDA builds skipped (tests/bridge/ssm.txt):
# their Python runs for real, their kernels (CUDA extensions, Triton) do not exist on a CPU. Under the tier's rule
# (decision 90; tests/unit/test_standin_kinds.py) each kernel megatron-core's MambaMixer calls is mapped onto its
# library's own reference implementation, the same math in torch; the adapters only carry the kernel's calling
# convention over (its argument names and layouts, the decode path's in-place state and batch indices), and anything
# a reference cannot do is refused, never approximated. Every patched call, its kind, and why:
#
#   [kernel]  megatron.core.ssm.mamba_mixer.mamba_split_conv1d_scan_combined (training: the fused conv + scan +
#             gate) -> mamba-ssm's own mamba_split_conv1d_scan_ref, packed sequences (seq_idx) each on its own
#             as the kernel computes them; initial or final states, which that reference does not take, are refused
#   [kernel]  mamba_ssm.ops.triton.ssd_combined.causal_conv1d_fn (what mamba_split_conv1d_scan_ref convolves with)
#             and megatron.core.ssm.mamba_mixer.causal_conv1d_fn (the prefill's conv) -> causal-conv1d's own
#             causal_conv1d_ref (seq_idx included)
#   [kernel]  mamba_ssm.ops.selective_scan_interface.selective_scan_fn (the CUDA selective scan that mamba-ssm's
#             ssd_selective_scan reference calls) -> mamba-ssm's own selective_scan_ref
#   [kernel]  megatron.core.ssm.mamba_mixer.mamba_chunk_scan_combined (the prefill's chunked SSD scan, with its final
#             state for decoding) -> mamba-ssm's own minimal SSD reference (modules/ssd_minimal.py:
#             ssd_minimal_discrete) with dt's bias, softplus and limits, the D skip and the z gate as the kernel
#             applies them (as ssd_chunk_scan_combined_ref does); varlen (cu_seqlens) and seq_idx are refused
#   [kernel]  mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn (the gated RMSNorm of the mixer) -> mamba-ssm's own
#             rms_norm_ref
#   [kernel]  megatron.core.ssm.mamba_mixer.causal_conv1d_update (decoding: megatron-core's Triton conv-state
#             update) -> causal-conv1d's own causal_conv1d_update_ref, over the batch rows the indices name
#   [kernel]  megatron.core.ssm.mamba_mixer.selective_state_update (decoding: megatron-core's Triton SSM-state
#             update) -> mamba-ssm's own selective_state_update_ref, one token at a time over the indices' rows
#
# The hybrid model itself (Bridge's NemotronH provider builds megatron-core's HybridModel):
#   [kernel]  megatron.bridge.models.hybrid.hybrid_provider.transformer_engine_hybrid_stack_spec (Bridge's default
#             hybrid stack: Transformer Engine layers) -> megatron-core's own local hybrid stack
#             (get_hybrid_stack_modelopt_spec with local core attention and remap_te_layernorm: the checkpoint keeps
#             the TE stack's key names, so a cluster's TE model loads what the tier writes), as the GPT family's
#             local_layer_spec
#   [kernel]  megatron.core.post_training.modelopt.hybrid.model_specs.Norm and
#             megatron.core.models.hybrid.hybrid_block.TENorm (TE's RMSNorm; the stack's final norm is TENorm
#             whatever the spec) -> megatron-core's WrappedTorchNorm (torch's RMSNorm)
#   [kernel]  HybridModelProvider.finalize: the CUDA-kernel fusions off, as GPTModelProvider's (sitecustomize.py),
#             and the MoE's: moe_permute_fusion, moe_router_fusion (TE's fused permute and router kernels: unfused
#             torch is their reference) and moe_grouped_gemm (TE's grouped GEMM: megatron-core's SequentialMLP runs
#             each expert's linears in torch, the same math; Bridge's NemotronH bridge maps both layouts)
#   [cuda]    torch.cuda.Stream/stream/current_stream/Event in megatron.core.transformer.moe.token_dispatcher,
#             shared_experts and moe_layer only -> torch.cpu's (a CPU stream whose record_event returns the
#             recorded Event, as a CUDA stream's does): the dispatcher's device-to-host copies and the shared
#             expert's overlap run on side streams
#   [cuda]    megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu (the split sizes' device-to-host
#             copy, which acts on CUDA tensors only) -> the same host copy of the CPU tensors that stand for them, as
#             numpy where asked: all_to_all (expert parallelism) takes the split sizes as a sequence of ints
#   [cuda]    megatron.bridge.training.model_load_save.temporary_distributed_context: Bridge's context (export_ckpt
#             loads in it) calls model_parallel_cuda_manual_seed(0) only where torch.cuda.is_available(); on the CPU
#             the same seeding of the (CPU-mapped) tracker, which MambaMixer.__init__ forks
#
# References that do not exist: none of megatron-core's own Triton ops under megatron/core/ssm/ops/ other than the two
# decode updates above is called by a tier case (ssd_combined's varlen scan serves dynamic-batching inference and
# speculative decoding's intermediate states: refused here, covered by the GPU tier, tests/gpu/device_check.sh).
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import repeat

PATCHED: list[tuple[str, str]] = []  # sitecustomize.PATCHED gets these too


def _patch(owner, name, value, label, kind):
    import sitecustomize

    sitecustomize._patch(owner, name, value, label, kind)
    PATCHED.append((label, kind))


class NotOnCPU(NotImplementedError):
    """What a reference cannot do: refused in one line (the GPU tier runs it)."""


# ---- adapters: the kernels' calling conventions onto the references ---------------------------------------------
def split_conv1d_scan(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
                      seq_idx=None, dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu",
                      rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                      ngroups=1, norm_before_gate=True):
    """mamba_split_conv1d_scan_combined on mamba_split_conv1d_scan_ref (same arguments, same result). Packed
    sequences (``seq_idx``: each position's sequence, as the kernel takes it) are what the kernel computes for them:
    each sequence on its own, its convolution and its state starting from zero, so the reference runs on each
    sequence's positions and the outputs are put back in place."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_split_conv1d_scan_ref

    if initial_states is not None or return_final_states:
        raise NotOnCPU("mamba_split_conv1d_scan_combined with initial or final states: its reference "
                       "(mamba_split_conv1d_scan_ref) takes neither")

    def ref(rows):
        return mamba_split_conv1d_scan_ref(rows, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                           dt_limit=dt_limit, activation=activation, rmsnorm_weight=rmsnorm_weight,
                                           rmsnorm_eps=rmsnorm_eps, outproj_weight=outproj_weight,
                                           outproj_bias=outproj_bias, headdim=headdim, ngroups=ngroups,
                                           norm_before_gate=norm_before_gate)

    if seq_idx is None:
        return ref(zxbcdt)
    out = []
    for b in range(zxbcdt.shape[0]):
        ids = seq_idx[b]
        starts = [0] + [t for t in range(1, ids.shape[0]) if ids[t] != ids[t - 1]] + [ids.shape[0]]
        out.append(torch.cat([ref(zxbcdt[b:b + 1, a:e]) for a, e in zip(starts, starts[1:])], dim=1))
    return torch.cat(out, dim=0)


def chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
               cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
               return_varlen_states=False):
    """mamba_chunk_scan_combined on ssd_minimal_discrete: x (b, l, h, p), dt (b, l, h), A (h,), B and C (b, l, g, n),
    D (h, p) or (h,), z (b, l, h, p); returns out (b, l, h, p) in x's dtype, and the final state (b, h, p, n) in
    float32 with ``return_final_states``."""
    from mamba_ssm.modules.ssd_minimal import ssd_minimal_discrete

    if seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise NotOnCPU("mamba_chunk_scan_combined over packed or variable-length sequences: its minimal reference "
                       "scans whole rows")
    batch, seqlen, nheads, headdim = x.shape
    ngroups = B.shape[2]
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    pad = (-seqlen) % chunk_size  # zero dt past the end: x*dt = 0 and exp(A*dt) = 1, the state passes unchanged
    xf = F.pad(x.float(), (0, 0, 0, 0, 0, pad))
    dtp = F.pad(dt, (0, 0, 0, pad))
    Bh = F.pad(repeat(B.float(), "b l g n -> b l (g r) n", r=nheads // ngroups), (0, 0, 0, 0, 0, pad))
    Ch = F.pad(repeat(C.float(), "b l g n -> b l (g r) n", r=nheads // ngroups), (0, 0, 0, 0, 0, pad))
    init = initial_states.float().unsqueeze(1) if initial_states is not None else None
    y, final = ssd_minimal_discrete(xf * dtp.unsqueeze(-1), A.float() * dtp, Bh, Ch, chunk_size, initial_states=init)
    y = y[:, :seqlen]
    if D is not None:
        y = y + x.float() * (D.float() if D.dim() == 2 else D.float().unsqueeze(-1))
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, final) if return_final_states else y


def conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
              final_states_out=None, activation=None):
    """causal_conv1d_fn on causal_conv1d_ref (keyword names as the kernel's)."""
    from causal_conv1d.causal_conv1d_interface import causal_conv1d_ref

    return causal_conv1d_ref(x, weight, bias, initial_states=initial_states, return_final_states=return_final_states,
                             final_states_out=final_states_out, activation=activation, seq_idx=seq_idx)


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """The gated RMSNorm on rms_norm_ref."""
    from mamba_ssm.ops.triton.layernorm_gated import rms_norm_ref

    return rms_norm_ref(x, weight, bias, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)


def conv_state_update(x, conv_state, weight, bias, silu_activation, conv_state_indices=None,
                      intermediate_conv_states=None):
    """megatron-core's causal_conv1d_update on causal_conv1d_update_ref: x (b, d) or (b, d, s); conv_state's rows
    are those ``conv_state_indices`` names (every row in order when None), updated in place."""
    from causal_conv1d.causal_conv1d_interface import causal_conv1d_update_ref

    if intermediate_conv_states is not None:
        raise NotOnCPU("causal_conv1d_update's intermediate states (speculative decoding)")
    activation = silu_activation if isinstance(silu_activation, str) else ("silu" if silu_activation else None)
    rows = conv_state_indices.long() if conv_state_indices is not None else torch.arange(x.shape[0])
    state = conv_state[rows]
    out = causal_conv1d_update_ref(x, state, weight, bias, activation=activation)
    conv_state[rows] = state
    return out


def ssm_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     state_batch_indices=None, intermediate_ssm_states=None):
    """megatron-core's selective_state_update on selective_state_update_ref: x (b, h, p) or (b, s, h, p), one token
    at a time; state's rows are those ``state_batch_indices`` names, updated in place."""
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update_ref

    if intermediate_ssm_states is not None:
        raise NotOnCPU("selective_state_update's intermediate states (speculative decoding)")
    steps = x.dim() == 4 if state.dim() == 4 else x.dim() == 3
    rows = state_batch_indices.long().reshape(-1) if state_batch_indices is not None else torch.arange(x.shape[0])
    sub = state[rows]
    if not steps:
        out = selective_state_update_ref(sub, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)
    else:
        out = torch.stack([selective_state_update_ref(sub, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=D,
                                                      z=None if z is None else z[:, t], dt_bias=dt_bias,
                                                      dt_softplus=dt_softplus) for t in range(x.shape[1])], dim=1)
    state[rows] = sub
    return out


# ---- the patches, once each module has loaded ---------------------------------------------------------------------
def patch_mixer(m):
    _patch(m, "mamba_split_conv1d_scan_combined", split_conv1d_scan,
           "megatron.core.ssm.mamba_mixer.mamba_split_conv1d_scan_combined", "kernel")
    _patch(m, "mamba_chunk_scan_combined", chunk_scan, "megatron.core.ssm.mamba_mixer.mamba_chunk_scan_combined",
           "kernel")
    _patch(m, "causal_conv1d_fn", conv1d_fn, "megatron.core.ssm.mamba_mixer.causal_conv1d_fn", "kernel")
    _patch(m, "causal_conv1d_update", conv_state_update, "megatron.core.ssm.mamba_mixer.causal_conv1d_update",
           "kernel")
    _patch(m, "selective_state_update", ssm_state_update, "megatron.core.ssm.mamba_mixer.selective_state_update",
           "kernel")


def patch_ssd_combined(m):
    _patch(m, "causal_conv1d_fn", conv1d_fn, "mamba_ssm.ops.triton.ssd_combined.causal_conv1d_fn", "kernel")


def patch_selective_scan(m):
    _patch(m, "selective_scan_fn", m.selective_scan_ref,
           "mamba_ssm.ops.selective_scan_interface.selective_scan_fn", "kernel")


def patch_layernorm_gated(m):
    _patch(m, "rmsnorm_fn", rmsnorm_fn, "mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn", "kernel")


# ---- the hybrid model itself: Bridge's provider and megatron-core's layer spec --------------------------------------
HYBRID_FUSIONS = ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                  "gradient_accumulation_fusion", "persist_layer_norm", "cross_entropy_loss_fusion",
                  "moe_permute_fusion", "moe_router_fusion", "moe_grouped_gemm")


def local_hybrid_stack_spec():
    """megatron-core's own local (non-Transformer-Engine) hybrid stack, with the sharded-state-dict keys remapped to
    the TE stack's (``remap_te_layernorm``): the checkpoint the tier writes has the names a cluster's TE model loads."""
    from megatron.core.post_training.modelopt.hybrid.model_specs import get_hybrid_stack_modelopt_spec

    return get_hybrid_stack_modelopt_spec(local_core_attention=True, remap_te_layernorm=True)


def patch_hybrid_provider(m):
    _patch(m, "transformer_engine_hybrid_stack_spec", local_hybrid_stack_spec,
           "megatron.bridge.models.hybrid.hybrid_provider.transformer_engine_hybrid_stack_spec", "kernel")
    finalize = m.HybridModelProvider.finalize

    def _finalize(self):
        for f in HYBRID_FUSIONS:
            if getattr(self, f, False):
                setattr(self, f, False)
        return finalize(self)

    _patch(m.HybridModelProvider, "finalize", _finalize, "HybridModelProvider.finalize (CUDA fusions off)", "kernel")


def patch_modelopt_specs(m):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    _patch(m, "Norm", WrappedTorchNorm, "megatron.core.post_training.modelopt.hybrid.model_specs.Norm", "kernel")


def patch_hybrid_block(m):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    _patch(m, "TENorm", WrappedTorchNorm, "megatron.core.models.hybrid.hybrid_block.TENorm", "kernel")


class _CpuStream(torch.cpu.Stream):
    """torch's CPU stream, whose ``record_event`` returns the recorded event as a CUDA stream's does (torch's CPU
    stub returns None; megatron-core's dispatcher synchronises on it)."""

    def record_event(self, event=None):
        event = event or torch.cpu.Event()
        event.record(self)
        return event


class _CpuStreams:
    """``torch.cuda`` as megatron-core's MoE modules see it: its streams and events are the CPU's (torch.cpu's
    Stream, stream, current_stream, Event: the same stream semantics on the CPU device, where work is ordered
    anyway); everything else torch.cuda itself. Scoped to those modules, as _CpuTorch is to the schedules."""

    Stream, Event = _CpuStream, torch.cpu.Event

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def stream(s):
        return torch.cpu.stream(s)

    @staticmethod
    def current_stream(device=None):
        return torch.cpu.current_stream()


class _MoeTorch:
    """``torch`` for one MoE module: its ``torch.cuda`` streams on the CPU (_CpuStreams), everything else torch."""

    cuda = _CpuStreams()

    def __getattr__(self, name):
        return getattr(torch, name)


def patch_moe_streams(m):
    _patch(m, "torch", _MoeTorch(), f"{m.__name__}: torch.cuda.Stream/stream/current_stream/Event", "cuda")
    if hasattr(m, "maybe_move_tensor_to_cpu"):
        _patch(m, "maybe_move_tensor_to_cpu", _to_host, f"{m.__name__}.maybe_move_tensor_to_cpu", "cuda")


def _to_host(tensor, as_numpy=False, record_stream=False):
    """megatron-core's maybe_move_tensor_to_cpu (it acts on CUDA tensors only: the split sizes' device-to-host copy)
    on the CPU tensors that stand for them: the host copy, as numpy where asked, as on a GPU (all_to_all takes the
    split sizes as a sequence of ints, which a numpy array is and a tensor is not)."""
    if torch.is_tensor(tensor):
        tensor = tensor.detach().clone()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def patch_model_load_save(m):
    import contextlib

    context = m.temporary_distributed_context

    @contextlib.contextmanager
    def seeded_context(backend: str = "gloo"):
        with context(backend):
            if not torch.cuda.is_available():  # what Bridge does where CUDA is (it skips it on a CPU)
                from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

                model_parallel_cuda_manual_seed(0)
            yield

    _patch(m, "temporary_distributed_context", seeded_context,
           "megatron.bridge.training.model_load_save.temporary_distributed_context (model_parallel_cuda_manual_seed)",
           "cuda")


HOOKS = {"megatron.core.ssm.mamba_mixer": patch_mixer,
         "megatron.bridge.training.model_load_save": patch_model_load_save,
         "mamba_ssm.ops.triton.ssd_combined": patch_ssd_combined,
         "mamba_ssm.ops.selective_scan_interface": patch_selective_scan,
         "mamba_ssm.ops.triton.layernorm_gated": patch_layernorm_gated,
         "megatron.bridge.models.hybrid.hybrid_provider": patch_hybrid_provider,
         "megatron.core.post_training.modelopt.hybrid.model_specs": patch_modelopt_specs,
         "megatron.core.models.hybrid.hybrid_block": patch_hybrid_block,
         "megatron.core.transformer.moe.token_dispatcher": patch_moe_streams,
         "megatron.core.transformer.moe.shared_experts": patch_moe_streams,
         "megatron.core.transformer.moe.moe_layer": patch_moe_streams}
