"""Cluster profiles (``configs/cluster/<name>.yaml``): everything that differs between a laptop and a cluster.

GPUs per node, device memory, launcher and NCCL env (read by the training launcher), the Slurm placement that
``isambard_sbatch`` adds to a submission (partition, account, time limit, exclusivity, GPUs per node), and the
shell knobs of ``pipeline_env_config.env`` (runtime, container image, shared bad-node log, log and cache roots).

Standard library only: the host's ``python3`` runs it before any environment exists::

    python3 -m pipeline.config.cluster env NAME     # KEY=VALUE lines for pipeline_env_config.env
    python3 -m pipeline.config.cluster show NAME    # the profile's fields

The profiles are written in a flat YAML subset (``key: value`` lines, one nested mapping for ``env``, block lists
of ``- item`` lines for ``binds``) parsed
here by hand, so the same parser serves the shell (no PyYAML on a login node) and the training launcher.
"""

from __future__ import annotations

import dataclasses
import netrc
import os
import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from pipeline.common import paths
from pipeline.common.argv import flag_values, has_flag
from pipeline.common.errors import UserError, cli_main

ROOT = paths.repo_root()  # evaluated at import: PIPELINE_ROOT of the process
RUNTIMES = ("venv", "apptainer", "charliecloud")
# Slurm time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"^(\d+|\d+:\d\d|\d+:\d\d:\d\d|\d+-\d+|\d+-\d+:\d\d|\d+-\d+:\d\d:\d\d)$")
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,-]+$")  # partition / account (a partition may be a comma list)
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

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
WANDB_MODES = ("auto", "online", "offline", "disabled")
WANDB_HOST = "api.wandb.ai"


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
# The record of which knobs a profile filled (``NAME:KEY,KEY``, NAME as selected: a name or a .yaml path), so that
# sourcing the env config again with
# another profile selected refills them, while a knob the user exported keeps winning.
FILLED = "PIPELINE_PROFILE_FILLED"
DEFAULT_PROFILE = "local_cpu"


@dataclasses.dataclass(frozen=True)
class ClusterProfile:
    name: str
    description: str = ""
    # How jobs run and where shared files live (relative paths are under the checkout).
    runtime: str = "venv"
    sif: str = ".cache/containers/nemo-26.06.sif"
    bad_nodes_log: str = ".slurm/bad_nodes.log"
    log_dir: str = "logs"
    cache_dir: str = ".cache"
    # Prepared datasets (PIPELINE_DATA_ROOT): ``prepare`` writes <data_root>/<org>__<name>/, the folder the shipped
    # configs' dataset.dataset_root names on that cluster.
    data_root: str = "data"
    # Where `pipeline_checkpoint_convert.sh import` writes Megatron checkpoints by default (<dir>/<HF name>), the
    # folder the shipped configs' checkpoint.pretrained_checkpoint reads; empty: <models dir>/megatron_bridges/models.
    megatron_models_dir: str = ""
    # What a container job must see besides the checkout (always bound) and the runtime's own folders: host paths
    # or HOST:CONTAINER pairs (the data, checkpoint, model, log and cache roots the configs read, the fabric
    # libraries of the NCCL plugin), bound by every launcher (PIPELINE_PROFILE_BINDS); a path a plan checks outside
    # them is a problem naming the bind to add. ``ld_library_path``: the container folders of those libraries
    # (libfabric for aws-ofi-nccl), put on the container's LD_LIBRARY_PATH after the plugin (PIPELINE_FABRIC_LIBS).
    binds: tuple[str, ...] = ()
    ld_library_path: str = ""
    # Hardware.
    gpus_per_node: int = 0
    procs_per_node: int = 1
    gpu_memory_gb: float = 0.0
    host_memory_gb: float = 0.0
    cpus_per_node: int = 1
    # Slurm placement added by isambard_sbatch unless the user or the script's #SBATCH header sets it.
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    exclusive: bool = False
    # Launcher.
    launcher: str = "torchrun"
    ft_section_timeouts: str = "setup:600,step:180,checkpointing:420"
    ft_out_of_section_timeout: int = 300
    max_restarts: int = 3
    rdzv_port: int = 29500
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # Services the cluster reaches (an exported HF_HUB_OFFLINE / WANDB_MODE / WANDB_ENTITY still wins).
    hub_offline: bool = True         # no Hugging Face hub at run time (laptop, CI); false where the hub is reachable
    wandb_mode: str = "auto"         # auto: online when a W&B key exists (WANDB_API_KEY or `wandb login`'s netrc)
    wandb_entity: str | None = None  # the team's W&B entity (None: the key's default)
    # The W&B project of coherence runs (pipeline_coherence_test.py; --wandb-project, else an exported
    # COHERENCE_WANDB_PROJECT, wins). Read by our Python only, so it is no shell knob.
    coherence_wandb_project: str = "pipeline-gen-tests"

    def __post_init__(self) -> None:
        where = f"cluster profile '{self.name}'"

        def bad(field: str, why: str) -> UserError:
            return UserError(f"{where}: {field} {getattr(self, field)!r} {why}")

        if not isinstance(self.name, str) or not re.match(r"^[A-Za-z0-9_.-]+$", self.name):
            raise UserError(f"{where}: name must be letters, digits, '_', '.', '-'")
        if self.runtime not in RUNTIMES:
            raise bad("runtime", f"is not one of {', '.join(RUNTIMES)}")
        for f in ("gpus_per_node", "procs_per_node", "cpus_per_node", "ft_out_of_section_timeout",
                  "max_restarts", "rdzv_port"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(f, "must be an integer")
        for f in ("gpu_memory_gb", "host_memory_gb"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise bad(f, "must be a number >= 0")
        if self.gpus_per_node < 0:
            raise bad("gpus_per_node", "must be >= 0 (0: a CPU machine)")
        if self.procs_per_node < 1 or self.cpus_per_node < 1:
            raise UserError(f"{where}: procs_per_node and cpus_per_node must be >= 1")
        if self.max_restarts < 0:
            raise bad("max_restarts", "must be >= 0")
        if not 1 <= self.rdzv_port <= 65535:
            raise bad("rdzv_port", "must be a port number (1-65535)")
        if self.time_limit is not None and (not isinstance(self.time_limit, str) or not _TIME.match(self.time_limit)):
            raise bad("time_limit", "is not a Slurm time (quote it: \"HH:MM:SS\", \"D-HH:MM:SS\" or minutes)")
        for f in ("partition", "account"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, str) or not _SLURM_NAME.match(v)):
                raise bad(f, "is not a Slurm name (letters, digits, '_', '.', '-', ','), or null for the default")
        if not isinstance(self.exclusive, bool):
            raise bad("exclusive", "must be true or false")
        if self.launcher not in ("torchrun", "ft_launcher"):
            raise bad("launcher", "must be torchrun or ft_launcher")
        for f in ("description", "sif", "bad_nodes_log", "log_dir", "cache_dir", "data_root", "ft_section_timeouts"):
            v = getattr(self, f)
            if not isinstance(v, str) or any(ord(c) < 32 or ord(c) == 127 for c in v):
                raise bad(f, "must be a one-line string")
        for f in ("sif", "bad_nodes_log", "log_dir", "cache_dir", "data_root"):
            if not getattr(self, f):
                raise bad(f, "must not be empty")
        if not isinstance(self.hub_offline, bool):
            raise bad("hub_offline", "must be true or false")
        if self.wandb_mode not in WANDB_MODES:
            raise bad("wandb_mode", f"is not one of {', '.join(WANDB_MODES)}")
        if self.wandb_entity is not None and (not isinstance(self.wandb_entity, str)
                                              or not re.match(r"^[A-Za-z0-9_.-]+$", self.wandb_entity)):
            raise bad("wandb_entity", "is not a W&B entity name (letters, digits, '_', '.', '-'), or null")
        if not isinstance(self.coherence_wandb_project, str) or not re.match(r"^[A-Za-z0-9_.-]+$",
                                                                             self.coherence_wandb_project):
            raise bad("coherence_wandb_project", "is not a W&B project name (letters, digits, '_', '.', '-')")
        if not isinstance(self.binds, tuple) or not all(isinstance(b, str) for b in self.binds):
            raise UserError(f"{where}: binds must be a list of host paths or HOST:CONTAINER pairs")
        for b in self.binds:
            parts = b.split(":")
            if (len(parts) > 2 or "," in b or any(ord(c) < 33 or ord(c) == 127 for c in b)
                    or not all(x.startswith("/") for x in parts)):
                raise UserError(f"{where}: binds {b!r} is not an absolute host path or HOST:CONTAINER pair of "
                                "absolute paths (no commas or spaces)")
        if not isinstance(self.ld_library_path, str) or any(
                ord(c) < 33 or ord(c) == 127 for c in self.ld_library_path) or not all(
                x.startswith("/") for x in self.ld_library_path.split(":") if self.ld_library_path):
            raise bad("ld_library_path", "must be absolute container folders separated by ':'")
        if not isinstance(self.env, dict):
            raise UserError(f"{where}: env must be a mapping of NAME: value")
        for k, v in self.env.items():
            if not _ENV_KEY.match(str(k)) or any(ord(c) < 32 for c in str(v)):
                raise UserError(f"{where}: env {k!r}: names are [A-Za-z_][A-Za-z0-9_]*, values one line")

    @property
    def has_gpus(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node if self.has_gpus else self.procs_per_node

    @property
    def memory_budget_gb(self) -> float:
        return self.gpu_memory_gb if self.has_gpus else self.host_memory_gb

    def path(self, field: str, root: Path | None = None) -> str:
        """A path field, absolute (relative ones are under the checkout)."""
        return str((root or ROOT) / getattr(self, field))

    def container_binds(self) -> list[tuple[str, str]]:
        """The profile's binds as (host, container) pairs."""
        return [(h, g or h) for h, _, g in (b.partition(":") for b in self.binds)]

    def knob_values(self, root: Path | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The shell knobs this profile fills (PIPELINE_RUNTIME, PIPELINE_SIF, ...), paths made absolute; W&B's
        auto mode is resolved against ``environ``'s key or netrc."""
        out = {}
        for k, f in KNOBS.items():
            v = getattr(self, f)
            if f in PATH_FIELDS:
                v = self.path(f, root)
            elif f == "binds":
                v = ",".join(v)
            elif f == "hub_offline":
                v = "1" if v else "0"
            elif f == "wandb_mode" and v == "auto":
                v = "online" if wandb_key_present(environ) else "offline"
            out[k] = "" if v is None else str(v)
        return out


def cluster_dir() -> Path:
    return ROOT / "configs" / "cluster"


def available() -> list[str]:
    return sorted(p.stem for p in cluster_dir().glob("*.yaml"))


# --- the flat YAML subset -------------------------------------------------------------------------------------

def _scalar(text: str, where: str):
    """One YAML scalar of the subset: null/~, true/false, integers, floats, quoted or plain strings."""
    t = text.strip()
    if t.startswith('"'):
        m = re.match(r'^"((?:[^"\\]|\\.)*)"\s*(#.*)?$', t)
        if not m:
            raise UserError(f"{where}: unterminated double-quoted string")
        return re.sub(r'\\(.)', lambda e: {"n": "\n", "t": "\t"}.get(e.group(1), e.group(1)), m.group(1))
    if t.startswith("'"):
        m = re.match(r"^'((?:[^']|'')*)'\s*(#.*)?$", t)
        if not m:
            raise UserError(f"{where}: unterminated single-quoted string")
        return m.group(1).replace("''", "'")
    t = re.split(r"\s+#", t, maxsplit=1)[0].strip()  # a comment starts at " #"
    if t and t[0] in "[{&*!|>@`%":
        raise UserError(f"{where}: {t[:40]!r}: only plain scalars are supported in a cluster profile "
                        "(quote the value)")
    if t in ("", "~", "null", "Null", "NULL"):
        return None
    if t in ("true", "True", "TRUE"):
        return True
    if t in ("false", "False", "FALSE"):
        return False
    if re.match(r"^[-+]?\d+$", t):
        return int(t)
    if re.match(r"^[-+]?(\d+\.\d*|\.\d+)([eE][-+]?\d+)?$", t):
        return float(t)
    return t


def parse_profile_text(text: str, source: str) -> dict:
    """The mapping of a profile file: ``key: value`` lines; ``env:`` alone on its line opens one nested mapping
    of indented ``NAME: value`` lines, and a key alone on its line followed by ``- item`` lines is a list of strings
    (``binds``). Anything else (lists, flow style, anchors, multi-line) is one-line error."""
    data: dict = {}
    nested: dict | None = None
    listed: str | None = None  # the key whose "- item" lines follow
    for n, raw in enumerate(text.splitlines(), 1):
        where = f"{source}:{n}"
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise UserError(f"{where}: tabs are not allowed for indentation")
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#") or line.strip() == "---":
            continue
        indented = line[0] == " "
        item = re.match(r"^\s*-(?:\s+(.*))?$", line)
        if item:
            if listed is None or (data[listed] != {} and not isinstance(data[listed], list)):
                raise UserError(f"{where}: a list item outside a list (only a key alone on its line, like binds:, "
                                "opens one)")
            if not isinstance(data[listed], list):
                data[listed] = []
            nested = None
            value = _scalar(item.group(1) or "", where)
            if not isinstance(value, str):
                raise UserError(f"{where}: a list item must be a string")
            data[listed].append(value)
            continue
        m = re.match(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*:(?:\s+(.*))?$", line)
        if not m:
            raise UserError(f"{where}: expected 'key: value' (a cluster profile is flat YAML), "
                            f"got {line.strip()[:60]!r}")
        key, value = m.group(1), (m.group(2) or "")
        if indented:
            if nested is None:
                raise UserError(f"{where}: unexpected indentation (only the env: mapping is nested)")
            listed = None
            if key in nested:
                raise UserError(f"{where}: duplicate key {key!r}")
            nested[key] = _scalar(value, where)
            continue
        if key in data:
            raise UserError(f"{where}: duplicate key {key!r}")
        if value.strip() == "" or value.strip().startswith("#"):
            data[key] = nested = {}  # a mapping or a list follows (or nothing: an empty mapping, like YAML's null)
            listed = key
            continue
        nested = None
        listed = None
        data[key] = _scalar(value, where)
    return {k: (None if v == {} and k != "env" else v) for k, v in data.items()}


def load_cluster(name: str) -> ClusterProfile:
    path = Path(name) if name.endswith(".yaml") else cluster_dir() / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown cluster profile '{name}'; available: {', '.join(available())}")
    try:
        data = parse_profile_text(path.read_text(encoding="utf-8"), str(path))
    except (UnicodeDecodeError, OSError) as exc:
        raise UserError(f"cluster profile {path} is not readable text: {str(exc).splitlines()[0][:200]}") from None
    fields = {f.name for f in dataclasses.fields(ClusterProfile)}
    unknown = set(data) - fields
    if unknown:
        raise UserError(f"{path}: unknown keys {sorted(unknown)} (valid: {sorted(fields)})")
    data.setdefault("name", path.stem)
    if data.get("name") is None:
        data["name"] = path.stem
    if not isinstance(data.get("env") or {}, dict):
        raise UserError(f"{path}: env must be a mapping of NAME: value lines")
    data["env"] = {str(k): str(v) for k, v in (data.get("env") or {}).items()}
    if isinstance(data.get("binds"), list):
        data["binds"] = tuple(data["binds"])
    elif data.get("binds") is None:
        data["binds"] = ()
    if data.get("ld_library_path") is None:
        data["ld_library_path"] = ""
    for k in ("description", "sif", "bad_nodes_log", "log_dir", "cache_dir", "data_root", "time_limit"):
        if isinstance(data.get(k), int) and not isinstance(data.get(k), bool):
            data[k] = str(data[k])  # time_limit: 60 is sixty minutes
    for k in ("gpu_memory_gb", "host_memory_gb"):
        if isinstance(data.get(k), int) and not isinstance(data.get(k), bool):
            data[k] = float(data[k])
    return ClusterProfile(**data)


# --- the environment of a job's ranks --------------------------------------------------------------------------

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


# --- the sbatch options a profile adds -------------------------------------------------------------------------

def profile_sbatch_options(profile, user_opts: list[str], script_opts: list[str] | tuple[str, ...] = ()
                           ) -> list[str]:
    """The sbatch options the cluster profile adds to a submission (pure; sorted): --gpus-per-node (when > 0),
    --partition, --account, --time, --exclusive - each only when neither the user's command line nor the
    script's own #SBATCH header sets it (user > script header > profile). The values were validated by
    ClusterProfile, and the result is an argv list, never shell text."""
    given = [*user_opts, *script_opts]
    out = []
    asks_gpus = has_flag(given, "--gpus-per-node", "--gpus", "-G", "--gpus-per-task", "--gpus-per-socket") or any(
        "gpu" in v for v in (*flag_values(given, "--gres"), *flag_values(given, "--tres-per-task")))
    if profile.gpus_per_node > 0 and not asks_gpus:  # a --gres of other resources asks for no GPU
        out.append(f"--gpus-per-node={profile.gpus_per_node}")
    if profile.partition and not has_flag(given, "--partition", "-p"):
        out.append(f"--partition={profile.partition}")
    if profile.account and not has_flag(given, "--account", "-A"):
        out.append(f"--account={profile.account}")
    if profile.time_limit and not has_flag(given, "--time", "-t"):
        out.append(f"--time={profile.time_limit}")
    if profile.exclusive and not has_flag(given, "--exclusive", "--oversubscribe", "-s"):
        out.append("--exclusive")
    return sorted(out)


# --- the shell side ---------------------------------------------------------------------------------------------

def profile_name(requested: str | None = None, config_cluster: str | None = None,
                 environ: Mapping[str, str] | None = None, default: str | None = DEFAULT_PROFILE) -> str:
    """Which profile, in the one order of every entry point: the command's --cluster, else PIPELINE_CLUSTER (the
    shell knobs of pipeline_env_config.env came from it), else the config's ``pipeline.cluster``, else ``default``
    (local_cpu; None: no default, a UserError)."""
    environ = os.environ if environ is None else environ
    name = requested or environ.get("PIPELINE_CLUSTER") or config_cluster or default
    if not name:
        raise UserError("no cluster profile: the config names none (pipeline.cluster) and --cluster was not given")
    return name


def resolve_profile(requested: str | None = None, config_cluster: str | None = None,
                    environ: Mapping[str, str] | None = None, default: str | None = DEFAULT_PROFILE) -> ClusterProfile:
    """The cluster profile of a command: the one resolver the launcher, isambard_sbatch, the checkpoint jobs and
    the shell knobs (``python3 -m pipeline.config.cluster env``) share; its knobs as the job sees them (an exported
    value wins) are :func:`effective_knobs`."""
    return load_cluster(profile_name(requested, config_cluster, environ, default))


def user_set(environ: Mapping[str, str]) -> dict[str, str]:
    """The profile knobs the user set: exported, and not a value that a profile filled earlier (an earlier
    sourcing of pipeline_env_config.env records those in PIPELINE_PROFILE_FILLED as ``NAME:KEY,KEY``)."""
    prev_name, _, keys = environ.get(FILLED, "").rpartition(":")
    filled = set(keys.split(",")) if keys else set()
    prev: dict[str, str] = {}
    if filled:
        try:
            prev = load_cluster(prev_name).knob_values(environ=environ)
        except UserError:
            prev = {}
    return {k: environ[k] for k in KNOBS if k in environ and not (k in filled and prev.get(k) == environ[k])}


def effective_knobs(profile: ClusterProfile, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each profile knob as a job would see it: the user's exported value wins, else the profile's."""
    environ = os.environ if environ is None else environ
    return {**profile.knob_values(environ=environ), **user_set(environ)}


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
              "usage: python3 -m pipeline.config.cluster env|show [NAME]", file=sys.stderr)
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
