"""tests/machine_cache.sh: a test tier's environment (the container twin's image stand-in, the Bridge harness venv)
built once per machine and linked into each checkout, keyed by its lock's hash, one build at a time under a flock.
Its builder here is a one-second shell function, so the real locking, stamping and linking run in seconds."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers import ROOT

SCRIPT = """set -euo pipefail
source "$LIB"
build() {
  echo "build $$" >> "$COUNTER"
  sleep "${BUILD_SLEEP:-1}"
  [[ -z "${BUILD_FAIL:-}" ]] || { echo "half" > "$1/half"; exit 7; }
  mkdir -p "$1/venv/bin" && echo "$KEY" > "$1/venv/pins"
}
machine_cache_build demo "$KEY" build "$CHECKOUT/.cache"
link_atomically "$CACHE_ENTRY/venv" "$CHECKOUT/.cache/demo-venv"
echo "entry=$CACHE_ENTRY built=$CACHE_BUILT"
"""


def start(tmp_path: Path, key: str, checkout: str = "co1", **env) -> subprocess.Popen:
    e = {**os.environ, "LIB": str(ROOT / "tests" / "machine_cache.sh"), "KEY": key, "COUNTER": str(tmp_path / "builds"),
         "CHECKOUT": str(tmp_path / checkout), "PIPELINE_MACHINE_CACHE": str(tmp_path / "machine"), **env}
    return subprocess.Popen(["bash", "-c", SCRIPT], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=60)
    return p.returncode, out, err


def builds(tmp_path: Path) -> int:
    f = tmp_path / "builds"
    return len(f.read_text().splitlines()) if f.exists() else 0


def test_two_checkouts_at_once_build_once_and_link_the_same_entry(tmp_path):
    a, b = start(tmp_path, "k1", "co1", BUILD_SLEEP="2"), start(tmp_path, "k1", "co2", BUILD_SLEEP="2")
    (ra, oa, ea), (rb, ob, eb) = finish(a), finish(b)
    assert ra == rb == 0, ea + eb
    entry = tmp_path / "machine" / "demo" / "k1"
    assert builds(tmp_path) == 1  # the second waited for the first's lock, then found the entry complete
    assert sorted([oa.split()[-1], ob.split()[-1]]) == ["built=0", "built=1"]
    assert "waiting for its lock" in ea + eb
    assert (entry / ".complete").is_file() and (entry / "venv" / "pins").read_text().strip() == "k1"
    for co in ("co1", "co2"):
        link = tmp_path / co / ".cache" / "demo-venv"
        assert link.is_symlink() and link.resolve() == (entry / "venv").resolve()
    rc, out, _ = finish(start(tmp_path, "k1", "co3"))  # a fresh clone later: links, never builds
    assert rc == 0 and out.split()[-1] == "built=0" and builds(tmp_path) == 1


def test_a_killed_or_failed_build_is_rebuilt_and_a_new_lock_builds_a_new_entry(tmp_path):
    rc, _, _ = finish(start(tmp_path, "k1", BUILD_FAIL="1"))
    entry = tmp_path / "machine" / "demo" / "k1"
    assert rc == 7 and (entry / "half").exists() and not (entry / ".complete").exists()
    rc, out, err = finish(start(tmp_path, "k1"))  # the half-built entry is removed and built again
    assert rc == 0 and out.split()[-1] == "built=1" and not (entry / "half").exists(), err
    assert builds(tmp_path) == 2
    # the checkout's own build from before the cache (a real directory) is replaced by the link
    own = tmp_path / "co9" / ".cache" / "demo-venv"
    own.mkdir(parents=True)
    assert finish(start(tmp_path, "k1", "co9"))[0] == 0 and own.is_symlink()
    # a changed lock: a new entry, the link moves to it; the old entry, unused for longer than the limit, goes
    os.utime(entry / ".complete", (1, 1))
    rc, out, err = finish(start(tmp_path, "k2"))
    assert rc == 0 and out.split()[-1] == "built=1", err
    link = tmp_path / "co1" / ".cache" / "demo-venv"
    assert link.resolve() == (tmp_path / "machine" / "demo" / "k2" / "venv").resolve()
    assert not entry.exists() and "unused for more than 14 days" in err


def test_machine_cache_off_builds_inside_the_checkout(tmp_path):
    rc, out, err = finish(start(tmp_path, "k1", PIPELINE_MACHINE_CACHE="off"))
    assert rc == 0, err
    assert out.split()[0] == f"entry={tmp_path / 'co1' / '.cache' / 'machine' / 'demo' / 'k1'}"
    assert not (tmp_path / "machine").exists()
