"""The default prompt set: 8 diverse prompts (facts, reasoning, code, instructions, creative, chat)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.common.errors import UserError

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the factorial of n.",
    "If I have 3 apples and buy 5 more, then eat 2, how many apples do I have?",
    "Give me three tips for sleeping better.",
    "Write a haiku about the ocean.",
    "Translate 'good morning, how are you?' into French.",
    "Hello! Can you introduce yourself?",
]


MAX_PROMPT_FILE = 16 * 1024 * 1024  # bytes; a coherence test is a handful of prompts
SHAPES = "a JSON list of prompts (strings, or objects with a string 'prompt')"


def _prompt(item, where: str) -> str:
    """One prompt of a JSON or JSONL file: a non-empty string, or an object whose 'prompt' is one."""
    if isinstance(item, dict):
        if "prompt" not in item:
            raise UserError(f"{where}: an object without a 'prompt' key (keys: {', '.join(map(str, item))[:80]})")
        item = item["prompt"]
    if not isinstance(item, str):
        raise UserError(f"{where}: a prompt must be a string (got {type(item).__name__})")
    if not item.strip():
        raise UserError(f"{where}: the prompt is empty")
    try:
        item.encode("utf-8")
    except UnicodeEncodeError:  # a JSON escape of half a surrogate pair ("\\ud800"): no report could hold it
        raise UserError(f"{where}: the prompt is not valid Unicode (a lone surrogate escape such as \\ud800)"
                        ) from None
    return item


def load_prompts(path: Path | None) -> list[str]:
    """Prompts from a file, else the defaults: ``.json`` - a list of strings or ``{"prompt": ...}`` objects;
    ``.jsonl`` - one string or ``{"prompt": ...}`` object per line; anything else - one prompt per non-empty line.
    Every other shape (an object, a bare string, numbers, nulls, an object without 'prompt') is one UserError line:
    ``{"prompts": [...]}`` had run the single prompt "prompts", and a JSON string one prompt per character."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist or is not a regular file")
    try:
        if path.stat().st_size > MAX_PROMPT_FILE:
            raise UserError(f"prompt file {path} is over {MAX_PROMPT_FILE >> 20} MiB; a coherence test takes a handful "
                            "of prompts")
        text = path.read_text(encoding="utf-8-sig")  # a BOM is not part of the first prompt
    except UnicodeDecodeError:
        raise UserError(f"prompt file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise UserError(f"prompt file {path} cannot be read ({exc.strerror})") from None
    prompts: list[str] = []
    if path.suffix.lower() == ".json":  # P.JSON too: it had run the list as one text line
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError, ValueError) as exc:
            raise UserError(f"prompt file {path} is not valid JSON: {str(exc)[:120]}") from None
        if not isinstance(data, list):
            hint = " (the list itself, not an object holding it)" if isinstance(data, dict) else ""
            raise UserError(f"prompt file {path} must be {SHAPES}{hint}; got a JSON {type(data).__name__}")
        prompts = [_prompt(p, f"prompt file {path}, item {i}") for i, p in enumerate(data)]
    elif path.suffix.lower() == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except (json.JSONDecodeError, RecursionError, ValueError) as exc:
                raise UserError(f"prompt file {path}, line {n}: not valid JSON: {str(exc)[:120]}") from None
            prompts.append(_prompt(item, f"prompt file {path}, line {n}"))
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"prompt file {path} has no prompts")
    return prompts
