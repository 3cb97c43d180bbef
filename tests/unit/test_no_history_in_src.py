"""Comments and docstrings in src/pipeline say what the code does and why, not which issue, hostile-pass finding or
decision found it: that story is docs/decisions.md's. Every Python and shell file under src/pipeline is searched,
code, comments and docstrings alike; the only hits allowed are user-facing message strings listed below."""

from __future__ import annotations

import re

from tests.helpers import ROOT

SRC = ROOT / "src" / "pipeline"
HISTORY = re.compile(r"issue [0-9]+|[Ii]ssue #?[0-9]+|decisions? #?[0-9]+|item [0-9]+|\(item [0-9]+\)|hostile pass"
                     r"|, item [0-9]+")
# (file under src/pipeline, text of the line): printed to users, so left as it is here
ALLOWED = {
    ("env/validate.py", "dataset-helpers Makefile; decision 90)"):
        "the dataset-helpers check's fix hint, printed by `validate` when the check fails",
}


def _hits() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted([*SRC.rglob("*.py"), *SRC.rglob("*.sh")]):
        rel = path.relative_to(SRC).as_posix()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if HISTORY.search(line):
                out.append((rel, n, line.strip()))
    return out


def test_no_history_labels_in_src():
    hits = _hits()
    found = [h for h in hits if not any(h[0] == f and text in h[2] for f, text in ALLOWED)]
    assert not found, "history labels in src/pipeline (say what and why; the story is docs/decisions.md's):\n" + \
        "\n".join(f"src/pipeline/{f}:{n}: {line}" for f, n, line in found)


def test_allowed_exceptions_are_still_there():
    # an exception whose message was reworded is dropped from ALLOWED, so the list stays the list of what is left
    hits = _hits()
    stale = [key for key in ALLOWED if not any(h[0] == key[0] and key[1] in h[2] for h in hits)]
    assert not stale, f"ALLOWED entries that match nothing any more: {stale}"
