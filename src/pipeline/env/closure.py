"""The container's package closure: is every requirement of the overlay satisfied by image + overlay?

Inside a job the overlay (3rdparty/requirements-container.txt, installed with ``pip install --no-deps --target``)
comes first on the path, then the NGC image's own packages. Nothing resolves that combination at install time,
so this module does it from the packages' own metadata (``packaging``):

- **closure**: the requirements of every overlay package whose metadata we have (megatron-bridge, megatron-core
  with the extras Bridge asks for, ...), walked recursively through overlay packages, each satisfied by the
  overlay's version if it has one (it shadows the image's) or else the image's; NVIDIA's own builds (torch,
  Transformer Engine, apex) count as provided whatever their version string says;
- **no redundant pins**: an overlay pin of a package that the image already has at a version satisfying every
  requirement on it is refused: an older copy first on the path shadows the image's (NVRx 0.4.1 over the image's
  0.6.0 crashed ``import megatron.core``);
- **each pin has its reason**: a comment line right above it.

    python -m pipeline.env.closure [--image FILE] [--overlay FILE] [--wheels DIR] [--machine aarch64]
    python -m pipeline.env.closure --installed     # inside the container: the image as pip sees it there

The image's package set is recorded in 3rdparty/image-packages.txt (``pip list --format=freeze`` inside the
SIF); ``--installed`` reads it from the running Python with the overlay taken off the path.
"""

from __future__ import annotations

import argparse
import dataclasses
import email.parser
import importlib.metadata as md
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from pipeline.common import paths
from pipeline.common.errors import UserError, cli_main
from pipeline.common.io import write_text

ROOT = paths.repo_root()
IMAGE_LIST = ROOT / "3rdparty" / "image-packages.txt"
OVERLAY = ROOT / "3rdparty" / "requirements-container.txt"
# NVIDIA's builds in the NGC image: their versions (2.10.0a0+gitXXXX, ...) are not PyPI's and no PyPI pin
# describes them; present in the image, they satisfy any requirement on them.
NVIDIA_PROVIDED = frozenset({"torch", "transformer-engine", "apex", "triton", "torchvision", "torchaudio",
                             "flash-attn", "mamba-ssm", "causal-conv1d", "fast-hadamard-transform",
                             "pytorch-triton"})
# The suite's own needs inside the container, pinned exactly as in the local venv (requirements/local.txt), so
# both worlds write the same bytes.
SUITE_NEEDS = ("orjson",)
PY = "3.12"  # the NGC image's Python


@dataclasses.dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: Version
    line: str
    reason: str  # the comment right above the pin ("" when none)


def _version(text: str, where: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise UserError(f"{where}: {text!r} is not a version") from None


def read_freeze(path: Path) -> dict[str, Version]:
    """``name==version`` lines (pip freeze); comments and blank lines skipped."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read the package list {path}: {exc.strerror}") from None
    out: dict[str, Version] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, ver = line.partition("==")
        if not sep:
            raise UserError(f"{path}:{n}: expected NAME==VERSION, got {line!r}")
        out[canonicalize_name(name.strip())] = _version(ver.strip(), f"{path}:{n}")
    return out


def read_overlay(path: Path) -> list[Pin]:
    pins, comment = [], []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if line.startswith("#"):
            comment.append(line.lstrip("# "))
            continue
        if not line:
            comment = []
            continue
        name, sep, ver = line.split(";")[0].partition("==")
        if not sep:
            raise UserError(f"{path}:{n}: overlay pins are exact (NAME==VERSION), got {line!r}")
        pins.append(Pin(canonicalize_name(name.strip()), _version(ver.strip(), f"{path}:{n}"), line,
                        " ".join(comment)))
        comment = []
    return pins


def _requires(metadata_text: str) -> list[Requirement]:
    msg = email.parser.Parser().parsestr(metadata_text, headersonly=True)
    out = []
    for r in msg.get_all("Requires-Dist") or []:
        try:
            out.append(Requirement(r))
        except InvalidRequirement:
            continue  # a malformed line in someone's metadata is theirs; pip skips it as well
    return out


def wheel_requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return _requires(z.read(name).decode("utf-8", "replace"))


def fetch_wheel(name: str, version: Version, cache: Path, machine: str = "x86_64") -> Path:
    """The wheel of ``name==version`` for CPython 3.12 on linux/``machine`` (downloaded once into ``cache``); for a
    package published only as a source archive, the pure-Python wheel built from it, as the overlay step builds it
    (src/pipeline/env/overlay.py install)."""
    stem = canonicalize_name(name).replace("-", "_")
    pattern = f"{stem}-{version}-*.whl"
    found = [w for w in cache.glob(pattern) if machine in w.name or w.name.endswith("-none-any.whl")]
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--python-version", PY, "--only-binary=:all:", *platform_args(machine), f"{name}=={version}",
           "-d", str(cache)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    found = [w for w in cache.glob(pattern) if machine in w.name or w.name.endswith("-none-any.whl")]
    if res.returncode != 0 or not found:  # published as a source archive only: the overlay step builds its wheel
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check",
                                "--no-deps", "--no-binary", name, f"{name}=={version}", "-w", str(cache)],
                               capture_output=True, text=True)
        found = [w for w in cache.glob(pattern) if w.name.endswith("-none-any.whl")]  # pure Python only
        if built.returncode == 0 and found:
            return found[0]
    if res.returncode != 0 or not found:
        last = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR")] or res.stderr.splitlines() or ["?"]
        raise UserError(f"{name}=={version} has no wheel for CPython {PY} on linux {machine}: {last[-1].strip()}")
    return found[0]


def platform_args(machine: str) -> list[str]:
    """Every manylinux tag pip should accept for ``machine`` (the GH200 nodes run glibc 2.39: NVRx 0.5+)."""
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(39, 16, -1)] + [f"manylinux2014_{machine}",
                                                                               f"linux_{machine}"]
    return [a for t in tags for a in ("--platform", t)]


def marker_env(machine: str, extra: str = "") -> dict[str, str]:
    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}  # every marker value is a str
    env.update(python_version=PY, python_full_version=f"{PY}.0", sys_platform="linux", platform_system="Linux",
               os_name="posix", platform_machine=machine, implementation_name="cpython",
               platform_python_implementation="CPython", extra=extra)
    return env


def _show(req: Requirement) -> str:
    """A requirement without its marker (the extra it came through is named by the requirer)."""
    return f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}"


def check(image: dict[str, Version], overlay: list[Pin], requires: dict[str, list[Requirement]],
          suite_needs: Iterable[Requirement] = (), machine: str = "x86_64",
          image_requires: dict[str, list[Requirement]] | None = None) -> list[str]:
    """Problems of image + overlay (empty: every requirement is satisfied and every pin is needed).
    ``requires[name]`` are the Requires-Dist of the overlay package ``name`` (canonical); ``image_requires``, when
    known (in the container, or the twin that installs the image's list), those of the image's packages, so that
    an overlay pin that breaks an image package (a downgrade it does not accept) is found too."""
    pins = {p.name: p for p in overlay}
    problems: list[str] = []
    env = marker_env(machine)
    for pkg, reqs in sorted((image_requires or {}).items()):
        if pkg in pins:
            continue  # shadowed: the overlay's copy and its requirements are what runs
        for r in reqs:
            name = canonicalize_name(r.name)
            if name in pins and name not in NVIDIA_PROVIDED and (r.marker is None or r.marker.evaluate(env)) \
                    and r.specifier and not r.specifier.contains(pins[name].version, prereleases=True):
                problems.append(f"the image's {pkg} {image.get(pkg, '?')} requires {_show(r)}, but the overlay's "
                                f"{pins[name].line} shadows the image's {name}; choose a pin both accept")
    specs: dict[str, list[tuple[Requirement, str]]] = {}
    roots = [Requirement(f"{p.name}=={p.version}") for p in overlay if p.name in requires]
    ROOT_PIN = "the overlay's pin"  # a pin walked for its requirements: not a requirement on itself
    queue: list[tuple[Requirement, str]] = [(r, ROOT_PIN) for r in roots] + [(r, "the suite") for r in suite_needs]
    walked: set[tuple[str, str]] = set()
    while queue:
        req, by = queue.pop(0)
        name = canonicalize_name(req.name)
        if by != ROOT_PIN:
            specs.setdefault(name, []).append((req, by))
        where, have = (("the overlay", pins[name].version) if name in pins else
                       ("the image", image[name]) if name in image else (None, None))
        if have is None:
            problems.append(f"{by} requires {_show(req)}, which neither the image nor the overlay has: pin it in "
                            f"{OVERLAY.name} (with its reason) or use an image that has it")
            continue
        if name not in NVIDIA_PROVIDED and req.specifier and not req.specifier.contains(have, prereleases=True):
            fix = (f"pin a matching {name} in the overlay" if where == "the image" else
                   f"change the overlay's pin ({name}=={have})")
            if where == "the overlay" and name in image and req.specifier.contains(image[name], prereleases=True):
                fix = f"remove {name} from the overlay: the image's {image[name]} satisfies it"
            problems.append(f"{by} requires {_show(req)}, but {where} has {name} {have} first on the path; {fix}")
        if name in requires:
            for extra in ("", *sorted(req.extras)):
                if (name, extra) in walked:
                    continue
                walked.add((name, extra))
                env = marker_env(machine, extra)
                for sub in requires[name]:
                    if sub.marker is None and extra:
                        continue  # the unconditional ones were walked with extra ""
                    if sub.marker is None or sub.marker.evaluate(env):
                        queue.append((sub, f"{name}{f'[{extra}]' if extra else ''}=={have}"))
    for pin in overlay:
        if not pin.reason:
            problems.append(f"overlay pin {pin.line} has no reason: write one on the comment line above it")
        if pin.name in image and pin.name in specs:
            img = image[pin.name]
            if all(not r.specifier or r.specifier.contains(img, prereleases=True) for r, _ in specs[pin.name]):
                older = " (an older copy first on the path shadows the image's)" if pin.version < img else ""
                problems.append(f"overlay pin {pin.line} is not needed: the image's {pin.name} {img} satisfies "
                                f"every requirement on it{older}; remove it from {OVERLAY.name}")
    return problems


def local_pins(names: Iterable[str]) -> list[Requirement]:
    """The suite's container needs, pinned as in the local venv's lock."""
    lock = read_freeze(ROOT / "requirements" / "local.txt")
    return [Requirement(f"{n}=={lock[canonicalize_name(n)]}") for n in names if canonicalize_name(n) in lock]


def overlay_requires(overlay: list[Pin], cache: Path, machine: str = "x86_64") -> dict[str, list[Requirement]]:
    """Requires-Dist of every overlay pin, read from its CPython 3.12 wheel for ``machine`` (downloaded once)."""
    return {p.name: wheel_requires(fetch_wheel(p.name, p.version, cache, machine)) for p in overlay}


def _parse_requires(dists) -> dict[str, list[Requirement]]:
    """``(name, Requires-Dist lines)`` per distribution, in path order -> the first of each name, parsed."""
    out: dict[str, list[Requirement]] = {}
    for raw_name, raw_reqs in dists:
        name = canonicalize_name(raw_name or "")
        if name and name not in out:
            reqs = []
            for r in raw_reqs or []:
                try:
                    reqs.append(Requirement(r))
                except InvalidRequirement:
                    continue
            out[name] = reqs
    return out


def installed_requires(paths_: list[str]) -> dict[str, list[Requirement]]:
    """Requires-Dist of every distribution found on ``paths_`` (first one of a name wins, as for imports)."""
    return _parse_requires((d.metadata["Name"], d.requires) for d in md.distributions(path=paths_))


# Run by this interpreter without PYTHONPATH (and -P: no script directory first): its distributions in path order.
_LIST_DISTRIBUTIONS = ("import importlib.metadata as md, json; "
                       "print(json.dumps([[d.metadata['Name'], d.requires] for d in md.distributions()]))")


def image_requires() -> dict[str, list[Requirement]]:
    """Requires-Dist of the image's own distributions: those this Python sees without PYTHONPATH (the overlay and
    the suite's src/), asked of a child of the same interpreter, as the image's own pip sees them."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-P", "-c", _LIST_DISTRIBUTIONS], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise UserError(f"listing the image's distributions failed: "
                        f"{(res.stderr.strip().splitlines() or ['?'])[-1]}")
    return _parse_requires(json.loads(res.stdout))


def installed_image() -> dict[str, Version]:
    """The packages of this Python with the overlay taken off the path: the image as its own pip sees it."""
    overlay = os.environ.get("PIPELINE_OVERLAY", "")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != overlay]
    if keep:
        env["PYTHONPATH"] = os.pathsep.join(keep)
    res = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
                         capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise UserError(f"pip list failed: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
    out: dict[str, Version] = {}
    for line in res.stdout.splitlines():
        name, sep, ver = line.partition("==")
        if sep:
            try:
                out[canonicalize_name(name)] = Version(ver)
            except InvalidVersion:
                continue
    return out


RECORD_SUFFIX = paths.IMAGE_RECORD_SUFFIX


def image_record(sif: str | None = None) -> Path | None:
    """Where ``validate`` records what the image really holds: beside the SIF it was pulled into
    (``$PIPELINE_SIF.packages.txt``); None without a SIF (the venv runtime)."""
    sif = sif if sif is not None else os.environ.get("PIPELINE_SIF", "")
    return Path(sif + RECORD_SUFFIX) if sif else None


def record_image(packages: dict[str, Version], where: Path, image: str) -> Path:
    """Write ``packages`` as ``where`` (pip freeze lines, sorted; atomically), headed by the image it was read in."""
    lines = [f"# The packages of {image}, recorded by pipeline.env.validate (image-packages) inside the container;",
             "# python -m pipeline.env.closure reads this record in place of 3rdparty/image-packages.txt."]
    lines += [f"{name}=={version}" for name, version in sorted(packages.items())]
    return write_text(where, "\n".join(lines) + "\n", shared=True)  # the team's: a teammate's validate rewrites it


def default_image_list() -> Path:
    """The image's recorded packages where validate has recorded them (:func:`image_record`), else the repository's
    list (3rdparty/image-packages.txt)."""
    record = image_record()
    return record if record is not None and record.is_file() else IMAGE_LIST


def diff_lists(recorded: dict[str, Version], actual: dict[str, Version]) -> list[str]:
    """How the running image differs from the recorded list (names and versions)."""
    out = [f"{n} {recorded[n]} -> {actual[n]}" for n in sorted(recorded.keys() & actual.keys())
           if recorded[n] != actual[n]]
    out += [f"{n} {recorded[n]} missing" for n in sorted(recorded.keys() - actual.keys())]
    out += [f"{n} {actual[n]} not recorded" for n in sorted(actual.keys() - recorded.keys())]
    return out


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.env.closure", description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", type=Path, default=None,
                    help="the image's package list (pip freeze; default: validate's record beside $PIPELINE_SIF "
                    "where it exists, else 3rdparty/image-packages.txt)")
    ap.add_argument("--installed", action="store_true", help="read the image from this Python (in the container)")
    ap.add_argument("--overlay", type=Path, default=OVERLAY, help="the overlay's pins")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".cache" / "wheels", help="wheel cache")
    ap.add_argument("--machine", default="x86_64", choices=("x86_64", "aarch64"))
    ap.add_argument("--provided", default="", metavar="NAME,...",
                    help="NVIDIA builds counted as present although absent (the container twin's stand-ins)")
    args = ap.parse_args(argv)
    if args.image is None:
        args.image = default_image_list()
    image = installed_image() if args.installed else read_freeze(args.image)
    for name in filter(None, args.provided.split(",")):
        if canonicalize_name(name) not in NVIDIA_PROVIDED:
            raise UserError(f"--provided {name}: only NVIDIA's builds can be stood in for "
                            f"({', '.join(sorted(NVIDIA_PROVIDED))})")
        image.setdefault(canonicalize_name(name), Version("0"))
    overlay = read_overlay(args.overlay)
    problems = check(image, overlay, overlay_requires(overlay, args.wheels, args.machine), local_pins(SUITE_NEEDS),
                     args.machine, image_requires() if args.installed else None)
    if not args.installed:
        print("note: the image packages' own requirements are checked where the image is installed (--installed, "
              "in the container or the container twin)", file=sys.stderr)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    what = "the running image" if args.installed else (args.image.name if args.image == IMAGE_LIST
                                                        else f"{args.image} (validate's record)")
    print(f"closure of {args.overlay.name} over {what} ({len(image)} packages, linux {args.machine}, CPython {PY}): "
          f"{'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
