import pytest

from pipeline.slurm.hostlist import expand, is_hostlist, is_node_name


@pytest.mark.parametrize("name", ["nid001234", "node1", "gpu-a_1.x"])
def test_good_names(name):
    assert is_node_name(name) and is_hostlist(name)


@pytest.mark.parametrize("bad", ["", "a b", "x;rm -rf /", "$(id)", "`id`", "a'b", "nid[1-", "-n", "a|b",
                                 "nid[3-1]", "node\n2", "x" * 5000])
def test_hostile_names_are_refused(bad):
    assert not is_hostlist(bad)


def test_expansion():
    assert expand("nid[001-003,7]") == ["nid001", "nid002", "nid003", "nid7"]
    assert expand("a1,b[1-2]") == ["a1", "b1", "b2"]
