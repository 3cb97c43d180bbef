"""pipeline_experiment.py runs (issue 49 item 8): every run under a runs root, however it was submitted (an
experiment, plain isambard_sbatch, by hand), with its state, step, last loss, Slurm job and latest complete checkpoint,
from the records the engines write (training/records.py's own writers here)."""

from __future__ import annotations

import json

from pipeline.checkpoint import layout
from pipeline.cli.experiment import main
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

    save = tmp_path / "ck"
    it = layout.iter_dir(save, 4)
    it.mkdir(parents=True)
    for f in ("metadata.json", "common.pt", "__0_0.distcp"):
        (it / f).write_bytes(b"{}")
    layout.write_tracker(save, 4)
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
