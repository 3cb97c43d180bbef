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


@pytest.mark.slurm
def test_a_submit_that_queued_nothing_writes_no_lock(tmp_path, senv):
    """Issue 59, item 4: the lock records what was queued. A submit whose first sbatch fails (here the real local
    Slurm refuses the run's partition, which does not exist) leaves no lock, so editing the file afterwards is not
    refused as drift; the same edit after a queued job would be (tests/integration/test_experiments.py)."""
    py = [sys.executable, str(ROOT / "pipeline_experiment.py")]
    exp = tmp_path / "e.yaml"
    body = BASE.replace("  mode: sft\n", "  mode: sft\n  sbatch: [--partition=no-such-partition]\n")
    assert body != BASE
    exp.write_text("name: nolock\n" + body + "grid: {optimizer.lr: [0.1]}\n")
    subprocess.run([sys.executable, "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus",
                    "--seq-length", "256", "--limit", "200", "--quiet"], env=senv, cwd=ROOT, check=True)
    res = subprocess.run([*py, "submit", str(exp)], capture_output=True, text=True, cwd=ROOT, env=senv)
    assert res.returncode == 2 and "isambard_sbatch exited" in res.stderr, res.stdout + res.stderr
    assert "invalid partition" in res.stderr.lower(), res.stderr
    assert "locked" not in res.stdout and "jobs submitted before it: none" in res.stderr, res.stdout + res.stderr
    assert not list((tmp_path / "locks").rglob("*.lock.yaml")), list((tmp_path / "locks").rglob("*"))
    exp.write_text("name: nolock\n" + body.replace("train_iters: 8", "train_iters: 9") + "grid: {optimizer.lr: [0.1]}\n")
    res = subprocess.run([*py, "submit", str(exp)], capture_output=True, text=True, cwd=ROOT, env=senv)
    assert res.returncode == 2 and "differs from its lock" not in res.stderr, res.stderr
    assert "isambard_sbatch exited" in res.stderr, res.stderr


HOSTILE = ["x\ntouch PWNED1 #", "y\rtouch PWNED2 #", "z\u2028touch PWNED3", "w\x85touch PWNED4", "v\x1b[2Ktouch PWNED5",
           "it's \\ $(touch PWNED6) `touch PWNED7`"]


def test_every_line_render_prints_is_safe_to_run(tmp_path):
    """Issue 60, item 1: a swept value "x\\ntouch PWNED #" ended render's `# run LABEL: key=value` comment and the
    next line ran as a command when the rendered lines were run. Every line render prints is now safe to run: the
    script render prints (hostile values in the grid and in the experiment file's own folder name) is executed by
    bash, with isambard_sbatch a function that prints a job id (what it would queue is not under test here), and
    nothing else runs; each command is one physical line and gets back each value byte for byte."""
    folder = tmp_path / "d\ntouch PWNED0 #"
    folder.mkdir()
    exp = folder / "e.yaml"
    values = ", ".join('"' + v.encode("unicode_escape").decode().replace('"', '\\"') + '"' for v in HOSTILE)
    exp.write_text("name: inj\n" + BASE + f"grid:\n  logger.wandb_project: [{values}]\n")
    res = subprocess.run([sys.executable, str(ROOT / "pipeline_experiment.py"), "render", str(exp)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split("\n")
    assert sum(ln.startswith("JOB_1=$(isambard_sbatch ") for ln in lines) == len(HOSTILE), res.stdout
    for ln in lines:
        assert ln == "" or ln.startswith(("# ", "JOB_", "mkdir -p ")), repr(ln)
        assert not any(c in ln for c in "\r\x85\u2028\x1b"), repr(ln)
    work = tmp_path / "work"
    work.mkdir()
    seen = work / "argv.txt"
    script = ("isambard_sbatch() { printf '%s\\0' \"$@\" >> " + str(seen) + "; printf '\\0' >> " + str(seen)
              + "; echo 1; }\n" + res.stdout)
    ran = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=work, env={"PATH": "/usr/bin:/bin"})
    assert ran.returncode == 0, ran.stderr
    assert not list(work.glob("PWNED*")) and not list(ROOT.glob("PWNED*")), list(work.iterdir())
    jobs = [j.split("\0") for j in seen.read_bytes().decode().split("\0\0") if j]
    got = [next(w for w in j if w.startswith("logger.wandb_project=")) for j in jobs]
    from pipeline.experiment.spec import render_override

    assert got == [render_override("logger.wandb_project", v) for v in HOSTILE]
