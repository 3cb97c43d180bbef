"""The megatron_cpu tier, the hybrid (Mamba) family's kernels (issue 61, items 1-2): mamba-ssm and causal-conv1d
installed by the tier's own setup (tests/bridge/setup_env.sh, tests/bridge/ssm.txt: their sdists, CUDA builds
skipped), megatron-core's MambaMixer finding them (HAVE_MAMBA_SSM), and each kernel it calls stood in by its
library's own reference (standin/mamba_standin.py), checked on random inputs, values and gradients, against an
independent computation of the same math (tests/megatron_cpu/mamba_kernels.py: one line per check)."""

from __future__ import annotations

import pytest

from tests.megatron_cpu.conftest import HERE, VENV, tier_run

pytestmark = [pytest.mark.megatron_cpu]

CHECKS = ("chunk_scan_equals_the_sequential_selective_scan_reference",
          "chunk_scan_states_carry_over_and_match_the_decode_step", "conv1d_equals_megatrons_torch_fallback",
          "conv1d_of_packed_sequences_restarts_at_each_boundary", "conv_state_update_steps_equal_the_prefill_conv",
          "gated_rmsnorm_equals_torchs_rms_norm", "split_conv1d_scan_equals_its_parts",
          "split_conv1d_scan_of_packed_sequences_is_each_sequence_alone", "what_a_reference_cannot_do_is_refused")


def test_the_mamba_kernel_stand_ins_equal_their_references(harness_venv):
    r = tier_run([str(VENV / "bin" / "python"), str(HERE / "mamba_kernels.py")], timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("PASS ")] == list(CHECKS), r.stdout


def test_megatron_core_builds_its_mamba_mixer_with_mamba_ssm_and_the_stand_ins(harness_venv):
    """Without mamba-ssm megatron-core's MambaMixer raises ImportError at construction (HAVE_MAMBA_SSM False); with
    the tier's install it imports for real, and every kernel stand-in the header lists was applied, each a
    [kernel]."""
    code = ("import megatron.core.ssm.mamba_mixer as m, mamba_ssm, causal_conv1d, mamba_standin\n"
            "import mamba_ssm.ops.triton.layernorm_gated, mamba_ssm.ops.selective_scan_interface\n"
            "import json; print(json.dumps({'have': m.HAVE_MAMBA_SSM, 'versions': [mamba_ssm.__version__, "
            "causal_conv1d.__version__], 'patched': mamba_standin.PATCHED}))")
    r = tier_run([str(VENV / "bin" / "python"), "-c", code], timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    import json

    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["have"] is True and got["versions"] == ["2.3.2.post1", "1.7.0"], got
    kernels = [(label, kind) for label, kind in got["patched"] if label.startswith(("megatron.core.ssm.", "mamba_ssm."))]
    labels = {label for label, _ in kernels}  # (the hybrid model's own stand-ins apply as megatron-core imports them)
    assert all(kind == "kernel" for _, kind in kernels), kernels
    assert labels == {"megatron.core.ssm.mamba_mixer.mamba_split_conv1d_scan_combined",
                      "megatron.core.ssm.mamba_mixer.mamba_chunk_scan_combined",
                      "megatron.core.ssm.mamba_mixer.causal_conv1d_fn",
                      "megatron.core.ssm.mamba_mixer.causal_conv1d_update",
                      "megatron.core.ssm.mamba_mixer.selective_state_update",
                      "mamba_ssm.ops.triton.ssd_combined.causal_conv1d_fn",
                      "mamba_ssm.ops.selective_scan_interface.selective_scan_fn",
                      "mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn"}, labels
