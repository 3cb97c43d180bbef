"""The one argument parser of the suite's commands: ``--help`` prints the module's whole usage (its docstring), and
a usage mistake is one line ``error: ... (see --help)`` with exit code 2 (through :func:`cli_main`)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pipeline.common.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse with the suite's conventions: raw-text description, one-line usage errors."""

    def __init__(self, prog: str, description: str | None = None, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(prog=prog, description=description, **kwargs)

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message} (see --help)")


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts that must be >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def path_arg(text: str):
    """An argparse ``type`` for a path the command writes or reads as a root: an empty one is refused (``Path("")`` is
    the current directory: ``--dataset-root ""`` overwrote an unrelated training.jsonl there, exit 0)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path is the current directory; name the directory (e.g. '.')")
    if "\0" in text:
        raise argparse.ArgumentTypeError("a path cannot hold a NUL character")
    return Path(text)


def run_dir_arg(text: str):
    """``--run-dir``: a path as :func:`path_arg`, and not a filesystem root (``--run-dir ""`` had made the checkout
    the run directory: its config.yaml, launch.json and checkpoints/ written into the working directory, exit 0)."""
    path = path_arg(text)
    if path.resolve() == path.resolve().parent:
        raise argparse.ArgumentTypeError(f"{text!r} is a filesystem root; name a directory for the run's records")
    return path


def name_arg(text: str) -> str:
    """A name that must not be empty (``--cluster ""`` had silently meant the default profile)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty name; give one (or leave the option out for the default)")
    return text


WATCH_MAX_SECONDS = 86400.0


def watch_seconds(text: str) -> float:
    """An argparse ``type`` for a refresh interval: a finite number of seconds, 1 to one day (inf and 1e300 made
    time.sleep raise, a negative one was taken as 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or not 1.0 <= value <= WATCH_MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds from 1 to {WATCH_MAX_SECONDS:g}")
    return value


def bounded_float(low: float, high: float, what: str):
    """An argparse ``type``: a finite number in [low, high] (NaN compares false with everything, so ``--atol nan``
    made the verification unable to fail; inf and 1e308 are not tolerances either)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} must be {what}, a finite number from {low:g} to {high:g}")
        return value

    return parse
