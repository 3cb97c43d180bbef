"""Fixtures of the tests that run the real local Slurm cluster (tests/slurm/local_slurm.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.tiers import slurm_conf, tier_unavailable


@pytest.fixture(scope="module")
def slurm():
    """The local Slurm cluster: the one tests/run.sh started, else one started here (and stopped after)."""
    conf = slurm_conf()
    env = {**os.environ, "SLURM_CONF": str(conf)}
    ok = conf.exists() and shutil.which("sinfo") and subprocess.run(["sinfo"], env=env, capture_output=True).returncode == 0
    started = False
    if not ok:
        if os.geteuid() != 0 and not shutil.which("slurmctld"):
            tier_unavailable("slurm", "not root and Slurm is not installed (tests/slurm/local_slurm.sh start)")
        res = subprocess.run(["bash", str(ROOT / "tests/slurm/local_slurm.sh"), "start"], capture_output=True,
                             text=True, env={k: v for k, v in os.environ.items() if k != "SLURM_CONF"})
        if res.returncode != 0:
            lines = res.stderr.strip().splitlines() or [f"tests/slurm/local_slurm.sh start exited {res.returncode}"]
            tier_unavailable("slurm", lines[-1].removeprefix("local_slurm: ").removeprefix("error: "))
        started = True
        env["SLURM_CONF"] = str(Path(os.environ.get("PIPELINE_SLURM_BASE", "/tmp/pslurm")) / "etc" / "slurm.conf")
    yield env
    if started:
        subprocess.run(["bash", str(ROOT / "tests/slurm/local_slurm.sh"), "stop"], capture_output=True)


@pytest.fixture
def senv(slurm, pipeline_env, tmp_path):
    return {**pipeline_env, "SLURM_CONF": slurm["SLURM_CONF"], "PIPELINE_CLUSTER": "local_cpu",
            "BAD_NODES_LOG": str(tmp_path / "bad.log"), "PIPELINE_LOG_DIR": str(ROOT / "logs")}
