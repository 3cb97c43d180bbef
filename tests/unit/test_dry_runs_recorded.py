"""Every shipped training config's documented dry run (the command of its header) prints what it printed when it was
recorded (tests/assets/dry_runs/), byte for byte, the checkout's path written <ROOT> and the user alice: a refactor of the planner
(issue 63, "behaviour stays the same") changes nothing a user sees. Its plan's record (``preflight.json``, the plan's
``as_dict``) is recorded beside it (``.plan.json``), for the same reason (issue 65: the plan base).

A change meant to alter a plan re-records the set, and the diff of tests/assets/dry_runs/ in the commit shows what
every shipped config's plan now says: ``PIPELINE_RECORD_DRY_RUNS=1 python -m pytest tests/unit/test_dry_runs_recorded.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.cli.train import main, parse_request
from pipeline.training.launch import plan_launch
from tests.helpers import ROOT
from tests.unit.test_shipped_configs import TRAINING_CONFIGS, documented_plan

RECORDED = ROOT / "tests" / "assets" / "dry_runs"
RECORD = os.environ.get("PIPELINE_RECORD_DRY_RUNS") == "1"  # read before each test clears the PIPELINE_ knobs


def recorded_path(config: Path, suffix: str = ".txt") -> Path:
    return RECORDED / (config.relative_to(ROOT / "configs").as_posix().replace("/", "__").removesuffix(".yaml")
                       + suffix)


def one_user(monkeypatch) -> None:
    for name in [n for n in os.environ if n.startswith("PIPELINE_")]:  # the config's own profile and knobs only
        monkeypatch.delenv(name)
    monkeypatch.setenv("USER", "alice")  # the configs' ${oc.env:USER}: one user for every machine's record
    monkeypatch.chdir(ROOT)


def compare_or_record(config: Path, out: str, suffix: str) -> None:
    path = recorded_path(config, suffix)
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out)
    assert path.exists(), f"no recorded dry run for {config.name}: record the set ({__doc__.split('``')[1]})"
    assert out == path.read_text(), f"{config.name}: the dry run differs from {path.relative_to(ROOT)}"


@pytest.mark.parametrize("config", TRAINING_CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_documented_dry_run_prints_what_was_recorded(config, capsys, monkeypatch):
    one_user(monkeypatch)
    argv = documented_plan(config)
    assert main(argv) == 0
    compare_or_record(config, capsys.readouterr().out.replace(str(ROOT), "<ROOT>"), ".txt")


@pytest.mark.parametrize("config", TRAINING_CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_documented_plan_records_what_was_recorded(config, monkeypatch):
    one_user(monkeypatch)
    req, dry_run = parse_request(documented_plan(config))
    assert dry_run
    record = json.dumps(plan_launch(req).preflight.as_dict(), indent=2, sort_keys=True, default=str)  # write_json
    compare_or_record(config, record.replace(str(ROOT), "<ROOT>") + "\n", ".plan.json")


def test_every_recorded_dry_run_belongs_to_a_shipped_config():
    assert sorted(RECORDED.glob("*.txt")) == sorted(recorded_path(c) for c in TRAINING_CONFIGS)
    assert sorted(RECORDED.glob("*.plan.json")) == sorted(recorded_path(c, ".plan.json") for c in TRAINING_CONFIGS)
