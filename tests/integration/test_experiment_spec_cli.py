"""pipeline_experiment.py's help and user errors, run for real (moved from tests/unit/test_experiment_spec.py:
this test runs the script)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.unit.test_experiment_spec import BASE


def test_cli_help_and_user_errors(tmp_path):
    py = [sys.executable, str(ROOT / "pipeline_experiment.py")]
    for cmd in ([], ["list"], ["render"], ["submit"], ["status"], ["csv"]):
        res = subprocess.run([*py, *cmd, "--help"], capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 0 and "usage:" in res.stdout, (cmd, res.stderr)
    res = subprocess.run([*py, "list", str(tmp_path / "missing.yaml")], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and res.stderr.strip() == f"error: experiment file {tmp_path / 'missing.yaml'} does not exist"
    (tmp_path / "e.yaml").write_text(BASE + "grid: {optimizer.lr: [0.1, 0.2]}\n")
    res = subprocess.run([*py, "list", str(tmp_path / "e.yaml")], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and "lr0.1 " in res.stdout and "optimizer.lr=0.2" in res.stdout


def test_a_refused_submission_reports_its_reason_not_its_count():
    """When isambard_sbatch refuses a job, the experiment says why (its first error line), not 'plan: 1 problem(s)'."""
    from pipeline.cli.experiment import _sbatch
    from pipeline.common.errors import UserError

    with pytest.raises(UserError) as exc:
        _sbatch(["pipeline_coherence_submit.sbatch", "/nonexistent/ckpt", "--backend", "megatron", "--tp", "3"])
    msg = str(exc.value)
    assert msg.startswith("isambard_sbatch exited 2: ") and "problem(s)" not in msg, msg
