"""Helpers the tests import: the repository root and a runner for the real scripts."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str] | str, env: dict | None = None, timeout: float = 900, check: bool = False,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         shell=isinstance(cmd, str))
    if check and res.returncode != 0:
        raise AssertionError(f"{cmd} exited {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}")
    return res
