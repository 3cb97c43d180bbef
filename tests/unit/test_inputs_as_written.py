"""Inputs read as the user wrote them (issue 34): YAML 1.2 values, duplicate keys and alias bombs refused, ``???``
refused, experiment strings reaching Hydra as strings, sbatch options read as sbatch reads them, every GPU option
compared with the plan, prompt files validated, numeric options range-checked."""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml

from pipeline.common import yamlio
from pipeline.common.errors import UserError
from pipeline.config.loader import load_config, read_yaml


# ---- YAML 1.2 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("1:20", "1:20"), ("2_0", "2_0"), ("010", 10), ("0o10", 8), ("0x1F", 31), ("1e-3", 1e-3), ("yes", "yes"),
    ("on", "on"), ("2024-01-01", "2024-01-01"), (".inf", float("inf")), ("-0", 0), ("'12'", "12"), ("~", None),
    ("True", True), ("1_000.5", "1_000.5"), ("0b11", "0b11"),
])
def test_values_are_yaml_1_2(text, want):
    """PyYAML's YAML 1.1 read ``train_iters: 1:20`` as 80 and ``2_0`` as 20."""
    assert yamlio.load(f"v: {text}\n") == {"v": want}


def test_a_config_value_in_base_60_is_not_a_number(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  train_iters: 1:20\n")
    assert read_yaml(p) == {"train": {"train_iters": "1:20"}}
    assert load_config(p).problems == ["train.train_iters='1:20' must be an integer"]  # never 80


def test_a_duplicate_key_is_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  train_iters: 10\n  micro_batch_size: 1\n  train_iters: 20\n")
    with pytest.raises(UserError) as e:
        read_yaml(p)
    assert str(e.value) == f"{p}: invalid YAML: duplicate key 'train_iters' (line 2 and line 4): write each key once"


def test_merge_keys_still_merge():
    assert yamlio.load("b: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\n")["c"] == {"x": 1, "y": 3}


def bomb(levels: int = 9) -> str:
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    prev = "a"
    for c in "bcdefghijk"[:levels - 1]:
        text += f"{c}: &{c} [" + ",".join([f"*{prev}"] * 9) + "]\n"
        prev = c
    return text


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    """A billion-laughs config ran past 60 s (an experiment file: a MemoryError traceback)."""
    p = tmp_path / "c.yaml"
    p.write_text(bomb())
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"invalid YAML: anchors and aliases expand to more than 100000 values"):
        read_yaml(p)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("text, problem", [
    ("a: &x [*x]\n", "recursive anchor"),
    ("[" * 1200 + "]" * 1200, "nests too deeply"),
])
def test_recursive_and_deep_documents_are_yaml_errors(text, problem):
    with pytest.raises(yaml.YAMLError, match=problem):
        yamlio.load(text)


def test_a_required_value_never_filled_is_refused(tmp_path):
    """``wandb_exp_name: ???`` named the run directory ``runs/???``."""
    p = tmp_path / "c.yaml"
    p.write_text("logger:\n  wandb_exp_name: ???\n")
    with pytest.raises(UserError) as e:
        load_config(p)
    assert str(e.value) == ("the config: logger.wandb_exp_name is '???', a required value that was never filled; "
                            "give it a value (in the file, or logger.wandb_exp_name=... on the command line)")
    assert load_config(p, ["logger.wandb_exp_name=x"]).logger.wandb_exp_name == "x"


# ---- experiment files ----------------------------------------------------------------------------------------
EXP = """
base:
  config: configs/local/tiny_moe_sft.yaml
  model: tiny-qwen3-moe
  mode: sft
  overrides: {train.train_iters: 8}
"""


def load_exp(tmp_path, body: str):
    from pipeline.experiment import spec
    from tests.helpers import ROOT

    p = tmp_path / "exp.yaml"
    p.write_text(EXP + body)
    return spec.load(p, root=ROOT)


@pytest.mark.parametrize("value", ["1e3", "1_000", "inf", "nan", "-0", "1.5", "true", "null", "a\\b", "a\\",
                                   "it's", "-inf", "+1", "", "x,y"])
def test_experiment_strings_reach_the_job_as_strings(tmp_path, value):
    """A quoted ``"1e3"`` reached the job as 1000.0, ``"1_000"`` as 1000, ``"inf"``/``"nan"``/``"-0"`` likewise."""
    from pipeline.experiment.spec import render_override
    from tests.helpers import ROOT

    exp = load_exp(tmp_path, f"grid:\n  logger.wandb_project: [{json.dumps(value)}, other]\n")
    assert exp.runs[0].overrides["logger.wandb_project"] == value
    line = render_override("logger.wandb_project", value)
    assert load_config(ROOT / "configs/local/tiny_moe_sft.yaml", [line]).logger.wandb_project == value


def test_numbers_in_experiments_stay_numbers(tmp_path):
    from pipeline.config.loader import parse_overrides
    from pipeline.experiment.spec import render_override

    for v in (1000.0, 1000, float("inf"), -0.0, [1, "1e3"]):
        assert parse_overrides([render_override("k", v)])[0].value() == v


def test_an_experiment_alias_bomb_is_one_line(tmp_path):
    """An alias bomb in an experiment file was a MemoryError traceback after more than 60 s."""
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"exp.yaml is not valid YAML: anchors and aliases expand to more than"):
        load_exp(tmp_path, bomb().replace("a: &a", "x: &a"))
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("body, where", [
    ("grid:\n  logger.wandb_project:\n    - b\n    - ???\n", "grid: logger.wandb_project[1]"),
    ("zip:\n  rng.seed: [1, '???']\n", "zip: rng.seed[1]"),
    ("computed:\n  train.train_iters: ???\n", "computed: train.train_iters"),
])
def test_an_experiment_value_never_filled_is_refused(tmp_path, body, where):
    with pytest.raises(UserError) as e:
        load_exp(tmp_path, body)
    assert str(e.value).endswith(f"exp.yaml: {where} is '???', a required value that was never filled; give it a "
                                 f"value (in the file, or {where.split(': ')[1].split('[')[0]}=... on the command "
                                 "line)")


def test_a_duplicate_key_in_an_experiment_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"is not valid YAML \(line 9\): duplicate key 'train.train_iters' "
                                        r"\(line 8 and line 9\)"):
        load_exp(tmp_path, "computed:\n  train.train_iters: 4\n  train.train_iters: 5\n")


# ---- sbatch options as sbatch reads them ---------------------------------------------------------------------
NANO_JOB = ["pipeline_training_submit.sbatch", "configs/quickstart/nemotron_nano_quickstart_sft.yaml", "nano", "sft",
            "--disable-ft", "--no-path-checks"]


@pytest.fixture
def submit(tmp_path, monkeypatch):
    """isambard_sbatch's planning of a submission (sinfo is not asked: no Slurm in the unit tier)."""
    from pipeline.cli import sbatch as sbatch_cli

    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.setenv("PIPELINE_BINDS", str(tmp_path))
    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    for k in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NODEID",
              "SLURM_GPUS_ON_NODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    return lambda argv: sbatch_cli.build_submission(argv)[0]


def test_a_repeated_option_is_the_last_one():
    from pipeline.slurm.sbatch_options import option_value, split_sbatch_args

    opts = split_sbatch_args(["--nodes=1", "-N", "3", "--nodes=2", "--job-name", "a", "-J", "b", "--output=x.out",
                              "-o", "y.out", "--gpus-per-node=1", "--gpus-per-node=4", "job.sbatch"])[0]
    assert option_value(opts, "--nodes", "-N") == "2"
    assert option_value(opts, "--job-name", "-J") == "b"
    assert option_value(opts, "--output", "-o") == "y.out"
    assert option_value(opts, "--gpus-per-node") == "4"


def test_the_log_path_is_the_last_output_and_job_name(tmp_path):
    from pipeline.cli.sbatch import log_path

    opts = ["--output=first-%x.out", "--job-name=one", "--output=second-%x.out", "--job-name=two"]
    assert log_path(opts, None, "7", None).name == "second-two.out"


def test_the_header_s_last_directive_wins(tmp_path):
    from pipeline.slurm.sbatch_options import directive_value

    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --nodes=3\necho\n")
    assert directive_value(str(script), "--nodes", "-N") == "3"


def test_a_repeated_nodes_plans_the_count_sbatch_allocates(submit):
    """``--nodes=1 --nodes=2`` was planned for 1 node and allocated 2."""
    assert "--nodes=16" in submit(["--nodes=1", "--nodes=16", *NANO_JOB, "--nodes", "16"])
    with pytest.raises(UserError, match=r"the launcher's --nodes 16 and sbatch's --nodes=1 disagree"):
        submit(["--nodes=16", "--nodes=1", *NANO_JOB, "--nodes", "16"])


@pytest.mark.parametrize("gpus, written", [
    (["--gpus-per-node=2"], "--gpus-per-node=2 gives 2"), (["--gres=gpu:1"], "--gres=gpu:1 gives 1"),
    (["--gpus=1"], "--gpus=1 gives 1"), (["-G", "1"], "--gpus=1 gives 1"), (["--gres=gpu:h100:8"], "gives 8"),
    (["--gpus-per-node=4", "--gpus-per-node=2"], "--gpus-per-node=2 gives 2"),
])
def test_every_gpu_option_of_a_training_submission_is_compared_with_the_plan(submit, gpus, written):
    """``--gpus-per-node=2`` planned for 4 GPUs per node and passed; ``--gres``/``--gpus``/``-G`` were never read."""
    with pytest.raises(UserError) as e:
        submit(["--nodes=1", *gpus, *NANO_JOB])
    assert written in str(e.value)
    assert str(e.value).endswith("the training plan (cluster profile isambard_gh200) is for 4: submit with "
                                 "--gpus-per-node=4 (or none: isambard_sbatch adds the profile's); nothing was "
                                 "submitted")


def test_gpu_options_that_match_the_plan_pass_and_other_gres_keep_the_profile_s(submit):
    cmd = submit(["--nodes=16", "--gres=gpu:4", *NANO_JOB])
    assert cmd.count("--gres=gpu:4") == 1 and not any(c.startswith("--gpus-per-node") for c in cmd)
    cmd = submit(["--nodes=16", "--gres=nvme:1", *NANO_JOB])
    assert "--gpus-per-node=4" in cmd and "--gres=nvme:1" in cmd  # a --gres of other things asks for no GPU


@pytest.mark.parametrize("opts, line", [
    (["--nodes=2", "--gpus=8"], "--gpus=8 is a total over the job's 2 nodes, which Slurm may place unevenly"),
    (["--gpus-per-node=4", "--gres=gpu:4"], "--gpus-per-node=4 and --gres=gpu:4: GPUs asked for in two ways"),
    (["--gpus-per-task=1"], "--gpus-per-task=1: GPUs per task or socket do not say how many GPUs each node gets"),
    (["--gres=gpu:h100:x"], "--gres='gpu:h100:x': the GPU count 'x' is not a number"),
    (["--tres-per-node=gres/gpu:2"], "--tres-per-node=gres/gpu:2: the plan does not read GPUs asked for as a "
                                     "trackable resource; use --gpus-per-node=N"),  # hostile pass: passed unread
])
def test_gpu_options_the_plan_cannot_count_are_refused(submit, opts, line):
    pattern = re.escape(line)
    if opts[0].startswith("--tres-per-node"):
        # a Slurm whose sbatch --help does not list --tres-per-node (Debian's 22.05, the test tiers' local Slurm)
        # refuses it earlier, as an option it does not know: refused either way, never passed through unread
        pattern += "|" + re.escape(f"unknown sbatch option '{opts[0]}' (not in this Slurm's sbatch --help)")
    with pytest.raises(UserError, match=pattern):
        submit([*opts, *NANO_JOB])


def test_a_gpu_job_reads_every_gpu_option(submit, tmp_path):
    """A coherence job's ``--gres=gpu:1`` (Super needs the node's four GPUs) was not compared with its plan."""
    from pipeline.config.models import get_model

    super_ = get_model("super").hf_id
    with pytest.raises(UserError, match=r"uses 4 GPU\(s\) per node, and --gres=gpu:1 gives 1: submit with "
                                        r"--gpus-per-node=4"):
        submit(["--gres=gpu:1", "pipeline_coherence_submit.sbatch", super_])


@pytest.mark.parametrize("nodes, line", [
    ("2-4", "--nodes=2-4: a range lets Slurm choose the node count when the job starts, and the job is planned for "
            "one count; give it: --nodes=2 (or --nodes=4)"),
    ("0", "--nodes='0' is not a node count (a positive integer)"),
    ("2,4", "--nodes='2,4' is not a node count (a positive integer)"),
])
def test_a_node_range_is_refused(submit, nodes, line):
    """``--nodes=2-4`` was planned for 2 nodes, and Slurm could allocate 4."""
    with pytest.raises(UserError) as e:
        submit([f"--nodes={nodes}", *NANO_JOB])
    assert str(e.value) == line


def test_a_range_of_one_count_is_that_count(submit):
    assert "--nodes=16-16" in submit(["--nodes=16-16", *NANO_JOB, "--nodes", "16"])


@pytest.mark.parametrize("opt, name", [
    (["--chdir=/tmp"], "--chdir=/tmp"), (["-D", "/tmp"], "--chdir=/tmp"), (["--array=0-3"], "--array=0-3"),
    (["-a", "1,2"], "--array=1,2"),
])
@pytest.mark.parametrize("job", [NANO_JOB, ["pipeline_data_submit.sbatch", "prepare", "--help"]])
def test_chdir_and_array_are_refused_for_pipeline_jobs(submit, opt, name, job):
    """``--chdir`` made the job fail with no log; ``--array`` started several trainings of one run directory."""
    with pytest.raises(UserError, match=rf"^{re.escape(name)} is not supported for {job[0]}: "):
        submit([*opt, *job])


# ---- coherence prompt files ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, body, line", [
    ("p.json", '{"prompts": ["a", "b"]}', "must be a JSON list of prompts (strings, or objects with a string "
                                          "'prompt') (the list itself, not an object holding it); got a JSON dict"),
    ("p.json", '"hello"', "must be a JSON list of prompts (strings, or objects with a string 'prompt'); got a JSON "
                          "str"),
    ("p.json", "42", "got a JSON int"),
    ("p.json", "null", "got a JSON NoneType"),
    ("p.json", "[1, 2]", "item 0: a prompt must be a string (got int)"),
    ("p.json", '["ok", null]', "item 1: a prompt must be a string (got NoneType)"),
    ("p.json", '[{"text": "x"}]', "item 0: an object without a 'prompt' key (keys: text)"),
    ("p.json", '[{"prompt": 5}]', "item 0: a prompt must be a string (got int)"),
    ("p.json", '[["a"]]', "item 0: a prompt must be a string (got list)"),
    ("p.json", '["  "]', "item 0: the prompt is empty"),
    ("p.json", "[", "is not valid JSON: Expecting value: line 1 column 2 (char 1)"),
    ("p.json", "[]", "has no prompts"),
    ("p.jsonl", '{"prompt": "a"}\n[1]\n', "line 2: a prompt must be a string (got list)"),
    ("p.jsonl", '{"prompt": "a"}\n{bad\n', "line 2: not valid JSON"),
    ("p.jsonl", '{"q": "a"}\n', "line 1: an object without a 'prompt' key (keys: q)"),
])
def test_a_prompt_file_of_another_shape_is_one_line(tmp_path, name, body, line):
    """``{"prompts": [...]}`` ran the single prompt "prompts", a JSON string one prompt per character (exit 0), and
    seven other shapes crashed."""
    from pipeline.coherence.prompts import load_prompts

    p = tmp_path / name
    p.write_text(body)
    with pytest.raises(UserError) as e:
        load_prompts(p)
    assert str(e.value).startswith(f"prompt file {p}") and line in str(e.value) and "\n" not in str(e.value)


def test_prompt_files_of_the_documented_shapes_load(tmp_path):
    from pipeline.coherence.prompts import load_prompts

    (tmp_path / "a.json").write_text('["one", {"prompt": "two"}]')
    (tmp_path / "b.jsonl").write_text('{"prompt": "one"}\n\n"two"\n')
    (tmp_path / "c.txt").write_text("one\n\n two \n")
    for f in ("a.json", "b.jsonl", "c.txt"):
        assert load_prompts(tmp_path / f) == ["one", "two"]
    (tmp_path / "d.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(UserError, match=r"is not UTF-8 text$"):
        load_prompts(tmp_path / "d.txt")


def test_the_coherence_plan_checks_the_prompt_file(tmp_path):
    """isambard_sbatch plans the job: a bad prompt file is refused before the queue wait, not in the job."""
    from pipeline.cli.coherence import plan_from_argv

    p = tmp_path / "p.json"
    p.write_text('{"prompts": ["a"]}')
    with pytest.raises(UserError, match="the list itself, not an object holding it"):
        plan_from_argv(["some/model", "--prompts", str(p)])


@pytest.mark.parametrize("flag, value", [("--timeout", "1e308"), ("--timeout", "nan"), ("--deadline", "inf"),
                                         ("--max-tokens", str(1 << 40))])
def test_coherence_numbers_are_bounded(flag, value):
    """``--timeout 1e308`` was a traceback (the socket's timeout overflowed)."""
    from pipeline.cli.coherence import plan_from_argv

    with pytest.raises(UserError, match=rf"^{flag} must be "):
        plan_from_argv(["m", "--backend", "endpoint", "--endpoint-url", "http://127.0.0.1:1", flag, value])


# ---- numbers in range ------------------------------------------------------------------------------------------
TINY = "configs/local/tiny_moe_sft.yaml"


@pytest.mark.parametrize("override, problem", [
    ("train.global_batch_size=4611686018427387904",
     "train.global_batch_size=4611686018427387904 is out of range [1, 16777216]"),
    ("train.micro_batch_size=0", "train.micro_batch_size=0 is out of range [1, 16777216]"),
    ("pipeline.cluster=''", "pipeline.cluster='' is empty: name one (or leave it unset)"),
    ("rng.seed=-1", "rng.seed=-1 is out of range [0, 4294967295]"),
    ("dataset.seed=4294967296", "dataset.seed=4294967296 is out of range [0, 4294967295]"),
])
def test_config_numbers_out_of_range_are_problems(override, problem):
    """``train.global_batch_size=2**62`` and ``pipeline.cluster=""`` passed; ``rng.seed=-1`` passed the preflight and
    failed in every restart."""
    from tests.helpers import ROOT

    assert load_config(ROOT / TINY, [override]).problems == [problem]


@pytest.mark.parametrize("env, problem", [
    ({"A=B": "x"}, "env_vars: 'A=B' is not a variable name (letters, digits and _, not starting with a digit; no '=' "
                   "or NUL)"),
    ({"A\0B": "x"}, "is not a variable name"),
    ({"1A": "x"}, "is not a variable name"),
    ({"A": "x\0y"}, "env_vars.A: the value holds a NUL byte, which no environment variable can carry"),
    ({"A": "x" * (128 * 1024)}, "env_vars.A: the value is 131072 bytes; one variable (NAME=value) must stay under "
                                "131072 bytes (Linux's MAX_ARG_STRLEN), or no rank can start"),
])
def test_env_vars_no_process_can_carry_are_problems(tmp_path, env, problem):
    """``env_vars`` names with ``=`` or NUL and values over 128 KiB passed the preflight and failed every restart."""
    p = tmp_path / "c.yaml"
    p.write_text(json.dumps({"env_vars": env}))  # JSON is YAML; it writes NUL as \u0000
    problems = load_config(p).problems
    assert len(problems) == 1 and problem in problems[0], problems


def test_env_vars_a_process_can_carry_pass(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(json.dumps({"env_vars": {"NCCL_DEBUG": "INFO", "_X1": 3, "BIG": "x" * 100_000}}))
    assert load_config(p).problems == []


@pytest.mark.parametrize("flag, value", [("--atol", "nan"), ("--kl-tol", "nan"), ("--atol", "inf"),
                                         ("--atol", "-1"), ("--top1-min", "1.5"), ("--kl-tol", "1e308")])
def test_verification_tolerances_are_finite_and_in_range(tmp_path, flag, value):
    """``--atol nan`` / ``--kl-tol nan`` made those checks unable to fail."""
    from pipeline.cli.checkpoint import plan_from_argv

    with pytest.raises(UserError, match=rf"argument {flag}: {re.escape(value)} must be a"):
        plan_from_argv(["export", str(tmp_path), "--hf-model", "m", "--no-reasoning", flag, value])


@pytest.mark.parametrize("flag, value", [("--interval", "nan"), ("--interval", "1e308"), ("--idle-timeout", "-5")])
def test_upload_all_seconds_are_checked_by_the_plan(tmp_path, flag, value):
    from pipeline.cli.checkpoint import plan_from_argv

    with pytest.raises(UserError, match=rf"argument {flag}: {re.escape(value)} must be a number of seconds"):
        plan_from_argv(["upload-all", str(tmp_path), "--hf-model", "m", "--no-reasoning", flag, value])


def test_strings_written_for_megatron_bridge_stay_strings():
    """Bridge reads its overrides with OmegaConf, which reads an unquoted ``1e3`` as 1000.0: PyYAML's dumper quoted
    only what YAML 1.1 resolves, so a string ``"1e3"`` reached the job as a float."""
    from omegaconf import OmegaConf

    from pipeline.bridge import bridge_overrides_yaml
    from tests.helpers import ROOT

    values = {"1e3", "1_000", "-0", "1:20", "yes", ".5", "0o7", "true", "null", ".inf"}
    data = {f"k{i}": v for i, v in enumerate(sorted(values))}
    text = yamlio.dump(data)
    assert OmegaConf.to_container(OmegaConf.create(text)) == data == yaml.safe_load(text) == yamlio.load(text)
    cfg = load_config(ROOT / TINY, ["logger.wandb_project='1e3'"])
    assert OmegaConf.create(bridge_overrides_yaml(cfg)).logger.wandb_project == "1e3"
