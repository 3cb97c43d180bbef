"""Records only their writer writes (issue 34): the run directory's writer lock, run identity, experiment flags,
readers of the run's records."""

from __future__ import annotations

import os

import pytest

from pipeline.common.errors import UserError
from pipeline.training import records

SLURM = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NODEID", "SLURM_RESTART_COUNT", "SLURMD_NODENAME")


def _claim(run_dir, monkeypatch, **env):
    for k in SLURM:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return records.claim_run_dir(run_dir)


def test_second_launch_in_the_same_salloc_is_refused(tmp_path, monkeypatch):
    # The first training was started in the allocation's shell (or by srun: step 0); a second launch in the same
    # salloc shares the job id but is another training: it used to be taken as "the same writer" and rewrote the
    # live run's launch.json, config.yaml, manifest and events.
    fd = _claim(tmp_path, monkeypatch, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_NODEID="0")
    try:
        for step in ({}, {"SLURM_STEP_ID": "1"}, {"SLURM_STEP_ID": "0"}):  # the shell, another step, the same node
            with pytest.raises(UserError, match=r"is being written by Slurm job 77 step 0 \(pid \d+ \(alive\)"):
                _claim(tmp_path, monkeypatch, SLURM_JOB_ID="77", SLURM_NODEID="0", **step)
        # the same training: another node of the same job step, and the requeued job's next incarnation
        assert _claim(tmp_path, monkeypatch, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_NODEID="1") is None
        assert _claim(tmp_path, monkeypatch, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_NODEID="0",
                      SLURM_RESTART_COUNT="1") is None
        with pytest.raises(UserError, match="one training per run directory"):
            _claim(tmp_path, monkeypatch, SLURM_JOB_ID="78", SLURM_STEP_ID="0", SLURM_NODEID="1")
    finally:
        os.close(fd)
    assert isinstance(_claim(tmp_path, monkeypatch, SLURM_JOB_ID="77"), int)  # released: the next launch writes
