"""Never silently wrong, round 2 (issue 22): the reproductions of the hostile review that run the real scripts
(moved from tests/unit/test_never_silently_wrong.py)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import run
from tests.unit.test_never_silently_wrong import corpus


# ---- experiments and common knobs: durations and intervals are finite numbers, in one line ---------------------
@pytest.mark.parametrize("value", ["inf", "1e300", "-5", "nan", "abc", "0"])
def test_status_watch_takes_a_finite_interval(value):
    res = run([sys.executable, "pipeline_experiment.py", "status", "configs/experiments/tiny_lr_batch_sweep.yaml",
               "--watch", value], env={**os.environ, "PIPELINE_RUNS_DIR": "/nonexistent"})
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "argument --watch" in lines[0] and "Traceback" not in res.stderr


@pytest.mark.parametrize("value", ["abc", "-1", "inf", "nan"])
def test_a_bad_progress_interval_is_one_line(tmp_path, value):
    d = corpus(tmp_path)
    res = run([sys.executable, "pipeline_data_prepare.py", "tokenize", str(d), "smollm2-135m", "c", "--output-dir",
               str(tmp_path / "out"), "--workers", "1"], env={**os.environ, "PIPELINE_PROGRESS_INTERVAL": value})
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: PIPELINE_PROGRESS_INTERVAL={value!r} is not a number of seconds >= 0")


def test_a_fifo_as_the_bad_node_log_is_one_line(tmp_path):
    """A FIFO as the log blocked every submission forever (item 13)."""
    fifo = tmp_path / "bad.log"
    os.mkfifo(fifo)
    env = {**os.environ, "BAD_NODES_LOG": str(fifo)}
    for args in (["--list-bad"], ["--mark-bad", "nid000001", "x"], ["--wrap", "true"]):
        res = run(["bash", "isambard_sbatch", *args], env=env, timeout=30)
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.strip().splitlines()[-1] == (
            f"error: the bad-node log {fifo} is not a regular file; point BAD_NODES_LOG (or the profile's "
            "bad_nodes_log) at one")


# ---- experiments: csv --output never replaces a special file ---------------------------------------------------
def _csv(tmp_path, output) -> object:
    env = {**os.environ, "PIPELINE_RUNS_DIR": str(tmp_path / "runs")}
    return run([sys.executable, "pipeline_experiment.py", "csv", "configs/experiments/tiny_lr_batch_sweep.yaml",
                "--output", str(output)], env=env, timeout=120)


def test_csv_output_refuses_fifos_and_directories(tmp_path):
    """csv --output turned a FIFO (and /dev/full) into a regular file, and a directory was a traceback (items 6, 14)."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    res = _csv(tmp_path, fifo)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        f"error: {fifo} is not a regular file (a FIFO, device or socket): name a regular file, or /dev/stdout")
    assert fifo.is_fifo()
    res = _csv(tmp_path, tmp_path)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path} is a directory")
    res = _csv(tmp_path, "/dev/stdout")
    assert res.returncode == 0 and res.stdout.startswith("run,"), res.stderr[-2000:]
    good = tmp_path / "r.csv"
    assert _csv(tmp_path, good).returncode == 0 and good.read_text().startswith("run,")


# ---- training: a local run's pretrained checkpoint is checked before torchrun ----------------------------------
@pytest.mark.parametrize("kind", ["missing", "not_a_checkpoint"])
def test_a_bad_pretrained_checkpoint_is_refused_by_the_preflight(tmp_path, kind):
    """A missing checkpoint.pretrained_checkpoint passed the preflight and then failed four times under torchrun
    (9 tracebacks; item 14)."""
    target = tmp_path / ("nope" if kind == "missing" else "empty")
    if kind == "not_a_checkpoint":
        target.mkdir()
    res = run(["bash", "pipeline_training_launch.sh", "configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe",
               "--mode", "sft", "--dry-run", f"checkpoint.pretrained_checkpoint={target}"],
              env={**os.environ, "PIPELINE_DATA_ROOT": str(tmp_path / "data")})
    assert res.returncode == 2 and "Traceback" not in res.stderr
    want = "does not exist" if kind == "missing" else "is neither a checkpoints/ folder"
    assert any(line.startswith(f"error: checkpoint.pretrained_checkpoint {target} {want}")
               for line in res.stderr.splitlines()), res.stderr


# ---- coherence: a folder that is not a model is one line -------------------------------------------------------
def test_coherence_on_a_folder_without_tokenizer_files_is_one_line(tmp_path, smollm2_dir):
    """Coherence on a directory without tokenizer files was a traceback (item 14)."""
    import shutil

    d = tmp_path / "weights_only"
    d.mkdir()
    shutil.copy(smollm2_dir / "config.json", d / "config.json")
    res = run([sys.executable, "pipeline_coherence_test.py", str(d), "--max-tokens", "4"],
              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: {d} is not a Hugging Face model folder: it has no tokenizer files (tokenizer.json, "
        "tokenizer_config.json) (an export's hf/ folder has both; a Megatron checkpoint needs --backend megatron)")


@pytest.mark.parametrize("text,needle", [
    ("not json {", "is not readable JSON"),
    ('["a"]', "is not a submission record"),
    ('{"runs": {"lr0.001": {"jobs": "oops"}}}', "the entry of run 'lr0.001' is malformed"),
    ('{"runs": {"lr0.001": {"jobs": {"train": {"job_id": 12}}}}}', "the entry of run 'lr0.001' is malformed"),
])
def test_a_broken_submission_record_is_one_line(tmp_path, text, needle):
    """A non-JSON submissions.json showed every run as "not submitted" (and the next submit overwrote it);
    malformed entries were tracebacks (item 14)."""
    env = {**os.environ, "PIPELINE_RUNS_DIR": str(tmp_path / "runs")}
    state = tmp_path / "runs" / "_experiments" / "tiny_lr_batch_sweep"
    state.mkdir(parents=True)
    (state / "submissions.json").write_text(text)
    res = run([sys.executable, "pipeline_experiment.py", "status", "configs/experiments/tiny_lr_batch_sweep.yaml",
               "--no-plots"], env=env, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    assert needle in line and line.endswith("nothing was changed"), line
    assert (state / "submissions.json").read_text() == text


# ---- issue 34: a real launch runs on the nodes it has --------------------------------------------------------
@pytest.mark.parametrize("slurm, line", [
    ({}, "error: --nodes 2 outside any Slurm allocation: nothing starts the other 1 node(s) and the launch would wait "
         "for them for ever; submit it (isambard_sbatch --nodes=2 pipeline_training_submit.sbatch ...), run it inside "
         "an allocation of that size, or plan it with --dry-run"),
    ({"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "1"},
     "error: --nodes 2 inside Slurm job 5, which has 1 node(s): the node count comes from the allocation; drop "
     "--nodes (or allocate that many)"),
])
def test_a_launch_for_nodes_it_does_not_have_is_refused_at_once(tmp_path, slurm, line):
    """``--nodes 2`` for a real launch outside any allocation waited for ever; inside one it overrode Slurm's count."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(slurm, PIPELINE_RUNS_DIR=str(tmp_path / "runs"))
    argv = ["bash", "pipeline_training_launch.sh", "configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe",
            "--mode", "sft", "--nodes", "2", "--no-path-checks"]
    res = run(argv, env=env, timeout=60)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == line, res.stderr[-2000:]
    assert "PASS" not in res.stdout and not (tmp_path / "runs").exists()  # nothing written
    dry = run([*argv, "--dry-run"], env=env, timeout=60)  # a plan for two nodes is still a plan
    assert dry.returncode == 0, dry.stderr[-2000:]


# ---- issue 34: configs and experiment files read as written ----------------------------------------------------
def _launch_dry(config, *overrides):
    return run(["bash", "pipeline_training_launch.sh", str(config), "--model", "tiny-qwen3-moe", "--mode", "sft",
                "--dry-run", "--no-path-checks", *overrides], timeout=60)


def test_an_alias_bomb_is_one_line_at_once(tmp_path):
    """A YAML alias bomb in a config or an experiment file ran past 60 s (a MemoryError traceback in experiments)."""
    from tests.unit.test_inputs_as_written import bomb

    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(bomb())
    res = _launch_dry(cfg)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        f"error: {cfg}: invalid YAML: anchors and aliases expand to more than 100000 values (an alias bomb?); write "
        "the values out")
    exp = tmp_path / "exp.yaml"
    exp.write_text("base: {config: configs/local/tiny_moe_sft.yaml, model: tiny-qwen3-moe, mode: sft}\n"
                   + bomb().replace("a: &a", "x: &a"))
    res = run([sys.executable, "pipeline_experiment.py", "list", str(exp)], timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: {exp} is not valid YAML: anchors and aliases expand to more than 100000 values (an alias bomb?); "
        "write the values out")


def test_yaml_1_1_numbers_and_unfilled_values_never_reach_a_run(tmp_path):
    """``train_iters: 1:20`` trained 80 iterations; ``wandb_exp_name: ???`` named the run directory ``runs/???``."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  train_iters: 1:20\n")
    res = _launch_dry(cfg)
    assert res.returncode == 2 and "error: train.train_iters='1:20' must be an integer" in res.stderr
    res = _launch_dry("configs/local/tiny_moe_sft.yaml", "logger.wandb_exp_name=???")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        "error: the config: logger.wandb_exp_name is '???', a required value that was never filled; give it a value "
        "(in the file, or logger.wandb_exp_name=... on the command line)")
