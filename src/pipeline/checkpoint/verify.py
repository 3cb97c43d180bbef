"""Numerical verification of an exported Hugging Face checkpoint.

Conversion fidelity decides the verdict:
  1. logits: the exported model's logits on a fixed prompt set match the source checkpoint's
     (max absolute difference within ``atol``, compared in float32);
  2. weights: no weight matrix is all zeros or non-finite (a broken file, not a young model).
Model quality is reported, and fatal only with ``require_quality`` (``--require-quality``): an early checkpoint of
a from-scratch run is a faithful conversion of a model that has not learned much yet (a perfect 16-iteration
export, logit difference 0.0, used to FAIL on its reference loss):
  3. the mean next-token loss on fixed reference text against a uniform guess, ln(vocab);
  4. a short greedy generation for each prompt is non-empty.
The verdict and every number are returned as a dict (written next to the export by the caller).
"""

from __future__ import annotations

import math
from typing import Any

VERIFY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, there was a",
]
REFERENCE_TEXT = (
    "The sun rises in the east and sets in the west. Water is made of hydrogen and oxygen. "
    "A week has seven days, and a year has twelve months. Paris is the capital of France."
)


def weight_problems(model) -> list[str]:
    import torch

    problems = []
    for name, p in model.state_dict().items():
        if not torch.is_floating_point(p) or p.numel() == 0:
            continue
        if p.ndim < 2 and torch.isfinite(p).all():
            continue  # biases, norms and router corrections may legitimately be zero
        if not torch.isfinite(p).all():
            problems.append(f"{name} has non-finite values")
        elif p.numel() > 1 and not p.abs().sum():
            problems.append(f"{name} is all zeros")
    return problems




def logits_for(model, tokenizer, prompts: list[str]):
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tokenizer(p, return_tensors="pt", add_special_tokens=False)["input_ids"]
            out.append(model(input_ids=ids).logits.float())
    return out


def reference_loss(model, tokenizer) -> float:
    import torch

    ids = tokenizer(REFERENCE_TEXT, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def greedy(model, tokenizer, prompts: list[str], max_new_tokens: int = 16) -> list[str]:
    import torch

    outs = []
    with torch.no_grad():
        for p in prompts:
            enc = tokenizer(p, return_tensors="pt", add_special_tokens=False)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            outs.append(tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    return outs


def verify(source_model, exported_model, tokenizer, *, atol: float = 1e-3, require_quality: bool = False
           ) -> dict[str, Any]:
    src = logits_for(source_model, tokenizer, VERIFY_PROMPTS)
    exp = logits_for(exported_model, tokenizer, VERIFY_PROMPTS)
    diffs = [float((a - b).abs().max()) for a, b in zip(src, exp)]
    max_diff = max(diffs)
    vocab = exported_model.config.vocab_size
    uniform = math.log(vocab)
    loss = reference_loss(exported_model, tokenizer)
    gens = greedy(exported_model, tokenizer, VERIFY_PROMPTS)
    weights = weight_problems(exported_model)
    failures, quality = [], []
    if not math.isfinite(max_diff) or max_diff > atol:
        failures.append(f"logits differ from the source checkpoint by {max_diff:.3g} (tolerance {atol:g})")
    if weights:
        failures.append(f"{len(weights)} bad weight tensor(s): {'; '.join(weights[:3])}")
    if not math.isfinite(loss) or loss > 0.8 * uniform:
        quality.append(f"reference-text loss {loss:.3f} is not well below the uniform-guess loss ln({vocab}) = "
                       f"{uniform:.3f}")
    empty = [p for p, g in zip(VERIFY_PROMPTS, gens) if not g.strip()]
    if empty:
        quality.append(f"empty greedy generation for {len(empty)} of {len(gens)} prompts")
    if require_quality:
        failures += quality
    return {
        "verdict": "PASS" if not failures else "FAIL",
        "failures": failures,
        "decided_on": "fidelity and quality" if require_quality else "conversion fidelity",
        "quality": {"warnings": quality, "fatal": require_quality, "reference_loss": loss, "uniform_loss": uniform},
        "max_abs_logit_diff": max_diff,
        "per_prompt_max_abs_logit_diff": diffs,
        "logit_tolerance": atol,
        "reference_loss": loss,
        "uniform_loss": uniform,
        "bad_weights": weights,
        "generations": [{"prompt": p, "generation": g} for p, g in zip(VERIFY_PROMPTS, gens)],
    }
