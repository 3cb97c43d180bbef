"""The shell entry points: --help, bad arguments exit 2, a missing environment prints the fix."""

import pytest

from tests.helpers import ROOT, run

LAUNCHERS = [
    ["bash", "pipeline_training_launch.sh", "configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft"],
    ["bash", "pipeline_checkpoint_convert.sh", "export", "/tmp/x", "--hf-model", "a/b", "--no-reasoning"],
    ["bash", "pipeline_env_exec.sh", "true"],
]


@pytest.mark.parametrize("cmd", LAUNCHERS)
def test_missing_environment_prints_fix(cmd, tmp_path, pipeline_env):
    env = {**pipeline_env, "PIPELINE_VENV": str(tmp_path / "no-venv")}
    res = run(cmd, env=env)
    assert res.returncode != 0
    assert f"create it with: bash {ROOT}/pipeline_env_setup.sh" in res.stderr


@pytest.mark.parametrize("script", ["pipeline_env_setup.sh", "pipeline_training_launch.sh", "pipeline_env_exec.sh",
                                    "pipeline_quickstart.sh", "pipeline_env_submit.sbatch", "pipeline_data_submit.sbatch",
                                    "pipeline_training_submit.sbatch", "pipeline_checkpoint_submit.sbatch",
                                    "pipeline_coherence_submit.sbatch"])
def test_help(script):
    """--help prints the script's whole header comment (its usage) and nothing else, with no Slurm needed."""
    res = run(["bash", script, "--help"])
    assert res.returncode == 0 and "Usage" in res.stdout, res.stdout + res.stderr
    lines = (ROOT / script).read_text().splitlines()[1:]
    header = lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    last = next(line for line in reversed(header) if not line.startswith("#SBATCH") and line.strip("# "))
    assert res.stdout.rstrip().endswith(last.lstrip("#").strip()), res.stdout[-300:]
    assert "set -euo" not in res.stdout and "#SBATCH" not in res.stdout


@pytest.mark.parametrize("cmd,needle", [
    (["bash", "pipeline_env_setup.sh", "--only", "nope"], "unknown step 'nope'"),
    (["bash", "pipeline_env_setup.sh", "--bogus"], "unknown argument '--bogus'"),
    (["bash", "pipeline_quickstart.sh", "--bogus"], "unknown argument"),
])
def test_bad_arguments_exit_2(cmd, needle):
    res = run(cmd)
    assert res.returncode == 2 and needle in res.stderr


def test_validate_lists_named_checks():
    res = run([str(ROOT / ".venv/bin/python"), "-m", "pipeline.env.validate", "--list"],
              env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0
    assert "package-pins" in res.stdout and "gpu-visible" in res.stdout


@pytest.mark.parametrize("args,needle", [
    (["export", "/nonexistent", "--hf-model", "a/b", "--no-reasoning"], "checkpoint directory /nonexistent does not exist"),
    (["export", "/tmp", "--no-reasoning"], "the following arguments are required: --hf-model"),
    (["export", "/tmp", "--hf-model", "a/b"], "one of the arguments --reasoning --no-reasoning is required"),
    (["upload-all", "/tmp", "--hf-model", "a/b", "--no-reasoning"], "holds no iter_NNNNNNN checkpoints"),
    (["upload-all", "/tmp", "--hf-model", "a/b", "--no-reasoning", "--poll", "--interval", "-5"],
     "--interval: -5 must be a number of seconds, a finite number from 0.001"),
    (["upload-all", "/tmp", "--hf-model", "a/b", "--no-reasoning", "--poll", "--idle-timeout", "nan"],
     "--idle-timeout: nan must be a number of seconds, a finite number from 0.001"),
])
def test_convert_bad_input(args, needle, pipeline_env):
    res = run(["bash", "pipeline_checkpoint_convert.sh", *args], env=pipeline_env)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and res.stderr.count("\n") == 1


def _pins(path):
    return {line.split("==")[0].lower(): line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def test_the_planner_pins_are_the_venv_pins():
    """The login node's planner plans with the same libraries (and versions) as the venv that CI tests."""
    planner, local = _pins(ROOT / "requirements" / "planner.txt"), _pins(ROOT / "requirements" / "local.txt")
    assert {"hydra-core", "omegaconf", "pyyaml", "numpy"} <= set(planner) and "torch" not in planner
    assert {k: v for k, v in planner.items() if local.get(k) != v} == {}


def test_validate_run_training_adds_the_bridge_and_smoke_checks_and_skips_bridge_off_the_cluster():
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "PIPELINE_RUNTIME": "venv"}
    py = str(ROOT / ".venv/bin/python")
    plain = run([py, "-m", "pipeline.env.validate", "--list"], env=env).stdout.splitlines()
    more = run([py, "-m", "pipeline.env.validate", "--list", "--run-training"], env=env).stdout.splitlines()
    assert more[:-3] == plain and [ln.split() for ln in more[-3:]] == [[str(len(plain) + 1), "gpu-packages"],
                                                                       [str(len(plain) + 2), "bridge-training"],
                                                                       [str(len(plain) + 3), "gpu-smoke-plan"]]
    res = run([py, "-m", "pipeline.env.validate", "--run-training", "--only", "bridge-training"], env=env)
    assert res.returncode == 0 and "[ 1/1] SKIP bridge-training: venv runtime" in res.stdout, res.stdout
    assert "validate: 0 passed, 0 failed, 1 skipped" in res.stdout


def test_the_gpu_ready_check_refuses_in_one_line_without_a_gpu(tmp_path):
    """tests/gpu/device_check.sh on a machine without CUDA: one line, exit 2, nothing installed or written; its
    --help is the usage. (The checks themselves need a GPU: docs/benchmarks.md says where they ran.)"""
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(ROOT / ".venv/bin/python"), "CUDA_VISIBLE_DEVICES": "",
           "TMPDIR": str(tmp_path)}
    res = run(["bash", "tests/gpu/device_check.sh", "--work", str(tmp_path / "work")], env=env)
    out = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode == 2 and len(out) == 1, res.stdout + res.stderr
    assert out[0].startswith("device_check: refused: no CUDA GPU visible (torch "), out
    assert list(tmp_path.iterdir()) == []
    res = run(["bash", "tests/gpu/device_check.sh", "--bogus"], env=env)
    assert res.returncode == 2 and res.stdout.strip().splitlines() == [
        "device_check: refused: unknown argument --bogus (--help)"]
    res = run(["bash", "tests/gpu/device_check.sh", "--help"], env=env)
    assert res.returncode == 0 and res.stdout.startswith("usage: bash tests/gpu/device_check.sh"), res.stdout
    assert all(name in res.stdout for name in ("bridge-train-resume", "export-verify", "megatron-generate"))


def test_the_device_check_module_refuses_without_a_gpu_and_names_its_checks():
    """validate --run-training and the script share pipeline.env.device_check: its own refusal, its check list."""
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    py = str(ROOT / ".venv/bin/python")
    res = run([py, "-m", "pipeline.env.device_check"], env=env)
    assert res.returncode == 2 and res.stdout.startswith("device_check: refused: no CUDA GPU visible"), res.stdout
    res = run([py, "-m", "pipeline.env.device_check", "--help"], env=env)
    assert res.returncode == 0 and "bridge-train-resume" in res.stdout and "megatron-generate" in res.stdout
