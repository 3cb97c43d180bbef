"""The megatron_cpu tier, the flagship (hybrid Mamba + MoE) family (issue 61, item 3): a tiny NemotronH with the Nano
pattern's layer kinds (Mamba-2, attention, Mamba-2, MoE with 4 routed experts, 2 per token, and a shared expert),
built by transformers' own NemotronH, converted by Bridge's own NemotronHBridge and HybridModelProvider, through the
suite's own CLIs, on CPU processes with the tier's stand-ins (standin/mamba_standin.py: every Mamba kernel onto its
library's reference, the TE layers onto megatron-core's local ones, the MoE's CUDA streams onto the CPU's).

What runs, for real: HF -> Megatron import (``pipeline.cli.checkpoint import``: AutoBridge.import_ckpt), a
torch_dist checkpoint under the Transformer Engine stack's key names; Megatron -> HF export (``pipeline.cli.checkpoint
export``: AutoBridge.export_ckpt, then the suite's verification, the Megatron source's logits against the export's):
PASS, published, every tensor equal to the original; the same export of a checkpoint whose Mamba weight's bytes are
broken: FAIL, nothing published. Greedy generation through ``pipeline.cli.coherence --backend megatron`` at tp 1 and
tp 2 (the Mamba heads and groups split over two ranks), token for token equal to Hugging Face's greedy generation of
the same weights (item 4 with the tp 2 import and export below). Issue 62's first step: the export at ep 2 (the
alltoall dispatcher over gloo in the verification's forward), verified and equal to the original; a broken expert
FAILs; the import at ep 2 equal to the single-process one; greedy generation at ep 2 and at tp 2 x ep 2 with the
alltoall dispatcher, equal to Hugging Face's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.megatron_cpu.conftest import HERE, VENV, tier_env, tier_run
from tests.megatron_cpu.test_megatron_cpu import READ_DCP, coherence_args, responses

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.slow]

MAMBA_WEIGHT = "decoder.layers.0.mixer.out_proj.weight"


def export(ckpt: Path, hf: Path):
    return tier_run([str(VENV / "bin" / "python"), "-m", "pipeline.cli.checkpoint", "export", str(ckpt),
                     "--iteration", "0", "--hf-model", str(hf), "--no-reasoning"], timeout=600)


def exported_and_original(nemotron_h: dict, hf_out: Path) -> tuple[dict, dict]:
    """(the export's tensors, the original Hugging Face model's), each name -> tensor."""
    from safetensors.torch import load_file

    got = {}
    for f in hf_out.glob("*.safetensors"):
        got.update(load_file(f))
    return got, load_file(nemotron_h["hf"] / "model.safetensors")


def unequal(want: dict, got: dict) -> list[str]:
    """The names whose export differs from the original (compared in the original's dtype)."""
    import torch

    return [k for k in want if not torch.equal(want[k], got[k].to(want[k].dtype))]


def read_back(nemotron_h: dict, it: Path, name: str) -> tuple[dict, dict, list[str]]:
    """The single-process import and the iteration ``it``, each read back whole with torch's DCP reader: (one, two,
    the names of one's tensors)."""
    import torch

    one, two = nemotron_h["work"] / "import_tp1.pt", nemotron_h["work"] / f"{name}.pt"
    r = tier_run([str(VENV / "bin" / "python"), "-c", READ_DCP, str(nemotron_h["meg"] / "iter_0000000"), str(one),
                  str(it), str(two)])
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    return a, b, [k for k in a if isinstance(a[k], torch.Tensor)]


def test_nemotron_h_imports_under_the_transformer_engine_stacks_names(nemotron_h):
    """The import is a torch_dist iteration the suite recognises, and its keys are the TE hybrid stack's (the local
    stack's layer norms remapped onto the TE linears' ``layer_norm_weight``; the experts in the grouped layout):
    the names a cluster's TE model asks its checkpoint for, whatever layers wrote it."""
    from torch.distributed.checkpoint import FileSystemReader

    from pipeline.common import layout

    it = nemotron_h["meg"] / "iter_0000000"
    assert layout.engine_of(it) == "megatron" and layout.latest_complete(nemotron_h["meg"]) == 0
    keys = set(FileSystemReader(str(it)).read_metadata().state_dict_metadata)
    for key in ("decoder.layers.0.mixer.in_proj.layer_norm_weight", "decoder.layers.0.mixer.A_log",
                "decoder.layers.0.mixer.conv1d.weight.x", "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
                "decoder.layers.3.mlp.experts.experts.linear_fc1.weight", "decoder.layers.3.mlp.router.expert_bias",
                "decoder.layers.3.mlp.shared_experts.linear_fc1.weight", "decoder.final_norm.weight"):
        assert key in keys, (key, sorted(keys))
    assert not any(k.endswith(("mixer.norm_in.weight", ".input_layernorm.weight")) for k in keys)


def test_nemotron_h_export_equals_the_original_and_verifies(nemotron_h):
    """Export (one process) and its verification: PASS, published in hf/, the file set exactly NemotronH's, and
    every tensor equal to the original Hugging Face model's (Mamba A_log, D, conv, dt bias, gated norm, in/out
    projections; attention; router, expert bias, experts, shared expert; embeddings and head)."""
    ckpt = nemotron_h["work"] / "export_src"
    shutil.copytree(nemotron_h["meg"], ckpt)
    r = export(ckpt, nemotron_h["hf"])
    assert r.returncode == 0, r.stderr[-3000:]
    hf_out = ckpt / "iter_0000000" / "hf"
    rec = json.loads((hf_out / "verification.json").read_text())
    assert rec["verdict"] == "PASS" and rec["file_set_problems"] == [], rec
    got, want = exported_and_original(nemotron_h, hf_out)
    assert set(got) == set(want), set(got) ^ set(want)
    assert any(".mixer.A_log" in k for k in want) and any(".mixer.experts." in k for k in want)
    assert unequal(want, got) == []


def test_nemotron_h_export_of_a_broken_mamba_weight_fails_and_publishes_nothing(nemotron_h):
    """The Mamba mixer's out_proj bytes broken in the torch_dist shard (worker.py perturb): the export's
    verification FAILs on the source's non-finite logits, hf_verification_FAILED.json records it, no hf/."""
    bad = nemotron_h["work"] / "export_bad"
    shutil.copytree(nemotron_h["meg"], bad)
    r = tier_run([str(VENV / "bin" / "python"), str(HERE / "worker.py"), "perturb", str(bad / "iter_0000000"),
                  MAMBA_WEIGHT])
    assert r.returncode == 0, r.stderr[-2000:]
    r = export(bad, nemotron_h["hf"])
    assert r.returncode != 0 and "FAILED verification" in r.stderr, r.stderr[-2000:]
    assert not (bad / "iter_0000000" / "hf").exists()
    rec = json.loads((bad / "iter_0000000" / "hf_verification_FAILED.json").read_text())
    assert rec["verdict"] == "FAIL" and any("not finite" in f for f in rec["failures"]), rec["failures"]


@pytest.mark.parametrize("layout", [("--tp", "1"), ("--tp", "2"), ("--ep", "2"), ("--tp", "2", "--ep", "2")],
                         ids=["tp1", "tp2", "ep2", "tp2-ep2"])
def test_nemotron_h_greedy_generation_matches_hugging_face(nemotron_h, layout):
    """The coherence CLI's megatron backend (the plan's torchrun line past one rank): every response equals Hugging
    Face greedy generation of the same weights (transformers' NemotronH on its pure-torch path), token for token.
    Issue 62, generation: at ep 2 (two ranks, two experts each) and at tp 2 x ep 2 (the plan folds the expert grid
    onto the two tensor-parallel ranks: world lcm(2, 2) = 2), the MoE layers built megatron-core's alltoall token
    dispatcher (the report records the class the model holds) and exchange tokens over gloo's all_to_all."""
    out = nemotron_h["work"] / f"gen_{'_'.join(layout)}"
    r = tier_run([str(VENV / "bin" / "python"), *coherence_args(nemotron_h, out, *layout)], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert responses(out) == [g["text"] for g in nemotron_h["greedy"]]
    sizes = dict(zip(layout[::2], map(int, layout[1::2]), strict=True))
    tp, ep = sizes.get("--tp", 1), sizes.get("--ep", 1)
    got = json.loads((out / "coherence_megatron.json").read_text())["results"][0]["layout"]
    assert got == {"tp": tp, "pp": 1, "ep": ep, "world": max(tp, ep), "experts": 4, "experts_per_rank": 4 // ep,
                   "moe_token_dispatcher_type": "alltoall", "moe_dispatcher": "MoEAlltoAllTokenDispatcher"}, got
    if ep > 1:
        assert f"--nproc-per-node={max(tp, ep)}" in r.stdout


def test_nemotron_h_tp2_import_equals_the_single_process_one_and_its_tp2_export_verifies(nemotron_h):
    """Item 4: the import CLI at --tp 2 (two ranks, each building its shard from the HF safetensors with Bridge's
    hybrid provider; decisions #83) writes one checkpoint whose every tensor equals the single-process import's
    (read back whole with torch's DCP reader); the export of it at --tp 2 under torchrun (every rank loads its shard,
    Bridge gathers) verifies, PASS, with every tensor equal to the original Hugging Face model's."""
    import torch

    out = nemotron_h["work"] / "import_tp2"
    r = tier_run([str(VENV / "bin" / "python"), "-m", "pipeline.cli.checkpoint", "import", str(nemotron_h["hf"]),
                  "--output", str(out), "--tp", "2"], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    it = out / "iter_0000000"
    assert sorted(f.name for f in it.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    a, b, tensors = read_back(nemotron_h, it, "import_tp2")
    assert set(a) == set(b) and any(".mixer.in_proj.weight" in k for k in tensors)
    assert [k for k in tensors if not torch.equal(a[k], b[k])] == []

    r = tier_run([str(VENV / "bin" / "python"), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                  "-m", "pipeline.cli.checkpoint", "export", str(out), "--iteration", "0", "--hf-model",
                  str(nemotron_h["hf"]), "--no-reasoning", "--tp", "2"], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((it / "hf" / "verification.json").read_text())["verdict"] == "PASS"
    got, want = exported_and_original(nemotron_h, it / "hf")
    assert set(got) == set(want) and unequal(want, got) == []


RENAME = """
import sys
from safetensors.torch import load_file, save_file
t = load_file(sys.argv[1]); t[sys.argv[3]] = t.pop(sys.argv[2]); save_file(t, sys.argv[1], metadata={"format": "pt"})
"""


def test_an_import_that_would_leave_a_weight_at_random_init_is_refused(nemotron_h):
    """The same model saved with transformers 5.12's name for its embedding (``backbone.embedding.weight``, which
    transformers loads and Bridge 0.6.2's NemotronHBridge does not map): Bridge's import only warns and leaves the
    embedding at its random initialisation; the suite's import refuses it, one line, exit 2, nothing written."""
    hf = nemotron_h["work"] / "hf_transformers_names"
    shutil.copytree(nemotron_h["hf"], hf)
    r = tier_run([str(VENV / "bin" / "python"), "-c", RENAME, str(hf / "model.safetensors"),
                  "backbone.embeddings.weight", "backbone.embedding.weight"])
    assert r.returncode == 0, r.stderr[-2000:]
    out = nemotron_h["work"] / "import_refused"
    r = tier_run([str(VENV / "bin" / "python"), "-m", "pipeline.cli.checkpoint", "import", str(hf), "--output",
                  str(out)], timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: {hf}: Megatron Bridge found no Hugging Face tensor for 1 Megatron weight(s), which "
                      "would keep their random initialisation (Can't find backbone.embeddings.weight in hf_keys); the "
                      "import is refused and nothing is written (is the checkpoint in the Hub's naming for its "
                      "architecture?)"], errors
    assert not out.exists() and not (out.parent / f".{out.name}.importing").exists()


EXPERT_WEIGHT = "decoder.layers.3.mlp.experts.experts.linear_fc1.weight"


def test_nemotron_h_ep2_export_verifies_equal_to_the_original_and_a_broken_expert_fails(nemotron_h):
    """Issue 62, export: ``pipeline_checkpoint_convert.sh export`` at --ep 2, the user's command (it activates the
    job's venv, here the harness venv, whose completion stamp stands for the setup's ready marker, then the export
    CLI plans and execs the plan's torchrun line: two ranks, two experts each; the verification's Megatron forward
    runs the alltoall dispatcher over gloo): PASS, with every tensor equal to the original Hugging Face model's, so
    equal to the ep 1 export's (test above). The last expert's bytes broken in the shard (on EP rank 1): FAIL, no
    hf/."""
    env = tier_env({"PIPELINE_VENV": str(VENV), "PIPELINE_ENV_READY": str(VENV / ".harness-pins")})

    def export_ep2(ckpt: Path):
        return tier_run(["bash", "pipeline_checkpoint_convert.sh", "export", str(ckpt), "--iteration", "0",
                         "--hf-model", str(nemotron_h["hf"]), "--no-reasoning", "--ep", "2"], env=env, timeout=600)

    ckpt = nemotron_h["work"] / "export_ep2"
    shutil.copytree(nemotron_h["meg"], ckpt)
    r = export_ep2(ckpt)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "launching: torchrun --standalone --nnodes=1 --nproc-per-node=2" in r.stdout
    hf_out = ckpt / "iter_0000000" / "hf"
    assert json.loads((hf_out / "verification.json").read_text())["verdict"] == "PASS"
    got, want = exported_and_original(nemotron_h, hf_out)
    assert set(got) == set(want) and unequal(want, got) == []

    bad = nemotron_h["work"] / "export_ep2_bad"
    shutil.copytree(nemotron_h["meg"], bad)
    r = tier_run([str(VENV / "bin" / "python"), str(HERE / "worker.py"), "perturb", str(bad / "iter_0000000"),
                  EXPERT_WEIGHT])
    assert r.returncode == 0, r.stderr[-2000:]
    r = export_ep2(bad)
    assert r.returncode != 0 and "FAILED verification" in r.stderr, r.stderr[-2000:]
    assert not (bad / "iter_0000000" / "hf").exists()
    assert json.loads((bad / "iter_0000000" / "hf_verification_FAILED.json").read_text())["verdict"] == "FAIL"


def test_nemotron_h_ep2_import_equals_the_single_process_one(nemotron_h):
    """Issue 62, import: the import CLI at --ep 2 (two ranks, each building its two experts and the replicated rest
    from the HF safetensors) writes one checkpoint whose every tensor, the stacked experts included, equals the
    single-process import's (read back whole with torch's DCP reader)."""
    import torch

    out = nemotron_h["work"] / "import_ep2"
    r = tier_run([str(VENV / "bin" / "python"), "-m", "pipeline.cli.checkpoint", "import", str(nemotron_h["hf"]),
                  "--output", str(out), "--ep", "2"], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "launching: torchrun --standalone --nnodes=1 --nproc-per-node=2" in r.stdout
    a, b, tensors = read_back(nemotron_h, out / "iter_0000000", "import_ep2")
    assert set(a) == set(b) and EXPERT_WEIGHT in tensors
    assert [k for k in tensors if not torch.equal(a[k], b[k])] == []
