"""The type checker over every package of src/pipeline (pyproject.toml [tool.mypy]): zero findings."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_nothing():
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"] == ["src/pipeline"]
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    findings = [line for line in r.stdout.splitlines() if ": error:" in line]
    assert r.returncode == 0 and not findings, r.stdout[-4000:] + r.stderr[-2000:]
    checked = subprocess.run([sys.executable, "-m", "mypy", "--version"], capture_output=True, text=True)
    assert checked.stdout.startswith("mypy 2.4.1"), checked.stdout  # the pinned checker (requirements/test.txt)
