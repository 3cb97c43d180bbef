"""Reading a value out of an argument list that is passed through, not parsed (a pipeline's arguments seen by
isambard_sbatch or the experiment layer). Standard library only."""

from __future__ import annotations

from collections.abc import Sequence


def flag_values(args: Sequence[str], flag: str) -> list[str]:
    """Every value of ``flag`` in ``args`` (``--flag VALUE`` or ``--flag=VALUE``), in order."""
    out = []
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
    return out


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag VALUE`` or ``--flag=VALUE``; the first one wins), else None."""
    values = flag_values(args, flag)
    return values[0] if values else None


def has_flag(args: Sequence[str], *names: str) -> bool:
    """Whether any of the options ``names`` appears in ``args``: a long one alone or as ``--name=VALUE``, a short one
    alone or with its value joined (``-pgpu``)."""
    for a in args:
        for n in names:
            if a == n or (n.startswith("--") and a.startswith(n + "=")) or (
                    not n.startswith("--") and len(n) == 2 and a.startswith(n)):
                return True
    return False


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
