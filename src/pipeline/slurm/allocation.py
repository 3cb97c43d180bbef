"""Facts about the current allocation, read from Slurm's environment (one place for them)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time

from pipeline.common.errors import UserError
from pipeline.slurm.hostlist import expand


@dataclasses.dataclass(frozen=True)
class Allocation:
    job_id: str | None
    nodes: int
    node_rank: int
    node_list: list[str]
    gpus_on_node: int | None
    restart_count: int

    @property
    def in_slurm(self) -> bool:
        return self.job_id is not None


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist (``node[1-3,5]``) with ``scontrol show hostnames``, or by hand without it."""
    if not hostlist:
        return []
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True,
                                 check=True, timeout=30).stdout
            return out.split()
        except (subprocess.SubprocessError, OSError):
            pass

    return expand(hostlist)


def node_address(node: str) -> str:
    """The address of a node for the rendezvous: its NodeAddr in Slurm (a node's name and its high-speed
    interface can differ; on the local test cluster every node's NodeAddr is 127.0.0.1)."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "node", node, "-o"], capture_output=True, text=True,
                                 check=True, timeout=30).stdout
            for tok in out.split():
                if tok.startswith("NodeAddr="):
                    return tok.split("=", 1)[1]
        except (subprocess.SubprocessError, OSError):
            pass
    return node


def planned_nodes(given: int | None, alloc: Allocation) -> int:
    """The node count a job is planned for: ``--nodes``, else the allocation's, else 1. The one rule of the count:
    a given one is >= 1, and an allocation's malformed one is refused (one line each, exit 2)."""
    if given is not None and given < 1:
        raise UserError(f"--nodes {given} must be >= 1")
    if alloc.in_slurm and alloc.nodes < 1:
        raise UserError(f"the Slurm environment is malformed: SLURM_JOB_NUM_NODES={alloc.nodes}")
    return given or alloc.nodes or 1


def current(env: dict[str, str] | None = None) -> Allocation:
    env = dict(os.environ if env is None else env)
    job = env.get("SLURM_JOB_ID")
    gpus = env.get("SLURM_GPUS_ON_NODE")
    return Allocation(
        job_id=job,
        nodes=int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1),
        node_rank=int(env.get("SLURM_NODEID") or 0),
        node_list=expand_hostlist(env.get("SLURM_JOB_NODELIST", "")) if job else [],
        gpus_on_node=int(gpus) if gpus and gpus.isdigit() else None,
        restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
    )


EPHEMERAL_PORTS_START = 32768  # Linux's default net.ipv4.ip_local_port_range starts here


def rendezvous(alloc: Allocation, base_port: int) -> tuple[str, int]:
    """Master address (first node's NodeAddr) and a per-job port (jobs can share a node): ``base_port`` plus the
    job id modulo the ports left below the kernel's ephemeral range (29500-32767 for the default base), so that
    no process that bound port 0 can hold it: the store's bind then fails, every node waits as a client and the
    rendezvous times out. A base at or above that range keeps up to 20,000 ports above it."""
    host = node_address(alloc.node_list[0]) if alloc.node_list else "127.0.0.1"
    span = EPHEMERAL_PORTS_START - base_port if base_port < EPHEMERAL_PORTS_START else min(20000, 65536 - base_port)
    port = base_port + (int(alloc.job_id) % span if alloc.job_id and alloc.job_id.isdigit() else 0)
    return host, port


@dataclasses.dataclass(frozen=True)
class JobTimes:
    """When Slurm queued and started this incarnation of a job (a requeue keeps the id and resets all three:
    SubmitTime is the requeue, EligibleTime the end of the requeue hold), as seconds since the epoch. Slurm reports
    whole seconds in the controller's local time."""

    submit: float
    eligible: float
    start: float
    batch: bool  # a batch job (sbatch); an salloc allocation's times say nothing about a run started by hand in it


def _slurm_time(value: str | None) -> float | None:
    if not value or value in ("Unknown", "None", "N/A"):
        return None
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def job_times(job_id: str | None) -> JobTimes | None:
    """This job's submit, eligible and start times from ``scontrol show job`` (which holds a job while it runs, with
    or without an accounting database); None outside Slurm or when scontrol cannot say."""
    if not job_id or not shutil.which("scontrol"):
        return None
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=15)
    except (subprocess.SubprocessError, OSError):
        return None
    fields = dict(tok.split("=", 1) for tok in out.stdout.split() if "=" in tok)
    submit, start = _slurm_time(fields.get("SubmitTime")), _slurm_time(fields.get("StartTime"))
    if out.returncode != 0 or submit is None or start is None:
        return None
    eligible = _slurm_time(fields.get("EligibleTime")) or submit
    return JobTimes(submit, min(max(eligible, submit), start), start, fields.get("BatchFlag") == "1")
