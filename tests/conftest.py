"""Shared test set-up: offline hub and W&B, temporary data/run/W&B dirs. Helpers live in tests/helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.tiers import FIXTURES_OF, TIERS, TierError, gpu_exemption, required_tiers

os.environ.setdefault("PIPELINE_ROOT", str(ROOT))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def pipeline_env(tmp_path, monkeypatch):
    """Environment for running the pipeline scripts with all outputs under tmp_path."""
    env = dict(os.environ)
    env.update({
        "PIPELINE_ROOT": str(ROOT),
        "PIPELINE_DATA_ROOT": str(tmp_path / "data"),
        "PIPELINE_RUNS_DIR": str(tmp_path / "runs"),
        "WANDB_DIR": str(tmp_path / "wandb"),
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "PIPELINE_BAD_NODES_LOG": str(tmp_path / "bad_nodes.log"),
    })
    for k in ("PIPELINE_DATA_ROOT", "PIPELINE_RUNS_DIR", "WANDB_DIR"):
        monkeypatch.setenv(k, env[k])
    return env


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from pipeline.config.models import get_model, require_local_model

    return require_local_model(get_model("smollm2-135m"))


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


# ---- test tiers (tests/tiers.py): a required tier never skips; the summary counts every tier and its time ------
_OUTCOMES: dict[str, tuple[tuple[str, ...], str]] = {}
_SECONDS: dict[str, float] = {}  # per test: its set-up, call and tear-down, summed (a module fixture's build included)


def _tiers_of(item) -> tuple[str, ...]:
    return tuple(t for t in TIERS if item.get_closest_marker(t) is not None)


def pytest_configure(config):
    try:
        required_tiers()
    except TierError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_collection_modifyitems(config, items):
    exempt = gpu_exemption()
    for item in items:
        for tier, fixtures in FIXTURES_OF.items():
            if item.get_closest_marker(tier) is None and set(fixtures) & set(getattr(item, "fixturenames", ())):
                item.add_marker(tier)
        if exempt and item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=f"test tier gpu {exempt}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    tiers = _tiers_of(item)
    if rep.skipped and not hasattr(rep, "wasxfail"):
        must = [t for t in tiers if t in required_tiers() and not (t == "gpu" and gpu_exemption())]
        if must:  # a skip inside a required tier, whoever raised it, fails the test with its reason
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            reason = reason.removeprefix("Skipped: ")
            rep.outcome = "failed"
            rep.longrepr = f"required test tier {must[0]} skipped a test: {reason}"
    prev = _OUTCOMES.get(item.nodeid, (tiers, "passed"))[1]
    now = "failed" if rep.failed or prev == "failed" else "skipped" if rep.skipped else prev
    _OUTCOMES[item.nodeid] = (tiers, now)
    _SECONDS[item.nodeid] = _SECONDS.get(item.nodeid, 0.0) + rep.duration


def pytest_terminal_summary(terminalreporter):
    if not _OUTCOMES:
        return
    required = required_tiers()
    tr = terminalreporter
    tr.section("test tiers")
    for tier in (*TIERS, "untiered"):
        ids = [i for i, (t, _) in _OUTCOMES.items() if (tier in t if tier != "untiered" else not t)]
        rows = [_OUTCOMES[i][1] for i in ids]
        counts = ", ".join(f"{rows.count(o)} {o}" for o in ("passed", "failed", "skipped"))
        note = " (required)" if tier in required else ""
        if tier == "gpu" and gpu_exemption():
            note = f"; {gpu_exemption()}"
        # tests run one after another: a tier's wall time is its tests' time, the tiers' add up to pytest's
        tr.write_line(f"tier {tier}: {counts}{note}; wall {sum(_SECONDS.get(i, 0.0) for i in ids):.1f} s")
