"""The plan base (issue 65, step 2): every job's plan is a ``jobs.plan.BasePlan`` with the same facts under the same
names; training's plan is one, and what it records and prints is unchanged (``test_dry_runs_recorded.py`` compares
every shipped config's text and ``preflight.json`` with the recorded ones)."""

from __future__ import annotations

import dataclasses
import json

from pipeline.cli.train import plan_from_argv
from pipeline.config.parallel import Layout
from pipeline.jobs.plan import BasePlan
from pipeline.training.preflight import Plan
from tests.helpers import ROOT

NANO_16 = [str(ROOT / "configs/quickstart/nemotron_nano_quickstart_sft.yaml"), "--model", "nano", "--mode", "sft",
           "--dry-run", "--no-path-checks", "--nodes", "16", "--cluster", "isambard_gh200"]


def test_training_plans_on_the_base_with_its_launch_facts(tmp_path):
    launch = plan_from_argv([*NANO_16, "--run-dir", str(tmp_path / "run"), f"checkpoint.save={tmp_path}/save"])
    plan = launch.preflight
    assert isinstance(plan, BasePlan) and issubclass(Plan, BasePlan) and plan.ok
    assert (plan.kind, plan.model, plan.engine, plan.cluster) == ("train", "nano", "megatron_bridge", "isambard_gh200")
    assert (plan.nodes, plan.ranks_per_node, plan.world) == (16, 4, 64) == (launch.nodes, 4, plan.layout.world)
    # the launch line is made once, when planned, and is the one the launcher runs; env is the ranks' environment
    assert plan.launch == launch.command() and plan.launch[0] == "ft_launcher" and "--nnodes=16" in plan.launch
    assert plan.env == launch.env and plan.env["NCCL_NET"] == "AWS Libfabric"
    # one phase, training, of the estimate's total; memory_gb keeps its parts (the record and the dry run show them)
    assert plan.memory_phases() == {"train": plan.memory_gb["total"]}
    assert plan.memory_per_gpu_gb == round(plan.memory_gb["total"], 1) <= plan.memory_budget_gb
    assert {"weights", "grads", "optimizer", "activations", "logits", "overhead"} < set(plan.memory_gb)


def test_the_base_record_and_text_of_a_training_plan(tmp_path):
    plan = plan_from_argv([*NANO_16, "--run-dir", str(tmp_path / "run"), f"checkpoint.save={tmp_path}/save"]).preflight
    common = BasePlan.as_dict(plan)
    json.dumps(common)  # JSON as it stands
    assert {k: common[k] for k in ("kind", "model", "engine", "cluster", "nodes", "ranks_per_node", "world", "tp",
                                   "ep", "dp", "memory_per_gpu_gb", "ok")} == {
        "kind": "train", "model": "nano", "engine": "megatron_bridge", "cluster": "isambard_gh200", "nodes": 16,
        "ranks_per_node": 4, "world": 64, "tp": plan.layout.tp, "ep": plan.layout.ep, "dp": plan.layout.dp,
        "memory_per_gpu_gb": plan.memory_per_gpu_gb, "ok": True}
    assert common["launch"] == plan.launch and common["env"] == plan.env
    text = BasePlan.format(plan)
    assert text.startswith("plan: train of nano (megatron_bridge) on cluster profile 'isambard_gh200'\n"
                           "  world 64 = 16 node(s) x 4 rank(s);")
    assert f"memory per GPU: {plan.memory_per_gpu_gb:.1f} GB of {plan.memory_budget_gb:g} GB (phases: train " in text
    assert "ft_launcher" in text and text.endswith("verdict: OK")
    # training's own record keeps the keys preflight.json always had (no kind, env or launch: records hold those)
    assert not {"kind", "env", "launch"} & set(plan.as_dict())


def test_a_refused_training_plan_launches_nothing(tmp_path):
    launch = plan_from_argv([*NANO_16, "--run-dir", str(tmp_path / "run"), f"checkpoint.save={tmp_path}/save",
                            "model.tensor_model_parallel_size=3"])
    plan = launch.preflight
    assert not plan.ok and plan.launch == []
    assert BasePlan.format(plan).endswith(f"verdict: REFUSED ({len(plan.problems)} problem(s))")
    assert BasePlan.as_dict(plan)["problems"] == plan.problems


def test_the_base_is_keyword_only_and_its_names_are_the_ones_every_plan_uses():
    names = [f.name for f in dataclasses.fields(BasePlan)]
    assert names == ["kind", "model", "engine", "cluster", "nodes", "ranks_per_node", "layout", "memory_gb",
                     "memory_budget_gb", "env", "launch", "problems", "notes"]
    assert all(f.kw_only for f in dataclasses.fields(BasePlan))
    plan = BasePlan(kind="export", model="m", engine="megatron", cluster="c", nodes=1, ranks_per_node=2,
                    layout=Layout(2, ep=2), memory_gb={"export": 10.04, "verify_hf": 12.06})
    assert plan.world == 2 and plan.memory_per_gpu_gb == 12.1 and plan.ok
    # a Plan's fields are the base's plus training's own; none of the base's is renamed or dropped
    assert set(names) < {f.name for f in dataclasses.fields(Plan)}
