"""Shared test set-up: offline hub and W&B, temporary data/run/W&B dirs. Helpers live in tests/helpers.py."""

from __future__ import annotations

import importlib
import os
import sys
import time
import types
from pathlib import Path

import pytest

from pipeline.training.conformance import fetch_wheel_source, pinned_version
from tests import parallel
from tests.helpers import ROOT
from tests.parallel import (  # noqa: F401  (the workers' groups and their scheduler: hooks)
    pytest_collection_finish,
    pytest_configure_node,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)
from tests.tiers import (
    FIXTURES_OF,
    NAMED_CASES,
    TIERS,
    TierError,
    gpu_exemption,
    required_tiers,
    tier_unavailable,
)

os.environ.setdefault("PIPELINE_ROOT", str(ROOT))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two workers on two cores: a torch process beside another (a test beside a Slurm job, an export beside a
# training) spends its cores on libgomp threads spinning for work under the default wait policy; PASSIVE makes
# waiting threads sleep. Measured: a pair of tiny trainings 2.9x faster per step, a lone one 0.88x (decision 88,
# bench/bench_omp_wait.py). Every process the tests start inherits it, Slurm jobs included (sbatch --export=ALL).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
# Counted from the reports where they arrive (pytest_runtest_logreport): in the one pytest process, or in xdist's
# controller from every worker's reports (each report carries its test's tiers, set where the test ran).
_OUTCOMES: dict[str, tuple[tuple[str, ...], str]] = {}
_SECONDS: dict[str, float] = {}  # per test: its set-up, call and tear-down, summed (a module fixture's build included)
_STARTED: list[float] = []


def _tiers_of(item) -> tuple[str, ...]:
    return tuple(t for t in TIERS if item.get_closest_marker(t) is not None)


def pytest_configure(config):
    try:
        required_tiers()
    except TierError as exc:
        raise pytest.UsageError(str(exc)) from None
    parallel.configure(config)


def pytest_sessionstart(session):
    _STARTED.append(time.monotonic())


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
    rep.pipeline_tiers = tiers  # an extra attribute of the report: xdist sends it to the controller with the rest
    if rep.skipped and not hasattr(rep, "wasxfail"):
        must = [t for t in tiers if t in required_tiers() and not (t == "gpu" and gpu_exemption())]
        if must:  # a skip inside a required tier, whoever raised it, fails the test with its reason
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            reason = reason.removeprefix("Skipped: ")
            rep.outcome = "failed"
            rep.longrepr = f"required test tier {must[0]} skipped a test: {reason}"


def pytest_runtest_logreport(report):
    if report.when not in ("setup", "call", "teardown"):
        return
    tiers = tuple(getattr(report, "pipeline_tiers", ()))
    prev = _OUTCOMES.get(report.nodeid, (tiers, "passed"))[1]
    now = "failed" if report.failed or prev == "failed" else "skipped" if report.skipped else prev
    _OUTCOMES[report.nodeid] = (tiers, now)
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
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
        # a tier's wall time: its tests' time; on one worker the tiers' add up to pytest's, on two (tests/parallel.py)
        # the serial group's tiers run on one worker beside the others, and the line below says how the two compare
        tr.write_line(f"tier {tier}: {counts}{note}; wall {sum(_SECONDS.get(i, 0.0) for i in ids):.1f} s")
        for label, path in NAMED_CASES.get(tier, {}).items():
            case = [i for i in ids if i.split("::", 1)[0] == path]
            outcomes = [_OUTCOMES[i][1] for i in case]
            tr.write_line(f"  {label} ({path}): " + ", ".join(f"{outcomes.count(o)} {o}"
                                                               for o in ("passed", "failed", "skipped"))
                          + f"; wall {sum(_SECONDS.get(i, 0.0) for i in case):.1f} s")
    workers = len(getattr(config.option, "tx", None) or ()) if getattr(config.option, "dist", "no") != "no" else 0
    if workers and _STARTED:
        tr.write_line(f"tiers together: {sum(_SECONDS.values()):.1f} s of tests on {workers} workers in "
                      f"{time.monotonic() - _STARTED[0]:.1f} s")


@pytest.fixture(scope="module")
def megatron_indexed_dataset():
    """megatron-core's own ``megatron/core/datasets/indexed_dataset.py`` (reader and builder) from the pinned wheel:
    its package __init__ pulls in the GPU stack (triton), the module itself needs only numpy and torch, so it is
    loaded with the package __init__ files bypassed and ``megatron.core.utils.log_single_rank`` (a logging helper)
    provided."""
    try:
        src = fetch_wheel_source(pinned_version("megatron-core"), ROOT / ".cache" / "wheels", "megatron-core")
    except Exception as exc:
        tier_unavailable("bridge", f"cannot download megatron-core from PyPI: {exc}")
    saved = {k: v for k, v in sys.modules.items() if k == "megatron" or k.startswith("megatron.")}
    for name, sub in [("megatron", ""), ("megatron.core", "core"), ("megatron.core.datasets", "core/datasets")]:
        mod = types.ModuleType(name)
        mod.__path__ = [str(src / "megatron" / sub)]
        sys.modules[name] = mod
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda logger, level, msg, *a, **k: logger.log(level, msg, *a)
    sys.modules["megatron.core.utils"] = utils
    try:
        yield importlib.import_module("megatron.core.datasets.indexed_dataset")
    finally:
        for k in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
            del sys.modules[k]
        sys.modules.update(saved)
