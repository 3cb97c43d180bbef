"""The end of a Bridge engine run (training/engines/megatron_bridge.run_rank), on CPU, with named stand-ins for
the CUDA-only calls (issue 32, items 4 and 7). Bridge's real callback machinery and its real NaN message are
exercised in the Bridge harness (tests/bridge/test_bridge_harness.py: step_records, nan_message).

Stand-ins, each for a call that needs CUDA:
  ``bridge_loop_saves_and_exits``  for ``pipeline.bridge.run_training`` (Bridge's ``pretrain()``) when the exit
                                   signal has been caught: train.py's should_exit branch, which saves (the tracker
                                   written through the suite's layout helper at the saved iteration) and calls
                                   ``sys.exit(exit_code)``
  ``bridge_loop_hits_nan``         for ``run_training`` when megatron-core's loss check rejects a NaN:
                                   ``RerunStateMachine.validate_result`` raises RuntimeError with the text below
  ``container``                    for Bridge's ``ConfigContainer`` (the two train fields run_rank reads)
"""

import json
import signal
import sys
import types

import pytest

from pipeline import bridge
from pipeline.common import layout
from pipeline.training import records
from pipeline.training.engines import megatron_bridge as engine

# megatron/core/rerun_state_machine.py, validate_result with reruns disabled (Bridge's default), formatting
# f"Rank {rank}, node {node}, device {device}, iteration {self.current_iteration + 1}: "
# f"Unexpected result {result} (message='{message}')", message from megatron/bridge/training/losses.py
NAN_ERROR = ("Rank 3, node gpu-17, device 3, iteration 3: Unexpected result nan "
             "(message='found NaN in local forward loss calculation')")


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run directory, its checkpoint root, the batch script's per-job request file, and a harmless exit signal
    (SIGUSR2, caught here as Megatron's handler would): the watcher may signal while a stand-in loop runs."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    request = tmp_path / "job.save_request"
    monkeypatch.setenv("PIPELINE_SAVE_REQUEST_FILE", str(request))
    previous = signal.signal(signal.SIGUSR2, lambda *a: None)
    yield types.SimpleNamespace(dir=run_dir, save=tmp_path / "checkpoints", request=request)
    signal.signal(signal.SIGUSR2, previous)


def container():
    return types.SimpleNamespace(train=types.SimpleNamespace(exit_signal_handler=True, exit_signal=signal.SIGUSR2))


def bridge_loop_saves_and_exits(save, steps: int, code: int = 0):
    def run_training(container, *, pretrain, on_step, on_step_start, on_save):
        for it in range(1, steps + 1):
            on_step_start(it)
            on_step(it, {"loss": 3.0 - 0.1 * it, "grad_norm": 1.0})
        layout.iter_dir(save, steps).mkdir(parents=True)
        layout.write_tracker(save, steps)
        on_save(steps)
        sys.exit(code)
    return run_training


def bridge_loop_hits_nan(steps_ok: int, error: str = NAN_ERROR):
    def run_training(container, *, pretrain, on_step, on_step_start, on_save):
        for it in range(1, steps_ok + 1):
            on_step_start(it)
            on_step(it, {"loss": 3.0, "grad_norm": 1.0})
        on_step_start(steps_ok + 1)
        raise RuntimeError(error)
    return run_training


def run_rank(run, iters=10):
    return engine.run_rank(run.dir, container(), save=run.save, iters=iters, tokens_per_step=8, pretrain=True,
                           rank=0, world=1)


def summary(run):
    return json.loads((run.dir / "metrics_summary.json").read_text())


def test_a_time_limit_stop_is_recorded_preempted_not_completed(run, monkeypatch):
    """Bridge saves at iteration 3 of 10 on the exit signal and calls sys.exit(0): the run ends preempted, as the
    local engine's does (exit code 0, the batch script requeues), SAVE_AND_EXIT is removed and the batch script's
    ``<request>.saved`` names the iteration (before the fix the SystemExit went past the records: COMPLETED never
    written, no .saved, no requeue)."""
    (run.dir / records.SAVE_AND_EXIT).write_text("")
    run.request.write_text("")
    monkeypatch.setattr(bridge, "run_training", bridge_loop_saves_and_exits(run.save, 3))
    assert run_rank(run) == 0
    s = summary(run)
    assert s["status"] == "preempted" and s["final_step"] == 3
    assert not (run.dir / records.SAVE_AND_EXIT).exists()
    assert (run.request.parent / (run.request.name + ".saved")).read_text() == "3\n"
    assert not (run.dir / records.DONE_MARKER).exists()
    assert [r["step"] for r in records.ProgressLog(run.dir, 8).records()] == [1, 2, 3]


def test_an_exit_at_the_last_iteration_is_completed(run, monkeypatch):
    """The signal caught at the last step: Bridge saves N and exits 0; the tracker says N = train_iters: done."""
    monkeypatch.setattr(bridge, "run_training", bridge_loop_saves_and_exits(run.save, 4))
    assert run_rank(run, iters=4) == 0
    assert summary(run)["status"] == "completed" and (run.dir / records.DONE_MARKER).exists()


def test_a_non_zero_bridge_exit_propagates(run, monkeypatch):
    """A non-zero sys.exit from Bridge's loop (the rerun state machine's exit codes) is not a save-and-exit."""
    monkeypatch.setattr(bridge, "run_training", bridge_loop_saves_and_exits(run.save, 2, code=16))
    with pytest.raises(SystemExit) as exc:
        run_rank(run)
    assert exc.value.code == 16
    assert not (run.dir / records.DONE_MARKER).exists() and not (run.dir / "metrics_summary.json").exists()


def test_megatrons_nan_error_writes_the_marker_and_is_reraised(run, monkeypatch):
    """megatron-core's NaN check raises RuntimeError; the engine writes FAILED_NAN (restarts then refuse: before
    the fix only the local engine wrote it and a NaN run was restarted 3 times) and re-raises the error."""
    monkeypatch.setattr(bridge, "run_training", bridge_loop_hits_nan(2))
    with pytest.raises(RuntimeError, match="found NaN in local forward loss calculation"):
        run_rank(run)
    marker = run.dir / records.NAN_MARKER
    assert marker.exists() and "found NaN in local forward loss calculation" in marker.read_text()
    assert summary(run)["status"] == "failed_nan" and summary(run)["final_step"] == 3


def test_another_runtime_error_is_not_a_nan(run, monkeypatch):
    monkeypatch.setattr(bridge, "run_training", bridge_loop_hits_nan(1, "CUDA out of memory. Tried to allocate"))
    with pytest.raises(RuntimeError, match="out of memory"):
        run_rank(run)
    assert not (run.dir / records.NAN_MARKER).exists()
