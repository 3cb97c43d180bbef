"""Benchmark evaluation of Hugging Face exports with lm-evaluation-harness (tasks, plan, run)."""
