"""Typed views of a resolved training config, built and validated once at launch and read by the engines.

The launcher resolves the config (recipe < YAML < overrides) and runs the preflight; :func:`build_view` turns the
result into a :class:`RunView`: the parallel layout (every factor named, as torchtitan's ``ParallelDims``), the
batch and sequence, the checkpoint directory and the data paths the preflight resolved. It is recorded with the run
(``view.json``, beside ``config.yaml``) and the engines read it instead of re-deriving these values from dotted
lookups into the config. The typed config (:class:`~pipeline.config.schema.TrainingConfig`) remains the config of
record; its dict form is what is handed to Megatron Bridge.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.common.errors import UserError
from pipeline.common.io import write_json
from pipeline.config.kinds import Mode
from pipeline.config.models import ModelSpec
from pipeline.config.parallel import Layout
from pipeline.config.schema import TrainingConfig
from pipeline.data.chat import tokenizer_model_name
from pipeline.training.preflight import Plan, packed_data_paths

VIEW_FILE = "view.json"
VIEW_VERSION = 1


@dataclass(frozen=True)
class BatchView:
    """One optimizer step: ``global_batch_size = micro_batch_size * grad_accum * dp`` sequences of ``seq_length``."""

    global_batch_size: int
    micro_batch_size: int
    grad_accum: int
    seq_length: int
    train_iters: int

    @property
    def tokens_per_iter(self) -> int:
        return self.global_batch_size * self.seq_length

    def grad_accum_for(self, world: int) -> int:
        """Gradient accumulation for a data-parallel world (the local engine's world is its dp)."""
        return max(1, self.global_batch_size // (self.micro_batch_size * max(1, world)))


@dataclass(frozen=True)
class DataView:
    """Where the training data is: the packed SFT Parquet the preflight resolved (train / validation / metadata),
    and the dataset root under which a pretraining run finds Megatron ``*_text_document`` prefixes."""

    dataset_root: Path | None = None
    tokenizer: str | None = None
    packed: dict[str, Path] = field(default_factory=dict)

    def indexed_prefixes(self) -> list[Path]:
        if self.dataset_root is None:
            return []
        return sorted(p.with_suffix("") for p in Path(self.dataset_root).rglob("*_text_document.idx"))


@dataclass(frozen=True)
class RunView:
    model: str
    mode: str
    parallel: Layout  # the preflight's (config/parallel.py): world = tp * pp * cp * dp, experts ep * etp of world / pp
    batch: BatchView
    data: DataView
    save: Path | None
    seed: int = 1234

    def to_dict(self) -> dict[str, Any]:
        def plain(v):
            if isinstance(v, Path):
                return str(v)
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            return v

        d = dataclasses.asdict(self)
        d["parallel"] = self.parallel.as_record()
        return {"version": VIEW_VERSION, **{k: plain(v) for k, v in d.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunView:
        if d.get("version") != VIEW_VERSION:
            raise UserError(f"{VIEW_FILE} has version {d.get('version')!r}, this code reads {VIEW_VERSION}: relaunch "
                            "the run with pipeline_training_launch.sh to record it again")
        data = d["data"]
        return cls(model=d["model"], mode=d["mode"], parallel=Layout.from_record(d["parallel"]),
                   batch=BatchView(**d["batch"]),
                   data=DataView(dataset_root=Path(data["dataset_root"]) if data.get("dataset_root") else None,
                                 tokenizer=data.get("tokenizer"),
                                 packed={k: Path(v) for k, v in (data.get("packed") or {}).items()}),
                   save=Path(d["save"]) if d.get("save") else None, seed=int(d.get("seed", 1234)))


def build_view(cfg: TrainingConfig, spec: ModelSpec, mode: Mode, plan: Plan) -> RunView:
    """The view of a config whose preflight passed (``plan.ok``): every value here was checked there."""
    if not plan.ok:
        raise ValueError("build_view needs a plan whose preflight passed")
    root = cfg.dataset.dataset_root
    tok = cfg.dataset.offline_packing_specs.tokenizer_model_name or tokenizer_model_name(spec.name)
    packed = packed_data_paths(cfg, tok) or {}
    save = cfg.checkpoint.save
    return RunView(
        model=spec.name, mode=mode,
        parallel=plan.layout,
        batch=BatchView(global_batch_size=plan.gbs, micro_batch_size=plan.mbs, grad_accum=plan.grad_accum,
                        seq_length=plan.seq_length, train_iters=plan.train_iters),
        data=DataView(dataset_root=Path(root) if root else None, tokenizer=tok, packed=dict(packed)),
        save=Path(save) if save else None,
        seed=cfg.rng.seed or 1234,
    )


def write_view(run_dir: Path, view: RunView) -> None:
    write_json(Path(run_dir) / VIEW_FILE, view.to_dict())


def read_view(run_dir: Path) -> RunView:
    path = Path(run_dir) / VIEW_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: the run was recorded by an older launcher; relaunch it with "
                        "pipeline_training_launch.sh")
    return RunView.from_dict(json.loads(path.read_text()))
