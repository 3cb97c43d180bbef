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


def _plan(run_dir, model="tiny-qwen3-moe", mode="sft", allow=False):
    from pipeline.training.launch import LaunchRequest, plan_launch

    return plan_launch(LaunchRequest(config="configs/local/tiny_moe_sft.yaml", model=model, mode=mode, disable_ft=True,
                                     path_checks=False, run_dir=run_dir, allow_config_change=allow,
                                     overrides=(f"checkpoint.save={run_dir / 'checkpoints'}",)))


def _record(plan):
    records.write_launch_records(plan.run_dir, cfg=plan.cfg, spec=plan.spec, mode=plan.request.mode, peft=None,
                                 cluster=plan.cluster, alloc=plan.alloc, nodes=plan.nodes, plan=plan.preflight,
                                 command=["pipeline_training_launch.sh"], launch_cmd=plan.command(), view=plan.view)


def test_run_identity_includes_model_and_mode(tmp_path, monkeypatch):
    # A qwen3 run relaunched as tiny-nemotronh-moe (same config) said "already finished" and rewrote launch.json,
    # or loaded qwen3 weights into NemotronH; another --mode resumed the run as if it were the same one.
    from tests.helpers import ROOT

    monkeypatch.chdir(ROOT)
    run_dir = (tmp_path / "run").resolve()
    _record(_plan(run_dir))
    assert _plan(run_dir).preflight.ok  # the same run relaunching
    for allow in (False, True):  # no weights carry over to another model: refused even with --allow-config-change
        with pytest.raises(UserError, match="holds a run of model 'tiny-qwen3-moe', not 'tiny-nemotronh-moe'"):
            _plan(run_dir, model="tiny-nemotronh-moe", allow=allow)
    with pytest.raises(UserError, match=r"launch.mode: 'sft' -> 'pretrain'"):
        _plan(run_dir, mode="pretrain")
    assert _plan(run_dir, mode="pretrain", allow=True).preflight.ok
    assert records.read_json(run_dir / "launch.json")["model"] == "tiny-qwen3-moe"  # untouched by the refusals
