"""The plan base (issue 65, steps 2 and 3): every job's plan is a ``jobs.plan.BasePlan`` with the same facts under the
same names. Training's plan is one, and what it records and prints is unchanged (``test_dry_runs_recorded.py`` compares
every shipped config's text and ``preflight.json`` with the recorded ones); so is each checkpoint-side job's (export,
upload-all, import, coherence, evaluation: their ``--dry-run`` text and ``--json`` record, recorded here)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from pipeline.checkpoint.plan import ExportJob, JobPlan, plan_export, plan_import
from pipeline.cli.checkpoint import plan_from_argv as checkpoint_plan
from pipeline.cli.coherence import plan_from_argv as coherence_plan
from pipeline.cli.evaluation import plan_from_argv as evaluation_plan
from pipeline.cli.train import plan_from_argv
from pipeline.coherence import backends
from pipeline.coherence.run import BACKENDS, CoherenceRun
from pipeline.common.errors import UserError
from pipeline.config.models import get_model
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
                           "  world 64 = 16 node(s) x 4 process(es);")
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
                     "memory_budget_gb", "env", "launch", "gpus_needed", "problems", "notes", "warnings", "profile",
                     "run_name"]
    assert all(f.kw_only for f in dataclasses.fields(BasePlan))
    plan = BasePlan(kind="export", model="m", engine="megatron", cluster="c", nodes=1, ranks_per_node=2,
                    layout=Layout(2, ep=2), memory_gb={"export": 10.04, "verify_hf": 12.06})
    assert plan.world == 2 and plan.memory_per_gpu_gb == 12.1 and plan.ok
    # a Plan's fields are the base's plus training's own; none of the base's is renamed or dropped
    assert set(names) < {f.name for f in dataclasses.fields(Plan)}


# ---- the checkpoint side (issue 65, step 3) ------------------------------------------------------------------
NANO, SUPER, SMOL = get_model("nano").hf_id, get_model("super").hf_id, get_model("smollm2-135m").hf_id
TINY_MOE = get_model("tiny-qwen3-moe").hf_id
JOBS = {  # a job's plan on a cluster profile, by its command line (cli/<job>.plan_from_argv) or its planner
    "export": lambda t: checkpoint_plan(["export", str(t), "--hf-model", NANO, "--no-reasoning"], inputs_later=True),
    "export-layout": lambda t: checkpoint_plan(["export", str(t), "--hf-model", SUPER, "--no-reasoning", "--tp", "2",
                                                "--ep", "8"], inputs_later=True),
    "export-missing": lambda t: checkpoint_plan(["export", str(t / "nope"), "--hf-model", NANO, "--no-reasoning"]),
    "export-local": lambda t: plan_export(ExportJob(t / "none", TINY_MOE, inputs_later=True)),
    "upload-all": lambda t: checkpoint_plan(["upload-all", str(t), "--hf-model", NANO, "--no-reasoning"]),
    "upload-all-local": lambda t: checkpoint_plan(["upload-all", str(t), "--hf-model", SMOL, "--no-reasoning"]),
    "import": lambda t: plan_import("nano", t / "nano"),
    "import-4-nodes": lambda t: plan_import("super", t / "super", nodes=4),
    "import-layout": lambda t: plan_import("nano", t / "nano", tp=2),
    "import-local": lambda t: plan_import(SMOL, t / "smol"),
    "coherence-hf": lambda t: coherence_plan([NANO]),
    "coherence-compare": lambda t: coherence_plan([SMOL, "--compare", SUPER, "--no-wandb"]),
    "coherence-2-nodes": lambda t: coherence_plan([SUPER], 2),
    "coherence-endpoint": lambda t: coherence_plan(["m", "--backend", "endpoint", "--endpoint-url", "http://x:1"], 1),
    "coherence-megatron": lambda t: coherence_plan(["/c", "--backend", "megatron", "--hf-model", SUPER, "--tp", "4",
                                                    "--pp", "4", "--ep", "4"], 4),
    "coherence-megatron-refused": lambda t: coherence_plan(["/c", "--backend", "megatron", "--hf-model", NANO,
                                                            "--tp", "4", "--ep", "8"], 2),
    "evaluate": lambda t: evaluation_plan([SMOL, "--tasks", "hellaswag"]),
}
RECORDED = ROOT / "tests" / "assets" / "job_plans"
RECORD = os.environ.get("PIPELINE_RECORD_DRY_RUNS") == "1"  # as test_dry_runs_recorded.py: re-record the set


def planned(job: str, cluster: str, tmp_path, monkeypatch) -> JobPlan:
    for name in [n for n in os.environ if n.startswith(("PIPELINE_", "SLURM_"))]:  # no allocation, the profile only
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIPELINE_CLUSTER", cluster)
    monkeypatch.setenv("USER", "alice")
    monkeypatch.chdir(ROOT)
    return JOBS[job](tmp_path)


@pytest.mark.parametrize("cluster", ["isambard_gh200", "local_cpu"])
@pytest.mark.parametrize("job", sorted(JOBS))
def test_each_checkpoint_side_job_plans_on_the_base_as_recorded(job, cluster, tmp_path, monkeypatch):
    """Every job's plan is a BasePlan whose text is the base's own; its ``--dry-run`` text and ``--json`` record are
    the ones recorded (tests/assets/job_plans/, before the plans moved onto the base: byte for byte)."""
    plan = planned(job, cluster, tmp_path, monkeypatch)
    assert isinstance(plan, BasePlan) and type(plan).format is BasePlan.format
    record = plan.as_dict()  # the --json keys its users read, each the base's fact under its old name
    assert (record["job"], record["world_size"], record["procs_per_node"]) == (plan.kind, plan.world,
                                                                              plan.ranks_per_node)
    common = BasePlan.as_dict(plan)
    assert {k: common[k] for k in ("model", "engine", "cluster", "nodes", "memory_per_gpu_gb", "ok", "problems")} \
        == {k: record[k] for k in ("model", "engine", "cluster", "nodes", "memory_per_gpu_gb", "ok", "problems")}
    out = (json.dumps(record, indent=2) + "\n" + plan.format() + "\n").replace(str(tmp_path), "<TMP>")
    path = RECORDED / f"{cluster}__{job}.txt"
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out.replace(str(ROOT), "<ROOT>"))
    assert out.replace(str(ROOT), "<ROOT>") == path.read_text(), f"{job} on {cluster} differs from {path.name}"


def test_every_recorded_job_plan_belongs_to_a_job():
    assert sorted(p.name for p in RECORDED.glob("*.txt")) == sorted(
        f"{c}__{j}.txt" for c in ("isambard_gh200", "local_cpu") for j in JOBS)


def test_gpus_per_node_is_asked_of_the_writer_and_the_backend_not_their_names(tmp_path, monkeypatch):
    """What JobPlan.gpus_per_node read from five words (megatron, local, hf, endpoint) is set where the plan is made,
    from the engine or backend object: none for a local-engine checkpoint or a served model, else a GPU per rank."""
    assert planned("export-local", "isambard_gh200", tmp_path, monkeypatch).gpus_per_node == 0
    assert planned("import-local", "isambard_gh200", tmp_path, monkeypatch).gpus_per_node == 0
    assert planned("coherence-endpoint", "isambard_gh200", tmp_path, monkeypatch).gpus_per_node == 0
    four = planned("import-4-nodes", "isambard_gh200", tmp_path, monkeypatch)
    assert four.gpus_per_node == four.ranks_per_node == 4 and four.gpus_needed is None
    assert planned("import", "local_cpu", tmp_path, monkeypatch).gpus_per_node == 1  # a Megatron import: one rank


def test_the_coherence_backends_are_objects():
    assert backends.NAMES == BACKENDS == ("hf", "endpoint", "megatron")
    assert [(b.reads_hf, b.reads_checkpoint, b.model_parallel, b.remote) for b in backends.BY_NAME.values()] == [
        (True, False, False, False), (False, False, False, True), (False, True, True, False)]
    assert backends.backend("megatron") is backends.MEGATRON and str(backends.ENDPOINT) == "endpoint"
    with pytest.raises(UserError, match="unknown backend 'vllm' \\(one of hf, endpoint, megatron\\)"):
        backends.backend("vllm")
    with pytest.raises(UserError, match="--tp/--pp/--ep apply to the megatron backend only"):
        CoherenceRun(model="m", backend="hf", tp=2).check()
    CoherenceRun(model="/c", backend="megatron", tp=2, hf_model=NANO).check()
