"""Test tiers: which must run, and what a tier that cannot start does.

A tier is a group of tests that needs something started first: the local Slurm cluster (`slurm`), the Bridge
harness venv and the pinned wheels (`bridge`), Megatron's own model code on CPU processes over gloo in that venv
(`megatron_cpu`: tests/megatron_cpu, its CUDA stand-in named there), a Charliecloud image built with debootstrap (`charliecloud`), the
container twin (`twin`: the overlay over a Python 3.12 stand-in of the NGC image), a CUDA GPU (`gpu`). Each is a pytest marker. A tier that cannot start is skipped with one line saying why and
which log to read; under CI=true (and for every tier named in PIPELINE_REQUIRE_TIERS, comma-separated, or
`all`) that line fails the run instead, so a green CI never hides a tier that did not run. The gpu tier is
exempt on a machine without a GPU, and says so.

    python -m tests.tiers required slurm    # exit 0 when the slurm tier must run (tests/run.sh asks this)
    python -m tests.tiers list               # the required tiers, one a line
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

TIERS = ("slurm", "bridge", "megatron_cpu", "charliecloud", "twin", "gpu")
RUNNABLE_HERE = ("slurm", "bridge", "megatron_cpu", "charliecloud", "twin")  # every tier that can run on a CPU-only CI machine
FIXTURES_OF = {"slurm": ("slurm", "senv")}  # a test that uses one of these fixtures is in that tier
# The cases a tier's summary line names (a required tier runs them; the summary shows their counts and time): label ->
# the test file that is the case
NAMED_CASES = {
    "megatron_cpu": {
        "finetune() of the Nano quickstart on the tiny NemotronH at EP 2 (alltoall), resume equal": "tests/megatron_cpu/test_bridge_finetune_cpu.py",
        "pretrain() save-and-exit and resume": "tests/megatron_cpu/test_bridge_pretrain_cpu.py",
        "the hybrid family's Mamba kernels on their references": "tests/megatron_cpu/test_mamba_kernels.py",
        "NemotronH: import/export equal and verified, a broken Mamba weight FAILs, tp 1 and tp 2 generation equal "
        "to HF greedy, tp 2 import and export, an import leaving a weight random refused, ep 2 export verified and a "
        "broken expert FAILs, ep 2 import equal, ep 2 and tp 2 x ep 2 generation with the alltoall dispatcher equal to "
        "HF greedy": "tests/megatron_cpu/test_nemotron_h_cpu.py",
    },
}


class TierError(ValueError):
    pass


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def required_tiers(environ: dict[str, str] | None = None) -> set[str]:
    """The tiers that must run: every runnable tier under CI=true, plus those PIPELINE_REQUIRE_TIERS names."""
    env = os.environ if environ is None else environ
    names = {n.strip() for n in env.get("PIPELINE_REQUIRE_TIERS", "").split(",") if n.strip()}
    unknown = names - set(TIERS) - {"all"}
    if unknown:
        raise TierError(f"PIPELINE_REQUIRE_TIERS names unknown tier(s) {', '.join(sorted(unknown))}; "
                        f"tiers: {', '.join(TIERS)}, all")
    if "all" in names:
        names = set(TIERS)
    if _truthy(env.get("CI")):
        names |= set(RUNNABLE_HERE)
    return names


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and Path("/dev/nvidia0").exists()


def gpu_exemption() -> str | None:
    """Why the gpu tier does not run here, or None when it can."""
    return None if has_gpu() else "exempt: no GPU on this machine (nvidia-smi or /dev/nvidia0 missing)"


def unavailable_line(tier: str, reason: str, log: str | Path | None = None) -> str:
    reason = " ".join(str(reason).split())  # one line, whatever the daemon printed
    return f"test tier {tier} cannot start: {reason}" + (f" (read {log})" if log else "")


def tier_unavailable(tier: str, reason: str, log: str | Path | None = None) -> NoReturn:
    """Skip the tier's tests with one line, or fail them with that line when the tier is required."""
    import pytest

    assert tier in TIERS, tier
    line = unavailable_line(tier, reason, log)
    if tier in required_tiers() and not (tier == "gpu" and gpu_exemption()):
        pytest.fail(f"{line} [required: CI=true or PIPELINE_REQUIRE_TIERS]", pytrace=False)
    pytest.skip(line)


def slurm_conf() -> Path:
    """The local Slurm cluster's config: SLURM_CONF when set (tests/run.sh exports it), else the default base's."""
    if os.environ.get("SLURM_CONF"):
        return Path(os.environ["SLURM_CONF"])
    return Path(os.environ.get("PIPELINE_SLURM_BASE", "/tmp/pslurm")) / "etc" / "slurm.conf"


def main(argv: list[str]) -> int:
    try:
        required = required_tiers()
    except TierError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if argv[:1] == ["required"] and len(argv) == 2 and argv[1] in TIERS:
        return 0 if argv[1] in required else 1
    if argv == ["list"]:
        print("\n".join(sorted(required)))
        return 0
    print("usage: python -m tests.tiers required TIER | list", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
