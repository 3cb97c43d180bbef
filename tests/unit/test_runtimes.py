"""Runtimes behind one interface: rendered command lines (Apptainer cannot be installed here, so its command
lines are covered by rendering), and missing images hard-fail every launcher with the fixing command."""


import pytest

from pipeline.env.runtimes import RuntimeConfig, check, main, render
from tests.helpers import ROOT


def cfg(tmp_path, runtime, **env):
    base = {"PIPELINE_ROOT": str(ROOT), "PIPELINE_RUNTIME": runtime, "PIPELINE_VENV": str(ROOT / ".venv"),
            "PIPELINE_SIF": str(tmp_path / "nemo.sif"), "PIPELINE_OVERLAY": "/projects/x/overlay",
            "PIPELINE_NCCL_PLUGIN_DIR": "/projects/x/aws-ofi-nccl", "PIPELINE_CH_IMAGE": str(tmp_path / "img"),
            "PIPELINE_DATA_ROOT": "/projects/a5k/public/data", "HF_HOME": str(ROOT / ".cache/huggingface"),
            "PIPELINE_BINDS": "/projects/a5k/public,/scratch/u:/scratch", "NCCL_NET": "AWS Libfabric",
            "WANDB_MODE": "offline", "USER": "alice", "HOME": "/home/alice", "SECRET_TOKEN": "x", **env}
    return RuntimeConfig.from_env(base), base


def test_apptainer_command_line(tmp_path):
    c, env = cfg(tmp_path, "apptainer")
    argv = render(c, "python -c 'print(1)'", env)
    assert argv[:4] == ["apptainer", "exec", "--nv", "--cleanenv"]
    bind = argv[argv.index("--bind") + 1].split(",")
    assert f"{ROOT}:{ROOT}" in bind
    assert "/projects/x/overlay:/projects/x/overlay" in bind and "/projects/x/aws-ofi-nccl:/projects/x/aws-ofi-nccl" in bind
    assert "/projects/a5k/public:/projects/a5k/public" in bind and "/scratch/u:/scratch" in bind
    assert not any(b.startswith(str(ROOT / ".cache")) for b in bind)  # inside the bound checkout already
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
    assert "NCCL_NET=AWS Libfabric" in envs and "WANDB_MODE=offline" in envs
    assert f"PYTHONPATH={ROOT}/src:/projects/x/overlay" in envs and "PIPELINE_IN_CONTAINER=apptainer" in envs
    assert any(e.startswith("LD_LIBRARY_PATH=/projects/x/aws-ofi-nccl/lib:") for e in envs)
    assert not any(e.startswith("SECRET_TOKEN") for e in envs)  # --cleanenv + an explicit list
    assert argv[-4:] == [str(tmp_path / "nemo.sif"), "bash", "-c", "python -c 'print(1)'"]


def test_charliecloud_and_venv_command_lines(tmp_path):
    c, env = cfg(tmp_path, "charliecloud")
    argv = render(c, "true", env)
    assert argv[0] == "ch-run" and argv[-5:] == [str(tmp_path / "img"), "--", "bash", "-c", "true"]
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "-b"]
    assert f"{ROOT}:{ROOT}" in pairs
    assert "--set-env=PIPELINE_IN_CONTAINER=charliecloud" in argv and "--set-env=USER=alice" in argv
    v, env = cfg(tmp_path, "venv")
    assert render(v, "echo hi", env) == ["bash", "-c", "echo hi"]
    b, _ = cfg(tmp_path, "bogus")
    with pytest.raises(ValueError, match="unknown runtime"):
        render(b, "true")


def test_enter_checks_before_it_renders(tmp_path, monkeypatch, capsys):
    """`enter` is what a launcher runs before it execs: the problems and exit 1, or the NUL-separated argv."""
    _, env = cfg(tmp_path, "apptainer")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["enter", "--", "true"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "--only pull" in captured.err
    monkeypatch.setenv("PIPELINE_RUNTIME", "venv")
    monkeypatch.setenv("PIPELINE_VENV", str(tmp_path / "venv"))
    monkeypatch.setenv("PIPELINE_ENV_READY", str(tmp_path / "venv" / "ready"))
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    (tmp_path / "venv" / "ready").touch()
    assert main(["enter", "--", "echo hi"]) == 0
    assert capsys.readouterr().out == "bash\0-c\0echo hi\0"


def test_missing_pieces_name_the_fix(tmp_path):
    c, _ = cfg(tmp_path, "apptainer")
    problems = check(c)
    assert any("container image" in p and "--only pull" in p for p in problems)
    assert any("NCCL network plugin" in p and "--only nccl-plugin" in p for p in problems)
    assert any("Python overlay" in p and "--only overlay" in p for p in problems)
