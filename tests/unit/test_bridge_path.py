"""The Megatron Bridge path around Bridge itself (CPU): the exact iteration reaches Bridge, the launcher turns
on Megatron's exit-signal handling and the save request becomes that signal, import runs once per allocation,
model-parallel export/generation start one rank per GPU, a multi-node salloc shell fans out, and validate
knows its runtime. Bridge's own code on these paths runs in the Bridge harness (tests/bridge/)."""

import signal
import threading
import time

import pytest

from pipeline import bridge
from pipeline.cli.train import plan_from_argv
from pipeline.coherence.run import megatron_iteration
from pipeline.common import layout
from pipeline.common.errors import UserError
from pipeline.slurm.allocation import Allocation
from pipeline.training import launch
from pipeline.training.engines.megatron_bridge import SaveRequestWatcher
from tests.helpers import ROOT


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
        "configs/quickstart/nemotron_nano_quickstart_sft.yaml", "--model", "nano", "--mode", "sft", "--disable-ft",
        "--nodes", "16", "--no-path-checks"])
    cfg = lp.cfg
    assert lp.preflight.ok and cfg.train.exit_signal_handler is True
    from pipeline.bridge import bridge_overrides_yaml

    assert "exit_signal_handler: true" in bridge_overrides_yaml(cfg)
    cfg = plan_from_argv([
        "configs/quickstart/nemotron_nano_quickstart_sft.yaml", "--model", "nano", "--mode", "sft", "--disable-ft",
        "--nodes", "16", "--no-path-checks", "train.exit_signal_handler=false"]).cfg
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
