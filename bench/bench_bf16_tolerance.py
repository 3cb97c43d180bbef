"""bf16 verification tolerance: how far bf16 logits are from fp32 logits on the export verification prompts.

    python bench/bench_bf16_tolerance.py [--models smollm2-135m tiny-qwen3-moe tiny-nemotronh-moe] [--seeds 1234]

The cluster verifies a Megatron export by comparing bf16 Megatron logits with bf16 Hugging Face logits, so the
verification tolerances (``pipeline.config.engines.BF16_TOLERANCES``) must admit bf16 rounding noise and
nothing more. This measures that noise on the registry's local models: ``smollm2-135m`` (real weights) and the
random-init MoE models ``tiny-qwen3-moe``, ``tiny-nemotronh-moe`` (built as the local engine builds them:
``build_tiny_config`` with the SmolLM2 tokenizer, ``from_config`` after ``torch.manual_seed(seed)``). For each
model two comparisons on ``VERIFY_PROMPTS``, with the verification's own metrics (``compare_logits``):
  bf16 vs fp32        the same weights cast to bf16 (sdpa attention) against fp32;
  bf16 eager vs sdpa  two bf16 implementations of the same model (what the cluster compares: two codes, both bf16);
and, for scale, the corruption the unit tests use (fp32, the first attention output projection times 1.5) against
fp32: what the tolerances must still reject.
Prints a Markdown table: max |logit diff|, mean KL(fp32 || bf16) and top-1 agreement, per model and seed.
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys

import torch

from pipeline.checkpoint.verify import VERIFY_PROMPTS, compare_logits, logits_for
from pipeline.config.models import build_tiny_config, get_model, require_local_model

MODELS = ("smollm2-135m", "tiny-qwen3-moe", "tiny-nemotronh-moe")


def build(name: str, tokenizer, seed: int):
    """The fp32 model the local engine would start from: real weights, or a seeded random init of a tiny spec."""
    from transformers import AutoModelForCausalLM

    spec = get_model(name)
    if spec.tiny_config is None:
        return AutoModelForCausalLM.from_pretrained(require_local_model(spec), dtype=torch.float32)
    torch.manual_seed(seed)
    conf = build_tiny_config(spec, len(tokenizer), tokenizer.pad_token_id or tokenizer.eos_token_id,
                             tokenizer.eos_token_id, tokenizer.bos_token_id)
    return AutoModelForCausalLM.from_config(conf, dtype=torch.float32)


def with_attention(model, impl: str):
    """``model`` with its attention implementation switched (models without the switch are returned as they are)."""
    try:
        model.set_attn_implementation(impl)
    except (AttributeError, ValueError):
        pass
    return model


def measure(name: str, tokenizer, seed: int) -> list[tuple[str, dict]]:
    fp32 = build(name, tokenizer, seed).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16).eval()
    ref = logits_for(fp32, tokenizer, VERIFY_PROMPTS)
    sdpa = logits_for(with_attention(bf16, "sdpa"), tokenizer, VERIFY_PROMPTS)
    eager = logits_for(with_attention(bf16, "eager"), tokenizer, VERIFY_PROMPTS)
    bad = copy.deepcopy(fp32)
    with torch.no_grad():
        next(w for n, w in bad.named_parameters() if "o_proj" in n and w.ndim == 2).mul_(1.5)
    corrupt = logits_for(bad, tokenizer, VERIFY_PROMPTS)
    return [("bf16 vs fp32", compare_logits(ref, sdpa)), ("bf16 eager vs sdpa", compare_logits(sdpa, eager)),
            ("corrupted fp32 vs fp32", compare_logits(ref, corrupt))]


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--seeds", nargs="+", type=int, default=[1234], help="random-init seeds of the tiny models")
    args = p.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    tokenizer = AutoTokenizer.from_pretrained(require_local_model(get_model("smollm2-135m")))
    print(f"machine: {platform.machine()}, {platform.processor() or '?'}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CPU")
    print("| model | seed | comparison | max abs logit diff | KL (mean) | worst prompt KL | top-1 agreement |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        seeds = args.seeds if get_model(name).tiny_config is not None else ["-"]
        for seed in seeds:
            for label, cmp in measure(name, tokenizer, 0 if seed == "-" else seed):
                worst = max(q["kl"] for q in cmp["per_prompt"])
                print(f"| {name} | {seed} | {label} | {cmp['max_abs_logit_diff']:.3g} | {cmp['kl']:.2e} | "
                      f"{worst:.2e} | {cmp['top1_agreement']:.3f} ({cmp['positions']} positions) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
