"""Chat template rendering and assistant-only loss masks.

Each conversation is rendered once with the tokenizer's own chat template. The character spans of
the assistant turns (their content plus the end-of-turn token that follows, so the model learns to
stop) are located in the rendered text; the whole batch is then tokenised in one call of the fast
tokenizer with offset mapping, and a token gets loss when it starts inside an assistant span.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.common.errors import UserError

ENCODE_SUB_BATCH = 2048


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
        import os

        hint = ""
        if os.environ.get("HF_HUB_OFFLINE") == "1" and not Path(str(path)).exists():
            hint = (f"; {path} is not in the Hugging Face cache (HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')})"
                    " and the Hub is off (HF_HUB_OFFLINE=1): run once with HF_HUB_OFFLINE=0 where the Hub is "
                    "reachable, or pass --tokenizer with a local tokenizer directory")
        raise UserError(f"cannot load tokenizer '{name_or_path}': {str(exc).splitlines()[0][:200]}{hint}") from None
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


def _template(tokenizer):
    """The tokenizer's chat template compiled once (as transformers compiles it), or None to fall back."""
    cached = getattr(tokenizer, "_pipeline_compiled_template", None)
    if cached is None:
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            cached = _compile_jinja_template(tokenizer.chat_template)
        except Exception:  # noqa: BLE001 - any problem: use apply_chat_template per conversation
            cached = False
        tokenizer._pipeline_compiled_template = cached
    return cached or None


def render_text(tokenizer, messages: list[dict[str, Any]], special: dict | None = None) -> str:
    tpl = _template(tokenizer)
    if tpl is not None:
        return tpl.render(messages=messages, add_generation_prompt=False,
                          **(tokenizer.special_tokens_map if special is None else special))
    return tokenizer.apply_chat_template(messages, tokenize=False)


def render(tokenizer, messages: list[dict[str, Any]], special: dict | None = None
           ) -> tuple[str, list[tuple[int, int]]] | None:
    """Rendered text and assistant character spans; None when a turn cannot be located."""
    text = render_text(tokenizer, messages, special)
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
    """Token ids and (unrolled) loss masks for each conversation; returns also the template-mismatch count.

    The batch is encoded in one call of the Rust tokenizer (parallel across cores); assistant spans are
    mapped to token positions with ``char_to_token`` instead of materialising every token's offsets.
    """
    mismatched = 0
    if conversations and _template(tokenizer) is not None:
        first = conversations[0]["messages"]
        if render_text(tokenizer, first) != tokenizer.apply_chat_template(first, tokenize=False):
            tokenizer._pipeline_compiled_template = False  # the direct render differs: use transformers'
    # Render sub-batch k+1 (Python) while the Rust tokenizer encodes sub-batch k (it releases the GIL).
    all_spans: list[list[tuple[int, int]]] = []
    futures = []
    backend = tokenizer.backend_tokenizer
    special = tokenizer.special_tokens_map  # computed per access in transformers: once per batch here
    with ThreadPoolExecutor(max_workers=1) as pool:
        for start in range(0, len(conversations), ENCODE_SUB_BATCH):
            texts = []
            for conv in conversations[start:start + ENCODE_SUB_BATCH]:
                r = render(tokenizer, conv["messages"], special)
                if r is None:
                    mismatched += 1
                    continue
                texts.append(r[0])
                all_spans.append(r[1])
            if texts:
                futures.append(pool.submit(backend.encode_batch, texts, add_special_tokens=False))
        encs = [e for f in futures for e in f.result()]
    if not encs:
        return [], [], mismatched
    lengths = np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))
    offsets = np.zeros(len(encs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    flat_ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=np.int64, count=total)
    flat_mask = np.zeros(total, dtype=np.int8)
    for e, spans, off in zip(encs, all_spans, offsets.tolist()):
        for a, b in spans:
            lo = _char_to_token(e, a, +1)
            hi = _char_to_token(e, b - 1, -1)
            if lo is not None and hi is not None and hi >= lo:
                flat_mask[off + lo: off + hi + 1] = 1
    ids_out = [flat_ids[offsets[i]:offsets[i + 1]] for i in range(len(encs))]
    mask_out = [flat_mask[offsets[i]:offsets[i + 1]] for i in range(len(encs))]
    return ids_out, mask_out, mismatched


def _char_to_token(enc, pos: int, step: int) -> int | None:
    """Token index covering character ``pos``; if none does (e.g. a normalised-away space), walk ``step``."""
    for _ in range(8):
        t = enc.char_to_token(pos)
        if t is not None:
            return t
        pos += step
        if pos < 0:
            return None
    return None
