"""A stand-in for ``pipeline.cli.coherence`` under a real launch line: each rank reports where it runs and its
position in the parallel layout, as megatron-core's own ``parallel_state`` assigns it.

    torchrun ... -m tests.slurm.rank_probe MODEL --backend megatron --hf-model ID --tp T --pp P --ep E

It takes the coherence test's own arguments (only --tp/--pp/--ep are read), initialises torch.distributed on gloo
from torchrun's environment, and appends one JSON line per rank to ``$RANK_PROBE_OUT`` (one ``write`` of a short
line on a file opened with O_APPEND: the ranks' lines never interleave, and a rank that reports twice shows up
twice). The line holds the rank's global rank, world size, Slurm node (SLURMD_NODENAME, SLURM_NODEID), torchrun's
LOCAL_RANK and GROUP_RANK, and its tp/pp/ep/dp/cp/etp ranks, with ``source``:

  megatron-core  ``parallel_state.initialize_model_parallel(tp, pp, ep, etp=1)`` and its ``get_*_rank()``: needs
                 megatron-core on the path (PYTHONPATH: .cache/bridge-venv/megatron-site, tests/bridge/setup_env.sh)
  plan           megatron-core is not importable or did not initialise (``megatron_error`` says why): the
                 positions of the project's own mapping, ``Layout.positions`` (config/parallel.py)

``sums`` proves the groups are live communicators and not only numbers: the all-reduced sum of the global ranks over
this rank's tp, pp and ep groups (the pp group spans both nodes of the 2-node layout).

To import megatron-core on a CPU host, two things, neither of which ``parallel_state`` itself uses: the Bridge
harness's import shim (tests/bridge/shim/sitecustomize.py: a stand-in ``triton`` for the few megatron-core modules
that import it unguarded to define kernels), loaded here from its file, and ``nvidia_resiliency_ext`` hidden,
because megatron-core 0.19.2 asserts nvidia-resiliency-ext >= 0.6.0 at import when the package is present and the
project venv has 0.4.1 (no ``__version__``: the import fails with AttributeError); hidden, megatron-core only turns
off NVRx async checkpointing.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests" / "bridge" / "shim" / "sitecustomize.py"
TIMEOUT_S = 90  # no rank outlives this: a hung rendezvous or collective dumps its stack and exits


def _megatron_positions(tp: int, pp: int, ep: int) -> tuple[dict[str, int], dict[str, object]]:
    """(positions, groups) from megatron-core's parallel_state, initialised on the gloo world."""
    sys.modules.setdefault("nvidia_resiliency_ext", None)  # see the module docstring
    if SHIM.is_file() and "pipeline_rank_probe_shim" not in sys.modules:
        spec = importlib.util.spec_from_file_location("pipeline_rank_probe_shim", SHIM)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    pos = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
           "ep": ps.get_expert_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
           "cp": ps.get_context_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank()}
    groups = {"tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
              "ep": ps.get_expert_model_parallel_group()}
    return pos, groups


def _plan_positions(tp: int, pp: int, ep: int, rank: int, world: int, per_node: int
                    ) -> tuple[dict[str, int], dict[str, object]]:
    """(positions, groups) from the project's mapping; every rank forms every group, in the same order."""
    import torch.distributed as dist

    from pipeline.config.parallel import Layout

    lay = Layout(world, tp=tp, pp=pp, ep=ep, etp=1)
    me = lay.positions(per_node)[rank]
    groups = {}
    for name, members in lay.groups().items():
        if name not in ("tp", "pp", "ep"):
            continue
        for g in members:
            handle = dist.new_group(g, backend="gloo")
            if rank in g:
                groups[name] = handle
    return {k: me[k] for k in ("tp", "pp", "ep", "dp", "cp", "etp")}, groups


def main(argv: list[str]) -> int:
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    p = argparse.ArgumentParser(prog="rank_probe", add_help=False)
    for flag in ("--tp", "--pp", "--ep"):
        p.add_argument(flag, type=int, default=1)
    args, _ = p.parse_known_args(argv)
    out = os.environ["RANK_PROBE_OUT"]

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S - 15))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    record: dict[str, object] = {"source": "megatron-core"}
    try:
        pos, groups = _megatron_positions(args.tp, args.pp, args.ep)
    except Exception as exc:  # any reason megatron-core cannot run here is reported (source "plan"), not raised
        record = {"source": "plan", "megatron_error": f"{type(exc).__name__}: {exc}"[:500]}
        pos, groups = _plan_positions(args.tp, args.pp, args.ep, rank, world, per_node)
    sums = {}
    for name, group in groups.items():
        t = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(t, group=group)
        sums[name] = int(t.item())
    record.update(rank=rank, world_size=world, node=os.environ.get("SLURMD_NODENAME"),
                  slurm_node_id=os.environ.get("SLURM_NODEID"), local_rank=int(os.environ["LOCAL_RANK"]),
                  group_rank=int(os.environ["GROUP_RANK"]), local_world_size=per_node, host=socket.gethostname(),
                  job_id=os.environ.get("SLURM_JOB_ID"), argv=argv, sums=sums, **pos)
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    dist.barrier()  # every rank has written before any exits (torchrun ends the node's others when one fails)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
