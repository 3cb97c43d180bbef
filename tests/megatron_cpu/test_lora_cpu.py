"""A LoRA iteration exported on CPU with Megatron Bridge's real code (issue 32, item 5): a tiny Llama imported with
``pipeline.bridge.import_from_hf``, a Bridge LoRA checkpoint on it (worker.py make-lora: Bridge's LoRA transform,
nonzero adapters, the adapter-only save), then the suite's export CLI. The published ``hf/`` must be base + adapters:
its fp32 logits equal those of the Megatron base + adapters that make-lora computed before saving, and differ from
the base's. Runs in the Bridge harness venv with the tier's CUDA stand-in (tests/megatron_cpu/standin)."""

from __future__ import annotations

import json

import pytest

from pipeline import bridge
from tests.megatron_cpu.conftest import HERE, VENV, tier_run

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.slow]

CHECK = """
import json, sys, torch
from transformers import AutoModelForCausalLM
ref = torch.load(sys.argv[1])
out = {}
for name, path in (("export", sys.argv[2]), ("base", sys.argv[3])):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out[name] = float((m(ref["input_ids"]).logits - ref["logits"]).abs().max())
print(json.dumps(out))
"""


def _run(*args: str, timeout: int = 600) -> str:
    r = tier_run([str(VENV / "bin" / "python"), *args], timeout=timeout)
    assert r.returncode == 0, f"{args[:3]} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_a_lora_iteration_exports_merged_and_verified(tiny, tmp_path):
    hf, meg, lora = tiny["hf"], tiny["meg"], tmp_path / "lora"
    worker = str(HERE / "worker.py")
    _run(worker, "make-lora", str(meg / "iter_0000000"), str(hf), str(lora))
    it = lora / "iter_0000002"
    peft = bridge.peft_iteration(it)  # the run_config.yaml written with Bridge's own serialiser
    assert peft is not None and peft.is_lora and peft.pretrained_checkpoint == str(meg)
    out = _run("-m", "pipeline.cli.checkpoint", "export", str(lora), "--iteration", "2", "--hf-model", str(hf),
               "--no-reasoning")
    assert f"exported: {it / 'hf'}" in out
    rec = json.loads((it / "hf" / "verification.json").read_text())
    assert rec["verdict"] == "PASS" and rec["lora"]["base"] == str(meg / "iter_0000000")
    assert not (it / "hf" / "adapter_config.json").exists()  # merged, not an adapter folder
    diffs = json.loads(_run("-c", CHECK, str(lora / "lora_logits.pt"), str(it / "hf"), str(hf)).splitlines()[-1])
    assert diffs["export"] < 1e-3, diffs  # the merged export is the Megatron base + adapters (fp32)
    assert diffs["base"] > 1.0, diffs  # and the adapters changed the model
