"""Experiment files: expansion (grid, zip, named axes, computed values), run names, refusals, Hydra rendering; the
run-identity check of the run records; lock comparison; the chain verdict; loss-curve PNGs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.common.errors import UserError
from pipeline.experiment import spec
from pipeline.experiment.status import PhaseRow, verdict
from pipeline.training.records import check_run_identity, config_diff
from tests.helpers import ROOT

BASE = """
base:
  config: configs/local/tiny_moe_sft.yaml
  model: tiny-qwen3-moe
  mode: sft
  overrides: {train.train_iters: 8}
"""


def load(tmp_path: Path, body: str, name: str = "exp.yaml") -> spec.Experiment:
    p = tmp_path / name
    p.write_text(BASE + body)
    return spec.load(p, root=ROOT)


def test_grid_zip_named_axes_and_computed_values(tmp_path):
    exp = load(tmp_path, """
grid:
  optimizer.lr: [3.0e-3, 1.0e-3]
  size:
    small: {train.global_batch_size: 2}
    big: {train.global_batch_size: 4, train.micro_batch_size: 2}
zip:
  rng.seed: [1, 2]
  scheduler.lr_warmup_iters: [0, 3]
computed:
  optimizer.min_lr: ${calc:'${optimizer.lr} / 10'}
  scheduler.lr_decay_iters: ${calc:'${train.train_iters} - ${scheduler.lr_warmup_iters}'}
""")
    assert exp.name == "exp" and len(exp.runs) == 2 * 2 * 2
    labels = [r.label for r in exp.runs]
    assert labels[0] == "lr0.003_small_seed1_warmup0" and labels[-1] == "lr0.001_big_seed2_warmup3"
    assert len(set(labels)) == 8
    run = exp.runs[-1]
    assert run.overrides["optimizer.min_lr"] == 0.0001  # rounded: not 0.00010000000000000002
    assert run.overrides["scheduler.lr_decay_iters"] == 5
    assert run.overrides["train.train_iters"] == 8
    assert run.values == {"optimizer.lr": 0.001, "train.global_batch_size": 4, "train.micro_batch_size": 2,
                          "rng.seed": 2, "scheduler.lr_warmup_iters": 3, "optimizer.min_lr": 0.0001,
                          "scheduler.lr_decay_iters": 5}
    assert exp.run_name(run) == "exp.lr0.001_big_seed2_warmup3"  # no phases: no phase suffix
    # stable: the same file expands to the same names
    assert [r.label for r in load(tmp_path, exp.path.read_text()[len(BASE):], "exp.yaml").runs] == labels


def test_interpolation_reads_the_base_config_and_names_with_phases(tmp_path):
    exp = load(tmp_path, """
name: chain
grid: {train.global_batch_size: [2, 4]}
computed:
  +pipeline.tokens_per_iter: ${calc:'${train.global_batch_size} * ${model.seq_length}'}
phases:
  - {name: pretrain}
  - {name: cooldown, from: pretrain, iteration: last, tokens: 4096}
  - {name: export, kind: export}
  - {name: coherence, kind: coherence}
""")
    assert [r.overrides["+pipeline.tokens_per_iter"] for r in exp.runs] == [512, 1024]  # seq_length 256 from YAML
    assert exp.run_name(exp.runs[0], exp.phase("cooldown")) == "chain.gbs2.cooldown"
    assert exp.phase("export").start == "cooldown" and exp.phase("coherence").start == "export"


def test_labels_that_print_alike_get_a_stable_hash(tmp_path):
    exp = load(tmp_path, "grid: {logger.wandb_project: ['a b', 'a/b']}\n")
    labels = [r.label for r in exp.runs]
    assert len(set(labels)) == 2 and all(x.startswith("wandb_project") and "-" in x for x in labels)


@pytest.mark.parametrize("body,needle", [
    ("grid: {optimizer.lr: []}\n", "non-empty list"),
    ("zip: {optimizer.lr: [1, 2], rng.seed: [1]}\n", "zip needs lists of one length"),
    ("grid: {logger.wandb_exp_name: [a, b]}\n", "set by the experiment"),
    ("grid: {optimizer.lr: [1]}\nzip: {optimizer.lr: [2]}\n", "swept by two axes"),
    ("sweep: {}\n", "unknown key(s) sweep"),
    ("phases: [{name: a}, {name: b, kind: export, from: nope}]\n", "not an earlier phase"),
    ("phases: [{name: a}, {name: b, from: a, iteration: 0}]\n", "iteration must be"),
    ("phases: [{name: a, kind: export}]\n", "needs 'from' a training phase"),
    ("computed:\n  optimizer.min_lr: ${calc:'__import__(1)'}\n", "does not resolve"),
    ("computed:\n  optimizer.min_lr: ${nope.key}\n", "does not resolve"),
    # YAML 1.1 read 1e-3 as a string: two labels for one run (issue 22, item 15); now one value, refused as such
    ("grid: {optimizer.lr: [1e-3, 0.001]}\n", "two runs have identical overrides"),
    # bounded arithmetic (issue 22, items 13 and 14): 9**9**9 hung for good, 10**5000 was a traceback
    ("computed:\n  train.train_iters: ${calc:'9**9**9'}\n", "9**387420489 is out of range"),
    ("computed:\n  train.train_iters: ${calc:'10**5000'}\n", "10**5000 is out of range"),
    ("computed:\n  optimizer.lr: ${calc:'1e308 * 10'}\n", "inf is not a finite number"),
    ("grid: {optimizer.lr: [" + ",".join(map(str, range(1000))) + "], rng.seed: [" + ",".join(map(str, range(1000)))
     + "]}\n",
     "the axes expand to 1000000 runs, more than 1000"),
])
def test_mistakes_are_one_line_user_errors(tmp_path, body, needle):
    with pytest.raises(UserError) as e:
        load(tmp_path, body)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_hydra_rendering_quotes_what_needs_it():
    r = spec.render_override
    assert r("optimizer.lr", 0.003) == "optimizer.lr=0.003"
    assert r("model.bf16", True) == "model.bf16=true"
    assert r("checkpoint.save", "/a/b-c_1") == "checkpoint.save=/a/b-c_1"
    assert r("logger.wandb_project", "it's a; b") == "logger.wandb_project='it\\'s a; b'"
    assert r("model.recompute_modules", ["core_attn", "mlp"]) == "model.recompute_modules=[core_attn,mlp]"
    assert r("checkpoint.load", None) == "checkpoint.load=null"
    assert spec.calc("ceil(4096 / (4 * 256)) + max(1, 2)") == 6
    with pytest.raises(ValueError):
        spec.calc("open('x')")


def test_run_identity_refuses_a_changed_config_but_not_attempt_keys(tmp_path):
    import yaml

    from pipeline.config.schema import TrainingConfig

    T = TrainingConfig.from_dict  # the typed config a launch resolves

    cfg = {"train": {"train_iters": 6}, "logger": {"wandb_save_dir": "/a"},
           "pipeline": {"local": {"fault_inject_step_sleep": None}}}
    assert check_run_identity(tmp_path, T(cfg)) == {}  # a new run directory
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(T(cfg).to_dict()))  # as write_launch_records does
    same = {"train": {"train_iters": 6}, "logger": {"wandb_save_dir": "/b"},
            "pipeline": {"local": {"fault_inject_step_sleep": 0.3}}}
    assert check_run_identity(tmp_path, T(same)) == {}  # W&B's directory and fault injection differ per attempt
    changed = {"train": {"train_iters": 8}, "logger": {"wandb_save_dir": "/a"}}
    with pytest.raises(UserError) as e:
        check_run_identity(tmp_path, T(changed))
    assert "train.train_iters: 6 -> 8" in str(e.value) and "--allow-config-change" in str(e.value)
    assert check_run_identity(tmp_path, T(changed), allow_change=True) == {"train.train_iters": (6, 8)}
    assert config_diff({"a": {"b": 1.0}}, {"a": {"b": 1.0, "c": None}}) == {}


def test_lock_diff_names_phase_and_key():
    from pipeline.experiment.locks import lock_diff

    old = {"phases": {"pretrain": {"kind": "train", "config": {"optimizer": {"lr": 0.003}}},
                      "export": {"kind": "export", "args": ["export", "/x", "--iteration", "4"]}}}
    new = {"phases": {"pretrain": {"kind": "train", "config": {"optimizer": {"lr": 0.001}}},
                      "export": {"kind": "export", "args": ["export", "/x", "--iteration", "6"]}}}
    assert lock_diff(old, new) == {"pretrain:optimizer.lr": (0.003, 0.001),
                                   "export:args": (old["phases"]["export"]["args"], new["phases"]["export"]["args"])}
    assert lock_diff(old, old) == {}


def test_chain_verdict_names_the_failed_phase():
    rows = [PhaseRow("r", "pretrain", "train", "1", "COMPLETED"), PhaseRow("r", "cooldown", "train", "2", "FAILED"),
            PhaseRow("r", "export", "export", "3", "PENDING", "DependencyNeverSatisfied")]
    assert verdict(rows) == "stopped at cooldown (FAILED, job 2); export will not run"
    rows[1].state = "RUNNING"
    assert verdict(rows) == "running: cooldown"
    rows[1].state, rows[2].state = "COMPLETED", "COMPLETED"
    assert verdict(rows) == "done"
    assert verdict([PhaseRow("r", "train", "train")]) == "not submitted"


def _plan_with_progress(tmp_path, steps: int):
    from pipeline.experiment.plan import Job, RunPlan

    run_dir = tmp_path / f"run{steps}"
    run_dir.mkdir()
    (run_dir / "progress.ndjson").write_text("".join(json.dumps({"step": s, "loss": 10 - s * 0.3}) + "\n"
                                                     for s in range(1, steps + 1)))
    job = Job(phase="train", kind="train", script="s", args=["a"], sbatch=[], run_dir=run_dir, iters=steps)
    return RunPlan(run=spec.Run(label="r", values={}, overrides={}), jobs=[job])


def test_loss_curve_png_follows_the_data(tmp_path, monkeypatch):
    from PIL import Image

    from pipeline.experiment.plots import write_plots

    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    exp = load(tmp_path, "")
    sizes = []
    for steps in (3, 30):
        out = write_plots(exp, [_plan_with_progress(tmp_path, steps)])
        with Image.open(out["r"]) as im:
            assert im.format == "PNG" and im.size == (600, 400)
        sizes.append(out["r"].stat().st_size)
    assert sizes[0] != sizes[1]
    assert write_plots(exp, []) == {}


def test_two_submits_of_one_experiment_at_once_are_refused(tmp_path, pipeline_env, capsys):
    """Submit reads then writes the experiment's locks and job record: a second concurrent submit is refused in one
    line (exit 2) before it submits anything, instead of losing the first one's job records."""
    from pipeline.cli.experiment import main
    from pipeline.common.locks import exclusive_lock
    from pipeline.experiment.plan import state_dir

    (tmp_path / "e.yaml").write_text(BASE + "grid: {optimizer.lr: [0.1, 0.2]}\n")
    exp = spec.load(tmp_path / "e.yaml", root=ROOT)
    state_dir(exp).mkdir(parents=True)
    with exclusive_lock(state_dir(exp) / ".submit.lock", "the first submit"):
        assert main(["submit", str(tmp_path / "e.yaml")]) == 2
    err = capsys.readouterr().err
    assert "a submit is running" in err and len(err.strip().splitlines()) == 1, err
    assert not (state_dir(exp) / "submissions.json").exists()


def test_phase_overrides_interpolate_the_experiment_run_and_phase(tmp_path):
    """Issue 59, item 7: ${exp.name}, ${exp.label} and ${exp.phase} in a phase's overrides, per run (before, only
    `computed` resolved them, and a phase's checkpoint folder had to be written out literally); the run's values and
    the base config resolve there too, and a reference to nothing is one line naming the phase and key."""
    exp = load(tmp_path, """
grid:
  optimizer.lr: [3.0e-3, 1.0e-3]
phases:
  - name: pretrain
    overrides: {checkpoint.save: "/ck/${exp.name}/${exp.label}/${exp.phase}", optimizer.min_lr: "${calc:'${optimizer.lr} / 10'}"}
  - name: cooldown
    from: pretrain
    overrides: {checkpoint.save: "/ck/${exp.name}/${exp.label}/${exp.phase}"}
  - {name: export, kind: export}
""", name="chain.yaml")
    first, second = exp.runs
    assert first.phase_overrides["pretrain"] == {"checkpoint.save": "/ck/chain/lr0.003/pretrain", "optimizer.min_lr": 0.0003}
    assert second.phase_overrides["cooldown"] == {"checkpoint.save": "/ck/chain/lr0.001/cooldown"}
    assert "export" not in second.phase_overrides and "checkpoint.save" not in second.overrides
    with pytest.raises(UserError, match=r"^phase 'pretrain' override checkpoint.save='/ck/\$\{exp.nope\}' does not resolve"):
        load(tmp_path, """
phases:
  - {name: pretrain, overrides: {checkpoint.save: "/ck/${exp.nope}"}}
""", name="bad.yaml")


@pytest.mark.parametrize("axes,where", [("grid:\n  optimizer.lr: [1.0e-5, 2.0e-5]\n", "grid.optimizer.lr"),
                                        ("zip:\n  optimizer.lr: [1.0e-5, 2.0e-5]\n  rng.seed: [1, 2]\n", "zip"),
                                        ("grid:\n  size:\n    a: {optimizer.lr: 1.0e-5}\n    b: {optimizer.lr: 2.0e-5}\n",
                                         "grid.size")])
def test_a_phase_may_not_set_what_an_axis_sweeps(tmp_path, axes, where):
    """Issue 60, item 5: a phase override of a swept key replaced the swept values: runs labelled, listed and
    exported as optimizer.lr 1e-5 and 2e-5 both ran 7e-5. Refused, naming the key, the axis and the phase."""
    with pytest.raises(UserError) as exc:
        load(tmp_path, axes + "phases:\n  - {name: train, overrides: {optimizer.lr: 7.0e-5}}\n")
    assert str(exc.value) == (f"{tmp_path / 'exp.yaml'}: phases[0] (train) overrides optimizer.lr, which {where} sweeps:"
                              " every run would run the phase's value while named for its own; drop it from the phase "
                              "(or from the axis)")


def test_tokens_may_not_size_a_phase_whose_iterations_an_axis_sweeps(tmp_path):
    """Issue 60, item 6: `tokens:` replaced a train.train_iters axis (run iters4 launched with train_iters=2, the CSV
    said 4). Refused on the phase the axis sizes; a cooldown that continues it counts on with its own tokens."""
    with pytest.raises(UserError, match=r"phases\[0\] \(train\) has tokens: 2048, which sets train.train_iters, and "
                                        r"grid.train.train_iters sweeps train.train_iters"):
        load(tmp_path, "grid:\n  train.train_iters: [4, 8]\nphases:\n  - {name: train, tokens: 2048}\n")
    exp = load(tmp_path, "grid:\n  train.train_iters: [4, 8]\nphases:\n  - {name: pretrain}\n"
                         "  - {name: cooldown, from: pretrain, tokens: 2048}\n", name="wsd.yaml")
    assert [r.label for r in exp.runs] == ["iters4", "iters8"]


def test_a_phase_may_not_set_a_section_above_or_a_key_inside_a_swept_one(tmp_path):
    """Hostile pass of issue 60, S2: `overrides: {optimizer: {lr: 0.5}}` with optimizer.lr swept passed, and every
    run trained with lr 0.5 while named lr0.001 / lr0.002."""
    with pytest.raises(UserError, match=r"overrides optimizer \(which sets optimizer.lr\), which grid.optimizer.lr "):
        load(tmp_path, "grid:\n  optimizer.lr: [1.0e-3, 2.0e-3]\n"
                       "phases:\n  - {name: train, overrides: {optimizer: {lr: 0.5}}}\n")
    with pytest.raises(UserError, match=r"overrides model.x.y \(inside model.x\), which grid.model.x sweeps"):
        load(tmp_path, "grid:\n  model.x: [{y: 1}, {y: 2}]\nphases:\n  - {name: train, overrides: {model.x.y: 3}}\n")


@pytest.mark.parametrize("where", ["base", "grid", "phase"])
def test_a_malformed_interpolation_is_one_line(tmp_path, where):
    """Hostile pass of issue 60, T1: `${exp.name` (or a lone `${`) in base overrides, grid values or phase overrides
    was an OmegaConf GrammarParseError traceback."""
    body = {"base": "computed:\n  logger.wandb_project: '${exp.name'\n",
            "grid": "grid:\n  logger.wandb_project: ['${', ok]\n",
            "phase": "phases:\n  - {name: train, overrides: {logger.wandb_project: '${exp.name'}}\n"}[where]
    with pytest.raises(UserError, match=r"logger.wandb_project does not parse: "):
        load(tmp_path, body)


def test_values_no_command_line_can_carry_are_refused_at_load(tmp_path):
    """Hostile pass of issue 60, S1/T2/T3: a NUL in a value (bash cut the word there: the job got another value;
    submit crashed after its preflight said PASS) and a 200 KB value ("Argument list too long" after the preflight)."""
    with pytest.raises(UserError, match="a value holds a NUL byte"):
        load(tmp_path, 'grid:\n  logger.wandb_project: ["a\\0b", c]\n')
    with pytest.raises(UserError, match="a value of 200000 characters is longer than a command line passes"):
        load(tmp_path, f"computed:\n  logger.wandb_project: {'x' * 200000}\n")


def test_a_later_phase_whose_time_limit_is_inside_the_save_signal_is_a_plan_problem(tmp_path):
    """Hostile pass of issue 60, W1: render and submit's preflight did not check a later phase's --time against the
    pre-limit save signal; submit queued the first phase, then isambard_sbatch refused the next (a partial chain).
    T4: tokens of 10**400 overflowed."""
    from pipeline.experiment.plan import plan_run

    exp = load(tmp_path, "phases:\n  - {name: pretrain, overrides: {checkpoint.save: /tmp/x-ck}}\n"
                         "  - {name: cooldown, from: pretrain, sbatch: [--time=4]}\n")
    jobs = plan_run(exp, exp.runs[0]).jobs
    assert [j.phase for j in jobs] == ["pretrain", "cooldown"]
    assert not any("pre-limit save signal" in p for p in jobs[0].problems)
    assert any(p.startswith("--time=4 (240 s) is at or under the pre-limit save signal") for p in jobs[1].problems)
    with pytest.raises(UserError, match="tokens is a positive integer token budget"):
        load(tmp_path, "phases:\n  - {name: train, tokens: " + "1" + "0" * 400 + "}\n")


def test_a_phase_may_not_set_what_computed_sets(tmp_path):
    """Hostile pass of issue 60, S3: a phase override (or tokens:) over a computed value ran the phase's value while
    list and csv showed the computed one as the run's own. Refused like a clash with an axis, naming computed."""
    with pytest.raises(UserError, match=r"phases\[0\] \(train\) overrides optimizer.min_lr, which computed sets: every "
                                        r"run would run the phase's value"):
        load(tmp_path, "grid:\n  optimizer.lr: [1.0e-3, 2.0e-3]\ncomputed:\n  optimizer.min_lr: ${calc:'${optimizer.lr}"
                       " / 10'}\nphases:\n  - {name: train, overrides: {optimizer.min_lr: 0.5}}\n")
    with pytest.raises(UserError, match=r"has tokens: 2048, which sets train.train_iters, and computed sets "
                                        r"train.train_iters"):
        load(tmp_path, "grid:\n  train.global_batch_size: [2, 4]\ncomputed:\n  train.train_iters: "
                       "${calc:'64 / ${train.global_batch_size}'}\nphases:\n  - {name: train, tokens: 2048}\n")


def test_exp_label_in_computed_is_the_label_the_run_has(tmp_path):
    """Hostile pass of issue 60, S6: `${exp.label}` in computed resolved with the label before two runs whose values
    print alike were told apart: both runs saved into /ck/wandb_project-a-b, one checkpoint folder for two runs.
    Each run's computed value now names its own (hashed) label; a label that was never shared is as before."""
    exp = load(tmp_path, "grid: {logger.wandb_project: ['a b', 'a/b']}\n"
                         "computed:\n  checkpoint.save: /ck/${exp.label}\n")
    saves = [r.overrides["checkpoint.save"] for r in exp.runs]
    assert saves == [f"/ck/{r.label}" for r in exp.runs] and len(set(saves)) == 2, saves
    assert [r.values["checkpoint.save"] for r in exp.runs] == saves
    plain = load(tmp_path, "grid: {optimizer.lr: [1.0e-3, 2.0e-3]}\ncomputed:\n  checkpoint.save: /ck/${exp.label}\n",
                 name="plain.yaml")
    assert [r.overrides["checkpoint.save"] for r in plain.runs] == ["/ck/lr0.001", "/ck/lr0.002"]
