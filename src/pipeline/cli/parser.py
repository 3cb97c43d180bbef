"""The one argument parser of the suite's commands: ``--help`` prints the module's whole usage (its docstring), and
a usage mistake is one line ``error: ... (see --help)`` with exit code 2 (through :func:`cli_main`)."""

from __future__ import annotations

import argparse

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
