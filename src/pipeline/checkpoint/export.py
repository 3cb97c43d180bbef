"""Export a checkpoint iteration to a standard Hugging Face directory ``<ckpt>/iter_NNNNNNN/hf/``, verified.

Local-engine iterations are Hugging Face checkpoints already: the export copies the model, config and
tokenizer files (not the optimizer state) and records the reasoning choice. Megatron iterations go
through Megatron Bridge's AutoBridge (``pipeline/bridge.py``, GPU only), given exactly the iteration
directory that ``layout.resolve_iteration`` resolved (never the checkpoint root).

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
from pipeline.checkpoint.lock import Lock, iteration_lock_path
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


def _rank() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def export_iteration(iter_path: Path, *, hf_model: str, reasoning: bool, strict: bool = True,
                     atol: float = 1e-3, force: bool = False, tp: int = 1, pp: int = 1, ep: int = 1,
                     locked: bool = False, require_quality: bool = False) -> dict[str, Any]:
    """Export and verify exactly one iteration directory (both engines); returns the verification record.

    The one publish-and-verify flow: the export is written to a temporary sibling of ``hf/``, the source
    checkpoint and the export are compared (``verify.py``), and only a PASS is renamed to ``hf/`` with
    ``verification.json`` inside. Local-engine iterations are HF checkpoints already (copied); Megatron
    iterations go through ``pipeline.bridge.export_to_hf`` with exactly ``iter_path`` (GPU; one torchrun rank
    per GPU when ``tp * pp * ep > 1``, rank 0 verifies and publishes). One writer per ``hf/``: the export holds the
    iteration's lock (the one ``upload-all`` holds; ``locked=True`` when the caller already does)."""
    iter_path = Path(iter_path)
    out = iter_path / "hf"
    rec = published_export(out)
    if rec is not None and not force:
        log.info("export: %s already exported and verified (%s), skipping", iter_path.name, rec.get("verdict"))
        return rec
    if locked or int(os.environ.get("RANK", "0")) != 0:
        return _export(iter_path, out, hf_model=hf_model, reasoning=reasoning, strict=strict, atol=atol,
                       require_quality=require_quality, tp=tp,
                       pp=pp, ep=ep)
    lock = Lock(iteration_lock_path(iter_path.parent, int(iter_path.name.split("_")[-1])), ttl=6 * 3600)
    if not lock.acquire():
        raise UserError(f"{iter_path.name} is being exported by {lock.holder()} ({lock.path}); wait for it, or "
                        "remove the lock if that process is gone")
    with lock:
        rec = published_export(out)  # the other writer may have published while we waited for the lock
        if rec is not None and not force:
            log.info("export: %s was exported and verified meanwhile, skipping", iter_path.name)
            return rec
        return _export(iter_path, out, hf_model=hf_model, reasoning=reasoning, strict=strict, atol=atol,
                       require_quality=require_quality, tp=tp,
                       pp=pp, ep=ep)


RECORDS = ("verification.json", "pipeline_export.json")


def file_digest(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def record_files(tmp: Path) -> dict[str, dict]:
    """Size, mtime and SHA-256 of every file of an export (its two records aside), computed once when written."""
    out = {}
    for f in sorted(tmp.iterdir()):
        if f.is_file() and f.name not in RECORDS:
            st = f.stat()
            out[f.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_digest(f)}
    return out


def published_export(out: Path) -> dict | None:
    """The verification record of a complete published export, or None: ``verification.json`` with a PASS, and
    every file its record lists matching what was recorded when the export was written: size and mtime, else
    (a file touched since) its content digest, re-hashed only then, so polling a large export stays cheap. An
    ``hf/`` holding only the records, a truncated file or one overwritten in place is not an export (a weight file
    overwritten with 0xFF bytes of the same size was "already exported and verified")."""
    try:
        rec = read_json(out / "verification.json")
        meta = read_json(out / "pipeline_export.json")
        files = meta.get("files") or meta.get("weights")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(rec, dict) or rec.get("verdict") != "PASS" or not isinstance(files, dict) or not files:
        return None
    for name, want in files.items():
        f = out / name
        try:
            st = f.stat()
        except OSError:
            st = None
        if isinstance(want, int):  # an export written before digests were recorded: its size only
            want = {"size": want}
        if st is None or not f.is_file() or st.st_size != want.get("size"):
            log.warning("export %s: %s is missing or has the wrong size; it will be redone", out, name)
            return None
        if "sha256" in want and st.st_mtime_ns != want.get("mtime_ns") and file_digest(f) != want["sha256"]:
            log.warning("export %s: %s changed since the export was verified (content digest differs); it will be "
                        "redone", out, name)
            return None
    return rec


def _export(iter_path: Path, out: Path, *, hf_model: str, reasoning: bool, strict: bool, atol: float, tp: int,
            pp: int, ep: int, require_quality: bool = False) -> dict[str, Any]:
    engine = layout.engine_of(iter_path)
    if engine not in ("local", "megatron"):
        raise UserError(f"{iter_path} is not a recognised checkpoint (no {layout.MARKER}, no Megatron metadata.json)")
    rank, world = _rank()
    if engine == "megatron":
        from pipeline import bridge

        bridge.require_bridge(f"exporting the Megatron checkpoint {iter_path}")
        if world > 1:  # every rank writes into the same temporary (named by the run), rank 0 publishes
            tmp_root = iter_path / f".hf.{os.environ.get('TORCHELASTIC_RUN_ID', 'export')}.tmp"
            tmp = tmp_root / "hf"
            bridge.export_to_hf(iter_path, tmp, hf_model=hf_model, strict=strict, tp=tp, pp=pp, ep=ep)
            _barrier()
            if rank != 0:
                return {"verdict": "rank", "rank": rank}
            return _verify_and_publish(iter_path, tmp, out, engine, hf_model=hf_model, reasoning=reasoning,
                                       strict=strict, atol=atol, require_quality=require_quality, tmp_root=tmp_root)

    (iter_path / FAILED).unlink(missing_ok=True)
    with atomic_path(out) as tmp:
        if engine == "megatron":
            from pipeline import bridge

            bridge.export_to_hf(iter_path, tmp, hf_model=hf_model, strict=strict)
        else:
            _copy_local(iter_path, tmp)
        record = _verify(iter_path, tmp, engine, hf_model=hf_model, reasoning=reasoning, strict=strict, atol=atol,
                         require_quality=require_quality)
    log.info("export: %s -> %s (max |logit diff| %.2e, reference loss %.3f)", iter_path.name, out,
             record["max_abs_logit_diff"], record["reference_loss"])
    return record


def _verify(iter_path: Path, tmp: Path, engine: str, *, hf_model: str, reasoning: bool, strict: bool,
            atol: float, require_quality: bool = False) -> dict[str, Any]:
    """Verify the export in ``tmp`` against its source; FAIL -> ``hf_verification_FAILED.json`` and raise."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.checkpoint.verify import VERIFY_PROMPTS, verify

    _apply_reasoning(tmp, reasoning)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    if engine == "megatron":
        from pipeline import bridge

        exported = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16, device_map="auto")
        source = bridge.MegatronCausalLM(iter_path, hf_model, exported.config)
        iteration = int(iter_path.name.split("_")[-1])
        model_name = hf_model
    else:
        marker = read_json(iter_path / layout.MARKER)
        source = AutoModelForCausalLM.from_pretrained(iter_path, dtype=torch.float32)
        exported = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        if strict:
            a, b = set(source.state_dict()), set(exported.state_dict())
            if a != b:
                raise UserError(f"strict export: parameter names differ ({sorted(a ^ b)[:5]}); --not-strict to allow")
        iteration = marker.get("iteration")
        model_name = marker.get("model")
    record = verify(source.eval(), exported.eval(), tokenizer, atol=atol, require_quality=require_quality)
    for w in record.get("quality", {}).get("warnings", []):
        log.warning("export: %s: %s (model quality: reported, not fatal; --require-quality makes it fatal)",
                    iter_path.name, w)
    record.update({"source": str(iter_path), "iteration": iteration, "engine": engine, "hf_model": hf_model,
                   "reasoning": reasoning, "strict": strict, "model": model_name, "prompts": VERIFY_PROMPTS})
    if record["verdict"] != "PASS":
        write_json(iter_path / FAILED, record)
        raise VerificationFailed(record)
    files = record_files(tmp)
    weights = {n: f["size"] for n, f in files.items() if n.endswith((".safetensors", ".bin"))}
    if not weights:
        raise UserError(f"the export of {iter_path} wrote no weight files into {tmp}")
    write_json(tmp / "verification.json", record)
    write_json(tmp / "pipeline_export.json", {"hf_model": hf_model, "reasoning": reasoning, "weights": weights,
                                              "files": files, "source": str(iter_path), "iteration": iteration})
    return record


def _verify_and_publish(iter_path: Path, tmp: Path, out: Path, engine: str, *, tmp_root: Path, **kw) -> dict:
    try:
        record = _verify(iter_path, tmp, engine, **kw)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return record
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


def import_hf(hf_id: str, output: Path, *, megatron: bool, force: bool = False) -> Path:
    """HF -> a checkpoint directory in our layout. Megatron: AutoBridge.import_ckpt (GPU). Local engine:
    ``<output>/iter_0000000/`` holding the HF weights, usable as ``checkpoint.pretrained_checkpoint``."""
    if megatron:
        from pipeline import bridge

        bridge.require_bridge(f"importing {hf_id} as a Megatron checkpoint")
        return bridge.import_from_hf(hf_id, output)
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
