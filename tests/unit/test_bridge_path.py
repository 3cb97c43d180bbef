"""The Megatron Bridge path around Bridge itself (CPU): the exact iteration reaches Bridge, the launcher turns
on Megatron's exit-signal handling and the save request becomes that signal, import runs once per allocation,
model-parallel export/generation start one rank per GPU, a multi-node salloc shell fans out, and validate
knows its runtime. Bridge's own code on these paths runs in the Bridge harness (tests/bridge/)."""

import json
import os
import signal
import threading
import time

import pytest

from pipeline import bridge
from pipeline.checkpoint import layout
from pipeline.cli.train import plan_from_argv
from pipeline.coherence.run import megatron_iteration
from pipeline.common.errors import UserError
from pipeline.slurm.allocation import Allocation
from pipeline.training import launch
from pipeline.training.engines.megatron_bridge import SaveRequestWatcher
from tests.helpers import ROOT, run

PY = str(ROOT / ".venv/bin/python")


def megatron_iters(root, complete=(200, 400), half=(600,), tracker=400):
    for it in complete:
        d = layout.iter_dir(root, it)
        d.mkdir(parents=True)
        for f in ("metadata.json", "common.pt", "__0_0.distcp", ".metadata"):
            (d / f).write_text("x")
    for it in half:  # a save still being written: metadata first, no shards yet
        d = layout.iter_dir(root, it)
        d.mkdir(parents=True)
        (d / "metadata.json").write_text("x")
        (d / "common.pt").write_text("x")
    layout.write_tracker(root, tracker)


def _tiny_safetensors(path):
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2, 2)}, str(path))


def test_the_requested_complete_iteration_is_resolved_never_a_later_one(tmp_path):
    megatron_iters(tmp_path)
    assert layout.resolve_iteration(tmp_path, 200).name == "iter_0000200"
    assert layout.resolve_iteration(tmp_path, None).name == "iter_0000400"
    with pytest.raises(UserError, match="iteration 600 .* is incomplete"):
        layout.resolve_iteration(tmp_path, 600)
    layout.write_tracker(tmp_path, 600)  # a tracker naming the half-written 600 is refused, never read or skipped
    with pytest.raises(UserError, match="names iteration 600, but iter_0000600 is incomplete"):
        layout.resolve_iteration(tmp_path, None)
    assert layout.latest_complete(tmp_path) == 400  # what a resuming run starts from
    # coherence --backend megatron: a root or an iteration directory, resolved the same way
    assert megatron_iteration(str(tmp_path), 200).name == "iter_0000200"
    assert megatron_iteration(str(tmp_path / "iter_0000400"), None).name == "iter_0000400"
    with pytest.raises(UserError, match="incomplete"):
        megatron_iteration(str(tmp_path / "iter_0000600"), None)


def test_bridge_refuses_a_checkpoint_root(tmp_path):
    """Given a root, Bridge's load_megatron_model takes the highest iter_* folder: pipeline.bridge refuses one."""
    with pytest.raises(ValueError, match="not an iteration directory"):
        bridge.export_to_hf(tmp_path, tmp_path / "hf", hf_model="x/y", strict=True)
    with pytest.raises(ValueError, match="not an iteration directory"):
        bridge.generate(tmp_path, "x/y", ["hi"], 4, tp=1, pp=1, ep=1, reasoning=False)


def test_launcher_turns_on_megatron_exit_signal_handling():
    lp = plan_from_argv([
        "configs/quickstart/nemotron_nano_quickstart_sft.yaml", "--model", "nano", "--mode", "sft", "--nodes", "16",
        "--no-path-checks"])
    cfg = lp.cfg
    assert lp.preflight.ok and cfg.train.exit_signal_handler is True
    from pipeline.bridge import bridge_overrides_yaml

    assert "exit_signal_handler: true" in bridge_overrides_yaml(cfg)
    cfg = plan_from_argv([
        "configs/quickstart/nemotron_nano_quickstart_sft.yaml", "--model", "nano", "--mode", "sft", "--nodes", "16",
        "--no-path-checks", "train.exit_signal_handler=false"]).cfg
    assert cfg.train.exit_signal_handler is False  # the user's explicit choice wins
    cfg = plan_from_argv(["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe",
                          "--mode", "sft", "--no-path-checks"]).cfg
    assert cfg.train.exit_signal_handler is None  # the local engine has its own handler


def test_save_request_becomes_the_exit_signal(tmp_path):
    got = threading.Event()
    old = signal.signal(signal.SIGUSR2, lambda *a: got.set())
    try:
        req = tmp_path / "save-request"
        w = SaveRequestWatcher([tmp_path / "SAVE_AND_EXIT", req], signal.SIGUSR2, interval=0.05).start()
        time.sleep(0.3)
        assert not got.is_set() and not w.fired.is_set()
        req.touch()
        deadline = time.time() + 10
        while not got.is_set() and time.time() < deadline:
            time.sleep(0.05)
        assert got.is_set() and w.fired.is_set()
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_multi_node_salloc_shell_fans_out():
    alloc = Allocation("7", 2, 0, ["node1", "node2"], None, 0)
    assert launch.needs_fan_out(alloc, {})
    assert not launch.needs_fan_out(alloc, {"SLURM_STEP_ID": "0"})  # already one task per node
    assert not launch.needs_fan_out(Allocation("7", 1, 0, ["node1"], None, 0), {})
    assert not launch.needs_fan_out(Allocation(None, 1, 0, [], None, 0), {})
    cmd = launch.fan_out_command(["c.yaml", "--model", "m"])
    assert cmd[:3] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert cmd[-4:] == [str(ROOT / "pipeline_training_launch.sh"), "c.yaml", "--model", "m"]


def test_import_runs_on_one_node(pipeline_env, tmp_path):
    """Bridge's import builds the model once, on one host: a multi-node allocation is refused with the one-node
    command (the reference's 4 nodes idled 3); on one node, `import nano` fetches the -Base-BF16 model its config
    reads."""
    env = {**pipeline_env, "PYTHONPATH": str(ROOT / "src"), "PIPELINE_CLUSTER": "isambard_gh200",
           "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "nid[001-004]", "SLURM_NODEID": "2"}
    res = run([PY, "-m", "pipeline.cli.checkpoint", "import", "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
               "--output", str(tmp_path / "out")], env=env)
    assert res.returncode == 2 and res.stderr == (
        "error: import runs on one node, and 4 were asked for: isambard_sbatch --nodes=1 "
        "pipeline_checkpoint_submit.sbatch import nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16\n")
    assert not (tmp_path / "out").exists()
    res = run([PY, "-m", "pipeline.cli.checkpoint", "import", "nano", "--output", str(tmp_path / "out")],
              env={**env, "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "nid001", "SLURM_NODEID": "0"})
    assert res.returncode == 2 and res.stderr.startswith(
        "error: importing nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16 as a Megatron checkpoint needs")
    assert "cannot be imported here" in res.stderr and res.stderr.count("\n") == 1


def test_model_parallel_export_starts_one_rank_per_gpu(pipeline_env, tmp_path):
    megatron_iters(tmp_path)
    env = {**pipeline_env, "PYTHONPATH": str(ROOT / "src"), "PATH": f"{ROOT}/.venv/bin:{os.environ['PATH']}",
           "PIPELINE_CLUSTER": "isambard_gh200"}
    plan = run([PY, "-m", "pipeline.cli.checkpoint", "export", str(tmp_path), "--hf-model", "x/y", "--no-reasoning",
                "--iteration", "200", "--tp", "2", "--ep", "2", "--dry-run", "--json"], env=env, timeout=300)
    assert json.loads(plan.stdout)["launch"] == [
        "torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2", "-m", "pipeline.cli.checkpoint", "export",
        str(tmp_path), "--hf-model", "x/y", "--no-reasoning", "--iteration", "200", "--tp", "2", "--ep", "2"]
    res = run([PY, "-m", "pipeline.cli.checkpoint", "export", str(tmp_path), "--hf-model", "x/y", "--no-reasoning",
               "--iteration", "200", "--tp", "1", "--ep", "2"], env=env, timeout=300)
    # Without Megatron Bridge (this machine) the launcher stops before starting any rank, with one line naming
    # exactly the requested iteration.
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"error: exporting the Megatron checkpoint {tmp_path}/iter_0000200 needs Megatron")
    local = tmp_path / "local"
    (layout.iter_dir(local, 10)).mkdir(parents=True)
    (layout.iter_dir(local, 10) / layout.MARKER).write_text('{"engine": "local"}')
    (layout.iter_dir(local, 10) / "config.json").write_text("{}")
    _tiny_safetensors(layout.iter_dir(local, 10) / "model.safetensors")
    layout.write_tracker(local, 10)
    res = run([PY, "-m", "pipeline.cli.checkpoint", "export", str(local), "--hf-model", "x/y", "--no-reasoning",
               "--tp", "2"], env=env)
    assert res.returncode == 2 and "apply to Megatron checkpoints" in res.stderr


def test_validate_knows_the_cluster_container(pipeline_env):
    """Inside the Apptainer image the local-venv checks are skipped with the reason and the GPU stack is checked.
    (Run on this CPU host with the container's marker set: the container's checks then fail, as they must.)"""
    env = {**pipeline_env, "PYTHONPATH": str(ROOT / "src"), "PIPELINE_IN_CONTAINER": "apptainer",
           "PIPELINE_RUNTIME": "apptainer"}
    res = run([PY, "-m", "pipeline.env.validate"], env=env, timeout=300)
    out = res.stdout
    for name in ("smollm2-package", "base-model-smollm2", "chat-corpus", "venv-active"):
        assert f"SKIP {name}: apptainer" in out, out
    assert "FAIL python-version: Python 3.11 in the container" in out
    assert "FAIL import-megatron-bridge" in out and "--only overlay" in out
    assert "SKIP ft-launcher" not in out and "ft-launcher: " in out and res.returncode == 1
    host = run([PY, "-m", "pipeline.env.validate", "--only", "import-megatron-bridge", "--only", "chat-corpus"],
               env={**pipeline_env, "PYTHONPATH": str(ROOT / "src")})
    assert "SKIP import-megatron-bridge: venv runtime" in host.stdout and "PASS chat-corpus" in host.stdout
