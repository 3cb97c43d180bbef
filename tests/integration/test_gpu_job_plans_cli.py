"""The GPU jobs other than training, planned before they are queued (issue 21), through the real scripts: dry runs
need no torch and exit 2 on an impossible layout (moved from tests/unit/test_gpu_job_plans.py: these tests run
processes)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from pipeline.checkpoint.plan import ExportJob, plan_export
from pipeline.cli.coherence import plan_from_argv as coherence_plan
from tests.helpers import ROOT, megatron_checkpoint, run
from tests.unit.test_gpu_job_plans import (  # noqa: F401  (isambard: the autouse fixture)
    NANO,
    PROBE_ENV,
    SUPER,
    isambard,
    probe_profile,
)

RUN = "/projects/a5k/public/checkpoints/run"  # a megatron checkpoint inside the Isambard profile's binds


@pytest.fixture(autouse=True)
def _checkpoints_are_not_read(monkeypatch):
    """The in-process plans here are about layouts: the megatron checkpoint they name is not read (that rule's tests:
    tests/unit/test_audit_issue34.py); the processes below get a checkpoint that exists."""
    monkeypatch.setattr("pipeline.coherence.plan._checkpoint_problem", lambda cfg: None)


def test_the_references_megatron_coherence_layout_nearest_that_runs_plans_16_ranks_on_4_nodes():
    """The reference's --tp 4 --pp 6 --ep 4 on 6 nodes cannot run Super (88 layers in 6 stages: issue 34); the
    nearest layout that does, --pp 4, is 16 ranks on 4 nodes."""
    six = coherence_plan([RUN, "--backend", "megatron", "--hf-model", SUPER, "--tp", "4", "--pp", "6",
                          "--ep", "4", "--max-tokens", "256"], 6)
    assert not six.ok and "the nearest layout that runs: --tp 4 --pp 4 --ep 4 on 4 node(s)" in six.problems[-1]
    plan = coherence_plan([RUN, "--backend", "megatron", "--hf-model", SUPER, "--tp", "4", "--pp", "4",
                           "--ep", "4", "--max-tokens", "256"], 4)
    d = plan.as_dict()
    assert (d["world_size"], d["nodes"], d["procs_per_node"], d["tp"], d["pp"], d["ep"], d["etp"], d["dp"]) == \
        (16, 4, 4, 4, 4, 4, 1, 1)
    assert plan.ok and 0 < d["memory_per_gpu_gb"] < 95
    launch = plan.launch
    assert launch[:3] == ["torchrun", "--nnodes=4", "--nproc-per-node=4"] and "--rdzv-backend=c10d" in launch
    assert launch[launch.index("-m") + 1] == "pipeline.cli.coherence"
    # the old layout arithmetic (ranks = tp * pp * ep = 64, one node) is gone; a 1-node allocation is told the count
    short = coherence_plan([RUN, "--backend", "megatron", "--hf-model", SUPER, "--tp", "4", "--pp", "4",
                            "--ep", "4"], 1)
    assert not short.ok and "needs 4 node(s) of 4 GPUs (16 ranks), and the allocation has 1: submit it with " \
        "--nodes=4" in short.problems[0]


@pytest.mark.parametrize("hf_model, export_gb", [(NANO, 26.1), (SUPER, 77.8)])
def test_nano_and_super_exports_plan_ep4_on_one_node_and_fit(hf_model, export_gb):
    # planned before training wrote it
    plan = plan_export(ExportJob(ROOT / "no-such-run", hf_model, inputs_later=True, strict=False))
    d = plan.as_dict()
    assert (d["world_size"], d["nodes"], d["procs_per_node"], d["tp"], d["pp"], d["ep"]) == (4, 1, 4, 1, 1, 4)
    assert plan.ok, plan.problems
    assert d["memory_gb"]["export"] == export_gb and d["memory_per_gpu_gb"] <= 95
    # the verification's HF side: Nano (63 GB) on one GPU, Super (240 GB) over the node's four
    assert d["memory_gb"]["verify_hf"] == (68.2 if hf_model == NANO else 65.0)
    assert plan.launch[:4] == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=4"]


def test_dry_runs_need_no_torch_and_exit_2_on_an_impossible_layout(tmp_path):
    """The login node's planner has no torch, transformers or Megatron: the plans import none of them."""
    code = ("import sys; from pipeline.cli.checkpoint import plan_from_argv as c; "
            "from pipeline.cli.coherence import plan_from_argv as g; "
            f"c(['export', '/c', '--hf-model', {SUPER!r}, '--no-reasoning']); c(['import', 'nano']); "
            f"g(['/c', '--backend', 'megatron', '--hf-model', {SUPER!r}]); g([{NANO!r}]); "
            "print(sorted(m for m in ('torch', 'transformers', 'megatron', 'safetensors') if m in sys.modules))")
    # /c is bound into the container (decisions #55): these plans are about layouts and missing checkpoints
    env = {**os.environ, "PIPELINE_CLUSTER": "isambard_gh200", "PIPELINE_BINDS": "/c"}
    res = run([sys.executable, "-c", code], env=env, timeout=120)
    # the launcher plans in the login node's planner when the container is not there (the venv stands in for it)
    env["PIPELINE_PLANNER_VENV"] = str(ROOT / ".venv")
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
    res = run(["bash", "pipeline_checkpoint_convert.sh", "export", "/c", "--hf-model", NANO, "--no-reasoning",
               "--dry-run", "--json"], env=env, timeout=120)
    assert res.returncode == 2 and res.stderr == "error: checkpoint directory /c does not exist\n"
    res = run(["bash", "pipeline_checkpoint_convert.sh", "upload-all", "/c", "--hf-model", NANO, "--no-reasoning",
               "--poll", "--dry-run", "--json"], env=env, timeout=120)  # upload-all --poll may wait for training
    d = json.loads(res.stdout)
    assert res.returncode == 0 and {"world_size", "nodes", "procs_per_node", "tp", "pp", "ep",
                                    "memory_per_gpu_gb"} <= set(d)
    # the reference's "Upload all iterations" pushes; ours pushes only with --push-to-hub, and the plan says so
    # (issue 59, item 3: it said verdict OK and never that nothing would be pushed)
    nothing = "upload-all converts each iteration to <iteration>/hf/ on this filesystem and pushes nothing to the " \
              "Hugging Face Hub: add --push-to-hub to upload each one"
    assert any(nothing in n for n in d["notes"]), d["notes"]
    res = run(["bash", "pipeline_checkpoint_convert.sh", "upload-all", "/c", "--hf-model", NANO, "--no-reasoning",
               "--poll", "--dry-run"], env=env, timeout=120)
    assert res.returncode == 0 and f"note: {nothing}" in res.stdout, res.stdout + res.stderr
    res = run(["bash", "pipeline_checkpoint_convert.sh", "upload-all", "/c", "--hf-model", NANO, "--no-reasoning",
               "--poll", "--push-to-hub", "--dry-run"], env={**env, "HF_HUB_OFFLINE": "0"}, timeout=120)
    assert "pushes nothing" not in res.stdout and "--push-to-hub: each iteration goes to" in res.stdout, res.stdout
    res = run([sys.executable, "pipeline_coherence_test.py", "/c", "--backend", "megatron", "--hf-model", NANO,
               "--tp", "4", "--ep", "8", "--dry-run", "--nodes", "2"], env=env, timeout=120)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("error: ep(8) * etp(1) = 8 > ")


def test_the_dry_runs_of_export_upload_all_and_coherence_show_the_profiles_env(tmp_path):
    """Through the real scripts, the profile selected with PIPELINE_CLUSTER=PATH: the launch line starts with the
    environment the launch sets (NAME=value), and --json has it as "env" (issue 32, item 8)."""
    env = {**os.environ, "PIPELINE_CLUSTER": str(probe_profile(tmp_path)), "PIPELINE_PLANNER_VENV": str(ROOT / ".venv")}
    export = run(["bash", "pipeline_checkpoint_convert.sh", "upload-all", str(tmp_path / "c"), "--hf-model", NANO,
                  "--no-reasoning", "--poll", "--dry-run"], env=env, timeout=120)
    assert export.returncode == 0, export.stderr
    assert "  launch (each node): PIPELINE_PROBE_VAR=marker NCCL_NET='AWS Libfabric' torchrun --standalone " \
        in export.stdout, export.stdout
    coherence = run([sys.executable, "pipeline_coherence_test.py", str(megatron_checkpoint(tmp_path / "mc")),
                     "--backend", "megatron", "--hf-model", SUPER,
                     "--tp", "4", "--pp", "4", "--ep", "4", "--dry-run", "--nodes", "4", "--json"], env=env,
                    timeout=120)
    d = json.loads(coherence.stdout)
    assert coherence.returncode == 0 and d["env"] == PROBE_ENV and d["launch"][0] == "torchrun", coherence.stderr
