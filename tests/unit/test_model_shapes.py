"""Plans that know the model's shape (issue 34): the registry's heads, KV heads, experts and layers (hybrid pattern),
checked by every plan with megatron-core 0.19.2's own rules (config/parallel.py ``model_shape_problems``). Each
finding of the hostile review is a test here that passed the plan before."""

from __future__ import annotations

import json

import pytest

from pipeline.cli.coherence import plan_from_argv as coherence_plan
from pipeline.cli.train import main as train_main
from pipeline.config.models import REGISTRY, get_model, local_model_path
from pipeline.config.parallel import Layout, model_shape_problems, pp_shape_problem, shape_fixes

NANO, SUPER = get_model("nano"), get_model("super")
QUICKSTART = ["configs/quickstart/nemotron_nano_quickstart_sft.yaml", "--model", "nano", "--mode", "sft",
              "--disable-ft", "--dry-run", "--no-path-checks"]


@pytest.fixture(autouse=True)
def isambard(monkeypatch):
    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    monkeypatch.setenv("PIPELINE_BINDS", "/c")
    for k in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NODEID"):
        monkeypatch.delenv(k, raising=False)
    # the megatron checkpoint the plans name is not read here: these tests are about the shape (that rule's tests:
    # tests/unit/test_audit_issue34.py)
    monkeypatch.setattr("pipeline.coherence.plan._checkpoint_problem", lambda cfg: None)


def errors(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


# ---- the registry's shapes -----------------------------------------------------------------------------------
def test_the_flagship_shapes_are_their_published_configs():
    n, s = NANO.shape, SUPER.shape
    assert (n.num_layers, n.num_attention_heads, n.num_query_groups, n.num_moe_experts, n.vocab_size) == \
        (52, 32, 2, 128, 131072)
    assert (s.num_layers, s.num_attention_heads, s.num_query_groups, s.num_moe_experts, s.vocab_size) == \
        (88, 32, 2, 512, 131072)
    # Nano: 23 Mamba + 23 MoE + 6 attention; Super: 40 + 40 + 8 and one MTP block
    assert [n.hybrid_pattern.count(c) for c in "ME*"] == [23, 23, 6]
    assert [s.hybrid_pattern.count(c) for c in "ME*"] == [40, 40, 8] and s.mtp_pattern == "*E"
    assert (n.mamba_num_heads, n.mamba_num_groups, s.mamba_num_heads, s.mamba_num_groups) == (64, 8, 128, 8)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_model_has_a_shape_that_agrees_with_its_size_facts(name):
    spec = REGISTRY[name]
    assert spec.shape is not None and spec.shape.source
    assert spec.shape.num_layers == spec.num_layers and spec.shape.vocab_size == spec.vocab_size
    if spec.shape.is_hybrid:
        assert len(spec.shape.hybrid_pattern) == spec.num_layers
    if spec.tiny_config is not None:  # read from the config the tiny model is built from
        heads = spec.tiny_config["num_attention_heads"]
        assert (spec.shape.num_attention_heads, spec.shape.num_query_groups) == \
            (heads, spec.tiny_config["num_key_value_heads"])
        assert spec.shape.num_moe_experts == spec.tiny_config.get("n_routed_experts",
                                                                  spec.tiny_config.get("num_experts"))


def test_smollm2s_shape_is_its_materialised_config():
    path = local_model_path(get_model("smollm2-135m")) / "config.json"
    if not path.exists():
        pytest.skip("SmolLM2 not materialised (bash pipeline_env_setup.sh --only assets)")
    cfg, shape = json.loads(path.read_text()), get_model("smollm2-135m").shape
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == \
        (shape.num_layers, shape.num_attention_heads, shape.num_query_groups, shape.vocab_size)


# ---- the rules -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, layout, kw, needle", [
    (NANO, Layout(3, tp=3), {}, "tp(3) does not divide the 32 attention heads of nano (TransformerConfig)"),
    (NANO, Layout(16, tp=16), {}, "tp(16) does not divide the 8 Mamba groups (n_groups) of nano (MambaMixer)"),
    (NANO, Layout(3, ep=3), {}, "ep(3) does not divide the 128 routed experts of nano (MoELayer): megatron-core "
                                "raises on every rank; use ep 2 or ep 4"),
    (NANO, Layout(3, pp=3), {}, "pp(3) does not split the 52-layer hybrid pattern of nano evenly (52 % 3 = 1; "
                                "select_pipeline_segment): megatron-core raises on every rank; use pp 2 or pp 4"),
    (SUPER, Layout(24, tp=4, pp=6, ep=4), {}, "pp(6) does not split the 88-layer hybrid pattern of super evenly "
                                              "(88 % 6 = 4; select_pipeline_segment)"),
    (SUPER, Layout(24, pp=6), {"last_stage_layers": 4}, "leaves 84 layers"),
    (get_model("tiny-nemotronh-moe"), Layout(8, cp=8), {}, "cp(8) does not divide the 4 Mamba heads per TP rank"),
    (get_model("smollm2-135m"), Layout(2, tp=2), {}, "tp(2) does not divide the 9 attention heads"),
    (NANO, Layout(4, tp=4), {"sequence_parallel": False}, "tp(4) > 1 without sequence parallelism"),
])
def test_megatron_cores_rules_refuse_what_it_refuses(spec, layout, kw, needle):
    found = model_shape_problems(spec, layout, **kw)
    assert len(found) == 1 and needle in found[0], found


@pytest.mark.parametrize("spec, layout, kw", [
    (NANO, Layout(4, tp=4), {"sequence_parallel": True}),  # 2 KV heads over tp 4: megatron-core replicates them
    (NANO, Layout(8, tp=8, ep=8), {}),
    (NANO, Layout(64, cp=2, ep=4), {"sequence_parallel": False}),  # the Nano quickstart
    (NANO, Layout(16, pp=4, ep=4), {}),
    (SUPER, Layout(128, pp=8, cp=4, ep=4), {"sequence_parallel": False}),  # the Super quickstart
    (SUPER, Layout(64, pp=8, cp=2, ep=2), {"last_stage_layers": 4}),  # Bridge's 32K SFT recipe: 7 x 12 + 4
    (SUPER, Layout(24, pp=6), {"last_stage_layers": 8}),  # 5 x 16 + 8: an uneven pp 6 that splits
    (SUPER, Layout(16, tp=4, pp=4, ep=4), {}),
])
def test_layouts_megatron_core_accepts_pass(spec, layout, kw):
    assert model_shape_problems(spec, layout, **kw) == []


def test_the_pp_rule_is_megatron_cores_on_every_split():
    """Our statement of select_pipeline_segment's rule over many pattern lengths and stage counts (the Bridge harness
    runs megatron-core's own function on the same cases: tests/bridge/test_bridge_harness.py)."""
    from dataclasses import replace

    for layers in (1, 4, 7, 12, 52, 88):
        shape = replace(NANO.shape, num_layers=layers, hybrid_pattern="M" * layers)
        for pp in range(1, 13):
            assert (pp_shape_problem(shape, pp) is None) == (layers % pp == 0), (layers, pp)


def test_shape_fixes_are_nearest_first():
    fixes = shape_fixes(SUPER, Layout(24, tp=4, pp=6, ep=4))
    assert [(f.tp, f.pp, f.ep) for f in fixes] == [(4, 4, 4), (4, 8, 4)]


# ---- the findings, through the plans --------------------------------------------------------------------------
def test_nano_tp4_without_sequence_parallel_is_refused_by_the_training_preflight(capsys):
    assert train_main([*QUICKSTART, "--nodes", "16", "model.tensor_model_parallel_size=4",
                       "model.context_parallel_size=1"]) == 2
    errs = errors(capsys)
    assert any("tp(4) > 1 without sequence parallelism: megatron-core's MoE layers of nano refuse to train" in e
               for e in errs), errs
    # with sequence parallelism the same layout is one megatron-core builds (KV heads replicated over tp 4)
    assert train_main([*QUICKSTART, "--nodes", "16", "model.tensor_model_parallel_size=4",
                       "model.context_parallel_size=1", "model.sequence_parallel=true"]) == 0


def test_nano_pp3_over_52_layers_is_refused_by_the_training_preflight(capsys):
    assert train_main([*QUICKSTART, "--nodes", "3", "model.pipeline_model_parallel_size=3"]) == 2
    errs = errors(capsys)
    assert any("pp(3) does not split the 52-layer hybrid pattern of nano evenly" in e and "use pp 2 or pp 4" in e
               for e in errs), errs


@pytest.mark.parametrize("flags, needle", [
    (["--tp", "3", "--ep", "1"], "tp(3) does not divide the 32 attention heads of nano"),
    (["--ep", "3"], "ep(3) does not divide the 128 routed experts of nano"),
])
def test_export_plans_refuse_what_nano_cannot_split(flags, needle):
    from pipeline.cli.checkpoint import plan_from_argv as checkpoint_plan

    plan = checkpoint_plan(["export", "/c", "--hf-model", NANO.hf_id, "--no-reasoning", *flags], inputs_later=True)
    assert any(needle in p for p in plan.problems), plan.problems


@pytest.mark.parametrize("flags, needle", [
    (["--tp", "3"], "tp(3) does not divide the 32 attention heads of nano"),
    (["--ep", "3"], "ep(3) does not divide the 128 routed experts of nano"),
])
def test_coherence_megatron_plans_refuse_what_nano_cannot_split(flags, needle):
    plan = coherence_plan(["/c", "--backend", "megatron", "--hf-model", NANO.hf_id, *flags], 1)
    assert any(needle in p for p in plan.problems), plan.problems


def test_the_references_super_pp6_is_refused_with_the_nearest_layout_that_runs():
    plan = coherence_plan(["/c", "--backend", "megatron", "--hf-model", SUPER.hf_id, "--tp", "4", "--pp", "6",
                           "--ep", "4", "--max-tokens", "256"], 6)
    assert plan.problems == [
        "pp(6) does not split the 88-layer hybrid pattern of super evenly (88 % 6 = 4; select_pipeline_segment): "
        "megatron-core raises on every rank; use pp 4 or pp 8; the nearest layout that runs: --tp 4 --pp 4 --ep 4 on "
        "4 node(s)"]
    near = coherence_plan(["/c", "--backend", "megatron", "--hf-model", SUPER.hf_id, "--tp", "4", "--pp", "4",
                           "--ep", "4", "--max-tokens", "256"], 4)
    assert near.ok and (near.nodes, near.world) == (4, 16), near.problems
