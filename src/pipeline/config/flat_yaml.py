"""The flat YAML subset the cluster profiles are written in, parsed by hand: the host's ``python3`` reads a profile
before any environment exists (no PyYAML on a login node), and the training launcher reads it with the same parser.

``key: value`` lines; a key alone on its line opens one nested mapping of indented ``NAME: value`` lines (``env``) or
a block list of ``- item`` strings (``binds``); scalars are null/~, true/false, integers, floats, quoted or plain
strings. Anything else (flow style, anchors, multi-line) is a one-line error naming the file and line.
"""

from __future__ import annotations

import re

from pipeline.common.errors import UserError


def scalar(text: str, where: str):
    """One YAML scalar of the subset: null/~, true/false, integers, floats, quoted or plain strings."""
    t = text.strip()
    if t.startswith('"'):
        m = re.match(r'^"((?:[^"\\]|\\.)*)"\s*(#.*)?$', t)
        if not m:
            raise UserError(f"{where}: unterminated double-quoted string")
        return re.sub(r'\\(.)', lambda e: {"n": "\n", "t": "\t"}.get(e.group(1), e.group(1)), m.group(1))
    if t.startswith("'"):
        m = re.match(r"^'((?:[^']|'')*)'\s*(#.*)?$", t)
        if not m:
            raise UserError(f"{where}: unterminated single-quoted string")
        return m.group(1).replace("''", "'")
    t = re.split(r"\s+#", t, maxsplit=1)[0].strip()  # a comment starts at " #"
    if t and t[0] in "[{&*!|>@`%":
        raise UserError(f"{where}: {t[:40]!r}: only plain scalars are supported in a cluster profile "
                        "(quote the value)")
    if t in ("", "~", "null", "Null", "NULL"):
        return None
    if t in ("true", "True", "TRUE"):
        return True
    if t in ("false", "False", "FALSE"):
        return False
    if re.match(r"^[-+]?\d+$", t):
        return int(t)
    if re.match(r"^[-+]?(\d+\.\d*|\.\d+)([eE][-+]?\d+)?$", t):
        return float(t)
    return t


def parse_profile_text(text: str, source: str) -> dict:
    """The mapping of a profile file: ``key: value`` lines; ``env:`` alone on its line opens one nested mapping
    of indented ``NAME: value`` lines, and a key alone on its line followed by ``- item`` lines is a list of strings
    (``binds``). Anything else (lists, flow style, anchors, multi-line) is one-line error."""
    data: dict = {}
    nested: dict | None = None
    listed: str | None = None  # the key whose "- item" lines follow
    for n, raw in enumerate(text.splitlines(), 1):
        where = f"{source}:{n}"
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise UserError(f"{where}: tabs are not allowed for indentation")
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#") or line.strip() == "---":
            continue
        indented = line[0] == " "
        item = re.match(r"^\s*-(?:\s+(.*))?$", line)
        if item:
            if listed is None or (data[listed] != {} and not isinstance(data[listed], list)):
                raise UserError(f"{where}: a list item outside a list (only a key alone on its line, like binds:, "
                                "opens one)")
            if not isinstance(data[listed], list):
                data[listed] = []
            nested = None
            value = scalar(item.group(1) or "", where)
            if not isinstance(value, str):
                raise UserError(f"{where}: a list item must be a string")
            data[listed].append(value)
            continue
        m = re.match(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*:(?:\s+(.*))?$", line)
        if not m:
            raise UserError(f"{where}: expected 'key: value' (a cluster profile is flat YAML), "
                            f"got {line.strip()[:60]!r}")
        key, value = m.group(1), (m.group(2) or "")
        if indented:
            if nested is None:
                raise UserError(f"{where}: unexpected indentation (only the env: mapping is nested)")
            listed = None
            if key in nested:
                raise UserError(f"{where}: duplicate key {key!r}")
            nested[key] = scalar(value, where)
            continue
        if key in data:
            raise UserError(f"{where}: duplicate key {key!r}")
        if value.strip() == "" or value.strip().startswith("#"):
            data[key] = nested = {}  # a mapping or a list follows (or nothing: an empty mapping, like YAML's null)
            listed = key
            continue
        nested = None
        listed = None
        data[key] = scalar(value, where)
    return {k: (None if v == {} and k != "env" else v) for k, v in data.items()}
