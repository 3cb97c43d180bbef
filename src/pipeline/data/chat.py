"""Chat template rendering and assistant-only loss masks.

Each conversation is rendered once with the tokenizer's own chat template. The character spans of
the assistant turns (their content plus the end-of-turn token that follows, so the model learns to
stop) are located in the rendered text; the whole batch is then tokenised in one call of the fast
tokenizer with offset mapping, and a token gets loss when it starts inside an assistant span.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.common.errors import UserError


def load_tokenizer(name_or_path: str | Path):
    """A Hugging Face fast tokenizer from a registry model name, a local directory or a hub id."""
    from transformers import AutoTokenizer

    from pipeline.config.models import REGISTRY, tokenizer_path

    spec = REGISTRY.get(str(name_or_path))
    if spec is not None and spec.is_local:
        path = tokenizer_path(spec)
    elif spec is not None:
        path = spec.hf_id
    else:
        path = name_or_path
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"cannot load tokenizer '{name_or_path}': {str(exc).splitlines()[0][:200]}") from None
    if not tok.is_fast:
        raise UserError(f"tokenizer '{name_or_path}' is not a fast tokenizer (offsets are needed for loss masks)")
    if tok.chat_template is None:
        raise UserError(f"tokenizer '{name_or_path}' has no chat template")
    return tok


def tokenizer_model_name(name_or_path: str | Path) -> str:
    """Name used in packed paths, as Megatron Bridge derives it: ``hf_org/hf_model`` -> ``hf_org--hf_model``."""
    from pipeline.config.models import REGISTRY

    spec = REGISTRY.get(str(name_or_path))
    if spec is not None:
        if spec.tokenizer_from:  # tiny models borrow another model's tokenizer
            spec = REGISTRY[spec.tokenizer_from]
        return spec.hf_id.replace("/", "--")
    p = Path(name_or_path)
    if p.exists():
        return p.resolve().name
    return str(name_or_path).replace("/", "--")


def render(tokenizer, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]] | None:
    """Rendered text and assistant character spans; None when a turn cannot be located."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    eot = tokenizer.eos_token or ""
    spans = []
    cursor = 0
    for m in messages:
        idx = text.find(m["content"], cursor)
        if idx < 0:
            return None
        end = idx + len(m["content"])
        if m["role"] == "assistant":
            if eot and text.startswith(eot, end):
                end += len(eot)
            spans.append((idx, end))
        cursor = end
    return text, spans


def tokenize_conversations(tokenizer, conversations: list[dict]) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """Token ids and (unrolled) loss masks for each conversation; returns also the template-mismatch count."""
    texts, all_spans = [], []
    mismatched = 0
    for conv in conversations:
        r = render(tokenizer, conv["messages"])
        if r is None:
            mismatched += 1
            continue
        texts.append(r[0])
        all_spans.append(r[1])
    if not texts:
        return [], [], mismatched
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    ids_out, mask_out = [], []
    for ids, offsets, spans in zip(enc["input_ids"], enc["offset_mapping"], all_spans):
        starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
        mask = np.zeros(len(ids), dtype=np.int8)
        for a, b in spans:
            lo, hi = np.searchsorted(starts, [a, b])
            mask[lo:hi] = 1
        ids_out.append(np.asarray(ids, dtype=np.int64))
        mask_out.append(mask)
    return ids_out, mask_out, mismatched
