"""Coherence pipeline: prompts, generation backends (hf, megatron, endpoint), metrics, reports."""
