"""Atomic writes: owned temporaries (only a dead owner's are stale), no recreated temporaries, umask modes."""

from __future__ import annotations

import os
import stat

import pytest

from pipeline.common import io
from pipeline.common.io import ConcurrentWriteError, atomic_path, write_json, write_text


def test_temporary_names_carry_host_and_pid(tmp_path):
    out = tmp_path / "x.json"
    with atomic_path(out) as t:
        owner = io.tmp_owner(t.parent, out.name)
        assert owner == (io._host(), os.getpid())
        t.write_text("{}")
    assert not list(tmp_path.glob(".*.tmp"))


def test_vanished_temporary_fails_instead_of_being_recreated(tmp_path):
    import shutil

    out = tmp_path / "hf"
    with pytest.raises(ConcurrentWriteError, match="vanished"):
        with atomic_path(out) as t:
            t.mkdir()
            (t / "weights.bin").write_text("w")
            shutil.rmtree(t.parent)  # what a second writer's old stale-cleanup did
            write_json(t / "verification.json", {"verdict": "PASS"})
    assert not out.exists()
    assert not t.parent.exists()  # the temporary was not recreated

    with pytest.raises(ConcurrentWriteError, match="vanished"):
        with atomic_path(tmp_path / "f") as t:
            t.write_text("x")
            shutil.rmtree(t.parent)
    assert not (tmp_path / "f").exists()


def test_write_text_whose_temporary_vanished_fails(tmp_path, monkeypatch):
    out = tmp_path / "a.txt"
    real_replace = os.replace

    def replace(src, dst):
        os.unlink(src)  # another writer removed our temporary just before we published it
        return real_replace(src, dst)

    monkeypatch.setattr(io.os, "replace", replace)
    with pytest.raises(ConcurrentWriteError):
        write_text(out, "hello")
    assert not out.exists()


def test_directory_outputs_replace_the_previous_one(tmp_path):
    out = tmp_path / "d"
    for content in ("one", "two"):
        with atomic_path(out) as t:
            t.mkdir()
            (t / "f").write_text(content)
    assert (out / "f").read_text() == "two" and not list(tmp_path.glob(".*"))


@pytest.fixture
def umask002():
    old = os.umask(0o002)
    try:
        yield
    finally:
        os.umask(old)


def test_modes_follow_the_umask_on_a_group_shared_directory(tmp_path, umask002):
    shared = tmp_path / "project"
    shared.mkdir()
    os.chmod(shared, 0o2775)  # setgid group-shared directory, as on a team's project space
    f = write_text(shared / "token_count.json", "{}\n")
    assert stat.S_IMODE(f.stat().st_mode) == 0o664
    with atomic_path(shared / "hf") as t:
        t.mkdir()
        (t / "sub").mkdir()
        fd = os.open(t / "sub" / "weights.bin", os.O_WRONLY | os.O_CREAT, 0o600)  # a mkstemp-like writer
        os.close(fd)
    assert stat.S_IMODE((shared / "hf").stat().st_mode) == 0o775
    assert stat.S_IMODE((shared / "hf" / "sub").stat().st_mode) == 0o775
    assert stat.S_IMODE((shared / "hf" / "sub" / "weights.bin").stat().st_mode) == 0o664
    with atomic_path(shared / "one.bin") as t:
        t.write_bytes(b"x")
        os.chmod(t, 0o600)
    assert stat.S_IMODE((shared / "one.bin").stat().st_mode) == 0o664
    os.umask(0o077)
    assert stat.S_IMODE(write_text(shared / "private", "x").stat().st_mode) == 0o600
