"""The training config schema: sections and field names mirror Megatron Bridge's ``ConfigContainer``.

So one override (``train.train_iters=200``) means the same on both engines. ``None`` means "keep the
recipe's value". A key that is not in the schema fails with a hint; Hydra's ``+key=value`` adds a key
the schema does not know (passed through to Megatron Bridge; the local engine warns that it ignores it).

Suite-only keys, stripped before the config reaches Megatron Bridge: the top-level ``pipeline`` section
(cluster profile, local-engine options) and ``dataset.dataset_name``.
"""

from __future__ import annotations

import copy
from typing import Any

SCHEMA: dict[str, Any] = {
    "model": {
        "seq_length": None,
        "tensor_model_parallel_size": None,
        "pipeline_model_parallel_size": None,
        "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": None,
        "expert_model_parallel_size": None,
        "expert_tensor_parallel_size": None,
        "sequence_parallel": None,
        "recompute_granularity": None,
        "recompute_method": None,
        "recompute_num_layers": None,
        "recompute_modules": None,
        "moe_permute_fusion": None,
        "moe_token_dispatcher_type": None,
        "moe_grouped_gemm": None,
        "gradient_accumulation_fusion": None,
        "cross_entropy_loss_fusion": None,
        "calculate_per_token_loss": None,
        "bf16": None,
        "fp8": None,
        "cp_comm_type": None,
        "attention_backend": None,
    },
    "train": {
        "train_iters": None,
        "global_batch_size": None,
        "micro_batch_size": None,
        "exit_signal_handler": None,
        "exit_duration_in_mins": None,
        "manual_gc": None,
        "manual_gc_interval": None,
    },
    "validation": {"eval_interval": None, "eval_iters": None},
    "optimizer": {
        "optimizer": None,
        "lr": None,
        "min_lr": None,
        "weight_decay": None,
        "adam_beta1": None,
        "adam_beta2": None,
        "adam_eps": None,
        "clip_grad": None,
        "use_distributed_optimizer": None,
    },
    "scheduler": {
        "lr_warmup_iters": None,
        "lr_decay_iters": None,
        "lr_decay_style": None,
        "start_weight_decay": None,
        "end_weight_decay": None,
    },
    "dataset": {
        "dataset_name": None,  # suite-only: where the data came from (documentation, stripped for Bridge)
        "dataset_root": None,
        "seq_length": None,
        "seed": None,
        "num_workers": None,
        "do_validation": None,
        "do_test": None,
        "enable_offline_packing": None,
        "offline_packing_specs": {
            "packed_sequence_size": None,
            "pad_seq_to_mult": None,
            "tokenizer_model_name": None,
            "packed_train_data_path": None,
            "packed_val_data_path": None,
            "packed_metadata_path": None,
            "pad_cu_seqlens": None,
        },
    },
    "checkpoint": {
        "save": None,
        "load": None,
        "pretrained_checkpoint": None,
        "save_interval": None,
        "save_optim": None,
        "save_rng": None,
        "ckpt_format": None,
        "async_save": None,
    },
    "logger": {
        "log_interval": None,
        "wandb_project": None,
        "wandb_entity": None,
        "wandb_exp_name": None,
        "wandb_save_dir": None,
        "tensorboard_dir": None,
    },
    "tokenizer": {"tokenizer_type": None, "tokenizer_model": None},
    "rng": {"seed": None},
    "ddp": {"use_distributed_optimizer": None, "grad_reduce_in_fp32": None, "overlap_grad_reduce": None,
            "overlap_param_gather": None, "check_for_nan_in_grad": None},
    "ft": {"enable_ft_package": None, "calc_ft_timeouts": None},
    "peft": {"dim": None, "alpha": None, "dropout": None, "target_modules": None},
    "dist": {"distributed_timeout_minutes": None},
    "mixed_precision": None,
    "env_vars": {},
    # Suite-only settings (never passed to Megatron Bridge).
    "pipeline": {
        "cluster": None,  # cluster profile name under configs/cluster/
        "local": {
            "dtype": "float32",     # local engine compute dtype (CPU: float32)
            # bf16 autocast of the forward (weights, gradients and optimizer stay in dtype): "bf16", "off", or
            # "auto" (bf16 where the CPU computes bf16 natively: AMX or AVX512-BF16; off elsewhere and on CUDA)
            "autocast": "off",
            "gradient_checkpointing": False,
            # Fault injection for the tests (training/engines/local.py, training/fault_tolerance.py).
            "fault_inject_nan_step": None,    # the loss becomes NaN from this step on
            "fault_inject_hang_step": None,   # rank 0 stops making progress at this step (first attempt only)
            "fault_inject_step_sleep": None,  # every step this many seconds slower (a predictable step time)
        },
    },
}

SUITE_ONLY = (("pipeline",), ("dataset", "dataset_name"))


def schema_copy() -> dict[str, Any]:
    return copy.deepcopy(SCHEMA)
