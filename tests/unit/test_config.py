import pytest

from pipeline.common.errors import UserError
from pipeline.config.loader import get, load_config, strip_suite_only
from pipeline.config.models import get_model


def test_precedence_recipe_yaml_override(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  train_iters: 50\n  global_batch_size: 8\n")
    recipe = {"train": {"train_iters": 10, "global_batch_size": 4, "micro_batch_size": 2}}
    cfg = load_config(y, ["train.train_iters=200"], recipe)
    assert get(cfg, "train.train_iters") == 200          # override beats YAML
    assert get(cfg, "train.global_batch_size") == 8      # YAML beats recipe
    assert get(cfg, "train.micro_batch_size") == 2       # recipe beats schema default


def test_hydra_grammar():
    cfg = load_config(None, ["+model.new_knob=3", "model.recompute_modules=[moe,mlp]",
                             "logger.wandb_exp_name='a b'", "~rng", "checkpoint.save=null",
                             "optimizer.lr=1e-4"])
    assert cfg["model"]["new_knob"] == 3
    assert cfg["model"]["recompute_modules"] == ["moe", "mlp"]
    assert cfg["logger"]["wandb_exp_name"] == "a b"
    assert "rng" not in cfg
    assert cfg["checkpoint"]["save"] is None
    assert cfg["optimizer"]["lr"] == pytest.approx(1e-4)


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
    assert cfg["dataset"]["dataset_root"] == "/data/x"
    assert cfg["dataset"]["seq_length"] == 1024
    bridge = strip_suite_only(cfg)
    assert "pipeline" not in bridge and "dataset_name" not in bridge["dataset"]
    assert bridge["dataset"]["seq_length"] == 1024 and "train" not in bridge  # unset sections vanish


def test_unknown_model_hint():
    with pytest.raises(UserError, match="did you mean 'nano'"):
        get_model("nanoo")
