"""common/shell.py: words and comments that are safe to run as printed (issue 60, item 1)."""

from __future__ import annotations

import subprocess

import pytest

from pipeline.common import shell

WORDS = ["plain", "with space", "it's", "back\\slash", "x\ntouch P #", "y\rz", "z\u2028t", "\x85a", "\x1b[2K",
         "tab\there", "é and \u00e9\u0301", "$(touch P) `touch P`", "\u202eevil", "\U0001f600\n"]


@pytest.mark.parametrize("locale", ["C", "C.UTF-8"])
def test_a_quoted_word_is_one_line_and_the_same_bytes_to_bash_in_any_locale(locale):
    for w in WORDS:
        q = shell.quote(w)
        assert "\n" not in q and "\r" not in q and "\u2028" not in q and "\x1b" not in q, repr(q)
        out = subprocess.run(["bash", "-c", "printf %s " + q], capture_output=True,
                             env={"LC_ALL": locale, "PATH": "/usr/bin:/bin"}).stdout
        assert out == w.encode(), (w, q, out)
    assert shell.quote("plain") == "plain" and shell.join(["a b", "c"]) == "'a b' c"


def test_a_comment_is_one_line_whatever_its_text_holds():
    for w in WORDS:
        c = shell.comment(f"run {w}: x")
        assert c.startswith("# ") and len(c.splitlines()) == 1 and "\x1b" not in c and "\u202e" not in c, repr(c)
        assert subprocess.run(["bash", "-c", c + "\nexit 3"], capture_output=True).returncode == 3
    assert shell.one_line("a\nb\u2028c") == "a\\nb\\u2028c"
