"""The shell knobs of ``pipeline_env_config.env`` (runtime, container image, shared bad-node log, log, cache and data
roots, the hub and W&B settings, binds) as a cluster profile fills them, and the round trip with the user's own
exported values (which win). Standard library only: the host's ``python3`` runs it before any environment exists::

    python3 -m pipeline.config.knobs env NAME     # KEY=VALUE lines for pipeline_env_config.env
    python3 -m pipeline.config.knobs show NAME    # the profile's fields

(``pipeline-cluster env|show NAME`` is the same command, installed.)
"""

from __future__ import annotations

import dataclasses
import netrc
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pipeline.common.errors import UserError, cli_main
from pipeline.config.cluster import ClusterProfile, load_cluster, profile_name

# Shell knobs of pipeline_env_config.env that come from the profile: knob -> profile field.
KNOBS = {
    "PIPELINE_RUNTIME": "runtime",
    "PIPELINE_SIF": "sif",
    "PIPELINE_BAD_NODES_LOG": "bad_nodes_log",
    "PIPELINE_LOG_DIR": "log_dir",
    "PIPELINE_CACHE_DIR": "cache_dir",
    "PIPELINE_DATA_ROOT": "data_root",
    "HF_HUB_OFFLINE": "hub_offline",
    "WANDB_MODE": "wandb_mode",
    "WANDB_ENTITY": "wandb_entity",
    "PIPELINE_PROFILE_BINDS": "binds",
    "PIPELINE_FABRIC_LIBS": "ld_library_path",
}
PATH_FIELDS = ("sif", "bad_nodes_log", "log_dir", "cache_dir", "data_root")
WANDB_HOST = "api.wandb.ai"
# The record of which knobs a profile filled (``NAME:KEY,KEY``, NAME as selected: a name or a .yaml path), so that
# sourcing the env config again with another profile selected refills them, while a knob the user exported keeps
# winning.
FILLED = "PIPELINE_PROFILE_FILLED"


def wandb_key_present(environ: Mapping[str, str] | None = None) -> bool:
    """A W&B key is there: WANDB_API_KEY, or an entry for api.wandb.ai in the netrc that ``wandb login`` writes
    (NETRC, else ~/.netrc)."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY"):
        return True
    path = environ.get("NETRC") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(WANDB_HOST) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def knob_values(profile: ClusterProfile, root: Path | None = None,
                environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The shell knobs a profile fills (PIPELINE_RUNTIME, PIPELINE_SIF, ...), paths made absolute; W&B's auto mode
    is resolved against ``environ``'s key or netrc."""
    out = {}
    for k, f in KNOBS.items():
        v = getattr(profile, f)
        if f in PATH_FIELDS:
            v = profile.path(f, root)
        elif f == "binds":
            v = ",".join(v)
        elif f == "hub_offline":
            v = "1" if v else "0"
        elif f == "wandb_mode" and v == "auto":
            v = "online" if wandb_key_present(environ) else "offline"
        out[k] = "" if v is None else str(v)
    return out


def user_set(environ: Mapping[str, str]) -> dict[str, str]:
    """The profile knobs the user set: exported, and not a value that a profile filled earlier (an earlier
    sourcing of pipeline_env_config.env records those in PIPELINE_PROFILE_FILLED as ``NAME:KEY,KEY``)."""
    prev_name, _, keys = environ.get(FILLED, "").rpartition(":")
    filled = set(keys.split(",")) if keys else set()
    prev: dict[str, str] = {}
    if filled:
        try:
            prev = knob_values(load_cluster(prev_name), environ=environ)
        except UserError:
            prev = {}
    return {k: environ[k] for k in KNOBS if k in environ and not (k in filled and prev.get(k) == environ[k])}


def effective_knobs(profile: ClusterProfile, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each profile knob as a job would see it: the user's exported value wins, else the profile's."""
    environ = os.environ if environ is None else environ
    return {**knob_values(profile, environ=environ), **user_set(environ)}


def env_lines(name: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """``KEY=VALUE`` lines for pipeline_env_config.env: every profile knob (the user's value where set) and the
    record of what the profile filled. Values are printed raw - the reader assigns them with ``declare``, which
    never evaluates them - so a value may not hold a newline (refused by the profile's validation)."""
    environ = os.environ if environ is None else environ
    profile = load_cluster(name)
    mine = user_set(environ)
    values = effective_knobs(profile, environ)
    filled = [k for k in KNOBS if k not in mine]
    lines = [f"{k}={v}" for k, v in values.items()]
    lines.append(f"{FILLED}={name}:{','.join(filled)}")
    for line in lines:
        if "\n" in line or "\0" in line:
            raise UserError(f"cluster profile '{name}': a value holds a newline: {line.splitlines()[0]!r}")
    return lines


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) not in (1, 2) or argv[0] not in ("env", "show"):
        print(__doc__.split("\n\n")[1] if argv and argv[0] in ("-h", "--help") else
              "usage: python3 -m pipeline.config.knobs env|show [NAME]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name = profile_name(argv[1] if len(argv) == 2 else None)
    if argv[0] == "env":
        print("\n".join(env_lines(name)))
    else:
        profile = load_cluster(name)
        for f in dataclasses.fields(ClusterProfile):
            print(f"{f.name}: {getattr(profile, f.name)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
