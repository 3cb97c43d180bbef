"""Cluster profiles (``configs/cluster/<name>.yaml``): everything that differs between a laptop and a cluster, as a
typed, validated ``ClusterProfile``, and the one way a command finds its profile (``resolve_profile``).

A profile says what the nodes have (GPUs, device and host memory, processes per node), how a node starts its ranks
(its launcher: ``config/launchers.py``; the NCCL and fabric ``env`` of every job: ``config/job_env.py``), the Slurm
placement ``isambard_sbatch`` adds (``slurm/sbatch_options.profile_sbatch_options``), the shell knobs of
``pipeline_env_config.env`` (``config/knobs.py``, also its command line) and the services the cluster reaches. The
files are the flat YAML subset of ``config/flat_yaml.py``. Standard library only: the host's ``python3`` reads a
profile before any environment exists.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from pipeline.common import paths
from pipeline.common.errors import UserError
from pipeline.config.flat_yaml import parse_profile_text
from pipeline.config.launchers import BY_NAME as LAUNCHERS
from pipeline.config.launchers import TORCHRUN, Launcher

ROOT = paths.repo_root()  # evaluated at import: PIPELINE_ROOT of the process
RUNTIMES = ("venv", "apptainer", "charliecloud")
# Slurm time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"^(\d+|\d+:\d\d|\d+:\d\d:\d\d|\d+-\d+|\d+-\d+:\d\d|\d+-\d+:\d\d:\d\d)$")
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,-]+$")  # partition / account (a partition may be a comma list)
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
WANDB_MODES = ("auto", "online", "offline", "disabled")
DEFAULT_PROFILE = "local_cpu"


@dataclasses.dataclass(frozen=True)
class ClusterProfile:
    name: str
    description: str = ""
    # How jobs run and where shared files live (relative paths are under the checkout).
    runtime: str = "venv"
    sif: str = ".cache/containers/nemo-26.06.sif"
    bad_nodes_log: str = ".slurm/bad_nodes.log"
    log_dir: str = "logs"
    cache_dir: str = ".cache"
    # Prepared datasets (PIPELINE_DATA_ROOT): ``prepare`` writes <data_root>/<org>__<name>/, the folder the shipped
    # configs' dataset.dataset_root names on that cluster.
    data_root: str = "data"
    # Where `pipeline_checkpoint_convert.sh import` writes Megatron checkpoints by default (<dir>/<HF name>), the
    # folder the shipped configs' checkpoint.pretrained_checkpoint reads; empty: <models dir>/megatron_bridges/models.
    megatron_models_dir: str = ""
    # What a container job must see besides the checkout (always bound) and the runtime's own folders: host paths
    # or HOST:CONTAINER pairs (the data, checkpoint, model, log and cache roots the configs read, the fabric
    # libraries of the NCCL plugin), bound by every launcher (PIPELINE_PROFILE_BINDS); a path a plan checks outside
    # them is a problem naming the bind to add. ``ld_library_path``: the container folders of those libraries
    # (libfabric for aws-ofi-nccl), put on the container's LD_LIBRARY_PATH after the plugin (PIPELINE_FABRIC_LIBS).
    binds: tuple[str, ...] = ()
    ld_library_path: str = ""
    # Hardware.
    gpus_per_node: int = 0
    procs_per_node: int = 1
    gpu_memory_gb: float = 0.0
    host_memory_gb: float = 0.0
    cpus_per_node: int = 1
    # Slurm placement added by isambard_sbatch unless the user or the script's #SBATCH header sets it.
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    exclusive: bool = False
    # Launcher.
    launcher: str = "torchrun"
    ft_section_timeouts: str = "setup:600,step:180,checkpointing:420"
    ft_out_of_section_timeout: int = 300
    max_restarts: int = 3
    rdzv_port: int = 29500
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # Services the cluster reaches (an exported HF_HUB_OFFLINE / WANDB_MODE / WANDB_ENTITY still wins).
    hub_offline: bool = True         # no Hugging Face hub at run time (laptop, CI); false where the hub is reachable
    wandb_mode: str = "auto"         # auto: online when a W&B key exists (WANDB_API_KEY or `wandb login`'s netrc)
    wandb_entity: str | None = None  # the team's W&B entity (None: the key's default)
    # The W&B project of coherence runs (pipeline_coherence_test.py; --wandb-project, else an exported
    # COHERENCE_WANDB_PROJECT, wins). Read by our Python only, so it is no shell knob.
    coherence_wandb_project: str = "pipeline-gen-tests"

    def __post_init__(self) -> None:
        where = f"cluster profile '{self.name}'"

        def bad(field: str, why: str) -> UserError:
            return UserError(f"{where}: {field} {getattr(self, field)!r} {why}")

        if not isinstance(self.name, str) or not re.match(r"^[A-Za-z0-9_.-]+$", self.name):
            raise UserError(f"{where}: name must be letters, digits, '_', '.', '-'")
        if self.runtime not in RUNTIMES:
            raise bad("runtime", f"is not one of {', '.join(RUNTIMES)}")
        for f in ("gpus_per_node", "procs_per_node", "cpus_per_node", "ft_out_of_section_timeout",
                  "max_restarts", "rdzv_port"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(f, "must be an integer")
        for f in ("gpu_memory_gb", "host_memory_gb"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise bad(f, "must be a number >= 0")
        if self.gpus_per_node < 0:
            raise bad("gpus_per_node", "must be >= 0 (0: a CPU machine)")
        if self.procs_per_node < 1 or self.cpus_per_node < 1:
            raise UserError(f"{where}: procs_per_node and cpus_per_node must be >= 1")
        if self.max_restarts < 0:
            raise bad("max_restarts", "must be >= 0")
        if not 1 <= self.rdzv_port <= 65535:
            raise bad("rdzv_port", "must be a port number (1-65535)")
        if self.time_limit is not None and (not isinstance(self.time_limit, str) or not _TIME.match(self.time_limit)):
            raise bad("time_limit", "is not a Slurm time (quote it: \"HH:MM:SS\", \"D-HH:MM:SS\" or minutes)")
        for f in ("partition", "account"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, str) or not _SLURM_NAME.match(v)):
                raise bad(f, "is not a Slurm name (letters, digits, '_', '.', '-', ','), or null for the default")
        if not isinstance(self.exclusive, bool):
            raise bad("exclusive", "must be true or false")
        if self.launcher not in LAUNCHERS:
            raise bad("launcher", f"must be {' or '.join(LAUNCHERS)}")
        for f in ("description", "sif", "bad_nodes_log", "log_dir", "cache_dir", "data_root", "ft_section_timeouts"):
            v = getattr(self, f)
            if not isinstance(v, str) or any(ord(c) < 32 or ord(c) == 127 for c in v):
                raise bad(f, "must be a one-line string")
        for f in ("sif", "bad_nodes_log", "log_dir", "cache_dir", "data_root"):
            if not getattr(self, f):
                raise bad(f, "must not be empty")
        if not isinstance(self.hub_offline, bool):
            raise bad("hub_offline", "must be true or false")
        if self.wandb_mode not in WANDB_MODES:
            raise bad("wandb_mode", f"is not one of {', '.join(WANDB_MODES)}")
        if self.wandb_entity is not None and (not isinstance(self.wandb_entity, str)
                                              or not re.match(r"^[A-Za-z0-9_.-]+$", self.wandb_entity)):
            raise bad("wandb_entity", "is not a W&B entity name (letters, digits, '_', '.', '-'), or null")
        if not isinstance(self.coherence_wandb_project, str) or not re.match(r"^[A-Za-z0-9_.-]+$",
                                                                             self.coherence_wandb_project):
            raise bad("coherence_wandb_project", "is not a W&B project name (letters, digits, '_', '.', '-')")
        if not isinstance(self.binds, tuple) or not all(isinstance(b, str) for b in self.binds):
            raise UserError(f"{where}: binds must be a list of host paths or HOST:CONTAINER pairs")
        for b in self.binds:
            parts = b.split(":")
            if (len(parts) > 2 or "," in b or any(ord(c) < 33 or ord(c) == 127 for c in b)
                    or not all(x.startswith("/") for x in parts)):
                raise UserError(f"{where}: binds {b!r} is not an absolute host path or HOST:CONTAINER pair of "
                                "absolute paths (no commas or spaces)")
        if not isinstance(self.ld_library_path, str) or any(
                ord(c) < 33 or ord(c) == 127 for c in self.ld_library_path) or not all(
                x.startswith("/") for x in self.ld_library_path.split(":") if self.ld_library_path):
            raise bad("ld_library_path", "must be absolute container folders separated by ':'")
        if not isinstance(self.env, dict):
            raise UserError(f"{where}: env must be a mapping of NAME: value")
        for k, v in self.env.items():
            if not _ENV_KEY.match(str(k)) or any(ord(c) < 32 for c in str(v)):
                raise UserError(f"{where}: env {k!r}: names are [A-Za-z_][A-Za-z0-9_]*, values one line")

    @property
    def has_gpus(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node if self.has_gpus else self.procs_per_node

    @property
    def memory_budget_gb(self) -> float:
        return self.gpu_memory_gb if self.has_gpus else self.host_memory_gb

    def path(self, field: str, root: Path | None = None) -> str:
        """A path field, absolute (relative ones are under the checkout)."""
        return str((root or ROOT) / getattr(self, field))

    def container_binds(self) -> list[tuple[str, str]]:
        """The profile's binds as (host, container) pairs."""
        return [(h, g or h) for h, _, g in (b.partition(":") for b in self.binds)]

    def launcher_for(self, disable_ft: bool = False) -> Launcher:
        """How each node starts its ranks: the profile's launcher, or plain torchrun with --disable-ft."""
        launcher = LAUNCHERS[self.launcher]
        return TORCHRUN if disable_ft and launcher.fault_tolerance else launcher


def cluster_dir() -> Path:
    return ROOT / "configs" / "cluster"


def available() -> list[str]:
    return sorted(p.stem for p in cluster_dir().glob("*.yaml"))


def load_cluster(name: str) -> ClusterProfile:
    path = Path(name) if name.endswith(".yaml") else cluster_dir() / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown cluster profile '{name}'; available: {', '.join(available())}")
    try:
        data = parse_profile_text(path.read_text(encoding="utf-8"), str(path))
    except (UnicodeDecodeError, OSError) as exc:
        raise UserError(f"cluster profile {path} is not readable text: {str(exc).splitlines()[0][:200]}") from None
    fields = {f.name for f in dataclasses.fields(ClusterProfile)}
    unknown = set(data) - fields
    if unknown:
        raise UserError(f"{path}: unknown keys {sorted(unknown)} (valid: {sorted(fields)})")
    data.setdefault("name", path.stem)
    if data.get("name") is None:
        data["name"] = path.stem
    if not isinstance(data.get("env") or {}, dict):
        raise UserError(f"{path}: env must be a mapping of NAME: value lines")
    data["env"] = {str(k): str(v) for k, v in (data.get("env") or {}).items()}
    if isinstance(data.get("binds"), list):
        data["binds"] = tuple(data["binds"])
    elif data.get("binds") is None:
        data["binds"] = ()
    if data.get("ld_library_path") is None:
        data["ld_library_path"] = ""
    for k in ("description", "sif", "bad_nodes_log", "log_dir", "cache_dir", "data_root", "time_limit"):
        if isinstance(data.get(k), int) and not isinstance(data.get(k), bool):
            data[k] = str(data[k])  # time_limit: 60 is sixty minutes
    for k in ("gpu_memory_gb", "host_memory_gb"):
        if isinstance(data.get(k), int) and not isinstance(data.get(k), bool):
            data[k] = float(data[k])
    return ClusterProfile(**data)


def profile_name(requested: str | None = None, config_cluster: str | None = None,
                 environ: Mapping[str, str] | None = None, default: str | None = DEFAULT_PROFILE) -> str:
    """Which profile, in the one order of every entry point: the command's --cluster, else PIPELINE_CLUSTER (the
    shell knobs of pipeline_env_config.env came from it), else the config's ``pipeline.cluster``, else ``default``
    (local_cpu; None: no default, a UserError)."""
    environ = os.environ if environ is None else environ
    name = requested or environ.get("PIPELINE_CLUSTER") or config_cluster or default
    if not name:
        raise UserError("no cluster profile: the config names none (pipeline.cluster) and --cluster was not given")
    return name


def resolve_profile(requested: str | None = None, config_cluster: str | None = None,
                    environ: Mapping[str, str] | None = None, default: str | None = DEFAULT_PROFILE) -> ClusterProfile:
    """The cluster profile of a command: the one resolver the launcher, isambard_sbatch, the checkpoint jobs and
    the shell knobs (``python3 -m pipeline.config.knobs env``) share; its knobs as the job sees them (an exported
    value wins) are ``config.knobs.effective_knobs``."""
    return load_cluster(profile_name(requested, config_cluster, environ, default))


if __name__ == "__main__":  # the shell knobs' command moved (config/knobs.py): say so, never print nothing with 0
    print("error: the cluster profile command is python3 -m pipeline.config.knobs env|show [NAME] "
          "(or pipeline-cluster)", file=sys.stderr)
    sys.exit(2)
