"""The suite's Megatron Bridge engine on the smoke run, with a save-and-exit and a resume: the GPU ready check's
``bridge-train-resume`` (``pipeline.env.device_check``; tests/gpu/device_check.sh, validate --run-training).

    torchrun --standalone --nproc-per-node=N -m pipeline.training.engines.smoke --run-dir DIR --iters 6 \\
        [--tp T] [--save-interval 2] [--request-at K] [--override KEY=VALUE ...]

Bridge's GPT recipe shrunk (``bridge.smoke_config``, mock data, random init) through ``megatron_bridge.run_rank``:
the engine's records, its save-request watcher and its end of run. Megatron's exit-signal handler is on, a
checkpoint every ``--save-interval`` steps, and ``checkpoint.load`` = ``checkpoint.save``: a second launch on the
same DIR resumes. ``--request-at K``: at the end of step K every rank writes DIR/SAVE_AND_EXIT (the time-limit
request a batch script makes) and waits for the engine's watcher to turn it into the exit signal, so Megatron
checkpoints and exits at step K and the run is recorded as stopped for a requeue. The last rank writes
DIR/smoke.json (``pipeline.env.bridge_smoke.report``): the steps this launch ran.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pipeline import bridge
from pipeline.common.errors import cli_main
from pipeline.env.bridge_smoke import report
from pipeline.training.engines import megatron_bridge as engine
from pipeline.training.records import SAVE_AND_EXIT

WATCHER_POLL = 2.0  # the engine's SaveRequestWatcher interval (RankHooks' default poll)


def engine_overrides(run_dir: Path, save_interval: int) -> list[str]:
    """What the engine run adds to the smoke recipe: the exit-signal handler (the save-and-exit path), periodic
    saves, and loading from the save folder (a relaunch resumes)."""
    ckpt = Path(run_dir) / "checkpoints"
    return ["train.exit_signal_handler=true", f"checkpoint.save_interval={save_interval}", f"checkpoint.load={ckpt}"]


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.training.engines.smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--save-interval", type=int, default=2, help="steps between checkpoints")
    ap.add_argument("--request-at", type=int, help="request save-and-exit at the end of this step")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a Hydra override after the engine's (repeatable; the megatron_cpu tier's CPU settings)")
    args = ap.parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    extra = [*engine_overrides(args.run_dir, args.save_interval), *args.override]
    container = bridge.smoke_config(args.run_dir, world=world, tp=args.tp, iters=args.iters, extra_overrides=extra)
    steps: list[dict] = []

    def on_step(it: int, metrics: dict) -> None:
        steps.append({"step": it, **metrics})
        if args.request_at and it == args.request_at:
            (args.run_dir / SAVE_AND_EXIT).touch()
            # the watcher polls every WATCHER_POLL s and signals this rank; Megatron's handler records the signal
            # (the sleep resumes after it) and the loop checkpoints and exits at this step's end
            time.sleep(3 * WATCHER_POLL)

    tokens = container.train.global_batch_size * container.model.seq_length
    rc = engine.run_rank(args.run_dir, container, save=args.run_dir / "checkpoints", iters=args.iters,
                         tokens_per_step=tokens, pretrain=True, rank=rank, world=world, on_step=on_step)
    if rank == world - 1:
        dist_opt = bool(container.optimizer.use_distributed_optimizer)
        note = "" if dist_opt or bridge.fused_adam_available() else bridge.NO_FUSED_ADAM
        return report(args.run_dir, world=world, tp=args.tp, steps=steps, want=len(steps), ok=rc == 0, engine=True,
                      distributed_optimizer=dist_opt, distributed_optimizer_note=note)
    return rc


if __name__ == "__main__":
    sys.exit(main())
