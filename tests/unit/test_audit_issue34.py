"""Issue 34's findings that the first round left open, found by the audit (each test failed before its fix):
``--compare`` models sized, the megatron plan reading the checkpoint, an export without tokenizer files or with a
chat template that raises, lone surrogates in prompt files and endpoint replies."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from pipeline.cli.coherence import plan_from_argv as coherence_plan
from pipeline.common.errors import UserError
from pipeline.config.models import get_model
from tests.helpers import megatron_checkpoint
from tests.unit.test_export_fidelity import _save_iteration

NANO, SUPER = get_model("nano").hf_id, get_model("super").hf_id
SMOL = get_model("smollm2-135m").hf_id


@pytest.fixture(autouse=True)
def isambard(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    monkeypatch.setenv("PIPELINE_BINDS", str(tmp_path))
    for k in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NODEID"):
        monkeypatch.delenv(k, raising=False)


# ---- coherence: a --compare model is sized like the model ----------------------------------------------------
def test_a_compare_model_is_sized_too():
    """``SMOL --compare SUPER`` was planned on one GPU at 5 GB: the Super it then loads needs the node's four."""
    alone = coherence_plan([SUPER, "--no-wandb"])
    both = coherence_plan([SMOL, "--compare", SUPER, "--no-wandb"])
    assert both.gpus_needed == alone.gpus_needed == 4 and both.memory_per_gpu_gb == alone.memory_per_gpu_gb
    assert any(n.startswith(f"{SUPER}: 120.0B parameters") for n in both.notes), both.notes
    with pytest.raises(UserError, match=r"uses 4 GPU\(s\) per node, and --gpus-per-node=1 gives 1"):
        from pipeline.cli import sbatch as sbatch_cli

        sbatch_cli.build_submission(["--gpus-per-node=1", "pipeline_coherence_submit.sbatch", SMOL, "--compare",
                                     SUPER])


# ---- coherence: the megatron plan reads the checkpoint ---------------------------------------------------------
@pytest.mark.parametrize("what, extra, line", [
    ("missing", [], "checkpoint directory {ck} does not exist"),
    ("empty", [], "no complete checkpoint in {ck}"),
    ("complete", ["--iteration", "20"], "iteration 20 does not exist in {ck}; complete iterations: 10"),
])
def test_the_megatron_plan_refuses_a_checkpoint_it_cannot_read(tmp_path, what, extra, line):
    """A missing directory or iteration planned OK and was submitted; every rank then failed."""
    ck = tmp_path / "ck"
    if what == "empty":
        ck.mkdir()
    elif what == "complete":
        megatron_checkpoint(ck)
    argv = [str(ck), "--backend", "megatron", "--hf-model", NANO, "--no-wandb", *extra]
    plan = coherence_plan(argv)
    assert not plan.ok and line.format(ck=ck) in plan.problems[0], plan.problems
    later = coherence_plan(argv, inputs_later=True)  # a job after an import reads it when it starts
    assert later.ok, later.problems


def test_the_megatron_plan_passes_a_complete_checkpoint(tmp_path):
    plan = coherence_plan([str(megatron_checkpoint(tmp_path / "ck")), "--backend", "megatron", "--hf-model", NANO,
                           "--no-wandb"])
    assert plan.ok, plan.problems


# ---- export: no tokenizer files, a chat template that raises ----------------------------------------------------
@pytest.fixture
def iteration(tmp_path, tokenizer):
    return _save_iteration(tmp_path / "save", tokenizer, tied=False)


def test_an_export_without_tokenizer_files_fails_verification_in_one_line(iteration):
    """The verification loaded an empty tokenizer and died in an IndexError (a traceback)."""
    from pipeline.checkpoint.export import ExportRequest, export_iteration
    from pipeline.checkpoint.verify import FAILED, VerificationFailed

    for f in iteration.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("chat_template.jinja", "vocab.json",
                                                                           "merges.txt"):
            f.unlink()
    with pytest.raises(VerificationFailed, match=r"^tokenizer: the export has no tokenizer files"):
        export_iteration(iteration, ExportRequest(hf_model="test/llama", reasoning=False))
    assert json.loads((iteration / FAILED).read_text())["decided_on"] == "tokenizer"
    assert not (iteration / "hf").exists()


RAISING = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('System turn required') }}{% endif %}"
           "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_an_export_whose_chat_template_raises_says_so_and_coherence_is_one_line(iteration, tmp_path):
    """It verified PASS, then coherence crashed in a jinja2 TemplateError."""
    from pipeline.checkpoint.export import ExportRequest, export_iteration
    from pipeline.checkpoint.verify import VerificationFailed
    from pipeline.coherence.backends import hf_generate

    config = iteration / "tokenizer_config.json"
    cfg = json.loads(config.read_text())
    cfg.pop("chat_template", None)
    config.write_text(json.dumps(cfg))
    (iteration / "chat_template.jinja").write_text(RAISING)
    strict = tmp_path / "strict" / iteration.name
    shutil.copytree(iteration, strict)
    rec = export_iteration(iteration, ExportRequest(hf_model="test/llama", reasoning=False))
    warning = ("the chat template refuses a conversation of one user turn (TemplateError: System turn required): "
               "coherence and chat serving will refuse it too")
    assert rec["verdict"] == "PASS" and warning in rec["quality"]["warnings"]
    with pytest.raises(VerificationFailed, match=re.escape(warning)):  # fatal with --require-quality
        export_iteration(strict, ExportRequest(hf_model="test/llama", reasoning=False, require_quality=True))
    with pytest.raises(UserError) as e:
        hf_generate(str(iteration / "hf"), ["Hello"], 4, False)
    assert str(e.value) == (f"the chat template of {iteration / 'hf'} refuses the coherence prompts (one user turn): "
                            "TemplateError: System turn required")


# ---- lone surrogates -------------------------------------------------------------------------------------------
def test_a_prompt_with_a_lone_surrogate_is_one_line(tmp_path):
    """``["\\ud800"]`` loaded, and the report could not be written (UnicodeEncodeError after the generation)."""
    from pipeline.coherence.prompts import load_prompts

    f = tmp_path / "p.json"
    f.write_text('["fine", "half \\ud800 a pair"]')
    with pytest.raises(UserError, match=r"item 1: the prompt is not valid Unicode \(a lone surrogate"):
        load_prompts(f)



def test_a_lone_surrogate_escape_in_a_config_is_a_yaml_error(tmp_path):
    """``wandb_exp_name: "\\ud800"`` was a UnicodeEncodeError traceback when the run directory was named (hostile
    pass); every value and key of a config or experiment file is text."""
    from pipeline.config.loader import read_yaml

    f = tmp_path / "c.yaml"
    f.write_text('logger:\n  wandb_exp_name: "\\ud800"\n')
    with pytest.raises(UserError, match=r"invalid YAML: the value on line 2 holds a lone surrogate escape"):
        read_yaml(f)
    f.write_text('logger:\n  wandb_exp_name: "caf\\u00e9 \\U0001F600"\n')  # escapes of real characters still read
    assert read_yaml(f)["logger"]["wandb_exp_name"] == "café \U0001F600"


# ---- experiment files: sbatch options the planner does not model -------------------------------------------------
@pytest.mark.parametrize("opts, line", [
    ("[--nodes=2]", "base.sbatch: '--nodes=2': --nodes is not an experiment's sbatch option: the runs are planned for "
                    "base.nodes: set the node count there"),
    ("[-N, '2']", "base.sbatch: '-N': --nodes is not"),
    ("[--array=0-3]", "base.sbatch: '--array=0-3': --array is not"),
    ("[-D, /tmp]", "base.sbatch: '-D': --chdir is not"),
    ("['--dependency=afterok:1']", "base.sbatch: '--dependency=afterok:1': --dependency is not"),
])
def test_an_experiment_s_sbatch_options_the_planner_does_not_model_are_refused(tmp_path, opts, line):
    """``base.sbatch: [--nodes=2]`` was planned for base.nodes (1) and allocated 2 (hostile pass); --array and
    --chdir were refused only by isambard_sbatch at submit time."""
    from pipeline.experiment.spec import load as load_experiment

    f = tmp_path / "x.yaml"
    f.write_text("name: hx\nbase:\n  config: configs/local/tiny_moe_sft.yaml\n  model: tiny-qwen3-moe\n  mode: sft\n"
                 f"  sbatch: {opts}\n")
    with pytest.raises(UserError, match=re.escape(line)):
        load_experiment(f)


def test_an_experiment_file_that_is_not_utf8_is_one_line(tmp_path):
    """It was a UnicodeDecodeError traceback (hostile pass); a config file of the same bytes was already one line."""
    from pipeline.experiment.spec import load as load_experiment

    f = tmp_path / "x.yaml"
    f.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(UserError, match=r"x.yaml: not a text file \(invalid UTF-8\)"):
        load_experiment(f)
    big = tmp_path / "big.yaml"
    big.write_text("name: a\nbase:\n  nodes: " + "9" * 5000 + "\n")
    with pytest.raises(UserError, match=r"big.yaml: a value cannot be read"):
        load_experiment(big)


def test_a_fifo_as_the_config_is_not_said_to_be_missing(tmp_path):
    import os

    from pipeline.config.loader import read_yaml

    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match=r"is not a regular file \(a FIFO, device or socket\)$"):
        read_yaml(fifo)


@pytest.mark.parametrize("name", ["P.JSON", "p.Json"])
def test_a_json_prompt_file_is_json_whatever_the_suffix_s_case(tmp_path, name):
    """``P.JSON`` was read as text: its one line ``["a", "b"]`` ran as a single prompt (hostile pass)."""
    from pipeline.coherence.prompts import load_prompts

    f = tmp_path / name
    f.write_text('["a", "b"]')
    assert load_prompts(f) == ["a", "b"]
    (tmp_path / "q.JSONL").write_text('{"prompt": "c"}\n')
    assert load_prompts(tmp_path / "q.JSONL") == ["c"]


@pytest.mark.parametrize("name", ["nosuchmodel", "a b/c", "../x"])
def test_an_import_of_no_model_is_refused_by_its_plan(name):
    """``import nosuchmodel`` planned OK and failed in the job, after the allocation (hostile pass)."""
    from pipeline.checkpoint.plan import plan_import

    plan = plan_import(name)
    assert f"{name!r} is neither a registry model, a Hugging Face hub id (ORG/NAME) nor a local model folder" \
        in plan.problems
    assert not any("neither" in p for p in plan_import(SMOL).problems)


def test_upload_all_eval_of_no_tasks_is_refused_not_dropped(tmp_path, monkeypatch):
    """``upload-all --eval ''`` (an empty $TASKS) planned OK and evaluated nothing (hostile pass); the refusal names
    the option as upload-all's user typed it (--eval, not the evaluation's own --tasks: issue 50)."""
    from pipeline.cli.checkpoint import plan_from_argv as checkpoint_plan

    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")
    with pytest.raises(UserError, match=r"--eval '': give task names .*\(e\.g\. --eval pipeline_smoke\)"):
        checkpoint_plan(["upload-all", str(tmp_path), "--hf-model", SMOL, "--no-reasoning", "--poll", "--eval", ""])


# ---- record readers: every line a writer could not have written is skipped ----------------------------------------
BIG = "9" * 5000  # past Python's int-conversion limit: json.loads raises ValueError, not JSONDecodeError
DEEP = "[" * 100000


def test_records_with_a_5000_digit_int_or_deep_nesting_are_skipped(tmp_path):
    """``experiment status``/``csv`` were ValueError tracebacks on such a progress or events line, and a resumed
    run's ProgressLog.start too (hostile pass); a summary linked to /dev/zero was a MemoryError."""
    import os

    from pipeline.training.goodput import read_events
    from pipeline.training.records import ProgressLog, read_progress, read_summary

    good = '{"step": 1, "time": 0.5, "loss": 3.0, "tokens": 8}\n'
    (tmp_path / "progress.ndjson").write_text(good + f'{{"step": 2, "loss": {BIG}}}\n{DEEP}\n')
    (tmp_path / "events.ndjson").write_text('{"event": "attempt", "t": 101.0}\n'
                                            f'{{"event": "step", "t": {BIG}}}\n{DEEP}\n')
    assert [r["step"] for r in read_progress(tmp_path)] == [1]
    assert [r["event"] for r in read_events(tmp_path)] == ["attempt"]
    assert ProgressLog(tmp_path, 8, writer=True).start(1) == 2  # the junk lines dropped, the good one kept
    assert (tmp_path / "progress.ndjson").read_text() == good
    os.symlink("/dev/zero", tmp_path / "metrics_summary.json")
    assert read_summary(tmp_path) == {}


# ---- the training launcher: a run directory that is the current directory or a root ------------------------------
@pytest.mark.parametrize("argv, line", [
    (["--run-dir", ""], "argument --run-dir: an empty path is the current directory"),
    (["--run-dir", "/"], "argument --run-dir: '/' is a filesystem root"),
    (["--cluster", ""], "argument --cluster: an empty name"),
])
def test_a_launch_into_the_current_directory_or_the_default_profile_by_accident_is_refused(argv, line):
    """``--run-dir ""`` planned PASS with the checkout as the run directory (its checkpoints/ in the working
    directory); ``--cluster ""`` silently meant the default profile (hostile pass)."""
    from pipeline.cli.train import build_parser

    with pytest.raises(UserError, match=re.escape(line)):
        build_parser().parse_args(["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft",
                                   *argv])


@pytest.mark.parametrize("cli, argv, line", [
    ("coherence", ["m", "--output-dir", ""], "argument --output-dir: an empty path is the current directory"),
    ("checkpoint", ["upload-all", "", "--hf-model", "x", "--no-reasoning", "--poll"],
     "argument ckpt_dir: an empty path is the current directory"),
    ("evaluation", ["m", "--tasks", "pipeline_smoke", "--output-dir", ""],
     "argument --output-dir: an empty path is the current directory"),
    ("data", ["prepare", "--dataset", "d", "--seq-length", "64", "--cluster", ""], "argument --cluster: an empty name"),
])
def test_empty_paths_and_names_of_the_other_clis_are_refused(cli, argv, line, capsys):
    """``--output-dir ""`` wrote the report into the working directory, ``upload-all ""`` polled the checkout,
    ``prepare --cluster ""`` silently took the default profile (hostile pass): as --dataset-root "" before."""
    import importlib

    assert importlib.import_module(f"pipeline.cli.{cli}").main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
