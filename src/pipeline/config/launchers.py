"""How a node starts its ranks, as objects of the cluster profile (NeMo-Run's launchers): ``torchrun``, or NVRx's
``ft_launcher`` (torchrun's interface with rank heartbeats, section timeouts and in-job restarts; Megatron's fault
tolerance on the Bridge engine). A profile names one (``launcher:``); ``ClusterProfile.launcher_for`` gives the object,
plain torchrun with ``--disable-ft``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Launcher:
    name: str  # the program each node runs
    fault_tolerance: bool  # NVRx's ft_launcher: heartbeats, section timeouts, in-job restarts

    def argv(self, *, nproc: int, max_restarts: int, rendezvous: tuple[str, int, str, int, int] | None,
             ft_section_timeouts: str = "", ft_out_of_section_timeout: int = 0,
             prefix: list[str] | tuple[str, ...] = ()) -> list[str]:
        """The node's launcher line up to the program it starts: standalone on one machine outside Slurm, else a
        c10d rendezvous (``rendezvous``: host, port, id, node count, this node's rank); ``prefix`` wraps it (Nsight
        Systems)."""
        cmd = [*prefix, self.name]
        if rendezvous is None:
            cmd += ["--standalone", "--nnodes=1"]
        else:
            host, port, rdzv_id, nodes, node_rank = rendezvous
            cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={rdzv_id}",
                    f"--nnodes={nodes}", f"--node-rank={node_rank}"]
        cmd += [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
        if self.fault_tolerance:
            cmd += [f"--ft-rank_section_timeouts={ft_section_timeouts}",
                    f"--ft-rank_out_of_section_timeout={ft_out_of_section_timeout}"]
        return cmd

    def __str__(self) -> str:
        return self.name


TORCHRUN = Launcher("torchrun", fault_tolerance=False)
FT_LAUNCHER = Launcher("ft_launcher", fault_tolerance=True)
BY_NAME = {launcher.name: launcher for launcher in (TORCHRUN, FT_LAUNCHER)}
