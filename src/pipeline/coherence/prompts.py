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


def load_prompts(path: Path | None) -> list[str]:
    """Prompts from a file (one per line, or a JSON list / JSONL with a 'prompt' field), else the defaults."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    prompts: list[str] = []
    if path.suffix == ".json":
        data = json.loads(text)
        prompts = [p if isinstance(p, str) else p["prompt"] for p in data]
    elif path.suffix == ".jsonl":
        prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"prompt file {path} has no prompts")
    return prompts
