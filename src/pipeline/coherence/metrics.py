"""Per-response metrics and the summary: more than emptiness.

  empty           the response is blank after stripping whitespace
  truncated       generation stopped at the token limit instead of ending by itself
  repetitive      more than half of the response's word 4-grams are repeats (a looping model)
  template_leak   chat-template artefacts in the text (<|im_start|>, <|im_end|>, [INST], role headers, an
                  unrequested <think> block) - the sign of a wrong or missing chat template in the export
"""

from __future__ import annotations

import re
from typing import Any

TEMPLATE_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|start_header_id|>",
                    "[INST]", "[/INST]", "<s>", "</s>", "<|assistant|>", "<|user|>", "<|system|>")
ROLE_HEADER = re.compile(r"(^|\n)(assistant|user|system)\s*\n", re.IGNORECASE)


def repeated_ngram_fraction(text: str, n: int = 4) -> float:
    words = text.split()
    if len(words) < n + 1:
        return 0.0
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


def template_leak(text: str, reasoning: bool) -> list[str]:
    found = [m for m in TEMPLATE_MARKERS if m in text]
    if ROLE_HEADER.search(text):
        found.append("role header")
    if not reasoning and "<think>" in text:
        found.append("<think>")
    return found


def score(response: str, n_tokens: int, max_tokens: int, finished: bool, reasoning: bool,
          prompt_tokens: int | None = None, context: int | None = None) -> dict[str, Any]:
    """``prompt_tokens``/``context``: where the backend knows them; ``context_full`` is a prompt that left no room
    for ``max_tokens`` in the model's context (its response was cut by the context, or never started)."""
    rep = repeated_ngram_fraction(response)
    leaks = template_leak(response, reasoning)
    context_full = bool(context and prompt_tokens is not None and prompt_tokens + n_tokens >= context
                        and not finished)
    return {
        "response_length": len(response),
        "response_tokens": n_tokens,
        "prompt_tokens": prompt_tokens,
        "context_full": context_full,
        "empty": not response.strip(),
        "truncated": (not finished) and (n_tokens >= max_tokens or context_full),
        "repeated_4gram_fraction": round(rep, 3),
        "repetitive": rep > 0.5,
        "template_leak": ", ".join(leaks),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows) or 1

    def pct(key):
        return round(100.0 * sum(bool(r[key]) for r in rows) / n, 1)

    return {
        "num_prompts": len(rows),
        "empty_pct": pct("empty"),
        "truncated_pct": pct("truncated"),
        "repetitive_pct": pct("repetitive"),
        "template_leak_pct": pct("template_leak"),
        "mean_response_length": round(sum(r["response_length"] for r in rows) / n, 1),
        "mean_response_tokens": round(sum(r["response_tokens"] for r in rows) / n, 1),
    }
