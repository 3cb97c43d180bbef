"""Shared test set-up: offline hub and W&B, temporary data/run/W&B dirs. Helpers live in tests/helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import ROOT

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
