"""pipeline_experiment.py runs (issue 49 item 8): every run under a runs root, however it was submitted (an
experiment, plain isambard_sbatch, by hand), with its state, step, last loss, Slurm job and latest complete checkpoint,
from the records the engines write (training/records.py's own writers here)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.cli.experiment import main
from pipeline.common import layout
from pipeline.training.records import ProgressLog


def make_run(root, name, steps, status=None, done=False, nan=False, job=None, save=None):
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(json.dumps({"checkpoint": {"save": str(save) if save else None}}))
    if job is not None:
        (run / "manifest.json").write_text(json.dumps({"run_dir": str(run), "launches": [{"slurm_job_id": job}]}))
    log = ProgressLog(run, tokens_per_step=128)
    for s in range(1, steps + 1):
        log.log(s, {"loss": 10.0 - s})
    if status:
        log.summarize(status, steps)
    if done:
        (run / layout.TRAINING_DONE).write_text("done\n")
    if nan:
        (run / "FAILED_NAN").write_text("nan\n")
    return run


def test_runs_lists_every_run_with_its_state_step_loss_job_and_checkpoint(tmp_path, capsys):
    save = tmp_path / "ck"
    it = layout.iter_dir(save, 4)  # a Megatron torch_dist save, as layout reads one complete
    it.mkdir(parents=True)
    for f in ("metadata.json", "common.pt", "__0_0.distcp"):
        (it / f).write_bytes(b"{}")
    layout.write_tracker(save, 4)
    make_run(tmp_path, "sweep.lr0.001", 4, status="completed", done=True, save=save)
    make_run(tmp_path, "by_hand", 2, status="preempted", job="4242")  # Slurm no longer knows the job
    make_run(tmp_path, "diverged", 1, nan=True)
    (tmp_path / "_experiments").mkdir()  # the status board's own folder: not a run
    (tmp_path / "not_a_run").mkdir()
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"runs under {tmp_path}: 3"
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[2:]}
    assert set(rows) == {"sweep.lr0.001", "by_hand", "diverged"}
    assert rows["sweep.lr0.001"][1:4] == ["completed", "4", "6.0"] and rows["sweep.lr0.001"][5] == "4"
    assert rows["by_hand"][1:5] == ["preempted", "2", "8.0", "4242"]
    assert rows["diverged"][1:4] == ["failed", "(non-finite", "loss)"]


def test_runs_refuses_a_root_that_is_not_a_folder_in_one_line(tmp_path, capsys):
    assert main(["runs", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: runs root {tmp_path / 'nope'} is not a folder (set PIPELINE_RUNS_DIR, or name one)"]


def test_runs_shows_a_nan_loss_as_nan_and_no_checkpoint_of_another_run(tmp_path, capsys):
    """Issue 60, item 10: a run whose last loss was NaN showed its last finite loss, and a run refused at its save
    claim (the folder belongs to another run) showed that run's checkpoint. The owner record is the save claim's
    own (training/records.claim_save)."""
    from pipeline.config.schema import TrainingConfig
    from pipeline.training import records
    from tests.helpers import megatron_checkpoint

    save = megatron_checkpoint(tmp_path / "ck", 4)
    owner = make_run(tmp_path, "owner", 4, status="completed", done=True, save=save)
    records.claim_save(save, owner, TrainingConfig())
    make_run(tmp_path, "refused", 1, status="failed", save=save)  # it named the same save; its claim was refused
    nan = make_run(tmp_path, "diverged", 2)
    ProgressLog(nan, tokens_per_step=128).log(3, {"loss": float("nan")})
    assert main(["runs", str(tmp_path)]) == 0
    rows = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines()[2:]}
    assert rows["owner"][5] == "4", rows["owner"]
    assert rows["refused"][5] == "-", rows["refused"]
    assert rows["diverged"][2:4] == ["3", "nan"], rows["diverged"]


def _as_other_user(cmd, env=None):
    """``cmd`` as uid/gid 65534 (nobody), a reader without rights to another user's 0700 folders."""
    import subprocess

    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd],
                          capture_output=True, text=True, timeout=120, env=env)


def test_runs_never_hangs_or_crashes_on_hostile_records(tmp_path, capsys):
    """Issue 60, items 13-14: `runs` blocked for ever on a FIFO as config.yaml, manifest.json or the save's tracker,
    read /dev/zero into memory through a linked manifest, and crashed on manifests of another shape, a null or scalar
    checkpoint: in config.yaml. Each run is now a row (its unreadable parts blank), and a root that cannot be read
    is one line. A FIFO owner record in a save is refused in one line by the launch (it blocked after the
    preflight)."""
    import os
    import sys

    import pytest

    from pipeline.common.errors import UserError
    from pipeline.config.schema import TrainingConfig
    from pipeline.training import records

    fifo_cfg = make_run(tmp_path, "fifo_config", 2)
    (fifo_cfg / "config.yaml").unlink()
    os.mkfifo(fifo_cfg / "config.yaml")
    fifo_manifest = make_run(tmp_path, "fifo_manifest", 2)
    os.mkfifo(fifo_manifest / "manifest.json")
    zero = make_run(tmp_path, "zero_manifest", 2)
    (zero / "manifest.json").symlink_to("/dev/zero")
    save = tmp_path / "fifo_save"
    save.mkdir()
    os.mkfifo(save / layout.TRACKER)
    make_run(tmp_path, "fifo_tracker", 2, save=save)
    for name, manifest in (("launches_int", {"launches": 5}), ("launches_dict", {"launches": {"a": 1}}),
                           ("launches_junk", {"launches": [{"slurm_job_id": {"x": 1}}]})):
        run = make_run(tmp_path, name, 1)
        (run / "manifest.json").write_text(json.dumps(manifest))
    for name, ck in (("null_checkpoint", None), ("scalar_checkpoint", 5)):
        run = make_run(tmp_path, name, 1)
        (run / "config.yaml").write_text(json.dumps({"checkpoint": ck}))
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[2:]}
    assert len(rows) == 9 and all(r[2] in ("1", "2") for r in rows.values()), out
    # records another user may not read: the runs root itself, and a run's progress inside a readable root (in a
    # folder of /tmp that the other user may enter: pytest's own are its user's alone)
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="pruns."))
    os.chmod(base, 0o755)
    private = base / "private"
    private.mkdir()
    make_run(private, "theirs", 2)
    os.chmod(private, 0o700)
    shared = base / "shared"
    shared.mkdir()
    mine = make_run(shared, "mine", 2)
    os.chmod(mine / "progress.ndjson", 0o600)
    for d in (shared, mine):
        os.chmod(d, 0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-c", "import sys; from pipeline.cli.experiment import main; sys.exit(main(sys.argv[1:]))",
           "runs"]
    res = _as_other_user([*cmd, str(private)], env)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"error: runs root {private} cannot be read (Permission denied): name a folder you may read"], res.stderr
    res = _as_other_user([*cmd, str(shared)], env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "mine  unreadable (Permission denied)" in res.stdout, res.stdout
    shutil.rmtree(base)
    # the launch's claim of a save whose owner record is a FIFO
    fifo_owner = tmp_path / "fifo_owner"
    fifo_owner.mkdir()
    os.mkfifo(fifo_owner / records.OWNER_FILE)
    with pytest.raises(UserError, match="that is not a regular file: remove it"):
        records.check_save_owner(fifo_owner, tmp_path / "some_run", TrainingConfig())
