"""The house rules, checked on every run of the README's test command: ruff (Python) and shellcheck (every shell
script and sbatch file) with zero findings, and the import layers of pyproject.toml ([tool.importlinter]) kept, with
a deliberately added upward import shown to break them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, run

BIN = Path(sys.executable).parent
# The commands of the house rules (program, then arguments), run from the repository root; .pre-commit-config.yaml
# runs the same ones (tests/unit/test_precommit_config.py).
RUFF = ["ruff", "check", "--no-cache", "."]
SHELLCHECK = ["shellcheck"]  # + every shell script (shell_scripts)
LINT_IMPORTS = ["lint-imports", "--config", "pyproject.toml", "--no-cache", "--no-logo"]  # with PYTHONPATH=src


def shell_scripts() -> list[str]:
    """Every tracked shell script and sbatch file (by extension or by a bash shebang)."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True).stdout
    out = []
    for name in files.split():
        path = ROOT / name
        if name.startswith(("3rdparty/", "tests/bridge/shim/")) or not path.is_file():
            continue
        if name.endswith((".sh", ".sbatch")) or path.read_bytes()[:40].startswith((b"#!/usr/bin/env bash", b"#!/bin/bash")):
            out.append(name)
    return sorted(out)


def test_ruff_finds_nothing():
    res = run([str(BIN / RUFF[0]), *RUFF[1:]])
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


def test_shellcheck_finds_nothing():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed: tests/run.sh installs it (apt-get install shellcheck)"
    scripts = shell_scripts()
    assert {"isambard_sbatch", "pipeline_training_submit.sbatch", "src/pipeline/common/lib.sh"} <= set(scripts)
    res = run([shellcheck, *SHELLCHECK[1:], *scripts])
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


def lint_imports(config: Path, src: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src)}  # the copy under test shadows the installed package
    args = [str(config) if a == "pyproject.toml" else a for a in LINT_IMPORTS[1:]]
    return run([str(BIN / LINT_IMPORTS[0]), *args], env=env, cwd=config.parent)


def test_import_layers_are_kept():
    res = lint_imports(ROOT / "pyproject.toml", ROOT / "src")
    assert res.returncode == 0 and "0 broken" in res.stdout, res.stdout[-4000:] + res.stderr[-2000:]


def test_an_upward_import_breaks_the_layers(tmp_path):
    shutil.copytree(ROOT / "src" / "pipeline", tmp_path / "src" / "pipeline",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    victim = tmp_path / "src" / "pipeline" / "checkpoint" / "poll.py"
    victim.write_text(victim.read_text() + "\n\ndef _upward():\n    from pipeline.training import records  # noqa\n")
    res = lint_imports(tmp_path / "pyproject.toml", tmp_path / "src")
    assert res.returncode != 0, res.stdout[-4000:]
    assert "pipeline.checkpoint is not allowed to import pipeline.training" in res.stdout, res.stdout[-4000:]
    assert "pipeline.checkpoint.poll -> pipeline.training.records" in res.stdout, res.stdout[-4000:]
