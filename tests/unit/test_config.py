from pathlib import Path

import pytest

from pipeline.common.errors import UserError
from pipeline.config.loader import load_config, strip_suite_only
from pipeline.config.models import get_model


def test_precedence_recipe_yaml_override(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  train_iters: 50\n  global_batch_size: 8\n")
    recipe = {"train": {"train_iters": 10, "global_batch_size": 4, "micro_batch_size": 2}}
    cfg = load_config(y, ["train.train_iters=200"], recipe)
    assert cfg.train.train_iters == 200          # override beats YAML
    assert cfg.train.global_batch_size == 8      # YAML beats recipe
    assert cfg.train.micro_batch_size == 2       # recipe beats schema default


def test_hydra_grammar():
    cfg = load_config(None, ["+model.new_knob=3", "model.recompute_modules=[moe,mlp]",
                             "logger.wandb_exp_name='a b'", "~rng", "checkpoint.save=null",
                             "optimizer.lr=1e-4"])
    assert cfg.extra["model"]["new_knob"] == 3  # not a field: passed through to Bridge
    assert cfg.to_dict()["model"]["new_knob"] == 3
    assert cfg.model.recompute_modules == ["moe", "mlp"]
    assert cfg.logger.wandb_exp_name == "a b"
    assert cfg.rng.seed is None and "rng" not in strip_suite_only(cfg)  # the section deleted: nothing of it set
    assert cfg.checkpoint.save is None
    assert cfg.optimizer.lr == pytest.approx(1e-4)


@pytest.mark.parametrize("override,needle", [
    ("train.train_iter=3", "did you mean 'train.train_iters'"),
    ("train.train_iters==", "malformed override"),
    ("model.tensor_model_parallel_size=[1", "malformed override"),
    ("train=3", "is a section"),
    ("+train.train_iters=5", "already exists"),
    ("~train.nope", "cannot delete"),
])
def test_bad_overrides_are_user_errors(override, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace("'", "'")):
        load_config(None, [override], {"train": {"train_iters": 1}})


def test_unknown_yaml_key_hint(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("model:\n  expert_parallel_size: 4\n")
    with pytest.raises(UserError, match="unknown key 'model.expert_parallel_size'.*expert_model_parallel_size"):
        load_config(y)


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    y = tmp_path / "bad.yaml"
    y.write_text("train: [1,\n")
    with pytest.raises(UserError, match="invalid YAML"):
        load_config(y)


def test_interpolation_and_strip(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_DATA", "/data/x")
    y = tmp_path / "c.yaml"
    y.write_text("dataset:\n  dataset_name: a/b\n  dataset_root: ${oc.env:MY_DATA}\n  seq_length: ${model.seq_length}\n"
                 "model:\n  seq_length: 1024\npipeline:\n  cluster: local_cpu\n")
    cfg = load_config(y)
    assert cfg.dataset.dataset_root == "/data/x"
    assert cfg.dataset.seq_length == 1024
    bridge = strip_suite_only(cfg)
    assert "pipeline" not in bridge and "dataset_name" not in bridge["dataset"]
    assert bridge["dataset"]["seq_length"] == 1024 and "train" not in bridge  # unset sections vanish


def test_unknown_model_hint():
    with pytest.raises(UserError, match="did you mean 'nano'"):
        get_model("nanoo")


def test_every_field_is_typed_as_megatron_bridge_types_it():
    """The schema's field types agree with the pinned Bridge's field table (bridge_fields.json, written from the real
    ConfigContainer by the Bridge harness): a value the loader accepts is one Bridge stores as given."""
    import json
    import typing

    from pipeline.config.schema import TrainingConfig, bridge_kind, field_types

    table = json.loads((Path(__file__).resolve().parents[2] / "src/pipeline/config/bridge_fields.json").read_text())
    compared = 0
    for recipe, sections in table["recipes"].items():
        for key, tp in field_types(TrainingConfig).items():
            fields, kind = sections, None
            for part in key.split("."):
                kind = fields.get(part) if isinstance(fields, dict) else None
                if kind is None:
                    break
                fields = table["classes"].get(kind[len("class:"):], {}) if kind.startswith("class:") else None
            if kind is None or kind == "any" or kind.startswith("class:"):
                continue  # not on this recipe's classes (the preflight refuses it there), or Bridge takes anything
            assert bridge_kind(tp) == kind, f"{recipe}: {key} is {tp} here but {kind} in Bridge"
            compared += 1
    assert compared > 200  # 6 recipes x ~60 typed leaves
    assert typing.get_args(field_types(TrainingConfig)["pipeline.local.autocast"]) == ("off", "bf16", "auto")


@pytest.mark.parametrize("override,line", [
    ("train.train_iters=abc", "train.train_iters='abc' must be an integer"),
    ("optimizer.lr=fast", "optimizer.lr='fast' must be a number"),
    ("model.sequence_parallel=maybe", "model.sequence_parallel='maybe' must be a boolean (true/false)"),
    ("logger.wandb_project=7", "logger.wandb_project=7 must be a string (quote it: logger.wandb_project='7')"),
    ("model.recompute_granularity=fulll", "model.recompute_granularity='fulll' is not one of full, selective"),
    ("train.micro_batch_size=99999999999999999999", "train.micro_batch_size=99999999999999999999 is out of range"),
])
def test_a_mistyped_value_is_one_line_and_leaves_the_field_unset(override, line):
    cfg = load_config(None, [override], {"train": {"train_iters": 1, "micro_batch_size": 1}})
    assert cfg.problems == [line]
    key = override.split("=")[0]
    assert cfg.invalid == {key}
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) is None


def test_the_config_of_record_round_trips():
    from pipeline.config.schema import TrainingConfig

    cfg = load_config("configs/local/tiny_moe_sft.yaml", ["+model.new_knob=3", "+newsection.x=1"],
                      get_model("tiny-qwen3-moe").recipe_defaults("sft"))
    again = TrainingConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.extra == {"model": {"new_knob": 3}, "newsection": {"x": 1}} and not again.problems


def test_a_mapping_override_merges_into_its_section_as_hydra_does(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("optimizer:\n  lr: 0.01\n  min_lr: 0.001\n  clip_grad: 1.0\nenv_vars:\n  A: '1'\n")
    cfg = load_config(y, ["optimizer={lr:0.002,weight_decay:0.1}", "env_vars={B:2}"])
    o = cfg.optimizer
    assert (o.lr, o.min_lr, o.clip_grad, o.weight_decay) == (0.002, 0.001, 1.0, 0.1)  # the others kept
    assert cfg.env_vars == {"A": "1", "B": 2}
    with pytest.raises(UserError, match=r"unknown key 'optimizer.lrr'.*did you mean 'optimizer.lr'"):
        load_config(y, ["optimizer={lrr:0.002}"])
