"""pyproject.toml's [project]: every entry point of the suite is a console script that resolves to a callable, and the
dependencies and extras carry exactly the pins of requirements/ (the env setup installs from those files)."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SCRIPTS: dict[str, str] = PROJECT["scripts"]
SRC = ROOT / "src"
# A main() that is no console script, with the reason: the setup runs it by its path with the new venv's python
# before the suite is installed (pipeline_env_setup.sh pip_install), so there is no console script to call yet.
NOT_SCRIPTS = {"pipeline.env.installer": "run by path before the suite is installed",
               "pipeline.env.overlay": "run by path inside the container, before the suite's environment exists"}


def pins(path: Path) -> dict[str, str]:
    """{canonical name: the pinned version} of a requirements file; every line is one exact pin."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==" and not req.extras and req.marker is None, f"{path.name}: {line} is no pin"
            out[canonicalize_name(req.name)] = spec.version
    return out


def as_pins(reqs: list[str]) -> dict[str, str]:
    out = {}
    for r in reqs:
        req = Requirement(r)
        (spec,) = req.specifier
        assert spec.operator == "==", r
        assert canonicalize_name(req.name) not in out, f"{req.name} twice"
        out[canonicalize_name(req.name)] = spec.version
    return out


def modules_with_main() -> set[str]:
    """Every module of src/pipeline that defines a top-level ``main``: the suite's programs."""
    out = set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            out.add(".".join(path.relative_to(SRC).with_suffix("").parts))
    return out


def test_every_program_of_the_suite_is_a_console_script():
    targets = {value.split(":")[0] for value in SCRIPTS.values()}
    assert all(value.endswith(":main") for value in SCRIPTS.values()), SCRIPTS
    assert all(name.startswith("pipeline-") for name in SCRIPTS), sorted(SCRIPTS)
    assert len(targets) == len(SCRIPTS), "two console scripts for one module"
    missing = modules_with_main() - targets - set(NOT_SCRIPTS)
    assert missing == set(), f"programs with no [project.scripts] entry: {sorted(missing)}"
    # the five pipelines, their Slurm wrapper and the env validation among them
    for module in ("cli.data", "cli.train", "cli.checkpoint", "cli.coherence", "cli.evaluation", "cli.experiment",
                   "cli.sbatch", "env.validate"):
        assert f"pipeline.{module}" in targets, module


def test_each_console_script_resolves_to_a_callable():
    for name, value in SCRIPTS.items():
        module, _, attr = value.partition(":")
        fn = getattr(importlib.import_module(module), attr)
        assert callable(fn), name


def test_the_installed_console_scripts_are_pyprojects_and_run():
    # The venv's editable install (pipeline_env_setup.sh, step packages, redone when pyproject.toml changes) has the
    # same console scripts, and one runs from the venv's bin/ as its module does.
    installed = {e.name: e.value for e in md.entry_points(group="console_scripts") if e.name.startswith("pipeline-")}
    assert installed == SCRIPTS, "rerun `bash pipeline_env_setup.sh` to reinstall the package"
    exe = Path(sys.executable).parent / "pipeline-cluster"
    by_script = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    by_module = subprocess.run([sys.executable, "-m", "pipeline.config.knobs", "--help"], capture_output=True,
                               text=True, timeout=120)
    assert by_script.returncode == by_module.returncode == 0, by_script.stderr
    assert by_script.stdout == by_module.stdout and by_script.stderr == by_module.stderr
    assert "env" in by_script.stdout + by_script.stderr


def test_dependencies_and_extras_are_the_requirements_files_pins():
    extras = PROJECT["optional-dependencies"]
    assert sorted(extras) == ["local", "planner", "test"]
    req = ROOT / "requirements"
    assert as_pins(PROJECT["dependencies"]) == pins(req / "planner.txt")
    assert as_pins(extras["planner"]) == pins(req / "planner.txt")
    assert as_pins(extras["local"]) == pins(req / "local.txt")
    assert as_pins(extras["test"]) == pins(req / "test.txt")
    # the planner's pins are the venv's (tests/integration/test_env_scripts.py checks the files agree)
    local = pins(req / "local.txt")
    assert {k: local.get(k) for k in pins(req / "planner.txt")} == pins(req / "planner.txt")
