"""The engine object (issue 65, step 1): every question the suite asks of a training engine is answered by
``config/engines.py``, not by comparing the engine's name where it is asked; the two engines' answers are the ones
the suite had spelled out branch by branch."""

from __future__ import annotations

import re

import pytest

from pipeline.common.errors import UserError
from pipeline.config import kinds
from pipeline.config.engines import (
    BF16_TOLERANCES,
    BY_NAME,
    FP32_TOLERANCES,
    LOCAL,
    MEGATRON_BRIDGE,
    Engine,
    engine,
    engine_of_checkpoint,
)
from pipeline.config.models import REGISTRY
from tests.helpers import ROOT

SRC = ROOT / "src" / "pipeline"
# An engine's name compared where a question is asked: `== "megatron_bridge"`, `!= "local"`, `.is_local`, ...
COMPARISON = re.compile(r'(==|!=) *"(megatron_bridge|megatron|local)"|"(megatron_bridge|megatron|local)" *(==|!=)'
                        r'|\.is_local\b|\b(engine|backend)s? (not )?in \('
                        r'|\.backend *(==|!=|(not )?in\b)')  # a coherence backend's name: ask coherence/backends.py
ALLOWED = {
    "config/engines.py": "the engine objects themselves",
    "common/layout.py": "reads a checkpoint folder's format from disk (below config: the objects map its word)",
}


def test_no_engine_name_is_compared_outside_the_engines():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("training/engines/") or rel in ALLOWED:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if COMPARISON.search(line.split("#")[0]):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "ask the engine object (config/engines.py) instead:\n" + "\n".join(found)
    for rel in ALLOWED:  # each exception is still needed (else it goes from the list)
        assert any(COMPARISON.search(x.split("#")[0]) for x in (SRC / rel).read_text().splitlines()), rel


def test_the_engines_answer_what_the_branches_did():
    assert tuple(BY_NAME) == kinds.ENGINES == ("local", "megatron_bridge")
    assert (LOCAL.needs_gpus, LOCAL.model_parallel, LOCAL.bridge_rules, LOCAL.adapters, LOCAL.nsys,
            LOCAL.megatron_resume, LOCAL.ships_models) == (False,) * 6 + (True,)
    assert (MEGATRON_BRIDGE.needs_gpus, MEGATRON_BRIDGE.model_parallel, MEGATRON_BRIDGE.bridge_rules,
            MEGATRON_BRIDGE.adapters, MEGATRON_BRIDGE.nsys, MEGATRON_BRIDGE.megatron_resume,
            MEGATRON_BRIDGE.ships_models) == (True,) * 6 + (False,)
    assert (LOCAL.default_cluster, MEGATRON_BRIDGE.default_cluster) == ("local_cpu", None)
    assert (LOCAL.rank_unit, MEGATRON_BRIDGE.rank_unit) == ("process", "GPU")
    assert (LOCAL.export_tolerances, MEGATRON_BRIDGE.export_tolerances) == (FP32_TOLERANCES, BF16_TOLERANCES)
    assert (LOCAL.megatron_checkpoint, MEGATRON_BRIDGE.megatron_checkpoint) == (False, True)
    assert str(MEGATRON_BRIDGE) == "megatron_bridge"


def test_a_name_or_a_checkpoint_format_gives_its_engine():
    for e in BY_NAME.values():
        assert engine(e.name) is e and engine_of_checkpoint(e.checkpoint_format) is e
    assert engine_of_checkpoint(None) is None and engine_of_checkpoint("gguf") is None
    with pytest.raises(UserError, match="unknown training engine 'megatron' \\(one of local, megatron_bridge\\)"):
        engine("megatron")


def test_every_registry_model_trains_on_an_engine_object():
    for spec in REGISTRY.values():
        assert isinstance(spec.trains_on, Engine) and spec.trains_on.name == spec.engine
    assert {s.name for s in REGISTRY.values() if s.trains_on.needs_gpus} >= {"nano", "super"}
