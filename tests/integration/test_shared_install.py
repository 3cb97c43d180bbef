"""One container install per cluster: the apptainer steps of pipeline_env_setup.sh (pull, nccl-plugin, overlay) on
one shared container directory, run from two checkouts with a fake `apptainer` (and `curl`) that record their calls.
The second checkout finds every step done; a new image tag pulls and builds again beside the old; two setups at
once take turns on the directory's lock; what readers see is never half-built."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, run

pytestmark = pytest.mark.slow
STEPS = ("pull", "nccl-plugin", "overlay")

FAKE_APPTAINER = r"""#!/usr/bin/env bash
# fake apptainer: records each call, then does the least that the setup step checks for.
echo "$*" >> "$FAKE_CALLS"
case "$1" in
  pull) sleep "${FAKE_PULL_SECONDS:-0}"; dest="$3"; echo "fake SIF" > "$dest" ;;
  exec)
    args="$*"
    if [[ "$args" == *"--target"* ]]; then  # the overlay: pip install --target DIR
      dir=$(sed -E 's/.*--target ([^ ]+).*/\1/' <<< "$args"); mkdir -p "$dir/megatron/core"
    elif [[ "$args" == *"--prefix="* ]]; then  # the NCCL plugin: configure --prefix=DIR; make install
      dir=$(sed -E "s/.*--prefix='([^']+)'.*/\1/" <<< "$args"); mkdir -p "$dir/lib"; touch "$dir/lib/libnccl-net.so"
    fi ;;
esac
"""


@pytest.fixture
def cluster(tmp_path):
    """Two checkouts (copies of this one's tracked files) and one shared container directory."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    checkouts = []
    for name in ("alice", "bob"):
        dest = tmp_path / name
        for f in files:
            src = ROOT / f
            if src.is_file():
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / f)
        checkouts.append(dest)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "apptainer").write_text(FAKE_APPTAINER)
    src_dir = tmp_path / "aws-ofi-nccl-src"
    (src_dir / "aws-ofi-nccl-1.14.0").mkdir(parents=True)
    with tarfile.open(tmp_path / "plugin.tar.gz", "w:gz") as t:
        t.add(src_dir / "aws-ofi-nccl-1.14.0", arcname="aws-ofi-nccl-1.14.0")
    (bin_ / "curl").write_text(f"#!/usr/bin/env bash\necho \"curl $*\" >> \"$FAKE_CALLS\"\ncat {tmp_path}/plugin.tar.gz\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    shared = tmp_path / "shared"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "VIRTUAL_ENV"))}
    env.update(PATH=f"{bin_}:{env['PATH']}", PIPELINE_CLUSTER="isambard_gh200", PIPELINE_SIF=str(shared / "nemo.sif"),
               FAKE_CALLS=str(tmp_path / "calls.log"))
    return checkouts, shared, env, tmp_path / "calls.log"


def setup(checkout: Path, env: dict, step: str) -> subprocess.CompletedProcess:
    return run(["bash", "pipeline_env_setup.sh", "--only", step], env=env, cwd=checkout, timeout=300)


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_a_second_checkout_reuses_the_shared_install(cluster):
    (alice, bob), shared, env, log = cluster
    for step in STEPS:
        res = setup(alice, env, step)
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"step {step}: running" in res.stderr
    first = calls(log)
    assert [c.split()[0] for c in first] == ["pull", "curl", "exec", "exec"], first
    assert (shared / "nemo.sif").exists() and (shared / "nemo.sif.tag").read_text().strip() == "nvcr.io/nvidia/nemo:26.06"
    overlays = sorted(p.name for p in shared.glob("overlay-*"))
    plugins = sorted(p.name for p in shared.glob("aws-ofi-nccl-*"))
    assert len(overlays) == 1 and (shared / overlays[0] / ".pipeline_overlay.done").exists(), overlays
    assert plugins and (shared / plugins[0] / "lib" / "libnccl-net.so").exists(), plugins
    assert not list(shared.glob("*.tmp.*")), "a build left its temporary directory behind"
    assert not (alice / ".cache" / "overlay").exists() and not (bob / ".cache").exists()

    for step in STEPS:  # the second checkout: every step already done, nothing pulled or built
        res = setup(bob, env, step)
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"step {step}: already done, skipping" in res.stderr, res.stderr
    assert calls(log) == first

    # The profile's image tag changes: pulled again, and a new overlay and plugin beside the old ones.
    newer = {**env, "PIPELINE_IMAGE": "nvcr.io/nvidia/nemo:26.08"}
    for step in STEPS:
        res = setup(bob, newer, step)
        assert res.returncode == 0 and f"step {step}: running" in res.stderr, res.stderr[-3000:]
    assert [c.split()[0] for c in calls(log)[len(first):]] == ["pull", "exec", "exec"]  # the plugin source is kept
    assert (shared / "nemo.sif.tag").read_text().strip() == "nvcr.io/nvidia/nemo:26.08"
    assert len(list(shared.glob("overlay-*"))) == 2 and len(list(shared.glob("aws-ofi-nccl-*-*"))) == 2


def test_two_setups_at_once_take_turns(cluster):
    (alice, bob), shared, env, log = cluster
    slow = {**env, "FAKE_PULL_SECONDS": "4"}
    first = subprocess.Popen(["bash", "pipeline_env_setup.sh", "--only", "pull"], cwd=alice, env=slow,
                             stderr=subprocess.PIPE, text=True)
    for _ in range(100):  # the first setup holds the lock and is pulling
        if calls(log):
            break
        time.sleep(0.1)
    second = setup(bob, slow, "pull")
    out1 = first.communicate(timeout=60)[1]
    assert first.returncode == 0 and "step pull: running" in out1, out1
    assert second.returncode == 0, second.stderr
    assert "another setup holds" in second.stderr and "waiting for it" in second.stderr, second.stderr
    assert "step pull: already done, skipping" in second.stderr
    assert [c.split()[0] for c in calls(log)] == ["pull"]
