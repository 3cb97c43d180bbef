"""User errors exit 2 with one line; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import difflib
import functools
import os
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

from pipeline.common.shell import terminal_lines

F = TypeVar("F", bound=Callable[..., int | None])


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file, bad flag). Exits with code 2."""

    exit_code = 2


def exc_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line, at most ``limit`` characters (its type's name when it has no message): what a
    one-line error quotes of a library's multi-line message."""
    return (str(exc).splitlines() or [type(exc).__name__])[0][:limit]


# How alike (difflib's ratio) a known name must be to a mistyped one to be suggested, for every hint of the suite:
# a typo (train_iter, lrr, nanoo) is suggested; a fragment (iters for train.train_iters) gets the message's list
# of the valid names instead of a guess. The training preflight's value, used by the loader, the model registry
# and the lm-eval task check too (not difflib's default 0.6).
HINT_CUTOFF = 0.75


def close_matches(word: str, choices: Iterable[str], n: int = 1) -> list[str]:
    """The ``n`` known names closest to a mistyped ``word``, best first (none below HINT_CUTOFF)."""
    return difflib.get_close_matches(word, list(choices), n=n, cutoff=HINT_CUTOFF)


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'NAME'?)`` with the known name closest to ``word`` (after ``prefix``), or ``""``."""
    close = close_matches(word, choices)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def cli_main(fn: F) -> F:
    """Wrap a ``main(argv)`` so a UserError prints ``error: ...`` and exits 2, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            rc = fn(*args, **kwargs)
        except UserError as exc:
            for line in str(exc).splitlines() or [""]:
                print(f"error: {terminal_lines(line)}", file=sys.stderr)  # a path's ESC or CR shown, not obeyed
            return exc.exit_code
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # output piped into `head` and the like: stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        return 0 if rc is None else rc

    return wrapper  # type: ignore[return-value]
