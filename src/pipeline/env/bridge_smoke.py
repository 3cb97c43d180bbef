"""A few real iterations of Megatron Bridge's training loop on this node's GPUs (Bridge's loop alone).

    torchrun --standalone --nproc-per-node=N -m pipeline.env.bridge_smoke --run-dir DIR [--tp T] [--iters 4]

Bridge's minimal GPT recipe shrunk to two layers (pipeline.bridge.smoke_config), random init, mock data: no
download and no dataset. The last rank writes DIR/smoke.json: per step the loss, grad norm and learning rate.

The same run through the suite's Bridge engine (its records, save-and-exit and resume) is
``pipeline.training.engines.smoke`` (the GPU ready check's ``bridge-train-resume``); it writes its
smoke.json with :func:`report`.
Runs only where Bridge runs (CUDA); validate skips it elsewhere, saying why.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from pipeline import bridge
from pipeline.common.errors import cli_main
from pipeline.common.io import write_json


def report(run_dir: Path, *, world: int, tp: int, steps: list[dict], want: int, ok: bool = True, **extra) -> int:
    """DIR/smoke.json and the one ``bridge smoke:`` line (on the rank that holds the reduced loss); 0 when ``want``
    steps ran with finite losses."""
    ok = ok and bool(steps) and len(steps) == want and all(math.isfinite(s.get("loss", math.nan)) for s in steps)
    write_json(run_dir / "smoke.json", {"world": world, "tp": tp, **extra, "steps": steps, "ok": ok})
    print(f"bridge smoke: {len(steps)} steps on {world} GPU(s), tp {tp}: "
          + ", ".join(f"{s.get('loss', float('nan')):.3f}" for s in steps))
    return 0 if ok else 1


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.env.bridge_smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=4)
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps: list[dict] = []
    container = bridge.smoke_config(args.run_dir, world=world, tp=args.tp, iters=args.iters)
    bridge.run_training(container, pretrain=True, on_step=lambda it, m: steps.append({"step": it, **m}))
    if int(os.environ.get("RANK", "0")) == world - 1:  # the last rank holds the reduced loss
        return report(args.run_dir, world=world, tp=args.tp, steps=steps, want=args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
