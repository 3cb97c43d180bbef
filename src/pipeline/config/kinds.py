"""The suite's kinds: each a ``Literal`` type with the tuple of its values, so that a word a model spec, a command
line, an experiment file or a record holds is checked by the type checker where it is written and validated once
where it is read (``--mode`` by argparse and the launch plan, an experiment phase's ``kind`` by its loader)."""

from __future__ import annotations

from typing import Literal, TypeGuard, get_args

EngineName = Literal["local", "megatron_bridge"]  # a model's training engine (ModelSpec.engine, the launch record;
ENGINES: tuple[EngineName, ...] = get_args(EngineName)  # the objects: config/engines.py)

CheckpointFormat = Literal["local", "megatron"]  # what a checkpoint folder holds (common.layout.engine_of)

Mode = Literal["pretrain", "cpt", "sft"]  # what a training run does (--mode; the recipe it starts from)
MODES: tuple[Mode, ...] = get_args(Mode)

PhaseKind = Literal["train", "export", "coherence"]  # an experiment phase's kind
PHASE_KINDS: tuple[PhaseKind, ...] = get_args(PhaseKind)

JobKind = Literal["train", "export", "coherence", "upload-all"]  # an experiment job: a phase's, or the upload rider's
JOB_KINDS: tuple[JobKind, ...] = get_args(JobKind)


def is_mode(value: object) -> TypeGuard[Mode]:
    return value in MODES


def is_phase_kind(value: object) -> TypeGuard[PhaseKind]:
    return value in PHASE_KINDS
