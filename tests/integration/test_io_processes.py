"""Atomic writes and the exclusive lock against other processes: a live owner's temporary is left alone, a second
holder is refused (moved from tests/unit/test_io.py: these tests start helper processes)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from pipeline.common import io
from pipeline.common.io import ConcurrentWriteError, atomic_path
from pipeline.common.locks import exclusive_lock


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has this pid (until reused, which the test would only make stricter)


def _tmp_for(path, pid, host=None):
    host = host or io._host()
    return path.with_name(f".{path.name}.{host}~{pid}~abcd1234.tmp")


def test_live_owners_temporary_is_left_alone_and_dead_owners_is_removed(tmp_path):
    out = tmp_path / "out.bin"
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        try:
            live_tmp = _tmp_for(out, live.pid)
            live_tmp.mkdir()
            (live_tmp / "out.bin").write_text("half")
            dead_tmp = _tmp_for(out, _dead_pid())
            dead_tmp.mkdir()
            other_host = _tmp_for(out, _dead_pid(), host="elsewhere-host")
            other_host.write_text("x")
            foreign = tmp_path / ".out.bin.not-ours.tmp"  # not our naming: never touched
            foreign.write_text("x")
            with atomic_path(out) as t:
                t.write_text("done")
            assert out.read_text() == "done"
            assert live_tmp.is_dir() and (live_tmp / "out.bin").read_text() == "half"
            assert not dead_tmp.exists()
            assert other_host.exists() and foreign.exists()
        finally:
            live.kill()


def test_exclusive_lock_refuses_a_second_holder(tmp_path):
    lock = tmp_path / ".lock"
    code = f"""
import sys, time
sys.path.insert(0, {str(io.Path(io.__file__).parents[2])!r})
from pipeline.common.locks import exclusive_lock
with exclusive_lock({str(lock)!r}, "x"):
    print("held", flush=True)
    time.sleep(60)
"""
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout.readline().strip() == "held"
            with pytest.raises(ConcurrentWriteError, match=rf"pid {holder.pid} on {socket.gethostname()}"):
                with exclusive_lock(lock, "data root r"):
                    pass
        finally:
            holder.kill()
    with exclusive_lock(lock, "data root r"):  # free again once the holder is gone
        pass
