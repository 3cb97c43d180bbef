"""User errors exit 2 with one line; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., int | None])


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file, bad flag). Exits with code 2."""

    exit_code = 2


def exc_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line, at most ``limit`` characters (its type's name when it has no message): what a
    one-line error quotes of a library's multi-line message."""
    return (str(exc).splitlines() or [type(exc).__name__])[0][:limit]


def cli_main(fn: F) -> F:
    """Wrap a ``main(argv)`` so a UserError prints ``error: ...`` and exits 2, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            rc = fn(*args, **kwargs)
        except UserError as exc:
            for line in str(exc).splitlines() or [""]:
                print(f"error: {line}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # output piped into `head` and the like: stop quietly
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        return 0 if rc is None else rc

    return wrapper  # type: ignore[return-value]
