"""YAML as the suite reads it: YAML 1.2's core schema on PyYAML's safe parser, duplicate keys refused and aliases
bounded.

PyYAML implements YAML 1.1, where ``1:20`` is the base-60 integer 80, ``2_0`` is 20, ``010`` is 8, ``yes``/``on`` are
booleans, ``2024-01-01`` is a date and ``1e-3`` is a *string* (a float needs a dot); a key written twice silently keeps
its last value. The core schema of YAML 1.2 - what OmegaConf's and Hydra's own readings of numbers follow - resolves
only ``null``/``~``/empty, ``true``/``false``, decimal integers (``0o`` octal, ``0x`` hex) and decimal floats with
``.inf``/``.nan``; everything else is the string it reads as. Anchors and aliases are allowed, but a document whose
aliases expand past ``MAX_NODES`` values (a "billion laughs" bomb) or refer to themselves is refused before it is
built: the suite copies and merges configs, and a shared node repeated 10**9 times never finishes.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError

from pipeline.common.errors import UserError
from pipeline.common.io import read_regular

# A training config has a few hundred values and an experiment file a few thousand; an expansion past this is a bomb.
MAX_NODES = 100_000


class Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema resolvers and a mapping constructor that refuses duplicate keys."""

    yaml_implicit_resolvers: dict = {}

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: SafeConstructor reports it
                if first is not None:
                    raise ConstructorError(
                        None, None, f"duplicate key {str(key)[:80]!r} (line {first.line + 1} and line "
                        f"{key_node.start_mark.line + 1}): write each key once", key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)

    def construct_scalar(self, node):
        value = super().construct_scalar(node)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # "\ud800": half a UTF-16 pair, which no file or process argument can hold
            raise ConstructorError(None, None, f"the value on line {node.start_mark.line + 1} holds a lone surrogate "
                                   "escape (such as \\ud800), which is not text", node.start_mark) from None
        return value

    def construct_yaml_int(self, node):
        value = self.construct_scalar(node)
        sign = -1 if value.startswith("-") else 1
        digits = value.lstrip("+-")
        if digits.startswith("0o"):
            return sign * int(digits[2:], 8)
        if digits.startswith("0x"):
            return sign * int(digits[2:], 16)
        return sign * int(digits, 10)  # 010 is ten in YAML 1.2 (eight in 1.1)


Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)

_CORE = [
    ("tag:yaml.org,2002:null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", r"true|True|TRUE|false|False|FALSE", list("tTfF")),
    ("tag:yaml.org,2002:int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", list("-+0123456789")),
    ("tag:yaml.org,2002:float", r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                                r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)", list("-+0123456789.")),
    ("tag:yaml.org,2002:merge", r"<<", ["<"]),  # YAML 1.1's merge key, which OmegaConf's loader also keeps
]
for _tag, _rx, _first in _CORE:
    Loader.add_implicit_resolver(_tag, re.compile(rf"^(?:{_rx})$"), _first)


class Dumper(yaml.SafeDumper):
    """SafeDumper that also quotes strings YAML 1.2 (and OmegaConf) would read as numbers: ``'1e3'`` stays a string
    for every reader (PyYAML's dumper quotes only what YAML 1.1 resolves, and OmegaConf read ``1e3`` as 1000.0)."""


for _tag, _rx, _first in _CORE:
    Dumper.add_implicit_resolver(_tag, re.compile(rf"^(?:{_rx})$"), _first)


def dump(data: Any, **kwargs) -> str:
    """``yaml.safe_dump`` whose strings read back as strings under YAML 1.1, YAML 1.2 and OmegaConf."""
    return yaml.dump(data, Dumper=Dumper, **kwargs)


def _expanded_size(root) -> int:
    """How many values the node graph stands for once every alias is expanded (shared nodes counted each time they
    are reached), computed once per distinct node; raises ComposerError on an alias inside its own anchor."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node) -> int:
        nid = id(node)
        if nid in sizes:
            return sizes[nid]
        if nid in active:
            raise yaml.composer.ComposerError(None, None, "an alias refers to the node that contains it (a "
                                              "recursive anchor)", node.start_mark)
        active.add(nid)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        active.discard(nid)
        sizes[nid] = min(total, MAX_NODES + 1)
        return sizes[nid]

    return size(root)


def load(text: str, loader_class: type = Loader) -> Any:
    """One YAML document read with YAML 1.2 core-schema values; raises ``yaml.YAMLError`` (a duplicate key, an alias
    bomb, a recursive anchor and nesting too deep included) with the problem on the first line of its message.
    ``loader_class=yaml.SafeLoader`` reads a record the suite (or Bridge) wrote with ``yaml.safe_dump`` as it was
    written (YAML 1.1), with the same bounds."""
    loader = loader_class(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise yaml.YAMLError("the document nests too deeply") from None
        if node is None:
            return None
        try:
            n = _expanded_size(node)
        except RecursionError:
            raise yaml.YAMLError("the document nests too deeply") from None
        if n > MAX_NODES:
            raise yaml.YAMLError(f"anchors and aliases expand to more than {MAX_NODES} values (an alias bomb?); "
                                 "write the values out")
        try:
            return loader.construct_document(node)
        except RecursionError:
            raise yaml.YAMLError("the document nests too deeply") from None
    finally:
        loader.dispose()


RECORD_MAX_BYTES = 16 * 2**20  # a run's config.yaml is a few KiB; a lock file or Bridge's run_config.yaml no more
RECORD_MAX_DEPTH = 64  # a run's config nests 4 deep; its readers (config_diff, flatten) recurse


def read_record(path: str | os.PathLike, max_bytes: int = RECORD_MAX_BYTES, *, as_written: bool = True) -> Any:
    """A YAML record from disk (a run's config.yaml, an experiment's lock file, Bridge's run_config.yaml): a regular
    file of at most ``max_bytes`` (never a FIFO, a device or /dev/zero), its nesting and aliases bounded as
    :func:`load` bounds them. ``as_written``: read with PyYAML's own (YAML 1.1) resolvers, as ``yaml.safe_dump``
    wrote it; else with the suite's core schema. Raises OSError (unreadable, not a regular file, too big),
    ``yaml.YAMLError`` (not YAML, nested too deeply, an alias bomb) or UnicodeDecodeError (a ValueError): a huge or
    deeply nested config.yaml in a run folder must not crash render, status, csv and the launcher with RecursionError
    or MemoryError."""
    text = read_regular(path, max_bytes).decode("utf-8")
    data = load(text, yaml.SafeLoader if as_written else Loader)
    stack = [(data, 1)]
    while stack:  # iterative: the check itself must not recurse
        node, depth = stack.pop()
        if depth > RECORD_MAX_DEPTH:
            raise yaml.YAMLError(f"{path}: nested more than {RECORD_MAX_DEPTH} deep; not a record the suite wrote")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return data


MISSING = "???"  # OmegaConf's mark for a required value


def refuse_missing(values: Any, where: str, prefix: str = "") -> None:
    """Refuse a value left as ``???`` (OmegaConf's "required, never filled"): read as the literal string it named the
    run directory ``runs/???``."""
    if isinstance(values, dict):
        for k, v in values.items():
            refuse_missing(v, where, f"{prefix}{k}.")
    elif isinstance(values, (list, tuple)):
        for i, v in enumerate(values):
            refuse_missing(v, where, f"{prefix[:-1]}[{i}].")
    elif values == MISSING:
        key = prefix[:-1] or "a value"
        option = re.sub(r"\[\d+\].*$", "", key)
        raise UserError(f"{where}: {key} is '???', a required value that was never filled; give it a value (in the "
                        f"file, or {option}=... on the command line)")
