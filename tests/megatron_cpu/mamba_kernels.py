"""The hybrid family's kernel stand-ins (standin/mamba_standin.py) checked on random inputs, values and gradients,
each against an independent computation of the same math: another of the libraries' own references, megatron-core's
own torch fallback, or the recurrence stepped token by token (the decode path against the prefill). Run by
tests/megatron_cpu/test_mamba_kernels.py in the harness venv with the tier's environment (the stand-ins loaded by
sitecustomize); prints one line per check and exits 1 on the first that fails."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from einops import rearrange

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def close(a, b, what, atol=1e-4, rtol=1e-4):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def grads(fn, inputs, seed=0):
    """Gradients of a random projection of fn(*inputs) with respect to every input that requires one."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) if t is not None else None for t in inputs]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.Generator().manual_seed(seed)
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().backward()
    return out.detach(), [t.grad if t is not None and t.requires_grad else None for t in leaves]


def same_values_and_grads(f, g, inputs, what, atol=1e-4):
    (a, ga), (b, gb) = grads(f, inputs), grads(g, inputs)
    close(a, b, f"{what}: values", atol=atol)
    for i, (x, y) in enumerate(zip(ga, gb)):
        if x is not None or y is not None:
            close(x, y, f"{what}: gradient of input {i}", atol=atol)


def ssm_inputs(b=2, seqlen=37, h=4, p=8, g=2, n=16, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(b, seqlen, h, p)
    dt = torch.randn(b, seqlen, h) * 0.5
    A = -torch.rand(h) - 0.5
    B, C = torch.randn(b, seqlen, g, n), torch.randn(b, seqlen, g, n)
    D, z, dt_bias = torch.randn(h, p), torch.randn(b, seqlen, h, p), torch.rand(h) - 1.0
    return x, dt, A, B, C, D, z, dt_bias


@check
def chunk_scan_equals_the_sequential_selective_scan_reference():
    """mamba_chunk_scan_combined (minimal SSD, chunked) == ssd_selective_scan (mamba-ssm's reference through the
    selective_scan_ref recurrence), a chunk size that does not divide the length, two groups; values and gradients."""
    from mamba_ssm.ops.triton.ssd_combined import ssd_selective_scan
    from mamba_standin import chunk_scan

    same_values_and_grads(
        lambda x, dt, A, B, C, D, z, bias: chunk_scan(x, dt, A, B, C, 16, D=D, z=z, dt_bias=bias, dt_softplus=True),
        lambda x, dt, A, B, C, D, z, bias: ssd_selective_scan(x, dt, A, B, C, D=D, z=z, dt_bias=bias,
                                                              dt_softplus=True),
        ssm_inputs(), "chunk scan vs selective scan")


@check
def chunk_scan_states_carry_over_and_match_the_decode_step():
    """The final state of a prefill continues it exactly (initial_states), and megatron-core's decode update
    (selective_state_update on its reference) stepped token by token gives the same outputs and final state."""
    from mamba_standin import chunk_scan, ssm_state_update

    x, dt, A, B, C, D, z, bias = ssm_inputs(seqlen=24)
    whole, final = chunk_scan(x, dt, A, B, C, 8, D=D, z=z, dt_bias=bias, dt_softplus=True, return_final_states=True)
    k = 11
    first, mid = chunk_scan(x[:, :k], dt[:, :k], A, B[:, :k], C[:, :k], 8, D=D, z=z[:, :k], dt_bias=bias,
                            dt_softplus=True, return_final_states=True)
    rest = chunk_scan(x[:, k:], dt[:, k:], A, B[:, k:], C[:, k:], 8, D=D, z=z[:, k:], dt_bias=bias,
                      dt_softplus=True, initial_states=mid)
    close(torch.cat([first, rest], dim=1), whole, "prefill in two parts")
    h, p, n = x.shape[2], x.shape[3], B.shape[3]
    state = torch.zeros(3, h, p, n)  # a cache of 3 rows; the batch's 2 sequences live in rows 2 and 0
    rows = torch.tensor([2, 0])
    # as megatron-core's decode step passes them: dt per channel, A per channel and state, dt_bias per channel
    stepped = ssm_state_update(state, x, dt[..., None].expand(*dt.shape, p), A[:, None, None].expand(h, p, n), B, C, D, z=z,
                               dt_bias=bias[:, None].expand(h, p), dt_softplus=True, state_batch_indices=rows)
    close(stepped, whole, "decode steps vs prefill")
    close(state[rows], final, "decode state vs prefill state")
    assert torch.count_nonzero(state[1]) == 0, "a row the indices do not name was written"


def conv_inputs(b=2, d=24, seqlen=19, w=4, seed=1):
    torch.manual_seed(seed)
    return torch.randn(b, d, seqlen), torch.randn(d, w), torch.randn(d)


@check
def conv1d_equals_megatrons_torch_fallback():
    """causal_conv1d_fn (causal_conv1d_ref) == megatron-core's own path without the kernel (a depthwise nn.Conv1d
    padded by width - 1, cut to the length, then SiLU); values and gradients."""
    from mamba_standin import conv1d_fn

    def fallback(x, w, bias):
        return F.silu(F.conv1d(x, w.unsqueeze(1), bias, padding=w.shape[1] - 1, groups=w.shape[0])[..., :x.shape[-1]])

    same_values_and_grads(lambda x, w, bias: conv1d_fn(x=x, weight=w, bias=bias, activation="silu"), fallback,
                          conv_inputs(), "causal conv1d vs nn.Conv1d")


@check
def conv1d_of_packed_sequences_restarts_at_each_boundary():
    """With seq_idx (packed sequences) each sequence is convolved as if alone."""
    from mamba_standin import conv1d_fn

    x, w, bias = conv_inputs(b=1, seqlen=20)
    seq_idx = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4], dtype=torch.int32)
    packed = conv1d_fn(x=x, weight=w, bias=bias, activation="silu", seq_idx=seq_idx)
    alone = torch.cat([conv1d_fn(x=x[..., a:b], weight=w, bias=bias, activation="silu")
                       for a, b in ((0, 7), (7, 16), (16, 20))], dim=-1)
    close(packed, alone, "packed vs one by one")


@check
def conv_state_update_steps_equal_the_prefill_conv():
    """megatron-core's decode conv update (causal_conv1d_update on its reference), token by token over rows named by
    indices, == the whole-sequence causal conv; the state holds the last width - 1 inputs; other rows untouched."""
    from mamba_standin import conv1d_fn, conv_state_update

    x, w, bias = conv_inputs()
    whole = conv1d_fn(x=x, weight=w, bias=bias, activation="silu")
    state = torch.zeros(4, x.shape[1], w.shape[1] - 1)
    rows = torch.tensor([3, 1])
    steps = torch.stack([conv_state_update(x[..., t], state, w, bias, "silu", conv_state_indices=rows)
                         for t in range(x.shape[-1])], dim=-1)
    close(steps, whole, "decode conv vs prefill conv")
    close(state[rows], x[..., -(w.shape[1] - 1):], "conv state")
    assert torch.count_nonzero(state[0]) == 0 and torch.count_nonzero(state[2]) == 0


@check
def gated_rmsnorm_equals_torchs_rms_norm():
    """The gated RMSNorm (rms_norm_ref) == torch's own F.rms_norm with the gate before or after, whole and in
    groups; values and gradients."""
    from mamba_standin import rmsnorm_fn

    torch.manual_seed(2)
    x, z, w = torch.randn(3, 5, 32), torch.randn(3, 5, 32), torch.randn(32)
    for before in (True, False):
        for group in (None, 8):
            def torch_norm(x, z, w, before=before, group=group):
                gated = x if before else x * F.silu(z)
                size = group or x.shape[-1]
                y = rearrange(F.rms_norm(rearrange(gated, "... (g d) -> ... g d", d=size), (size,), eps=1e-5),
                              "... g d -> ... (g d)") * w
                return y * F.silu(z) if before else y

            same_values_and_grads(lambda x, z, w, before=before, group=group: rmsnorm_fn(
                x, w, None, z=z, eps=1e-5, group_size=group, norm_before_gate=before), torch_norm, (x, z, w),
                f"gated RMSNorm (norm_before_gate={before}, group_size={group})")


@check
def split_conv1d_scan_equals_its_parts():
    """mamba_split_conv1d_scan_combined (training: on mamba_split_conv1d_scan_ref) == the causal conv, the chunked
    scan and the gate applied one after the other, without and with its RMSNorm and output projection; values and
    gradients."""
    from mamba_standin import chunk_scan, conv1d_fn, rmsnorm_fn, split_conv1d_scan

    torch.manual_seed(3)
    b, seqlen, h, p, g, n, w = 2, 21, 4, 8, 2, 16, 4
    dim, conv_dim = h * p, h * p + 2 * g * n
    zxbcdt = torch.randn(b, seqlen, 2 * dim + 2 * g * n + h)
    cw, cb = torch.randn(conv_dim, w) * 0.5, torch.randn(conv_dim)
    dt_bias, A, D = torch.rand(h) - 1.0, -torch.rand(h) - 0.5, torch.randn(h)
    norm_w, out_w = torch.randn(dim), torch.randn(12, dim) * 0.2

    def parts(zxbcdt, cw, cb, dt_bias, A, D, norm_w=None, out_w=None):
        z, xBC, dt = torch.split(zxbcdt, [dim, conv_dim, h], dim=-1)
        xBC = rearrange(conv1d_fn(x=rearrange(xBC, "b l d -> b d l"), weight=cw, bias=cb, activation="silu"),
                        "b d l -> b l d")
        x, B, C = torch.split(xBC, [dim, g * n, g * n], dim=-1)
        y = chunk_scan(rearrange(x, "b l (h p) -> b l h p", h=h), dt, A, rearrange(B, "b l (g n) -> b l g n", g=g),
                       rearrange(C, "b l (g n) -> b l g n", g=g), 8, D=D,
                       z=None if norm_w is not None else rearrange(z, "b l (h p) -> b l h p", h=h),
                       dt_bias=dt_bias, dt_softplus=True)
        y = rearrange(y, "b l h p -> b l (h p)")
        if norm_w is not None:
            y = rmsnorm_fn(y, norm_w, None, z=z, eps=1e-6, norm_before_gate=False)
        return y if out_w is None else F.linear(y, out_w)

    args = (zxbcdt, cw, cb, dt_bias, A, D)
    same_values_and_grads(lambda *a: split_conv1d_scan(*a, chunk_size=8, headdim=p, ngroups=g),
                          parts, args, "split conv1d scan", atol=2e-4)
    same_values_and_grads(
        lambda *a: split_conv1d_scan(*a[:6], chunk_size=8, headdim=p, ngroups=g, rmsnorm_weight=a[6],
                                     outproj_weight=a[7], norm_before_gate=False),
        lambda *a: parts(*a), (*args, norm_w, out_w), "split conv1d scan with norm and projection", atol=2e-4)


@check
def split_conv1d_scan_of_packed_sequences_is_each_sequence_alone():
    """With seq_idx (packed sequences, as an SFT batch is) the fused scan gives each sequence what it gives that
    sequence alone: its convolution and its state restart at the boundary; values and gradients."""
    from mamba_standin import split_conv1d_scan

    torch.manual_seed(4)
    h, p, g, n, w = 4, 8, 2, 16, 4
    dim, conv_dim = h * p, h * p + 2 * g * n
    zxbcdt = torch.randn(2, 23, 2 * dim + 2 * g * n + h)
    cw, cb = torch.randn(conv_dim, w) * 0.5, torch.randn(conv_dim)
    dt_bias, A, D = torch.rand(h) - 1.0, -torch.rand(h) - 0.5, torch.randn(h)
    bounds = [(0, 9), (9, 20), (20, 23)]
    seq_idx = torch.tensor([[i for i, (a, e) in enumerate(bounds) for _ in range(a, e)]] * 2, dtype=torch.int32)

    def alone(zxbcdt, *rest):
        return torch.cat([split_conv1d_scan(zxbcdt[:, a:e], *rest, chunk_size=8, headdim=p, ngroups=g)
                          for a, e in bounds], dim=1)

    same_values_and_grads(lambda z, *rest: split_conv1d_scan(z, *rest, chunk_size=8, headdim=p, ngroups=g,
                                                             seq_idx=seq_idx),
                          alone, (zxbcdt, cw, cb, dt_bias, A, D), "packed fused scan vs each sequence alone")
    whole = split_conv1d_scan(zxbcdt, cw, cb, dt_bias, A, D, chunk_size=8, headdim=p, ngroups=g)
    packed = split_conv1d_scan(zxbcdt, cw, cb, dt_bias, A, D, chunk_size=8, headdim=p, ngroups=g, seq_idx=seq_idx)
    assert not torch.allclose(whole[:, 9:], packed[:, 9:]), "the boundary changed nothing: seq_idx was ignored"


@check
def what_a_reference_cannot_do_is_refused():
    """Initial states through the fused training scan, packed or varlen prefill scans and speculative decoding's
    intermediate states are refused in one line (the GPU tier runs them), never approximated."""
    from mamba_standin import NotOnCPU, chunk_scan, split_conv1d_scan

    x, dt, A, B, C, D, z, bias = ssm_inputs(seqlen=8)
    for call in (lambda: chunk_scan(x, dt, A, B, C, 8, seq_idx=torch.zeros(2, 8, dtype=torch.int32)),
                 lambda: split_conv1d_scan(torch.zeros(1, 4, 8), None, None, None, None, None, 8,
                                           initial_states=torch.zeros(1))):
        try:
            call()
        except NotOnCPU:
            continue
        raise AssertionError("a call the reference cannot make was not refused")


def main() -> int:
    import mamba_standin  # noqa: F401  (loaded by sitecustomize, which the tier's PYTHONPATH puts first)
    import megatron.core.ssm.mamba_mixer as mixer

    assert mixer.HAVE_MAMBA_SSM, "megatron-core did not find mamba-ssm"
    for fn in CHECKS:
        fn()
        print(f"PASS {fn.__name__}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
