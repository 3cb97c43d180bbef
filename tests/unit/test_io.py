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


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_team_files_are_group_writable_whatever_the_umask(tmp_path, umask):
    """The team's shared files (issue 59): a lock file, the bad-node log, a folder made for them, the image record -
    group read/write whatever the creator's umask; others keep what the umask gives. An existing file keeps its mode."""
    from pipeline.common.io import make_shared_dirs, shared_mode, write_text
    from pipeline.common.locks import open_shared, release, try_flock

    old = os.umask(umask)
    try:
        make_shared_dirs(tmp_path / "a" / "b")
        fd, _ = try_flock(tmp_path / "a" / "b" / "x.lock")
        release(fd)
        os.close(open_shared(tmp_path / "a" / "log", os.O_WRONLY | os.O_APPEND))
        write_text(tmp_path / "a" / "record.txt", "x\n", shared=True)
        (tmp_path / "kept").write_text("")
        os.chmod(tmp_path / "kept", 0o600)
        os.close(open_shared(tmp_path / "kept", os.O_WRONLY))
    finally:
        os.umask(old)
    file_mode = (0o666 & ~umask) | 0o060
    assert shared_mode(umask) == file_mode and shared_mode(umask, directory=True) == (0o777 & ~umask) | 0o070
    for d in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(d.stat().st_mode) == (0o777 & ~umask) | 0o070, d
    for f in (tmp_path / "a" / "b" / "x.lock", tmp_path / "a" / "log", tmp_path / "a" / "record.txt"):
        assert stat.S_IMODE(f.stat().st_mode) == file_mode, f
    assert stat.S_IMODE((tmp_path / "kept").stat().st_mode) == 0o600


def test_a_lock_taken_but_not_yet_described_is_read_again_not_reported_empty(tmp_path):
    """The gap between a holder's flock and its holder text: two nodes' launchers of one Slurm job met there and the
    second read an empty holder ("pid ? on host ?") and refused its own job (seen in test_slurm's 2-node job). The
    reader now waits for the text (or the lock's end)."""
    import subprocess
    import sys
    import textwrap

    from pipeline.common.locks import release, try_flock

    lock = tmp_path / "w.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        sys.stdin.readline()          # the test reads the lock now, in the gap
        os.pwrite(fd, b'{{"pid": 7, "host": "n1"}}\\n', 0)
        sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        import threading
        threading.Timer(0.2, lambda: (holder.stdin.write("\n"), holder.stdin.flush())).start()
        fd, text = try_flock(lock)
        assert fd is None and text == '{"pid": 7, "host": "n1"}'
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait() == 0
        fd, text = try_flock(lock)  # free again: taken at once
        assert fd is not None and text == ""
        release(fd)
    finally:
        holder.kill()
