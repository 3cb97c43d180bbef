"""Reading a value out of an argument list that is passed through, not parsed (a pipeline's arguments seen by
isambard_sbatch or the experiment layer). Standard library only."""

from __future__ import annotations

from collections.abc import Sequence


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag VALUE`` or ``--flag=VALUE``; the first one wins), else None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def strip_options(args: Sequence[str], flags: Sequence[str] = (), valued: Sequence[str] = ()) -> list[str]:
    """``args`` without the ``flags`` and without the ``valued`` options and their values (``--opt V`` or
    ``--opt=V``): a command line replayed by a launcher without the options only its first process reads."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in flags or any(a.startswith(v + "=") for v in valued):
            continue
        elif a in valued:
            skip = True
        else:
            out.append(a)
    return out
