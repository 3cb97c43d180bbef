"""Shell text that is safe to run as printed: every word quoted on one physical line, every comment one line.

``render`` prints the exact lines to run, and a swept value is user text: a newline in it would end a
``# run ...`` comment and the next line would run as a command. bash ends a line (and a comment) only at ``\\n``;
a terminal also moves on at ``\\r``, ``\\v``, ``\\f`` and Unicode line separators, which would hide what runs. So:
a word with any control or line-separating character is written in ANSI-C quoting (``$'...'``, bash's own), and a
comment has those characters escaped. Standard library only (isambard_sbatch and the planner use it)."""

from __future__ import annotations

import shlex
import unicodedata
from collections.abc import Iterable

_ESCAPES = {"\a": "\\a", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v", "\f": "\\f", "\r": "\\r",
            "\x1b": "\\E", "\\": "\\\\", "'": "\\'"}


def _unsafe(ch: str) -> bool:
    """A character that ends or hides a line on a terminal: C0/C1 controls, format characters (bidirectional
    overrides), and the Unicode line and paragraph separators."""
    return unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp")


def _escape(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def quote(word: str) -> str:
    """``shlex.quote``, except that a word holding a control or line-separating character is written as ``$'...'``
    with those characters escaped: one physical line, the same bytes to bash."""
    if not any(_unsafe(ch) for ch in word):
        return shlex.quote(word)
    return "$'" + "".join(_escape_bytes(ch) if _unsafe(ch) or ch in "\\'" else ch for ch in word) + "'"


def _escape_bytes(ch: str) -> str:
    """The escape of one character inside ``$'...'``: a character past ASCII as its UTF-8 bytes (``\\xHH``),
    which bash gives back as they are in any locale (``\\uHHHH`` depends on the locale's encoding)."""
    if ord(ch) < 0x80:
        return _escape(ch)
    return "".join(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogatepass"))


def join(words: Iterable[str]) -> str:
    return " ".join(quote(w) for w in words)


def one_line(text: str) -> str:
    """``text`` with every control or line-separating character escaped (``\\n``, ``\\x1b``, ``\\u2028``): safe
    inside a comment, and one line on a terminal."""
    return "".join(_escape(ch) if _unsafe(ch) else ch for ch in text)


def terminal_lines(text: str) -> str:
    """``text`` with every control character escaped as :func:`one_line` escapes it, except the newlines (and tabs)
    that lay it out in lines: a log message or a printed summary that carries a user's or a file's text (an ESC
    sequence, a CR that rewrites the line) shows it, never obeys it."""
    return "".join(_escape(ch) if _unsafe(ch) and ch not in "\n\t" else ch for ch in text)


def comment(text: str) -> str:
    """A shell comment line of ``text`` (escaped by :func:`one_line`)."""
    return "# " + one_line(text)
