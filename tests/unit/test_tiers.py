"""Which test tiers must run: every runnable tier under CI=true, plus those PIPELINE_REQUIRE_TIERS names."""

import pytest

from tests.tiers import RUNNABLE_HERE, TIERS, TierError, required_tiers, unavailable_line


@pytest.mark.parametrize(("env", "want"), [
    ({}, set()),
    ({"CI": "false"}, set()),
    ({"CI": "true"}, set(RUNNABLE_HERE)),
    ({"CI": "1", "PIPELINE_REQUIRE_TIERS": "gpu"}, {*RUNNABLE_HERE, "gpu"}),
    ({"PIPELINE_REQUIRE_TIERS": " slurm, bridge ,"}, {"slurm", "bridge"}),
    ({"PIPELINE_REQUIRE_TIERS": "all"}, set(TIERS)),
])
def test_required_tiers(env, want):
    assert required_tiers(env) == want


def test_an_unknown_tier_is_refused_with_the_names():
    with pytest.raises(TierError, match=r"unknown tier\(s\) slrum; tiers: slurm, bridge, megatron_cpu, charliecloud, twin, gpu, all"):
        required_tiers({"PIPELINE_REQUIRE_TIERS": "slrum"})


def test_the_line_is_one_line_whatever_the_daemon_printed():
    assert unavailable_line("slurm", "fatal:\n  bind failed\n", "/tmp/x/log") == (
        "test tier slurm cannot start: fatal: bind failed (read /tmp/x/log)")
