"""A few real iterations of the Megatron Bridge engine on this node's GPUs: validate's ``bridge-training`` check and
the GPU ready check (``pipeline.env.device_check``, tests/gpu/device_check.sh).

    torchrun --standalone --nproc-per-node=N -m pipeline.env.bridge_smoke --run-dir DIR [--tp T] [--iters 4]
    torchrun ... -m pipeline.env.bridge_smoke --run-dir DIR --iters 6 --engine [--request-at K]

Bridge's minimal GPT recipe shrunk to two layers (pipeline.bridge.smoke_config), random init, mock data: no
download and no dataset. Rank 0 writes DIR/smoke.json: per step the loss, grad norm and learning rate.

``--engine`` runs the suite's Bridge engine (``training.engines.megatron_bridge.run_rank``: its records, its
save-request watcher, its end of run) instead of Bridge's loop alone, with Megatron's exit-signal handler on, one
checkpoint every ``--save-interval`` steps and ``checkpoint.load`` = ``checkpoint.save`` (a second launch on the
same DIR resumes). ``--request-at K``: at the end of step K every rank writes DIR/SAVE_AND_EXIT (the time-limit
request a batch script makes) and waits for the engine's watcher to turn it into the exit signal, so Megatron
checkpoints and exits at a known step; the run is then recorded as stopped for a requeue.
Runs only where Bridge runs (CUDA); validate skips it elsewhere, saying why.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from pipeline import bridge
from pipeline.common.errors import cli_main
from pipeline.common.io import write_json

WATCHER_POLL = 2.0  # the engine's SaveRequestWatcher interval (RankHooks' default poll)


def engine_overrides(run_dir: Path, save_interval: int) -> list[str]:
    """What ``--engine`` adds to the smoke recipe: the exit-signal handler (the save-and-exit path), periodic saves,
    and loading from the save folder (a relaunch resumes)."""
    ckpt = Path(run_dir) / "checkpoints"
    return ["train.exit_signal_handler=true", f"checkpoint.save_interval={save_interval}", f"checkpoint.load={ckpt}"]


def _engine_run(args, world: int, rank: int, steps: list[dict]) -> int:
    from pipeline.training.engines import megatron_bridge as engine
    from pipeline.training.records import SAVE_AND_EXIT

    container = bridge.smoke_config(args.run_dir, world=world, tp=args.tp, iters=args.iters,
                                    extra_overrides=engine_overrides(args.run_dir, args.save_interval))

    def on_step(it: int, metrics: dict) -> None:
        steps.append({"step": it, **metrics})
        if args.request_at and it == args.request_at:
            (args.run_dir / SAVE_AND_EXIT).touch()
            # the watcher polls every WATCHER_POLL s and signals this rank; Megatron's handler records the signal
            # (the sleep resumes after it) and the loop checkpoints and exits at this step's end
            time.sleep(3 * WATCHER_POLL)

    tokens = container.train.global_batch_size * container.model.seq_length
    return engine.run_rank(args.run_dir, container, save=args.run_dir / "checkpoints", iters=args.iters,
                           tokens_per_step=tokens, pretrain=True, rank=rank, world=world, on_step=on_step)


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.env.bridge_smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--engine", action="store_true", help="run the suite's Bridge engine (records, save-and-exit)")
    ap.add_argument("--save-interval", type=int, default=2, help="--engine: steps between checkpoints")
    ap.add_argument("--request-at", type=int, help="--engine: request save-and-exit at the end of this step")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    steps: list[dict] = []
    if args.engine:
        rc = _engine_run(args, world, rank, steps)
    else:
        container = bridge.smoke_config(args.run_dir, world=world, tp=args.tp, iters=args.iters)
        bridge.run_training(container, pretrain=True, on_step=lambda it, m: steps.append({"step": it, **m}))
        rc = 0
    if rank == world - 1:  # the last rank holds the reduced loss
        want = len(steps) if args.engine else args.iters  # a stopped or resumed engine run runs a part
        ok = rc == 0 and bool(steps) and len(steps) == want and all(math.isfinite(s.get("loss", math.nan))
                                                                    for s in steps)
        write_json(args.run_dir / "smoke.json", {"world": world, "tp": args.tp, "engine": args.engine,
                                                 "steps": steps, "ok": ok})
        print(f"bridge smoke: {len(steps)} steps on {world} GPU(s), tp {args.tp}: "
              + ", ".join(f"{s.get('loss', float('nan')):.3f}" for s in steps))
        return 0 if ok else 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
