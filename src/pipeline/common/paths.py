"""Every root of the suite, with one fallback rule: the environment variable when it is set and not empty, else a
fixed place under the repository (``PIPELINE_ROOT``, else the checkout this package is installed from). Each
function reads ``os.environ``, or the mapping it is given (a job's environment being built).

``pipeline_env_config.env`` exports the same defaults for the shell side; this module is the Python side's only
reader of these variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# The batch scripts at the checkout's root, one per job: their names are written here and nowhere else in Python.
TRAINING_SUBMIT = "pipeline_training_submit.sbatch"
CHECKPOINT_SUBMIT = "pipeline_checkpoint_submit.sbatch"
COHERENCE_SUBMIT = "pipeline_coherence_submit.sbatch"
EVAL_SUBMIT = "pipeline_eval_submit.sbatch"
DATA_SUBMIT = "pipeline_data_submit.sbatch"
ENV_SUBMIT = "pipeline_env_submit.sbatch"
# validate's record of what an image holds, beside its SIF (pipeline.env.closure writes it, the training preflight
# reads it on the login node)
IMAGE_RECORD_SUFFIX = ".packages.txt"

# src/pipeline/common/paths.py -> the checkout (the editable install points here).
_CHECKOUT = Path(__file__).resolve().parents[3]


def _env_or(var: str, default: Path, env: Mapping[str, str] | None) -> Path:
    value = (os.environ if env is None else env).get(var)
    return Path(value) if value else default


def repo_root(env: Mapping[str, str] | None = None) -> Path:
    """The checkout: configs/, the pipeline_* scripts, runs/ and data/ by default."""
    return _env_or("PIPELINE_ROOT", _CHECKOUT, env)


def runs_dir(env: Mapping[str, str] | None = None) -> Path:
    """Run directories (``<runs>/<run name>/``): ``$PIPELINE_RUNS_DIR`` or ``<repo>/runs``."""
    return _env_or("PIPELINE_RUNS_DIR", repo_root(env) / "runs", env)


def data_root(env: Mapping[str, str] | None = None) -> Path:
    """Prepared datasets: ``$PIPELINE_DATA_ROOT`` or ``<repo>/data``."""
    return _env_or("PIPELINE_DATA_ROOT", repo_root(env) / "data", env)


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Downloads, images, built wheels: ``$PIPELINE_CACHE_DIR`` or ``<repo>/.cache``."""
    return _env_or("PIPELINE_CACHE_DIR", repo_root(env) / ".cache", env)


def models_dir(env: Mapping[str, str] | None = None) -> Path:
    """Materialised base models and imported checkpoints: ``$PIPELINE_MODELS_DIR`` or ``<repo>/.cache/models``."""
    return _env_or("PIPELINE_MODELS_DIR", repo_root(env) / ".cache" / "models", env)


def machine_cache_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """What is built once per machine and shared by every checkout on it (the SmolLM2 conversion):
    ``$PIPELINE_MACHINE_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/pipeline-suite``; ``off`` turns it off."""
    e = os.environ if env is None else env
    value = e.get("PIPELINE_MACHINE_CACHE")
    if value == "off":
        return None
    if value:
        return Path(value)
    return Path(e.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipeline-suite"
