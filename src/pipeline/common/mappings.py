"""Nested-mapping helpers, one of each: flatten to dotted keys, nest dotted keys, deep-merge, drop unset values."""

from __future__ import annotations

from typing import Any


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train.train_iters": 40, ...}``: every leaf under its dotted key (an empty mapping is a leaf)."""
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flatten` (a leading ``+`` of a Hydra key is dropped). Raises ValueError when one key
    sets a value where another needs a section."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        d = out
        parts = key.lstrip("+").split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise ValueError(f"override {key} sets a key below {p}, which another override sets to a value")
        d[parts[-1]] = value
    return out


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``update``, section by section (neither is modified)."""
    out = dict(base)
    for k, v in update.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def drop_unset(d: Any) -> Any:
    """``d`` without unset (None) values and the sections left empty."""
    if not isinstance(d, dict):
        return d
    out = {}
    for k, v in d.items():
        v = drop_unset(v)
        if v is not None and v != {}:
            out[k] = v
    return out
