"""Every shipped training config's documented dry run (the command of its header) prints what it printed when it was
recorded (tests/assets/dry_runs/), byte for byte, the checkout's path written <ROOT> and the user alice: a refactor of the planner
(issue 63, "behaviour stays the same") changes nothing a user sees.

A change meant to alter a plan re-records the set, and the diff of tests/assets/dry_runs/ in the commit shows what
every shipped config's plan now says: ``PIPELINE_RECORD_DRY_RUNS=1 python -m pytest tests/unit/test_dry_runs_recorded.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.cli.train import main
from tests.helpers import ROOT
from tests.unit.test_shipped_configs import TRAINING_CONFIGS, documented_plan

RECORDED = ROOT / "tests" / "assets" / "dry_runs"
RECORD = os.environ.get("PIPELINE_RECORD_DRY_RUNS") == "1"  # read before each test clears the PIPELINE_ knobs


def recorded_path(config: Path) -> Path:
    return RECORDED / (config.relative_to(ROOT / "configs").as_posix().replace("/", "__").removesuffix(".yaml")
                       + ".txt")


@pytest.mark.parametrize("config", TRAINING_CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_documented_dry_run_prints_what_was_recorded(config, capsys, monkeypatch):
    for name in [n for n in os.environ if n.startswith("PIPELINE_")]:  # the config's own profile and knobs only
        monkeypatch.delenv(name)
    monkeypatch.setenv("USER", "alice")  # the configs' ${oc.env:USER}: one user for every machine's record
    monkeypatch.chdir(ROOT)
    argv = documented_plan(config)
    assert main(argv) == 0
    out = capsys.readouterr().out.replace(str(ROOT), "<ROOT>")
    path = recorded_path(config)
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out)
    assert path.exists(), f"no recorded dry run for {config.name}: record the set ({__doc__.split('``')[1]})"
    assert out == path.read_text(), f"{config.name}: the dry run differs from {path.relative_to(ROOT)}"


def test_every_recorded_dry_run_belongs_to_a_shipped_config():
    assert sorted(RECORDED.glob("*.txt")) == sorted(recorded_path(c) for c in TRAINING_CONFIGS)
