"""Issue 33: the reference's data command on the cluster profile plans exactly the packed path the shipped
configs read (data root from the profile, the model's tokenizer and pad multiple); the local profile is unchanged.

Planning only, in-process: the Nano tokenizer is not available offline, so nothing is tokenised here."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli.data import build_parser, plan_prepare
from pipeline.common import paths
from pipeline.common.errors import UserError
from pipeline.config.loader import load_config
from pipeline.data.packed_parquet import packed_paths
from pipeline.data.sources import dataset_dirname
from pipeline.training.preflight import packed_data_paths

ROOT = Path(__file__).resolve().parents[2]
NANO_CFG = ROOT / "configs" / "quickstart" / "nemotron_nano_quickstart_sft.yaml"
REFERENCE = ["prepare", "--dataset", "allenai/Dolci-Instruct-SFT", "--seq-length", "8192"]


def _plan(argv):
    return plan_prepare(build_parser().parse_args(argv))


@pytest.fixture
def isambard(monkeypatch):
    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    for k in ("PIPELINE_DATA_ROOT", "PIPELINE_PROFILE_FILLED"):
        monkeypatch.delenv(k, raising=False)


def _config_packing():
    cfg = load_config(NANO_CFG)
    specs = cfg.dataset.offline_packing_specs
    return cfg, specs.tokenizer_model_name, specs.pad_seq_to_mult


def test_reference_command_without_model_is_refused_on_the_cluster(isambard):
    with pytest.raises(UserError, match="--model"):
        _plan(REFERENCE)


def test_reference_command_with_nano_plans_the_configs_layout(isambard):
    cfg, tok, pad = _config_packing()
    opts, planned = _plan([*REFERENCE, "--model", "nano"])
    assert opts.tokenizer == "nano" and opts.pad_seq_to_mult == pad == 16
    # the config's data root is <profile data root>/<dataset dir>; the reference's dataset lands beside it
    data_root = Path(cfg.dataset.dataset_root).parent
    assert Path(cfg.dataset.dataset_root) == data_root / dataset_dirname(cfg.dataset.dataset_name)
    want = packed_paths(data_root / dataset_dirname("allenai/Dolci-Instruct-SFT"), tok, pad, 8192)
    assert planned == want
    assert str(planned["train"]).startswith("/projects/a5k/public/data/")


def test_prepare_for_a_config_plans_exactly_the_path_it_reads(isambard):
    cfg, tok, _ = _config_packing()
    opts, planned = _plan(["prepare", "--config", str(NANO_CFG)])
    assert planned["train"] == packed_data_paths(cfg, tok)["train"]
    assert planned == packed_data_paths(cfg, tok)
    assert opts.dataset == cfg.dataset.dataset_name and opts.tokenizer == "nano"


def test_config_disagreeing_with_the_command_is_refused(isambard):
    with pytest.raises(UserError, match="seq"):
        _plan(["prepare", "--config", str(NANO_CFG), "--seq-length", "8192"])


def test_local_profile_is_unchanged(monkeypatch):
    monkeypatch.delenv("PIPELINE_CLUSTER", raising=False)
    opts, planned = _plan(REFERENCE)
    assert opts.tokenizer == "smollm2-135m" and opts.pad_seq_to_mult == 1
    assert opts.dataset_root == paths.data_root() / "allenai__Dolci-Instruct-SFT"
    assert planned["train"] == (paths.data_root() / "allenai__Dolci-Instruct-SFT" / "packed"
                                / "HuggingFaceTB--SmolLM2-135M-Instruct_pad_seq_to_mult1" / "training_8192.idx.parquet")


@pytest.mark.parametrize("model,config", [("nano", "nemotron_nano_quickstart_sft.yaml"),
                                          ("super", "nemotron_super_quickstart_sft.yaml")])
def test_registry_pad_multiple_is_the_shipped_configs(model, config):
    from pipeline.config.models import get_model

    cfg = load_config(ROOT / "configs" / "quickstart" / config)
    assert get_model(model).pad_seq_to_mult == cfg.dataset.offline_packing_specs.pad_seq_to_mult
