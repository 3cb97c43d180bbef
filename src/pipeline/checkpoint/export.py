"""Export a checkpoint iteration to a standard Hugging Face directory ``<ckpt>/iter_NNNNNNN/hf/``, verified.

Local-engine iterations are Hugging Face checkpoints already: the export copies the model, config and
tokenizer files (not the optimizer state) and records the reasoning choice. Megatron iterations go
through Megatron Bridge's AutoBridge (``pipeline/bridge.py``, GPU only), given exactly the iteration
directory that ``layout.resolve_iteration`` resolved (never the checkpoint root). A LoRA iteration (Bridge saved
only its adapters) is merged into ``--hf-model`` when that is exactly the run's base (``lora_base``; else one line
naming the base and what to run), and verified against the Megatron base + adapters (docs/decisions.md #53).

Every export is verified (``verify.py``) before it is published: it is written to a temporary sibling,
verified there, and renamed to ``hf/`` only on PASS, with ``hf/verification.json`` inside. The file set is checked
first (safetensors headers against the config's architecture, no weight loaded); then the logits. A Megatron
source is run first, on the export's own model-parallel layout, its logits kept on CPU and the model freed, and only
then is the export loaded (on the node's GPUs, spread with ``device_map="auto"`` when it does not fit one): the two
models of a large checkpoint never share the GPUs. On FAIL the
temporary directory is removed, ``hf_verification_FAILED.json`` is written next to where ``hf/`` would
be, and the export exits non-zero: no ``hf/`` directory that looks finished is ever left behind.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import bridge
from pipeline.checkpoint.lock import Lock, iteration_lock_path
from pipeline.checkpoint.verify import (
    FAILED,
    file_set_problems,
    free_gpu_memory,
    megatron_source_logits,
    verify_export,
)
from pipeline.common import layout
from pipeline.common.errors import UserError
from pipeline.common.io import atomic_path, read_json, write_json
from pipeline.common.procs import barrier
from pipeline.config.engines import engine_of_checkpoint
from pipeline.config.models import REGISTRY, require_local_model
from pipeline.config.parallel import Layout

log = logging.getLogger(__name__)
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class ExportRequest:
    """What one export of an iteration asks for: the command line's export (and upload-all) options, read once.

    ``atol``, ``kl_tol``, ``top1_min``: the verification's tolerances, None for the engine's default
    (``verify.default_tolerances``: fp32 for the local engine, bf16 for Megatron). ``layout``: the model-parallel
    layout the export's ranks run (the plan's; one process: ``Layout(1)``). ``locked``: the caller holds the
    iteration's lock (upload-all, and the torchrun it starts)."""

    hf_model: str
    reasoning: bool
    strict: bool = True
    atol: float | None = None
    kl_tol: float | None = None
    top1_min: float | None = None
    require_quality: bool = False
    force: bool = False
    layout: Layout = Layout(1)
    locked: bool = False

    def argv(self) -> list[str]:
        """The export's command-line options that say this request (upload-all's torchrun of one iteration)."""
        lay = self.layout
        return ["--hf-model", self.hf_model, "--reasoning" if self.reasoning else "--no-reasoning",
                "--tp", str(lay.tp), "--pp", str(lay.pp), "--ep", str(lay.ep),
                *(["--lock-held"] if self.locked else []),
                *(["--atol", repr(self.atol)] if self.atol is not None else []),
                *(["--kl-tol", repr(self.kl_tol)] if self.kl_tol is not None else []),
                *(["--top1-min", repr(self.top1_min)] if self.top1_min is not None else []),
                *(["--not-strict"] if not self.strict else []),
                *(["--require-quality"] if self.require_quality else []),
                *(["--force"] if self.force else [])]


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


def export_iteration(iter_path: Path, req: ExportRequest) -> dict[str, Any]:
    """Export and verify exactly one iteration directory (both engines); returns the verification record.

    The one publish-and-verify flow: the export is written to a temporary sibling of ``hf/``, the source
    checkpoint and the export are compared (``verify.py``), and only a PASS is renamed to ``hf/`` with
    ``verification.json`` inside. Local-engine iterations are HF checkpoints already (copied); Megatron
    iterations go through ``pipeline.bridge.export_to_hf`` with exactly ``iter_path`` (GPU; one torchrun rank
    per GPU of ``req.layout``, rank 0 verifies and publishes). One writer per ``hf/``: the export holds the
    iteration's lock (the one ``upload-all`` holds; ``req.locked`` when the caller already does)."""
    iter_path = Path(iter_path)
    out = iter_path / "hf"
    rec = published_export(out)
    if rec is not None and not req.force:
        log.info("export: %s already exported and verified (%s), skipping", iter_path.name, rec.get("verdict"))
        return rec
    problem = hf_output_problem(out)  # before any work: a folder that is not ours is never replaced
    if problem:
        raise UserError(problem)
    if req.locked or int(os.environ.get("RANK", "0")) != 0:
        return _export(iter_path, out, req)
    lock = Lock(iteration_lock_path(iter_path.parent, layout.iteration_number(iter_path)), ttl=6 * 3600)
    if not lock.acquire():
        raise UserError(f"{iter_path.name} is being exported by {lock.holder()} ({lock.path}); wait for it, or "
                        "remove the lock if that process is gone")
    with lock:
        rec = published_export(out)  # the other writer may have published while we waited for the lock
        if rec is not None and not req.force:
            log.info("export: %s was exported and verified meanwhile, skipping", iter_path.name)
            return rec
        return _export(iter_path, out, req)


RECORDS = ("verification.json", "pipeline_export.json")


def hf_output_problem(out: Path) -> str | None:
    """The output-folder rule (``layout.output_folder_problem``) for an export's own ``hf/``: absent, empty, or an
    export of ours (its records: a published one is replaced only with --force, an unverified or tampered one is
    redone; or only the results written into it, ``eval/`` and ``coherence/``) may be written. A folder holding
    anything else is never replaced, even with --force: one line naming what it holds."""
    if not out.exists() and not out.is_symlink():
        return None
    if out.is_symlink():  # publishing replaces the link; what it points to is the user's
        return f"export output {out} is a link (to {os.readlink(out)}): move it away; the export writes a folder there"
    if not out.is_dir():
        return f"export output {out} exists and is not a folder: move it away"
    names = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in out.iterdir())
    results = {"eval/", "coherence/"}
    # the results folders hold what the evaluation and the coherence test write, nothing else (a user's notes in
    # hf/eval/ must not go with a forced export)
    names += [f"{r}{n}" for r in results if r in names for n in _foreign_results(out / r.rstrip("/"), r)]
    if any(n in RECORDS for n in names):
        # an export of ours: what its record lists, the records and the results written into it, nothing else
        # (a user's notes beside a real export must not be deleted by --force, never named)
        names = [n for n in names if n not in RECORDS and n not in results and n.rstrip("/") not in _listed(out)]
    else:  # only results written into it (an export whose files are gone: ours, redone), nothing of a user's
        names = [n for n in names if n not in results]
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"export output {out} holds files that are not an export of this suite ({shown}): refusing to replace "
            "it, even with --force; move them away")


_RESULT_FILES = {"eval/": ("*.json",), "coherence/": ("coherence_*.json", "coherence_*.md")}


def _foreign_results(folder: Path, kind: str) -> list[str]:
    """What a results folder of an export holds that the suite does not write there (its own files and atomic
    temporaries aside)."""
    out = []
    for p in sorted(folder.iterdir()):
        ours = p.is_file() and not p.is_symlink() and any(fnmatch.fnmatch(p.name, g) for g in _RESULT_FILES[kind])
        if not ours and not (p.name.startswith(".") and p.name.endswith(".tmp")):
            out.append(p.name + ("/" if p.is_dir() and not p.is_symlink() else ""))
    return out


def _listed(out: Path) -> set[str]:
    """The top-level names the export record of ``out`` lists (its files and their folders); empty when it has no
    readable record (then nothing but the records and the results is the export's)."""
    try:
        meta = read_json(out / "pipeline_export.json")
        files = meta.get("files") or {}
        legacy = not files and meta.get("weights")
    except (OSError, ValueError, AttributeError):
        return set()
    if legacy and isinstance(legacy, dict):  # a record of before every file was listed: its weights only, so the
        # Hugging Face files an export writes beside them are the export's too

        hf = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
              "chat_template.jinja", "model*.safetensors", "model.safetensors.index.json")
        return set(legacy) | {p.name for p in out.iterdir() if any(fnmatch.fnmatch(p.name, g) for g in hf)}
    return {str(name).split("/", 1)[0] for name in files} if isinstance(files, dict) else set()


def file_digest(path: Path) -> str:
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


def _export(iter_path: Path, out: Path, req: ExportRequest) -> dict[str, Any]:
    hf_model, lay = req.hf_model, req.layout
    engine = layout.engine_of(iter_path)
    writer = engine_of_checkpoint(engine)
    if engine is None or writer is None:
        raise UserError(f"{iter_path} is not a recognised checkpoint (no {layout.MARKER}, no Megatron metadata.json)")
    rank, world = _rank()
    base = None
    if writer.megatron_checkpoint:
        peft = bridge.peft_iteration(iter_path)
        if peft is not None:
            base = lora_base(peft, hf_model)  # refuses in one line where the adapters cannot be merged
            if world > 1:
                raise UserError(f"{peft.what}: its export (Bridge's export_adapter_ckpt, merged into {hf_model}) runs "
                                "in one process: rerun the export with --tp 1 --pp 1 --ep 1")
        bridge.require_bridge(f"exporting the Megatron checkpoint {iter_path}")
        if world > 1:  # every rank writes into the same temporary (named by the run), rank 0 publishes
            if rank == 0:
                (iter_path / FAILED).unlink(missing_ok=True)  # an earlier attempt's record is not this one's
            tmp_root = iter_path / f".hf.{os.environ.get('TORCHELASTIC_RUN_ID', 'export')}.tmp"
            tmp = tmp_root / "hf"
            bridge.export_to_hf(iter_path, tmp, hf_model=hf_model, strict=req.strict, tp=lay.tp, pp=lay.pp,
                                ep=lay.ep)
            free_gpu_memory()
            barrier()
            # every rank runs the sharded source (a collective forward), unless the file set already fails: each
            # rank reads the same files, so all decide alike; then every rank frees its shard before rank 0 loads
            # the export onto the node's GPUs
            source_logits = None
            if not file_set_problems(tmp):
                source_logits = megatron_source_logits(iter_path, tmp, hf_model=hf_model, tp=lay.tp, pp=lay.pp,
                                                       ep=lay.ep)
            barrier()
            if rank != 0:
                return {"verdict": "rank", "rank": rank}
            return _verify_and_publish(iter_path, tmp, out, engine, req, tmp_root=tmp_root,
                                       source_logits=source_logits)

    (iter_path / FAILED).unlink(missing_ok=True)
    with atomic_path(out) as tmp:
        if writer.megatron_checkpoint:
            if base is not None:
                _export_lora(iter_path, tmp, hf_model=hf_model)
            else:
                bridge.export_to_hf(iter_path, tmp, hf_model=hf_model, strict=req.strict)
        else:
            _copy_local(iter_path, tmp)
        record = _verify(iter_path, tmp, engine, req, lora_base=base)
        forget_results(iter_path)  # verified: the new hf/ replaces the old one on leaving this block
    log.info("export: %s -> %s (max |logit diff| %.2e, KL %.2e, top-1 agreement %.3f, reference loss %.3f)",
             iter_path.name, out, record["max_abs_logit_diff"], record["kl"], record["top1_agreement"],
             record["reference_loss"])
    return record


def _same_model(a: str, b: str) -> bool:
    """Two Hugging Face model names for the same model: the same hub id, or the same local directory."""
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def lora_base(peft, hf_model: str) -> Path:
    """The base iteration of a LoRA iteration, where ``hf_model`` is exactly that base as a Hugging Face model;
    else one line naming the base checkpoint and what to run.

    The adapters are merged into ``hf_model`` (Bridge's export_adapter_ckpt maps them onto it, peft merges them), so
    ``hf_model`` must hold the very weights the run started from (``checkpoint.pretrained_checkpoint``): either that
    checkpoint is Bridge's import of ``hf_model`` (its run_config.yaml: ``model.hf_model_id``, no ``train:``), or
    ``hf_model`` is that checkpoint's own verified export (``<base iteration>/hf``)."""
    if not peft.is_lora:
        raise UserError(f"{peft.what}; only LoRA adapters can be merged (Bridge's export_adapter_ckpt writes LoRA "
                        "only): merge it into its base with Bridge's own tools, then export the merged checkpoint")
    pre = peft.pretrained_checkpoint
    if not pre:
        raise UserError(f"{peft.what}, and its run_config.yaml names no base (checkpoint.pretrained_checkpoint): the "
                        "export cannot know which model the adapters belong to")
    pre_path = Path(pre)
    try:
        step = peft.ckpt_step
        base = pre_path if layout.is_iteration_dir(pre_path) else layout.resolve_iteration(pre_path, step)
    except UserError as exc:
        raise UserError(f"{peft.what}; its base checkpoint {pre} cannot be read ({exc}): restore it, then rerun the "
                        "export") from None
    if not base.is_dir():
        raise UserError(f"{peft.what}; its base checkpoint {base} does not exist: restore it, then rerun the export")
    newer = _saved_at(base) > _saved_at(peft.iter_path)
    if not layout.is_iteration_dir(pre_path) and step is None and newer:
        # Bridge loaded the base root's latest iteration when the run started; one written after this iteration
        # cannot be the one the adapters were trained on
        raise UserError(f"{peft.what}; its base {pre} has an iteration newer than this one ({base.name}), so the "
                        "one the run started from is unknown: export from a copy of the base holding only that "
                        "iteration")
    exported = base / "hf"
    if published_export(exported) is not None and _same_model(hf_model, str(exported)):
        return base
    source = bridge.hf_import_source(base)
    if source is not None and _same_model(source, hf_model):
        return base
    if source is not None:
        raise UserError(f"{peft.what}; its base checkpoint {base} was imported from {source}, not from --hf-model "
                        f"{hf_model}: rerun the export with --hf-model {source}")
    n = layout.iteration_number(base)
    raise UserError(f"{peft.what}; its base checkpoint {base} is not a Hugging Face import, so --hf-model {hf_model} "
                    f"is not known to be its base: export the base first (python -m pipeline.cli.checkpoint export "
                    f"{base.parent} --iteration {n} --hf-model ID --reasoning|--no-reasoning), then rerun this export "
                    f"with --hf-model {exported}")


def _saved_at(iteration: Path) -> float:
    """When a Megatron iteration was saved: its ``metadata.json`` (written once by the save; the directory's own mtime
    moves when an ``hf/`` export is written into it later)."""
    for name in ("metadata.json", "run_config.yaml"):
        if (iteration / name).is_file():
            return (iteration / name).stat().st_mtime
    return iteration.stat().st_mtime


def _export_lora(iter_path: Path, out: Path, *, hf_model: str) -> None:
    """A LoRA iteration -> the merged Hugging Face model in ``out``: Bridge's export_adapter_ckpt writes the
    HF-PEFT adapter (a temporary sibling of ``out``, not kept: an ``adapter_config.json`` in ``hf/`` would make
    transformers load it as an adapter), peft merges it into ``hf_model`` in float32
    (``PeftModel.from_pretrained(base, adapter).merge_and_unload()``), saved in the base's dtype with its tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix=".adapter.", dir=out.parent) as adapter:
        bridge.export_lora_adapter(iter_path, Path(adapter), hf_model=hf_model)
        dtype = getattr(AutoConfig.from_pretrained(hf_model), "dtype", None) or torch.float32
        base = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32)
        before = {k: v.clone() for k, v in base.state_dict().items()}
        merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
        # peft only warns when the adapter's target modules do not match: a merge that changed no weight would publish
        # the base relabelled as fine-tuned, and the bf16 verification alone may not tell a small adapter from none
        changed = [k for k, v in merged.state_dict().items() if k in before and not torch.equal(v, before[k])]
        if not changed:
            raise UserError(f"the LoRA adapters of {iter_path} changed no weight of {hf_model} when merged (their "
                            "target modules do not match the base's): nothing was published")
        log.info("export: LoRA merge changed %d of %d tensors of %s", len(changed), len(before), hf_model)
        del before
    merged.to(dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), torch.float32))
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(hf_model).save_pretrained(out)
    src = Path(hf_model)
    if src.is_dir():  # files the tokenizer's save does not write (a chat_template.jinja, generation_config.json)
        for name in HF_FILES:
            if (src / name).is_file() and not (out / name).exists():
                shutil.copy2(src / name, out / name)


def _verify(iter_path: Path, tmp: Path, engine: str, req: ExportRequest, *, source_logits: list | None = None,
            lora_base: Path | None = None) -> dict[str, Any]:
    """The reasoning choice applied to the export in ``tmp``, the export verified against its source
    (``verify.verify_export``: a FAIL raises), and the PASS recorded in ``tmp`` (``verification.json``, and
    ``pipeline_export.json``: what was exported from what, each file's size and digest)."""
    _apply_reasoning(tmp, req.reasoning)
    record = verify_export(iter_path, tmp, engine, req, source_logits=source_logits, lora_base=lora_base)
    files = record_files(tmp)
    weights = {n: f["size"] for n, f in files.items() if n.endswith((".safetensors", ".bin"))}
    if not weights:
        raise UserError(f"the export of {iter_path} wrote no weight files into {tmp}")
    write_json(tmp / "verification.json", record)
    write_json(tmp / "pipeline_export.json", {"hf_model": req.hf_model, "reasoning": req.reasoning,
                                              "weights": weights, "files": files, "source": str(iter_path),
                                              "iteration": record["iteration"]})
    return record


def _verify_and_publish(iter_path: Path, tmp: Path, out: Path, engine: str, req: ExportRequest, *, tmp_root: Path,
                        source_logits: list | None) -> dict:
    try:
        record = _verify(iter_path, tmp, engine, req, source_logits=source_logits)
        forget_results(iter_path)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return record
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


def forget_results(iter_path: Path) -> list[Path]:
    """Before a new ``hf/`` is published (``--force`` replaces the old one with its ``eval/`` and ``coherence/``):
    remove upload-all's markers of this iteration (``layout.result_markers``), so the results that went with the old
    ``hf/`` are produced again instead of reported done. Removing the markers, not keeping the results: results
    measured on the replaced export do not describe the new one (a forced re-export exists to change it)."""
    it = layout.iteration_of(iter_path)
    gone = layout.result_markers(iter_path.parent, it) if it is not None else []
    for marker in gone:
        marker.unlink(missing_ok=True)
        log.info("export: removed %s (it stood for results of the replaced hf/)", marker)
    return gone


def check_import_target(output: Path, *, force: bool) -> None:
    """The import's output folder by the one output-folder rule (``layout.check_output_folder``): absent, empty, or
    a checkpoint of ours with --force; a folder holding anything else is never written or deleted."""
    layout.check_output_folder(output, force=force, what="import output")


def import_hf(hf_id: str, output: Path, *, megatron: bool, force: bool = False, tp: int = 1, pp: int = 1,
              ep: int = 1) -> Path:
    """HF -> a checkpoint directory in our layout. Megatron: ``pipeline.bridge.import_from_hf`` (one process, or
    every torchrun rank with the plan's layout). Local engine: ``<output>/iter_0000000/`` holding the HF weights,
    usable as ``checkpoint.pretrained_checkpoint``."""
    if megatron:
        check_import_target(output, force=force)
        bridge.require_bridge(f"importing {hf_id} as a Megatron checkpoint")
        return bridge.import_from_hf(hf_id, output, tp=tp, pp=pp, ep=ep)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = REGISTRY.get(hf_id)
    src = require_local_model(spec) if spec is not None and spec.trains_on.ships_models else Path(hf_id)
    if not Path(src).exists() and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise UserError(f"{hf_id} is neither a registry model, a local directory, nor reachable (HF_HUB_OFFLINE=1)")
    target = layout.iter_dir(output, 0)
    check_import_target(output, force=force)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    with atomic_path(target) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_json(tmp / layout.MARKER, {"engine": "local", "model": spec.name if spec else str(hf_id),
                                          "hf_id": spec.hf_id if spec else str(hf_id), "iteration": 0,
                                          "imported_from": str(src), "files": layout.written_names(tmp)})
    layout.write_tracker(output, 0)
    return target


def check_hub_access(repo_id: str | None = None) -> str:
    """The token's user name, checked before converting: the token is valid (``HfApi().whoami()``) and can write
    to ``repo_id``'s namespace (the user's own, or an organisation where its role is write or admin). Needs the
    network; UserError (one line) otherwise."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise UserError("--push-to-hub needs the Hugging Face hub, but HF_HUB_OFFLINE=1")
    from huggingface_hub import HfApi

    try:
        who = HfApi().whoami()
    except Exception as exc:  # no token, an invalid one, no network
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UserError(f"--push-to-hub: the Hugging Face token does not work ({type(exc).__name__}: {first}); "
                        "set HF_TOKEN or run `hf auth login`") from None
    user = str(who.get("name") or "")
    role = (who.get("auth") or {}).get("accessToken", {}).get("role")
    if role == "read":
        raise UserError(f"--push-to-hub: the Hugging Face token of {user} is read-only; use a write token")
    ns = repo_id.split("/")[0] if repo_id and "/" in repo_id else user
    if ns != user:
        orgs = {o.get("name"): o.get("roleInOrg") for o in who.get("orgs") or []}
        if orgs.get(ns) not in ("write", "admin", "contributor"):
            raise UserError(f"--push-to-hub: {user} cannot write to the namespace '{ns}' (role: {orgs.get(ns)})")
    return user


def push_to_hub(hf_dir: Path, repo_id: str) -> str:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise UserError("--push-to-hub needs the Hugging Face hub, but HF_HUB_OFFLINE=1 (set HF_HUB_OFFLINE=0 and "
                        "HF_TOKEN on a machine with network)")
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, exist_ok=True, private=True)
    api.upload_folder(folder_path=str(hf_dir), repo_id=repo_id)
    return f"https://huggingface.co/{repo_id}"
