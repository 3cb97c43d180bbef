"""Training engines: ``local`` (transformers Trainer, CPU or one GPU) and ``megatron_bridge`` (GPU cluster)."""
