"""The megatron_cpu tier: megatron-core's and Megatron Bridge's OWN model code, run on CPU processes over gloo,
through the suite's own ``pipeline.bridge`` functions and CLIs, the way a cluster job calls them.

Where it runs: the Bridge harness venv (tests/bridge/setup_env.sh: Python 3.11, CPU torch, megatron-bridge 0.6.2,
megatron-core 0.19.2, transformers 5.12.1) with PYTHONPATH = tests/megatron_cpu/standin + src. The stand-in
(tests/megatron_cpu/standin/sitecustomize.py) maps the few CUDA-only calls onto the CPU and lists each one with its
reason; it chains the harness's import shim. Nothing of the suite imports either.

The model: a tiny Llama (4 layers, hidden 64, GQA 4/2 heads, untied output layer, a byte-level BPE tokenizer with a
ChatML template; tests/megatron_cpu/worker.py), because Bridge 0.6.2's LlamaBridge maps megatron-core's local (non-
Transformer-Engine) layer names to Hugging Face's. No Bridge 0.6.2 MoE bridge does (Qwen3-MoE maps only TE's fused
``linear_qkv.layer_norm_weight``; OLMoE and GLM only TE's grouped ``experts.linear_fc1.weight*``), so an expert-
parallel layout of a converted GPT-family checkpoint cannot run on CPU: ep 2 stops at Bridge's conversion (decisions
#53). Bridge's NemotronHBridge maps the local experts too: the tiny NemotronH exports at ep 2 (test_nemotron_h_cpu.py).
Nemotron-H's Mamba layers need mamba-ssm and causal-conv1d: the tier installs both (CUDA builds skipped) and maps
their kernels onto the libraries' references (standin/mamba_standin.py, test_mamba_kernels.py; decision 104); the
tiny NemotronH's import, export, generation and finetune() are test_nemotron_h_cpu.py's and
test_bridge_finetune_cpu.py's (decision 105).

What runs, for real: HF -> Megatron import (``pipeline.bridge.import_from_hf``: AutoBridge.import_ckpt, a torch_dist
checkpoint; and at tp 2 under torchrun through ``pipeline.cli.checkpoint import``, equal tensor for tensor); greedy generation through ``pipeline.cli.coherence --backend megatron`` (the plan's own torchrun launch
line) at tp 1, tp 2, pp 2 and pp 2 across 2 nodes of the local Slurm, each token for token equal to Hugging Face
greedy generation of the same weights; export at tp 2 through ``pipeline.cli.checkpoint export`` under torchrun
(Bridge's save_hf_pretrained gathering the shards, then the Megatron source's logits against the export): PASS and
published; the same export from a checkpoint with one shard perturbed: FAIL, nothing published.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.megatron_cpu.conftest import HERE, MAX_TOKENS, PROFILE, ROOT, VENV, tier_env, tier_run

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.slow]


def coherence_args(tiny, out: Path, *layout: str) -> list[str]:
    return ["-m", "pipeline.cli.coherence", str(tiny["meg"]), "--backend", "megatron", "--hf-model",
            str(tiny["hf"]), *layout, "--max-tokens", str(MAX_TOKENS), "--prompts", str(tiny["prompts"]),
            "--output-dir", str(out), "--no-wandb", "--allow-empty", "--quiet"]


def responses(out: Path) -> list[str]:
    report = json.loads((out / "coherence_megatron.json").read_text())
    return [row["response"] for row in report["results"][0]["rows"]]


def test_import_writes_a_torch_dist_checkpoint(tiny):
    """AutoBridge.import_ckpt through pipeline.bridge.import_from_hf on a CPU process: a torch_dist iteration the
    suite's layout recognises as Megatron's (Bridge's import writes no common.pt: the layout used to miss it)."""
    from pipeline.common import layout

    it = tiny["meg"] / "iter_0000000"
    assert json.loads((it / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert layout.engine_of(it) == "megatron" and layout.is_complete_dir(it)
    assert layout.latest_complete(tiny["meg"]) == 0


@pytest.mark.parametrize("layout", [("--tp", "1"), ("--tp", "2")], ids=["tp1", "tp2"])  # pp 2: 2 nodes, below
def test_greedy_generation_matches_hugging_face(tiny, layout):
    """The coherence CLI's megatron backend (it plans, then execs the plan's torchrun line for 2 ranks): every
    response equals Hugging Face greedy generation of the same weights, token for token (compared as the decoded
    text and its length)."""
    out = tiny["work"] / f"gen_{'_'.join(layout)}"
    r = tier_run([str(VENV / "bin" / "python"), *coherence_args(tiny, out, *layout)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert responses(out) == [g["text"] for g in tiny["greedy"]]


NODE_JOB = """#!/usr/bin/env bash
# One task per node, as pipeline_coherence_submit.sbatch runs: each node plans the job and execs its torchrun line.
set -euo pipefail
srun --ntasks-per-node=1 --kill-on-bad-exit=1 {python} {args}
"""


def test_greedy_generation_across_two_nodes_of_slurm(tiny, slurm):
    """pp 2 on a profile of one "GPU" per node: the plan spans 2 nodes of the local Slurm, and each node's
    pipeline.cli.coherence execs the plan's c10d torchrun line (a rank per node). Same tokens as Hugging Face."""
    from tests.integration.test_slurm import job_state, wait_job

    one_per_node = tiny["work"] / "one_per_node.yaml"
    one_per_node.write_text(PROFILE.read_text().replace("gpus_per_node: 2", "gpus_per_node: 1")
                            .replace("name: megatron_cpu_ranks", "name: megatron_cpu_one_rank"))
    out = tiny["work"] / "gen_2nodes"
    env = tier_env({"PIPELINE_CLUSTER": str(one_per_node), "SLURM_CONF": slurm["SLURM_CONF"]})
    plan = tier_run([str(VENV / "bin" / "python"), *coherence_args(tiny, out, "--pp", "2"), "--dry-run", "--json"],
                    env=env)
    assert plan.returncode == 0 and json.loads(plan.stdout)["nodes"] == 2, plan.stdout[-1000:]
    job = tiny["work"] / "job.sh"
    job.write_text(textwrap.dedent(NODE_JOB.format(python=VENV / "bin" / "python",
                                                   args=" ".join(coherence_args(tiny, out, "--pp", "2")))))
    sub = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--chdir={ROOT}",
                          f"--output={tiny['work'] / 'job-%j.out'}", str(job)], capture_output=True, text=True,
                         env=env, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    wait_job(env, job_id, timeout=300)
    log = next(tiny["work"].glob(f"job-{job_id}.out")).read_text()
    assert job_state(env, job_id) == "COMPLETED", log[-4000:]
    assert responses(out) == [g["text"] for g in tiny["greedy"]], log[-2000:]


def export(tiny, ckpt: Path, *layout: str) -> subprocess.CompletedProcess:
    return tier_run([str(VENV / "bin" / "python"), "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node=2", "-m", "pipeline.cli.checkpoint", "export", str(ckpt), "--iteration", "0",
                     "--hf-model", str(tiny["hf"]), "--no-reasoning", *layout])


def test_model_parallel_export_verifies_and_a_perturbed_shard_fails(tiny):
    """Export at tp 2 (every rank loads its shard; Bridge's save_hf_pretrained gathers) and its verification (the
    Megatron source's logits on the export's own layout against the export): PASS, published in hf/ with the
    weights equal to the original Hugging Face model's. Then one shard of a copy perturbed: FAIL, no hf/."""
    import torch
    from safetensors.torch import load_file

    ckpt = tiny["work"] / "export_src"
    shutil.copytree(tiny["meg"], ckpt)
    r = export(tiny, ckpt, "--tp", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    hf_out = ckpt / "iter_0000000" / "hf"
    rec = json.loads((hf_out / "verification.json").read_text())
    assert rec["verdict"] == "PASS", rec  # the export is loaded in bf16 for the check (export.py), as on GPUs
    want = load_file(tiny["hf"] / "model.safetensors")
    got = {}
    for f in hf_out.glob("*.safetensors"):
        got.update(load_file(f))
    assert set(got) == set(want) and all(torch.equal(want[k], got[k].to(want[k].dtype)) for k in want)

    bad = tiny["work"] / "export_bad"
    shutil.copytree(tiny["meg"], bad)
    r = tier_run([str(VENV / "bin" / "python"), str(HERE / "worker.py"), "perturb", str(bad / "iter_0000000")])
    assert r.returncode == 0, r.stderr[-2000:]
    r = export(tiny, bad, "--tp", "2")
    assert r.returncode != 0
    assert "FAILED verification" in r.stderr
    assert not (bad / "iter_0000000" / "hf").exists()
    assert json.loads((bad / "iter_0000000" / "hf_verification_FAILED.json").read_text())["verdict"] == "FAIL"


READ_DCP = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
    dcp_to_torch_save(src, dst)
"""


def test_a_model_parallel_import_under_torchrun_equals_the_single_process_one(tiny):
    """The import CLI at --tp 2 (it plans, then execs the plan's torchrun line: two ranks, each building its shard
    from the HF safetensors with Bridge's provider and saving it with save_megatron_model; decisions #83): one
    torch_dist checkpoint whose every tensor equals the single-process import's (AutoBridge.import_ckpt), read back
    whole with torch's own DCP reader. A second import to the same output is refused without --force."""
    import torch

    out = tiny["work"] / "import_tp2"
    args = [str(VENV / "bin" / "python"), "-m", "pipeline.cli.checkpoint", "import", str(tiny["hf"]), "--output",
            str(out), "--tp", "2"]
    plan = tier_run([*args, "--dry-run", "--json"])
    assert plan.returncode == 0 and json.loads(plan.stdout)["launch"][:4] == [
        "torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2"], plan.stdout
    r = tier_run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "launching: torchrun --standalone --nnodes=1 --nproc-per-node=2" in r.stdout
    assert r.stdout.count(f"imported {tiny['hf']} -> {out}") == 1  # rank 0 reports
    it = out / "iter_0000000"
    assert sorted(f.name for f in it.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # each rank its shard
    assert not (out.parent / f".{out.name}.importing").exists()
    one, two = tiny["work"] / "import_tp1.pt", tiny["work"] / "import_tp2.pt"
    r = tier_run([str(VENV / "bin" / "python"), "-c", READ_DCP, str(tiny["meg"] / "iter_0000000"), str(one),
                  str(it), str(two)])
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    assert set(a) == set(b) and len(tensors) >= 9
    assert all(torch.equal(a[k], b[k]) for k in tensors)
    again = tier_run(args)
    assert again.returncode == 2 and again.stderr == f"error: {out} already holds a checkpoint; --force to overwrite\n"


def test_every_stand_in_is_named_in_its_header_and_the_suite_imports_none(tiny):
    """What the stand-ins really replaced once megatron is imported (PATCHED: the model stand-in, and with
    MEGATRON_CPU_TRAINING=1 the training loop's), each of a kind the tier allows ([cuda] or [kernel], decision 90)
    and named in its file's header; nothing the tier runs for real (compile_helpers, NVRx, the JIT warm-up) is
    patched; and no module of the suite refers to the stand-in."""
    probe = ("import sitecustomize, megatron.core.tensor_parallel.random, megatron.core.transformer.utils, "
             "megatron.core.pipeline_parallel.schedules, megatron.bridge.models.gpt_provider, "
             "megatron.bridge.peft.utils, megatron.bridge.peft.module_matcher, megatron.bridge.training.setup, "
             "megatron.bridge.training.initialize, megatron.bridge.training.pretrain, "
             "megatron.core.optimizer.distrib_optimizer, megatron.core.optimizer.optimizer, "
             "megatron.bridge.models.hybrid.hybrid_provider, megatron.core.post_training.modelopt.hybrid.model_specs, "
             "megatron.core.models.hybrid.hybrid_block, megatron.core.transformer.moe.token_dispatcher, "
             "megatron.core.transformer.moe.shared_experts, megatron.core.transformer.moe.moe_layer, "
             "megatron.bridge.training.model_load_save, mamba_ssm.ops.triton.layernorm_gated; "
             "print(repr(sitecustomize.PATCHED))")
    r = tier_run([str(VENV / "bin" / "python"), "-c", probe], env=tier_env({"MEGATRON_CPU_TRAINING": "1"}))
    assert r.returncode == 0, r.stderr[-2000:]
    patched = ast.literal_eval(r.stdout.strip().splitlines()[-1])  # the (label, kind) pairs the probe printed
    header = "".join(line for f in ("sitecustomize.py", "training_standin.py", "mamba_standin.py")
                     for line in (HERE / "standin" / f).read_text().splitlines(True) if line.startswith("#"))
    assert len(patched) >= 40
    assert {kind for _, kind in patched} == {"cuda", "kernel"}
    for label, _kind in patched:
        if ": torch." in label:  # a module's own torch (its "cuda" factories): the header names the factories
            name = label.split(": ", 1)[1].split("(")[0]
        else:
            name = label.split(" ")[0].split(":")[0].split("(")[0].split(".")[-1]
        assert name in header, f"{label} is patched but its header does not name it"
        assert not any(w in label for w in ("compile_helpers", "CallWrapper", "_warmup_jit_function")), label
    for f in (ROOT / "src").rglob("*.py"):
        assert "megatron_cpu/standin" not in f.read_text(), f  # the tier's worker may be reused; its stand-in never
