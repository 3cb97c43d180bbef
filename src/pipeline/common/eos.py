"""The token ids that end a generation: one rule for every generation backend.

A model's ``generation_config.json`` may list several end ids (``eos_token_id`` an int or a list: a chat model's
end-of-turn and end-of-text), none of which need be the tokenizer's ``eos_token_id``. transformers' ``generate`` stops
on the generation config's ids, falling back to ``config.json``'s when the generation config names none; the suite
stops on those and the tokenizer's own. The hf backend (``pipeline.coherence.backends``) and the megatron backend
(``pipeline.bridge.generate``) both call :func:`end_ids`, so a model stops on the same tokens in both.

Standard library only at import (``huggingface_hub`` is imported only to read a hub id's files): ``pipeline.bridge``
imports it, and nothing here may pull in torch or megatron.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _ids(value: Any) -> set[int]:
    """``eos_token_id`` as written: an int, a list of ints, or null."""
    items = value if isinstance(value, list | tuple) else [value]
    return {int(v) for v in items if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def _model_json(model: str | os.PathLike[str], name: str) -> dict[str, Any]:
    """``name`` of a local model folder, or of a hub id from the cache (or the hub, when it is reachable); {} when
    there is none or it is not a JSON object."""
    local = Path(model)
    path: str | Path | None = local / name if local.is_dir() else None
    if path is None and str(model).count("/") == 1 and not str(model).startswith((".", "/")):
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(str(model), name)
        except Exception:  # not on the hub, offline and not cached, no such file: the next source decides
            path = None
    if path is None or not Path(path).is_file():
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def end_ids(model: str | os.PathLike[str], tokenizer: Any) -> frozenset[int]:
    """The ids a generation from ``model`` (a local HF folder or a hub id) stops on: its generation config's
    ``eos_token_id`` (an int or a list), else its ``config.json``'s (or its ``text_config``'s), and ``tokenizer``'s
    ``eos_token_id``."""
    ids = _ids(_model_json(model, "generation_config.json").get("eos_token_id"))
    if not ids:
        conf = _model_json(model, "config.json")
        text = conf.get("text_config")
        ids = _ids(conf.get("eos_token_id")) or (_ids(text.get("eos_token_id")) if isinstance(text, dict) else set())
    return frozenset(ids | _ids(getattr(tokenizer, "eos_token_id", None)))
