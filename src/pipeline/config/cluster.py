"""Cluster profiles (``configs/cluster/<name>.yaml``): GPUs per node, device memory, launcher, NCCL env."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

from pipeline.common.errors import UserError

ROOT = Path(os.environ.get("PIPELINE_ROOT") or Path(__file__).resolve().parents[3])


@dataclasses.dataclass(frozen=True)
class ClusterProfile:
    name: str
    description: str = ""
    gpus_per_node: int = 0
    procs_per_node: int = 1
    gpu_memory_gb: float = 0.0
    host_memory_gb: float = 0.0
    cpus_per_node: int = 1
    partition: str | None = None
    account: str | None = None
    time_limit: str = "01:00:00"
    exclusive: bool = False
    launcher: str = "torchrun"
    ft_section_timeouts: str = "setup:600,step:180,checkpointing:420"
    ft_out_of_section_timeout: int = 300
    max_restarts: int = 3
    rdzv_port: int = 29500
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def has_gpus(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node if self.has_gpus else self.procs_per_node

    @property
    def memory_budget_gb(self) -> float:
        return self.gpu_memory_gb if self.has_gpus else self.host_memory_gb


def cluster_dir() -> Path:
    return ROOT / "configs" / "cluster"


def available() -> list[str]:
    return sorted(p.stem for p in cluster_dir().glob("*.yaml"))


def load_cluster(name: str) -> ClusterProfile:
    path = Path(name) if name.endswith(".yaml") else cluster_dir() / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown cluster profile '{name}'; available: {', '.join(available())}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
        raise UserError(f"cluster profile {path} is not readable YAML: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(data, dict):
        raise UserError(f"cluster profile {path} must be a mapping of fields")
    fields = {f.name for f in dataclasses.fields(ClusterProfile)}
    unknown = set(data) - fields
    if unknown:
        raise UserError(f"{path}: unknown keys {sorted(unknown)} (valid: {sorted(fields)})")
    data.setdefault("name", path.stem)
    data["env"] = {str(k): str(v) for k, v in (data.get("env") or {}).items()}
    return ClusterProfile(**data)
