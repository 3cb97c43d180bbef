"""Checkpoint ownership (issue 33 item 1): a run records itself in its checkpoint.save; another run pointing its
save there is refused before launch (one line naming the owner) and at experiment render (two runs of a sweep that
resolve to one save: one line naming both); the same run relaunching is accepted; starting from another run's
weights goes through checkpoint.pretrained_checkpoint / load."""

from __future__ import annotations

import json

import pytest

from pipeline.cli.train import main
from pipeline.common.errors import UserError
from pipeline.experiment import spec
from pipeline.experiment.plan import plan_experiment
from pipeline.training import records
from pipeline.training.launch import LaunchRequest, plan_launch
from tests.helpers import ROOT

TRAIN = ["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--disable-ft",
         "--dry-run", "--no-path-checks"]


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.chdir(ROOT)
    return tmp_path


def plan(run_dir, save, *extra):
    req = LaunchRequest(config=TRAIN[0], model=TRAIN[2], mode=TRAIN[4], overrides=(f"checkpoint.save={save}", *extra),
                        disable_ft=True, path_checks=False, run_dir=run_dir)
    return plan_launch(req)


def fake_checkpoints(save):
    (save / "iter_0000004").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("4\n")


def test_a_second_run_on_an_owned_save_is_refused_naming_the_owner(dirs, capsys):
    save = dirs / "shared"
    a = plan(dirs / "a", save)
    records.claim_save(a.cfg.checkpoint.save, a.run_dir, a.cfg)
    fake_checkpoints(save)
    owner = json.loads((save / records.OWNER_FILE).read_text())
    assert owner["run_dir"] == str((dirs / "a").resolve()) and owner["identity"] == records.config_identity(a.cfg)
    with pytest.raises(UserError, match=f"checkpoint.save {save} belongs to run {dirs / 'a'}"):
        plan(dirs / "b", save)
    # the launcher: exit 2, one line, before anything is launched
    assert main([*TRAIN, "--run-dir", str(dirs / "b"), f"checkpoint.save={save}"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert len(err) == 1 and "belongs to run" in err[0] and "checkpoint.pretrained_checkpoint" in err[0]


def test_the_same_run_relaunching_is_accepted(dirs):
    save = dirs / "own"
    a = plan(dirs / "a", save)
    records.claim_save(a.cfg.checkpoint.save, a.run_dir, a.cfg)
    fake_checkpoints(save)
    again = plan(dirs / "a", save)  # a requeue / restart: same run directory, same identity
    assert again.preflight.ok
    since = json.loads((save / records.OWNER_FILE).read_text())["since"]
    records.claim_save(again.cfg.checkpoint.save, again.run_dir, again.cfg)
    assert json.loads((save / records.OWNER_FILE).read_text())["since"] == since


def test_the_same_run_directory_with_another_config_needs_allow_change(dirs):
    save = dirs / "own"
    a = plan(dirs / "a", save)
    records.claim_save(a.cfg.checkpoint.save, a.run_dir, a.cfg)
    with pytest.raises(UserError, match="belongs to run .* with another config"):
        plan(dirs / "a", save, "optimizer.lr=1e-2")
    req = LaunchRequest(config=TRAIN[0], model=TRAIN[2], mode=TRAIN[4], disable_ft=True, path_checks=False,
                        overrides=(f"checkpoint.save={save}", "optimizer.lr=1e-2"), run_dir=dirs / "a",
                        allow_config_change=True)
    assert plan_launch(req).preflight.ok


def test_starting_from_another_runs_weights_is_an_explicit_load(dirs):
    save_a = dirs / "a_ckpt"
    a = plan(dirs / "a", save_a)
    records.claim_save(a.cfg.checkpoint.save, a.run_dir, a.cfg)
    fake_checkpoints(save_a)
    b = plan(dirs / "b", dirs / "b_ckpt", f"checkpoint.pretrained_checkpoint={save_a}", f"checkpoint.load={save_a}")
    assert b.preflight.ok


def test_checkpoints_without_an_owner_record(dirs):
    save = dirs / "legacy"
    fake_checkpoints(save)
    with pytest.raises(UserError, match="holds checkpoints but no owner record"):
        plan(dirs / "b", save)
    # this run directory's own records name it: its checkpoints from before owner records existed
    (dirs / "a").mkdir()
    (dirs / "a" / "config.yaml").write_text(f"checkpoint:\n  save: {save}\n")
    records.check_save_owner(save, dirs / "a", plan(dirs / "c", dirs / "fresh").cfg)
    # an empty (or new) save is anybody's
    records.check_save_owner(dirs / "empty", dirs / "b", plan(dirs / "c", dirs / "fresh").cfg)


SWEEP = """
name: s
base: {config: configs/local/tiny_moe_sft.yaml, model: tiny-qwen3-moe, mode: sft, flags: [--disable-ft],
       overrides: {checkpoint.save: SAVE}}
grid:
  optimizer.lr: [3.0e-3, 1.0e-3]
"""


def test_two_runs_of_a_sweep_sharing_one_save_are_refused_at_render(dirs):
    p = dirs / "s.yaml"
    p.write_text(SWEEP.replace("SAVE", str(dirs / "one_save")))
    exp = spec.load(p, root=ROOT)
    plans = plan_experiment(exp)
    shared = [pr for rp in plans for pr in rp.problems if "is shared by runs" in pr]
    assert len(shared) == 2 and shared[0] == shared[1]
    labels = [rp.run.label for rp in plans]
    assert all(label in shared[0] for label in labels)


def test_a_sweep_with_a_save_per_run_is_not_refused(dirs):
    p = dirs / "s.yaml"
    p.write_text(SWEEP.replace("    overrides: {checkpoint.save: SAVE}", "").replace(
        ", flags: [--disable-ft],\n       overrides: {checkpoint.save: SAVE}}", ", flags: [--disable-ft]}"))
    exp = spec.load(p, root=ROOT)
    assert not [pr for rp in plan_experiment(exp) for pr in rp.problems if "is shared by runs" in pr]
