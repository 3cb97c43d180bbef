import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline.common import layout
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


# What parsing an iteration folder's name by hand looks like (issue 63, item 1): the layout module is the one place
ITERATION_PARSING = re.compile(r"""startswith\(["']iter_|split\(["']_["']\)\[-1\]|iter_\(\\d|iter_\{|"""
                               r"""glob\(["'][^"']*iter_|["']iter_\d|["']latest_checkpointed_iteration""")
SRC = Path(layout.__file__).resolve().parents[1]


def test_no_iteration_folder_is_parsed_outside_the_layout_module():
    """Every module asks pipeline.common.layout (iteration_of, iteration_number, iter_dir, TRACKER, ...): none
    matches an iteration folder's name, builds one, or names the tracker by hand."""
    found = [f"{f.relative_to(SRC)}:{i}: {line.strip()}"
             for f in sorted(SRC.rglob("*.py")) if f != Path(layout.__file__).resolve()
             for i, line in enumerate(f.read_text().splitlines(), 1) if ITERATION_PARSING.search(line)]
    assert found == []
    defs = [f.relative_to(SRC) for f in SRC.rglob("*.py") if "def iteration_of(" in f.read_text()]
    assert defs == [Path("common/layout.py")]


@pytest.mark.parametrize(("name", "want"), [("iter_0000200", 200), ("iter_0000000", 0), ("iter_200", None),
                                            ("iter_00002000", None), ("iter_000020x", None), ("hf", None)])
def test_iteration_of_reads_megatrons_seven_digits_only(name, want, tmp_path):
    assert layout.iteration_of(tmp_path / name) == want and layout.is_iteration_dir(name) == (want is not None)
    if want is None:
        with pytest.raises(ValueError):
            layout.iteration_number(name)
    else:
        assert layout.iteration_number(name) == want and layout.iter_dirname(want) == name


def test_an_exports_iteration_is_its_folders(tmp_path):
    it = tmp_path / "ckpt" / "iter_0000040"
    (it / "hf").mkdir(parents=True)
    (tmp_path / "link").symlink_to(it / "hf")
    assert layout.export_iteration(it / "hf") == 40 and layout.export_iteration(it) == 40
    assert layout.export_iteration(tmp_path / "link" / "..") is None and layout.export_iteration("org/model") is None
    linked = tmp_path / "models" / "hf"
    linked.parent.mkdir()
    linked.symlink_to(it / "hf")
    assert layout.export_iteration(linked) == 40  # a link to an export: the export's iteration
