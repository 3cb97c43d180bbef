"""The layout module against megatron-core's own rank mapping (the pinned wheel's source), and the node-local rule on
the layouts the reference documents."""

from __future__ import annotations

import itertools
import re

import pytest

from pipeline.config.parallel import Layout, node_local_problems, weight_gb_per_gpu
from pipeline.training.conformance import fetch_wheel_source
from tests.helpers import ROOT
from tests.tiers import tier_unavailable


def pinned_core() -> str:
    text = (ROOT / "3rdparty" / "requirements-container.txt").read_text()
    return re.search(r"^megatron-core==(\S+)", text, re.M).group(1)


@pytest.fixture(scope="module")
def rank_generator():
    """megatron-core's RankGenerator and generate_masked_orthogonal_rank_groups, executed from the pinned wheel's
    parallel_state.py (the two pieces only: the module imports torch.distributed at the top)."""
    try:
        root = fetch_wheel_source(pinned_core(), ROOT / ".cache" / "wheels", package="megatron-core")
    except Exception as exc:
        tier_unavailable("bridge", f"cannot download megatron-core=={pinned_core()} from PyPI: {exc}")
    src = (root / "megatron" / "core" / "parallel_state.py").read_text()
    pieces = [src[src.index("def generate_masked_orthogonal_rank_groups"):src.index("def create_hierarchical_groups")],
              src[src.index("class RankGenerator"):src.index("def default_embedding_ranks")]]
    ns: dict = {}
    exec("from typing import List\n" + "\n".join(pieces), ns)  # the pinned wheel's own code
    return ns["RankGenerator"]


@pytest.mark.bridge
def test_groups_are_megatron_cores_own(rank_generator):
    """Every group of 600+ layouts (world 1-32, tp/pp/cp/ep/etp) equals RankGenerator.get_ranks with the orders
    initialize_model_parallel uses: tp-cp-ep-dp-pp, ep=1 on the dense grid, cp=1 and tp=etp on the expert grid."""
    checked = 0
    for world in (1, 2, 4, 8, 12, 16, 24, 32):
        for tp, pp, cp, ep, etp in itertools.product((1, 2, 4), (1, 2, 3, 6), (1, 2), (1, 2, 4, 8), (1, 2, 4)):
            lay = Layout(world, tp, pp, cp, ep, etp)
            if lay.problems():
                continue
            dense = rank_generator(tp=tp, ep=1, dp=lay.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
            expert = rank_generator(tp=etp, ep=ep, dp=lay.edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
            assert lay.groups() == {
                "tp": dense.get_ranks("tp"), "cp": dense.get_ranks("cp"), "dp": dense.get_ranks("dp"),
                "pp": dense.get_ranks("pp"), "ep": expert.get_ranks("ep"), "etp": expert.get_ranks("tp"),
                "expert": expert.get_ranks("tp-ep")}, (world, tp, pp, cp, ep, etp)
            checked += 1
    assert checked > 600


@pytest.mark.parametrize("layout, ok", [
    (Layout(24, tp=4, pp=6, ep=4, etp=1), True),    # the reference's Megatron generation (6 nodes x 4 GPUs)
    (Layout(4, tp=1, pp=1, ep=4, etp=1), True),     # the reference's Nano / Super export: EP=4 on one node
    (Layout(64, tp=1, pp=1, ep=4, etp=1), True),    # the Nano 32K quickstart's training layout
    (Layout(32, tp=4, pp=1, ep=8, etp=1), False),   # tp 4 x ep 8: the expert group spans two nodes
    (Layout(16, tp=4, pp=1, ep=4, etp=4), False),   # etp = tp: the reference's TP x EP <= 4 rule
    (Layout(16, tp=4, pp=1, ep=1, etp=4), True),
    (Layout(16, tp=8, pp=1, ep=1, etp=1), False),
    (Layout(16, tp=2, pp=1, cp=4, ep=1, etp=1), False),
])
def test_the_node_local_rule_on_4_gpu_nodes(layout, ok):
    assert layout.problems() == []
    assert (node_local_problems(layout, 4, "on 'isambard_gh200'") == []) is ok


def test_a_group_that_fits_a_node_but_straddles_two_is_named():
    lay = Layout(12, tp=3)
    assert node_local_problems(lay, 4, "here") == [
        "the tp group [3, 4, 5] spans nodes [0, 1] here (4 GPUs per node): tensor-parallel all-reduces would cross "
        "nodes; use sizes that divide 4"]


def test_positions_follow_the_groups():
    pos = Layout(24, tp=4, pp=6, ep=4, etp=1).positions(4)
    assert [(p["node"], p["tp"], p["pp"], p["ep"], p["dp"]) for p in pos[:5]] == [
        (0, 0, 0, 0, 0), (0, 1, 0, 1, 0), (0, 2, 0, 2, 0), (0, 3, 0, 3, 0), (1, 0, 1, 0, 0)]
    assert {p["pp"] for p in pos if p["node"] == 5} == {5}  # one pipeline stage per node


def test_problems_and_weights():
    assert Layout(8, tp=3).problems()[0].startswith("world size 8 is not divisible by tp(3)")
    assert "expert groups of ep(8) * etp(1) = 8" in Layout(8, pp=2, ep=8).problems()[0]
    assert Layout(4, tp=0).problems() == ["tp (0) must be an integer >= 1"]
    # a world pp does not divide is one line (the tp * pp * cp one), not also an expert line for ep * etp = 1
    assert len(Layout(64, pp=3).problems()) == 1 and Layout(64, pp=3).dp == 0
    with pytest.raises(ValueError, match="no groups for a layout megatron-core refuses"):
        Layout(64, pp=3).groups()
    # Super's export layout: dense 7.2B whole on each rank, 112.8B of experts over 4 ranks, BF16
    assert weight_gb_per_gpu(7.2, 112.8, Layout(4, ep=4)) == pytest.approx(2 * (7.2 + 28.2))
