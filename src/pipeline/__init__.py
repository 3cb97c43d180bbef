"""LLM pipeline suite: data -> training -> checkpoint -> coherence, on Slurm or one machine."""

__version__ = "0.1.0"
