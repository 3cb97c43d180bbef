"""Runtimes behind one interface: ``venv`` (local), ``apptainer`` (cluster default), ``charliecloud``.

Pure functions render the exact command line that runs a shell command inside the configured runtime, with
the bind list and environment from ``pipeline_env_config.env``; ``check`` lists what is missing, each with
the command that fixes it. Standard library only: launchers call it with the host's python3 before any
environment exists.

    python3 -m pipeline.env.runtimes render -- "python -c 'import torch'"   # NUL-separated argv on stdout
    python3 -m pipeline.env.runtimes check                                  # problems + fixes, exit 1 if any
    python3 -m pipeline.env.runtimes enter -- "COMMAND"     # check, prepare and render: one Python start
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path

from pipeline.common import paths
from pipeline.config.knobs import effective_knobs

RUNTIMES = ("venv", "apptainer", "charliecloud")
# Environment passed into a container explicitly (apptainer runs with --cleanenv).
PASS_ENV_PREFIXES = ("PIPELINE_", "HF_", "WANDB_", "NCCL_", "FI_", "SLURM_", "TORCH_", "CUDA_", "BAD_NODES_")
PASS_ENV_NAMES = ("TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "PYTHONUNBUFFERED",
                  "TRANSFORMERS_OFFLINE")


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    runtime: str
    root: Path
    venv: Path
    env_ready: Path  # PIPELINE_ENV_READY: the env setup's marker of a complete venv
    sif: Path
    image: str
    ch_image: Path
    overlay: Path
    nccl_plugin_dir: Path
    extra_binds: tuple[str, ...] = ()
    data_paths: tuple[Path, ...] = ()
    profile_binds: tuple[str, ...] = ()  # PIPELINE_PROFILE_BINDS: the cluster profile's binds, SRC[:DST]
    fabric_libs: str = ""                # PIPELINE_FABRIC_LIBS: the profile's libfabric folder(s) in the container

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RuntimeConfig:
        e = dict(os.environ if env is None else env)
        root, cache = paths.repo_root(e), paths.cache_dir(e)
        venv = Path(e.get("PIPELINE_VENV") or root / ".venv")
        data = tuple(Path(e[k]) for k in ("PIPELINE_DATA_ROOT", "PIPELINE_RUNS_DIR", "PIPELINE_LOG_DIR",
                                          "PIPELINE_MODELS_DIR", "HF_HOME", "WANDB_DIR") if e.get(k))
        return cls(
            runtime=e.get("PIPELINE_RUNTIME", "venv"),
            root=root,
            venv=venv,
            env_ready=Path(e.get("PIPELINE_ENV_READY") or venv / ".pipeline_steps" / "packages.done"),
            sif=Path(e.get("PIPELINE_SIF") or cache / "containers" / "nemo.sif"),
            image=e.get("PIPELINE_IMAGE", "nvcr.io/nvidia/nemo:26.06"),
            ch_image=Path(e.get("PIPELINE_CH_IMAGE") or cache / "containers" / "debian-bookworm"),
            overlay=Path(e.get("PIPELINE_OVERLAY") or cache / "overlay"),
            nccl_plugin_dir=Path(e.get("PIPELINE_NCCL_PLUGIN_DIR") or cache / "aws-ofi-nccl"),
            extra_binds=tuple(b for b in (e.get("PIPELINE_BINDS") or "").split(",") if b),
            data_paths=data,
            profile_binds=tuple(b for b in (e.get("PIPELINE_PROFILE_BINDS") or "").split(",") if b),
            fabric_libs=e.get("PIPELINE_FABRIC_LIBS") or "",
        )


def venv_home(venv: Path) -> Path | None:
    """The interpreter installation a venv links to (``home`` in pyvenv.cfg), so it can be bound too."""
    cfg = venv / "pyvenv.cfg"
    if not cfg.exists():
        return None
    for line in cfg.read_text().splitlines():
        k, _, v = line.partition("=")
        if k.strip() == "home":
            return Path(v.strip()).parent
    return None


def binds(cfg: RuntimeConfig) -> list[tuple[str, str]]:
    """(host, guest) pairs: the checkout, the Python overlay and NCCL plugin, the cluster profile's binds,
    data/run/cache dirs, extra binds (PIPELINE_BINDS). A path inside an already bound directory is not bound
    again."""
    paths: list[Path] = [cfg.root]
    if cfg.runtime == "charliecloud":
        home = venv_home(cfg.venv)
        paths += [cfg.venv] + ([home] if home else [])
    else:
        paths += [cfg.overlay, cfg.nccl_plugin_dir]
    pairs: list[tuple[str, str]] = []
    for b in cfg.profile_binds:
        src, _, dst = b.partition(":")
        if dst and dst != src:
            pairs.append((src, dst))
        else:
            paths.append(Path(src))
    paths += list(cfg.data_paths)
    out: list[tuple[str, str]] = []
    seen: list[Path] = []
    for p in paths:
        p = Path(os.path.abspath(p))
        if any(p == s or s in p.parents for s in seen):
            continue
        seen.append(p)
        out.append((str(p), str(p)))
    out += pairs
    for b in cfg.extra_binds:
        src, _, dst = b.partition(":")
        out.append((src, dst or src))
    return out


def visible(cfg: RuntimeConfig, path: str | os.PathLike) -> bool:
    """Whether ``path`` (as a process in the runtime names it) lies in the checkout or under a bind's guest
    side; always True for the venv runtime (the host's own files)."""
    if cfg.runtime == "venv":
        return True
    pairs = binds(cfg)

    def under(p: Path, roots: list[Path]) -> bool:
        return any(p == r or r in p.parents for r in roots)

    p = Path(os.path.abspath(path))
    if not under(p, [Path(os.path.abspath(d)) for _, d in pairs]):
        return False
    # and where it leads: a symlink under a bind that points outside every bind is a dangling link in the container
    # (<bound>/link/ck must not pass where the same folder named directly is refused). The host's real path
    # is compared with each bind's real source (a bind whose source is itself a link is mounted where it leads).
    # A bind SRC:DST with SRC != DST shows the host's SRC at DST: the path the container names is SRC/rest on the
    # host, and a link resolved there to SRC/... (an absolute target) is not at that name in the container; only a
    # bind mounted at its own name (SRC == DST) keeps a host link's target visible.
    host = p
    for src, dst in sorted(pairs, key=lambda sd: len(sd[1]), reverse=True):
        d = Path(os.path.abspath(dst))
        if under(p, [d]):
            host = Path(os.path.abspath(src)) / p.relative_to(d)
            break
    real = Path(os.path.realpath(host))
    if real == host:
        return True  # no link on the way
    return under(real, [Path(os.path.realpath(src)) for src, dst in pairs
                        if os.path.abspath(src) == os.path.abspath(dst)])


def job_runtime(profile, environ: dict[str, str] | None = None) -> RuntimeConfig:
    """The runtime a job of this cluster profile starts in: ``environ`` (default: this process's) with the
    profile's knobs (runtime, log/cache dirs, binds; an exported value wins), as pipeline_env_config.env sets
    them for the launchers."""
    e = dict(os.environ if environ is None else environ)
    e.update(effective_knobs(profile, e))
    return RuntimeConfig.from_env(e)


def invisible_paths(profile, checked: list[tuple[str, object]], environ: dict[str, str] | None = None
                    ) -> list[str]:
    """One line for each (label, path) of ``checked`` that a container job of ``profile`` would not see (outside
    the checkout and every bind), naming the bind to add; none for the venv runtime or a path of None."""
    cfg = job_runtime(profile, environ)
    out = []
    for label, path in checked:
        if path is None or str(path) == "" or visible(cfg, str(path)):
            continue
        p = Path(str(path))
        folder = p if p.is_dir() else p.parent
        have = (environ if environ is not None else os.environ).get("PIPELINE_BINDS", "")
        binds = f"{have},{folder}" if have else str(folder)
        out.append(f"{label} {path} is not visible in the container ({cfg.runtime}): bind it for your jobs with "
                   f"export PIPELINE_BINDS={shlex.quote(binds)} (comma-separated SRC[:DST]), or for every user add "
                   f"it (or a folder above it) to the cluster profile's binds (configs/cluster/{profile.name}.yaml)")
    return out


def container_env(cfg: RuntimeConfig, env: dict[str, str] | None = None) -> dict[str, str]:
    e = dict(os.environ if env is None else env)
    out = {k: v for k, v in e.items() if k.startswith(PASS_ENV_PREFIXES) or k in PASS_ENV_NAMES}
    out["PIPELINE_ROOT"] = str(cfg.root)
    out["PIPELINE_IN_CONTAINER"] = cfg.runtime
    out["USER"] = e.get("USER") or "pipeline"
    out["HOME"] = e.get("HOME", "/root")
    # caches must be writable inside a read-only image: keep them under the bound checkout
    out["XDG_CACHE_HOME"] = e.get("PIPELINE_CACHE_DIR") or str(cfg.root / ".cache")
    if cfg.runtime == "apptainer":
        out["PYTHONPATH"] = f"{cfg.root}/src:{cfg.overlay}"
        # the aws-ofi-nccl plugin built by the nccl-plugin step, ahead of the image's libraries
        # and the host's libfabric it was built against (the profile's ld_library_path, bound from /opt/cray)
        fabric = f"{cfg.fabric_libs}:" if cfg.fabric_libs else ""
        out["LD_LIBRARY_PATH"] = f"{cfg.nccl_plugin_dir}/lib:{fabric}/usr/local/cuda/lib64:/usr/local/lib"
    return dict(sorted(out.items()))


def render(cfg: RuntimeConfig, command: str, env: dict[str, str] | None = None) -> list[str]:
    """The argv that runs ``bash -c command`` inside the runtime (a pure function of its inputs)."""
    if cfg.runtime == "venv":
        return ["bash", "-c", command]
    envs = container_env(cfg, env)
    if cfg.runtime == "apptainer":
        argv = ["apptainer", "exec", "--nv", "--cleanenv", "--bind", ",".join(f"{s}:{d}" for s, d in binds(cfg))]
        for k, v in envs.items():
            argv += ["--env", f"{k}={v}"]
        return argv + [str(cfg.sif), "bash", "-c", command]
    if cfg.runtime == "charliecloud":
        argv = ["ch-run"]
        for s, d in binds(cfg):
            argv += ["-b", f"{s}:{d}"]
        argv += [f"--set-env={k}={v}" for k, v in envs.items()]
        argv += ["--env-no-expand", "-c", str(cfg.root), str(cfg.ch_image), "--", "bash", "-c", command]
        return argv
    raise ValueError(f"unknown runtime {cfg.runtime!r} (expected one of {', '.join(RUNTIMES)})")


def check(cfg: RuntimeConfig) -> list[str]:
    """What is missing for the runtime to start, each problem with the command that fixes it."""
    setup = f"bash {cfg.root}/pipeline_env_setup.sh"
    problems = []
    if cfg.runtime not in RUNTIMES:
        return [f"unknown PIPELINE_RUNTIME '{cfg.runtime}' (expected one of {', '.join(RUNTIMES)}); "
                "fix pipeline_env_config.env"]
    if cfg.runtime in ("venv", "charliecloud"):
        if not (cfg.venv / "bin" / "python").exists() or not cfg.env_ready.exists():
            problems.append(f"the environment is missing or incomplete ({cfg.venv}); create it with: {setup}")
    if cfg.runtime == "apptainer":
        if not cfg.sif.is_file():
            problems.append(f"container image {cfg.sif} is missing; pull it with: {setup} --only pull")
        if not (cfg.nccl_plugin_dir / "lib" / "libnccl-net.so").exists():
            problems.append(f"NCCL network plugin missing in {cfg.nccl_plugin_dir}; build it with: "
                            f"{setup} --only nccl-plugin")
        if not (cfg.overlay / ".pipeline_overlay.done").exists():
            problems.append(f"Python overlay missing in {cfg.overlay}; install it with: {setup} --only overlay")
    if cfg.runtime == "charliecloud" and not (cfg.ch_image / "bin" / "bash").exists():
        problems.append(f"container image {cfg.ch_image} is missing; build it with: {setup} --only image")
    return problems


def prepare(cfg: RuntimeConfig) -> None:
    """A Charliecloud directory image is read-only at run time: create the bind mount points first."""
    if cfg.runtime == "charliecloud" and cfg.ch_image.is_dir():
        for _, dst in binds(cfg):
            (cfg.ch_image / dst.lstrip("/")).mkdir(parents=True, exist_ok=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = RuntimeConfig.from_env()
    if argv[:1] in (["render"], ["enter"]):
        cmd = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        if not cmd:
            print(f"error: {argv[0]} needs a command", file=sys.stderr)
            return 2
        if argv[0] == "enter":  # what a launcher does before it execs the argv: check, prepare, render
            problems = check(cfg)
            for p in problems:
                print(f"error: {p}", file=sys.stderr)
            if problems:
                return 1
            prepare(cfg)
        try:
            out = render(cfg, " ".join(cmd))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write("\0".join(out) + "\0")
        return 0
    if argv[:1] == ["check"]:
        problems = check(cfg)
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 1 if problems else 0
    if argv[:1] == ["prepare"]:
        prepare(cfg)
        return 0
    if argv[:1] == ["binds"]:
        for s, d in binds(cfg):
            print(f"{s}:{d}")
        return 0
    print(__doc__)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
