"""The typed view of a resolved config (training/views.py): built once at launch from the preflight's checked
values, recorded as view.json, read back identically by the engines."""

import json

import pytest

from pipeline.cli.train import plan_from_argv
from pipeline.common.errors import UserError
from pipeline.training.views import VIEW_FILE, read_view, write_view

TINY = ["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--no-path-checks"]


def test_view_carries_the_checked_layout_batch_and_data_paths(pipeline_env, tmp_path):
    plan = plan_from_argv([*TINY, "train.global_batch_size=8", "train.micro_batch_size=2", "dataset.dataset_root=/d",
                           "--run-dir", str(tmp_path / "run")])
    assert plan.preflight.ok, plan.preflight.problems
    v = plan.view
    assert (v.model, v.mode) == ("tiny-qwen3-moe", "sft")
    assert v.parallel == plan.preflight.layout
    assert (v.batch.global_batch_size, v.batch.micro_batch_size) == (8, 2)
    assert v.batch.grad_accum == plan.preflight.grad_accum and v.batch.grad_accum_for(2) == 2
    assert v.batch.tokens_per_iter == 8 * v.batch.seq_length == plan.preflight.tokens_per_iter
    assert str(v.data.dataset_root) == "/d" and v.data.packed["train"].name.startswith("training_")
    assert str(v.data.packed["train"]).startswith("/d/packed/")
    assert v.save == tmp_path / "run" / "checkpoints"


def test_view_round_trips_through_view_json(pipeline_env, tmp_path):
    v = plan_from_argv([*TINY, "dataset.dataset_root=/d", "--run-dir", str(tmp_path / "run")]).view
    write_view(tmp_path, v)
    assert read_view(tmp_path) == v
    assert json.loads((tmp_path / VIEW_FILE).read_text())["batch"]["seq_length"] == v.batch.seq_length


def test_failed_preflight_has_no_view_and_an_old_run_says_how_to_continue(pipeline_env, tmp_path):
    plan = plan_from_argv([*TINY, "train.global_batch_size=3", "train.micro_batch_size=2"])
    assert not plan.preflight.ok and plan.view is None
    with pytest.raises(UserError, match="relaunch it with pipeline_training_launch.sh"):
        read_view(tmp_path)
    (tmp_path / VIEW_FILE).write_text(json.dumps({"version": 99}))
    with pytest.raises(UserError, match="version 99"):
        read_view(tmp_path)
