import pytest
import torch
from safetensors.torch import save_file

from pipeline.checkpoint import layout
from pipeline.common.errors import UserError
from pipeline.common.io import write_json


def make_iter(save, it, complete=True):
    d = layout.iter_dir(save, it)
    d.mkdir(parents=True)
    write_json(d / layout.MARKER, {"engine": "local", "iteration": it})
    if complete:
        (d / "config.json").write_text("{}")
        save_file({"w": torch.ones(2, 2)}, str(d / "model.safetensors"))
    return d


def test_only_tracked_complete_iterations_count(tmp_path):
    make_iter(tmp_path, 10)
    make_iter(tmp_path, 20)
    make_iter(tmp_path, 30, complete=False)   # a save that was interrupted
    assert layout.complete_iterations(tmp_path) == []  # no tracker yet: nothing is complete
    layout.write_tracker(tmp_path, 20)
    assert layout.complete_iterations(tmp_path) == [10, 20]
    layout.write_tracker(tmp_path, 30)
    assert layout.latest_complete(tmp_path) == 20  # iter 30 lacks its files
    assert layout.iter_dirname(200) == "iter_0000200"


def test_resolve_iteration_errors_name_the_iteration(tmp_path):
    make_iter(tmp_path, 10)
    layout.write_tracker(tmp_path, 10)
    assert layout.resolve_iteration(tmp_path, None).name == "iter_0000010"
    with pytest.raises(UserError, match="iteration 400 does not exist.*complete iterations: 10"):
        layout.resolve_iteration(tmp_path, 400)
    with pytest.raises(UserError, match="does not exist"):
        layout.resolve_iteration(tmp_path / "nope", None)


def test_truncated_weights_binary_tracker_and_missing_tracked_iteration(tmp_path):
    d = make_iter(tmp_path, 10)
    make_iter(tmp_path, 20)
    layout.write_tracker(tmp_path, 20)
    st = layout.iter_dir(tmp_path, 20) / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-3])  # a copy cut short
    assert layout.complete_iterations(tmp_path) == [10]
    with pytest.raises(UserError, match="names iteration 20, but iter_0000020 is incomplete"):
        layout.resolve_iteration(tmp_path, None)
    layout.write_tracker(tmp_path, 30)
    with pytest.raises(UserError, match="names iteration 30, but iter_0000030 does not exist"):
        layout.resolve_iteration(tmp_path, None)
    (tmp_path / layout.TRACKER).write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UserError, match="not text"):
        layout.read_tracker(tmp_path)
    (d / layout.MARKER).write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        layout.engine_of(d)
