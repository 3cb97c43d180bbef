"""Inputs read as the user wrote them (issue 34): YAML 1.2 values, duplicate keys and alias bombs refused, ``???``
refused, experiment strings reaching Hydra as strings, sbatch options read as sbatch reads them, every GPU option
compared with the plan, prompt files validated, numeric options range-checked."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from pipeline.common import yamlio
from pipeline.common.errors import UserError
from pipeline.config.loader import load_config, read_yaml


# ---- YAML 1.2 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("1:20", "1:20"), ("2_0", "2_0"), ("010", 10), ("0o10", 8), ("0x1F", 31), ("1e-3", 1e-3), ("yes", "yes"),
    ("on", "on"), ("2024-01-01", "2024-01-01"), (".inf", float("inf")), ("-0", 0), ("'12'", "12"), ("~", None),
    ("True", True), ("1_000.5", "1_000.5"), ("0b11", "0b11"),
])
def test_values_are_yaml_1_2(text, want):
    """PyYAML's YAML 1.1 read ``train_iters: 1:20`` as 80 and ``2_0`` as 20."""
    assert yamlio.load(f"v: {text}\n") == {"v": want}


def test_a_config_value_in_base_60_is_not_a_number(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  train_iters: 1:20\n")
    assert read_yaml(p) == {"train": {"train_iters": "1:20"}}
    assert load_config(p).problems == ["train.train_iters='1:20' must be an integer"]  # never 80


def test_a_duplicate_key_is_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  train_iters: 10\n  micro_batch_size: 1\n  train_iters: 20\n")
    with pytest.raises(UserError) as e:
        read_yaml(p)
    assert str(e.value) == f"{p}: invalid YAML: duplicate key 'train_iters' (line 2 and line 4): write each key once"


def test_merge_keys_still_merge():
    assert yamlio.load("b: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\n")["c"] == {"x": 1, "y": 3}


def bomb(levels: int = 9) -> str:
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    prev = "a"
    for c in "bcdefghijk"[:levels - 1]:
        text += f"{c}: &{c} [" + ",".join([f"*{prev}"] * 9) + "]\n"
        prev = c
    return text


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    """A billion-laughs config ran past 60 s (an experiment file: a MemoryError traceback)."""
    p = tmp_path / "c.yaml"
    p.write_text(bomb())
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"invalid YAML: anchors and aliases expand to more than 100000 values"):
        read_yaml(p)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("text, problem", [
    ("a: &x [*x]\n", "recursive anchor"),
    ("[" * 1200 + "]" * 1200, "nests too deeply"),
])
def test_recursive_and_deep_documents_are_yaml_errors(text, problem):
    with pytest.raises(yaml.YAMLError, match=problem):
        yamlio.load(text)


def test_a_required_value_never_filled_is_refused(tmp_path):
    """``wandb_exp_name: ???`` named the run directory ``runs/???``."""
    p = tmp_path / "c.yaml"
    p.write_text("logger:\n  wandb_exp_name: ???\n")
    with pytest.raises(UserError) as e:
        load_config(p)
    assert str(e.value) == ("the config: logger.wandb_exp_name is '???', a required value that was never filled; "
                            "give it a value (in the file, or logger.wandb_exp_name=... on the command line)")
    assert load_config(p, ["logger.wandb_exp_name=x"]).logger.wandb_exp_name == "x"


# ---- experiment files ----------------------------------------------------------------------------------------
EXP = """
base:
  config: configs/local/tiny_moe_sft.yaml
  model: tiny-qwen3-moe
  mode: sft
  overrides: {train.train_iters: 8}
"""


def load_exp(tmp_path, body: str):
    from pipeline.experiment import spec
    from tests.helpers import ROOT

    p = tmp_path / "exp.yaml"
    p.write_text(EXP + body)
    return spec.load(p, root=ROOT)


@pytest.mark.parametrize("value", ["1e3", "1_000", "inf", "nan", "-0", "1.5", "true", "null", "a\\b", "a\\",
                                   "it's", "-inf", "+1", "", "x,y"])
def test_experiment_strings_reach_the_job_as_strings(tmp_path, value):
    """A quoted ``"1e3"`` reached the job as 1000.0, ``"1_000"`` as 1000, ``"inf"``/``"nan"``/``"-0"`` likewise."""
    from pipeline.experiment.spec import render_override
    from tests.helpers import ROOT

    exp = load_exp(tmp_path, f"grid:\n  logger.wandb_project: [{json.dumps(value)}, other]\n")
    assert exp.runs[0].overrides["logger.wandb_project"] == value
    line = render_override("logger.wandb_project", value)
    assert load_config(ROOT / "configs/local/tiny_moe_sft.yaml", [line]).logger.wandb_project == value


def test_numbers_in_experiments_stay_numbers(tmp_path):
    from pipeline.config.loader import parse_overrides
    from pipeline.experiment.spec import render_override

    for v in (1000.0, 1000, float("inf"), -0.0, [1, "1e3"]):
        assert parse_overrides([render_override("k", v)])[0].value() == v


def test_an_experiment_alias_bomb_is_one_line(tmp_path):
    """An alias bomb in an experiment file was a MemoryError traceback after more than 60 s."""
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"exp.yaml is not valid YAML: anchors and aliases expand to more than"):
        load_exp(tmp_path, bomb().replace("a: &a", "x: &a"))
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("body, where", [
    ("grid:\n  logger.wandb_project:\n    - b\n    - ???\n", "grid: logger.wandb_project[1]"),
    ("zip:\n  rng.seed: [1, '???']\n", "zip: rng.seed[1]"),
    ("computed:\n  train.train_iters: ???\n", "computed: train.train_iters"),
])
def test_an_experiment_value_never_filled_is_refused(tmp_path, body, where):
    with pytest.raises(UserError) as e:
        load_exp(tmp_path, body)
    assert str(e.value).endswith(f"exp.yaml: {where} is '???', a required value that was never filled; give it a "
                                 f"value (in the file, or {where.split(': ')[1].split('[')[0]}=... on the command "
                                 "line)")


def test_a_duplicate_key_in_an_experiment_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"is not valid YAML \(line 9\): duplicate key 'train.train_iters' "
                                        r"\(line 8 and line 9\)"):
        load_exp(tmp_path, "computed:\n  train.train_iters: 4\n  train.train_iters: 5\n")
