"""Per-rank training entry point: ``python -m pipeline.training.run --run-dir DIR`` (started by torchrun or
ft_launcher from ``pipeline_training_launch.sh``). Reads the run records and hands over to the engine."""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from pathlib import Path

from pipeline.common.errors import cli_main
from pipeline.common.log import setup_logging
from pipeline.config.engines import LOCAL, MEGATRON_BRIDGE, engine
from pipeline.training import records
from pipeline.training.engines.local import train as local_train
from pipeline.training.engines.megatron_bridge import train as bridge_train

TRAIN = {LOCAL.name: local_train, MEGATRON_BRIDGE.name: bridge_train}  # each engine's train(run_dir, cfg, launch)
_PARENT = os.getppid()  # at start: the launcher's agent that started this rank


def _die_with_launcher() -> None:
    """Linux: this rank gets SIGKILL when its parent (torchrun's or ft_launcher's agent) dies. torchrun starts the
    ranks in their own session, so killing the launcher's process group left them training, and a relaunch then
    trained beside them. SIGKILL, not SIGTERM (which asks the local engine for a save-and-exit): the run directory's
    writer lock ends with the agent, so a rank must not outlive it by even one checkpoint."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != _PARENT:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    args = parser.parse_args(argv)

    log = setup_logging("pipeline.training")
    _die_with_launcher()
    run_dir = args.run_dir.resolve()
    if (run_dir / records.NAN_MARKER).exists():
        print(f"error: this run stopped on a NaN ({(run_dir / records.NAN_MARKER).read_text().strip()}); "
              f"not restarting. Fix the config and start a new run (or delete {run_dir / records.NAN_MARKER}).",
              file=sys.stderr)
        return 3
    cfg, launch = records.load_run(run_dir)
    eng = engine(launch["engine"])
    if eng.needs_gpus:
        log.info("%s engine on rank %s", eng.title, os.environ.get("RANK", "0"))
    return TRAIN[eng.name](run_dir, cfg, launch)


if __name__ == "__main__":
    sys.exit(main())
