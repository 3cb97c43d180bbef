"""Export a checkpoint iteration to a standard Hugging Face directory ``<ckpt>/iter_NNNNNNN/hf/``, verified.

Local-engine iterations are Hugging Face checkpoints already: the export copies the model, config and
tokenizer files (not the optimizer state) and records the reasoning choice. Megatron iterations go
through Megatron Bridge's AutoBridge (``training/engines/megatron_bridge.py``, GPU only).

Every export is verified (``verify.py``) before it is published: it is written to a temporary sibling,
verified there, and renamed to ``hf/`` only on PASS, with ``hf/verification.json`` inside. On FAIL the
temporary directory is removed, ``hf_verification_FAILED.json`` is written next to where ``hf/`` would
be, and the export exits non-zero: no ``hf/`` directory that looks finished is ever left behind.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from pipeline.checkpoint import layout
from pipeline.common.errors import UserError
from pipeline.common.io import atomic_path, read_json, write_json

log = logging.getLogger(__name__)
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")
FAILED = "hf_verification_FAILED.json"


class VerificationFailed(Exception):
    def __init__(self, record: dict):
        super().__init__("; ".join(record.get("failures", [])))
        self.record = record


def _copy_local(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name in HF_FILES or f.suffix == ".safetensors" or f.name.endswith(".safetensors.index.json"):
            shutil.copy2(f, dst / f.name)


def _apply_reasoning(hf_dir: Path, reasoning: bool) -> None:
    """Record the reasoning choice; where the chat template has an ``enable_thinking`` switch, make the
    choice its default so generation with the exported tokenizer behaves as requested."""
    tpl = hf_dir / "chat_template.jinja"
    if tpl.exists():
        text = tpl.read_text()
        if "enable_thinking" in text:
            default = "true" if reasoning else "false"
            header = f"{{%- if enable_thinking is not defined %}}{{%- set enable_thinking = {default} %}}{{%- endif %}}"
            tpl.write_text(header + text)


def export_iteration(iter_path: Path, *, hf_model: str, reasoning: bool, strict: bool = True,
                     atol: float = 1e-3, force: bool = False) -> dict[str, Any]:
    """Export and verify one iteration directory; returns the verification record."""
    out = iter_path / "hf"
    if (out / "verification.json").exists() and not force:
        rec = read_json(out / "verification.json")
        log.info("export: %s already exported and verified (%s), skipping", iter_path.name, rec.get("verdict"))
        return rec
    engine = layout.engine_of(iter_path)
    if engine == "megatron":
        from pipeline.training.engines import megatron_bridge

        return megatron_bridge.export_checkpoint(iter_path, out, hf_model=hf_model, reasoning=reasoning,
                                                 strict=strict, atol=atol)
    if engine != "local":
        raise UserError(f"{iter_path} is not a recognised checkpoint (no {layout.MARKER}, no Megatron metadata.json)")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.checkpoint.verify import verify

    marker = read_json(iter_path / layout.MARKER)
    (iter_path / FAILED).unlink(missing_ok=True)
    with atomic_path(out) as tmp:
        _copy_local(iter_path, tmp)
        _apply_reasoning(tmp, reasoning)
        source = AutoModelForCausalLM.from_pretrained(iter_path, dtype=torch.float32)
        exported = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        if strict:
            a, b = set(source.state_dict()), set(exported.state_dict())
            if a != b:
                raise UserError(f"strict export: parameter names differ ({sorted(a ^ b)[:5]}); --not-strict to allow")
        record = verify(source.eval(), exported.eval(), tokenizer, atol=atol)
        record.update({"source": str(iter_path), "iteration": marker.get("iteration"), "engine": "local",
                       "hf_model": hf_model, "reasoning": reasoning, "strict": strict,
                       "model": marker.get("model")})
        if record["verdict"] != "PASS":
            write_json(iter_path / FAILED, record)
            raise VerificationFailed(record)
        write_json(tmp / "verification.json", record)
        write_json(tmp / "pipeline_export.json", {"hf_model": hf_model, "reasoning": reasoning,
                                                  "source": str(iter_path), "iteration": marker.get("iteration")})
    log.info("export: %s -> %s (max |logit diff| %.2e, reference loss %.3f)", iter_path.name, out,
             record["max_abs_logit_diff"], record["reference_loss"])
    return record


def import_hf(hf_id: str, output: Path, *, megatron: bool, force: bool = False) -> Path:
    """HF -> a checkpoint directory in our layout. Megatron: AutoBridge.import_ckpt (GPU). Local engine:
    ``<output>/iter_0000000/`` holding the HF weights, usable as ``checkpoint.pretrained_checkpoint``."""
    if megatron:
        from pipeline.training.engines import megatron_bridge

        return megatron_bridge.import_checkpoint(hf_id, output)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config.models import REGISTRY, require_local_model

    spec = REGISTRY.get(hf_id)
    src = require_local_model(spec) if spec is not None and spec.is_local else Path(hf_id)
    if not Path(src).exists() and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise UserError(f"{hf_id} is neither a registry model, a local directory, nor reachable (HF_HUB_OFFLINE=1)")
    target = layout.iter_dir(output, 0)
    if layout.read_tracker(output) is not None and not force:
        raise UserError(f"{output} already holds a checkpoint; --force to overwrite")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    with atomic_path(target) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_json(tmp / layout.MARKER, {"engine": "local", "model": spec.name if spec else str(hf_id),
                                          "hf_id": spec.hf_id if spec else str(hf_id), "iteration": 0,
                                          "imported_from": str(src)})
    layout.write_tracker(output, 0)
    return target


def push_to_hub(hf_dir: Path, repo_id: str) -> str:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise UserError("--push-to-hub needs the Hugging Face hub, but HF_HUB_OFFLINE=1 (set HF_HUB_OFFLINE=0 and "
                        "HF_TOKEN on a machine with network)")
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, exist_ok=True, private=True)
    api.upload_folder(folder_path=str(hf_dir), repo_id=repo_id)
    return f"https://huggingface.co/{repo_id}"
