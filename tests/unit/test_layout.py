import pytest

from pipeline.checkpoint import layout
from pipeline.common.errors import UserError
from pipeline.common.io import write_json


def make_iter(save, it, complete=True):
    d = layout.iter_dir(save, it)
    d.mkdir(parents=True)
    write_json(d / layout.MARKER, {"engine": "local", "iteration": it})
    if complete:
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"x")
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
