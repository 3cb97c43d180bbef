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


def test_a_mistyped_kind_is_a_finding(tmp_path):
    # The kinds are Literal types (config/kinds.py) and [tool.mypy] has strict_equality: a word that is no engine,
    # mode or phase kind, compared or assigned, is a finding where it is written.
    probe = tmp_path / "probe.py"
    probe.write_text("from pipeline.config.kinds import Mode\nfrom pipeline.config.models import get_model\n\n"
                     "is_bridge = get_model('nano').engine == 'megatron'\nmode: Mode = 'finetune'\n"
                     "ok = get_model('nano').engine == 'megatron_bridge'\n")
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", str(tmp_path / "cache"),
                        "--config-file", str(ROOT / "pyproject.toml"), str(probe)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    lines = sorted(int(line.split(":")[1]) for line in r.stdout.splitlines() if ": error:" in line)
    assert lines == [4, 5], r.stdout + r.stderr
