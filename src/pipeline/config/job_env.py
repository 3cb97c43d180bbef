"""The environment of a job's ranks: the cluster profile's ``env`` (NCCL over libfabric, CXI, socket interfaces), then
what the job adds (training's ``env_vars``, which win). The one rule of every GPU job (training, export, upload-all,
import, coherence, evaluation) and what their dry runs show."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping


def job_env(profile_env: Mapping[str, str], extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """The variables a GPU job sets for its ranks on top of the environment it starts in: the cluster profile's
    ``env`` (NCCL over libfabric, CXI, socket interfaces), then ``extra`` (training's ``env_vars``, which win). The
    one rule of every GPU job - training, export, upload-all, import, coherence - and what their dry runs show."""
    return {**{str(k): str(v) for k, v in profile_env.items()},
            **{str(k): str(v) for k, v in (extra or {}).items()}}


def job_environ(profile_env: Mapping[str, str], base: Mapping[str, str] | None = None,
                extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """The environment a job's ranks get: ``base`` (default: this process's environment) with :func:`job_env` on
    top (a profile value wins over an inherited one, as the training launcher has always set it)."""
    return {**(os.environ if base is None else base), **job_env(profile_env, extra)}


def apply_job_env(profile_env: Mapping[str, str], extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """Sets :func:`job_env` in this process's own environment - for a job that runs in process or execs its
    launcher (the exec'd torchrun and its ranks inherit it) - before torch.distributed / NCCL initialise.
    Returns the variables set."""
    env = job_env(profile_env, extra)
    os.environ.update(env)
    return env


def env_words(env: Mapping[str, str]) -> list[str]:
    """``NAME=value`` shell words (values quoted) for a dry run's launch line: what the launch sets."""
    return [f"{k}={shlex.quote(v)}" for k, v in env.items()]
