"""Fixtures of the tests that run the real local Slurm cluster (tests/slurm/local_slurm.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

CONF = Path(os.environ.get("PIPELINE_SLURM_BASE", "/tmp/pslurm")) / "etc" / "slurm.conf"


@pytest.fixture(scope="module")
def slurm():
    env = {**os.environ, "SLURM_CONF": str(CONF)}
    ok = CONF.exists() and shutil.which("sinfo") and subprocess.run(["sinfo"], env=env, capture_output=True).returncode == 0
    started = False
    if not ok:
        if os.geteuid() != 0 and not shutil.which("slurmctld"):
            pytest.skip("no local Slurm: not root and Slurm is not installed (tests/slurm/local_slurm.sh start)")
        res = subprocess.run(["bash", str(ROOT / "tests/slurm/local_slurm.sh"), "start"], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot start the local Slurm cluster: {res.stderr.strip()[-300:]}")
        started = True
    yield env
    if started:
        subprocess.run(["bash", str(ROOT / "tests/slurm/local_slurm.sh"), "stop"], capture_output=True)


@pytest.fixture
def senv(slurm, pipeline_env, tmp_path):
    return {**pipeline_env, "SLURM_CONF": slurm["SLURM_CONF"], "PIPELINE_CLUSTER": "local_cpu",
            "BAD_NODES_LOG": str(tmp_path / "bad.log"), "PIPELINE_LOG_DIR": str(ROOT / "logs")}
