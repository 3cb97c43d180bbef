"""The megatron_cpu tier, training: Megatron Bridge's own ``pretrain()`` loop (setup, the training loop, Megatron's
exit-signal save-and-exit, torch_dist checkpoint save and load, megatron-core's NaN check) on a CPU process over
gloo, through the suite's Bridge engine (``pipeline.training.engines.smoke`` -> ``megatron_bridge.run_rank``), and
what the engine records around it: items 4 (a save-and-exit request stops the run for a requeue), 6 (iterations
1..N in progress.ndjson, across a resume) and 7 (a non-finite loss ends the run with FAILED_NAN).

Where it runs: the Bridge harness venv with the tier's CUDA stand-in and, with MEGATRON_CPU_TRAINING=1, its training
stand-in (tests/megatron_cpu/standin/training_standin.py: every patched call with its reason). The run is the
engine's smoke recipe (Bridge's vanilla GPT recipe, 2 layers x 256, mock data) with CPU-only settings added here, on
the command line (``--override``), not in the suite's defaults:

  dist.distributed_backend=gloo                      no NCCL on a CPU
  tokenizer.vocab_size=1024, model/dataset.seq_length=64
                                                     the 32000-token output layer in bf16 on one core took ~25 s a
                                                     step; this keeps a step near one second

The distributed optimizer is off by the product's own rule (``pipeline.bridge.smoke_config``: without TE's or Apex's
FusedAdam, megatron-core 0.19.2's DistributedOptimizer with torch's Adam cannot load a checkpoint: its state_dict
asserts one Adam ``step`` across a still-empty optimizer state, distrib_optimizer.py:839, from Bridge's
generate_state_dict, checkpointing.py:2038); the Float16 optimizer (bf16 params, fp32 main params) loads. Bridge's
compile_helpers() (make, with the Makefile every install of megatron-core gets) and its JIT warm-up (torch.compile on
the CPU) run for real.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.megatron_cpu.conftest import VENV, tier_env, tier_run

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.slow]

ITERS, REQUEST_AT = 4, 2
CPU_OVERRIDES = ["dist.distributed_backend=gloo", "tokenizer.vocab_size=1024", "model.seq_length=64",
                 "dataset.seq_length=64"]


def engine(run_dir: Path, *extra: str, iters: int = ITERS) -> list[str]:
    args = [str(VENV / "bin" / "python"), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            "-m", "pipeline.training.engines.smoke", "--run-dir", str(run_dir), "--iters", str(iters), *extra]
    for o in CPU_OVERRIDES:
        args += ["--override", o]
    return args


def training_env(tmp: Path) -> dict:
    return tier_env({"MEGATRON_CPU_TRAINING": "1", "TMPDIR": str(tmp)})


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, harness_venv):
    """One engine launch with a save-and-exit request at step REQUEST_AT, then a relaunch on the same run dir."""
    work = tmp_path_factory.mktemp("bridge_pretrain_cpu")
    run = work / "run"
    env = training_env(work)
    t0 = time.monotonic()
    first = tier_run(engine(run, "--save-interval", str(ITERS), "--request-at", str(REQUEST_AT)), env=env)
    after_first = {
        "files": sorted(p.name for p in run.iterdir()),
        "progress": lines(run / "progress.ndjson") if (run / "progress.ndjson").exists() else [],
        "summary": json.loads((run / "metrics_summary.json").read_text()),
        "tracker": (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip(),
    }
    second = tier_run(engine(run, "--save-interval", str(ITERS)), env=env)
    print(f"save-and-exit + resume: {time.monotonic() - t0:.0f} s")
    return {"run": run, "first": first, "second": second, "after_first": after_first}


def test_save_and_exit_stops_for_a_requeue(resumed):
    """Item 4 on Bridge's real loop: the request file becomes Megatron's exit signal, Megatron checkpoints at the
    request's step and exits; the engine records a stop for the requeue (no TRAINING_DONE) and removes the request."""
    assert resumed["first"].returncode == 0, resumed["first"].stderr[-3000:]
    after = resumed["after_first"]
    assert "SAVE_AND_EXIT" not in after["files"]
    assert "TRAINING_DONE" not in after["files"] and "FAILED_NAN" not in after["files"]
    assert after["summary"]["status"] == "preempted"
    assert after["tracker"] == str(REQUEST_AT)  # Megatron's own save at the request's step
    assert [p["step"] for p in after["progress"]] == list(range(1, REQUEST_AT + 1))
    events = lines(resumed["run"] / "events.ndjson")
    ends = [e for e in events if e["event"] == "end"]
    assert ends[0]["status"] == "preempted" and ends[0]["step"] == REQUEST_AT


def test_setup_compiles_the_dataset_helpers_for_real(resumed):
    """Bridge's setup runs megatron-core's own compile_helpers() (``make -C megatron/core/datasets``) on local rank 0:
    with the Makefile that every install of megatron-core gets (src/pipeline/env/overlay.py), make finds the wheel's
    prebuilt helpers up to date, and setup goes on; the distributed optimizer is off by the product's rule, and the
    smoke record says why."""
    out = resumed["first"].stdout + resumed["first"].stderr
    assert "> compiling dataset index builder ..." in out and ">>> done with dataset index builder" in out
    assert "make: Nothing to be done for 'default'." in out
    smoke = json.loads((resumed["run"] / "smoke.json").read_text())
    assert smoke["distributed_optimizer"] is False and "FusedAdam" in smoke["distributed_optimizer_note"]


def test_relaunch_resumes_and_completes(resumed):
    """The relaunch loads Megatron's checkpoint of step REQUEST_AT, runs the remaining steps and completes:
    TRAINING_DONE in the run dir and beside the checkpoints, the tracker at ITERS."""
    assert resumed["second"].returncode == 0, resumed["second"].stderr[-3000:]
    assert f"successfully loaded checkpoint from {resumed['run'] / 'checkpoints'}" in resumed["second"].stdout
    run = resumed["run"]
    assert (run / "TRAINING_DONE").exists() and (run / "checkpoints" / "TRAINING_DONE").exists()
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert json.loads((run / "metrics_summary.json").read_text())["status"] == "completed"
    smoke = json.loads((run / "smoke.json").read_text())
    assert smoke["ok"] and [s["step"] for s in smoke["steps"]] == list(range(REQUEST_AT + 1, ITERS + 1))


def test_progress_counts_iterations_1_to_n_across_the_resume(resumed):
    """Item 6: progress.ndjson has iterations 1..N once each, with finite losses, the relaunch's continuing from
    the checkpoint's step (nothing redone: the save was at the stop)."""
    progress = lines(resumed["run"] / "progress.ndjson")
    assert [p["step"] for p in progress] == list(range(1, ITERS + 1))
    assert all(0 < p["loss"] < 100 for p in progress)
    assert [p["tokens"] for p in progress] == [128 * s for s in range(1, ITERS + 1)]  # 2 sequences of 64 a step
    steps = [e["step"] for e in lines(resumed["run"] / "events.ndjson") if e["event"] == "step"]
    assert steps == list(range(1, ITERS + 1))


def test_non_finite_loss_ends_with_failed_nan(tmp_path, harness_venv):
    """Item 7: a learning rate of 1e30 makes step 2's forward loss NaN; megatron-core's NaN check raises and the
    engine writes FAILED_NAN (which stops restarts) and fails the launch."""
    run = tmp_path / "run"
    r = tier_run(engine(run, "--save-interval", "3", "--override", "optimizer.lr=1e30",
                        "--override", "optimizer.min_lr=1e29", iters=3), env=training_env(tmp_path))
    assert r.returncode != 0
    assert "found NaN in local forward loss calculation" in r.stdout + r.stderr
    marker = (run / "FAILED_NAN").read_text()
    assert "Megatron stopped on a non-finite value at iteration 2" in marker
    assert not (run / "TRAINING_DONE").exists()
    assert [p["step"] for p in lines(run / "progress.ndjson")] == [1]
    assert json.loads((run / "metrics_summary.json").read_text())["status"] == "failed_nan"
