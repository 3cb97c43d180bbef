"""The container overlay's installer, and what every install of megatron-core needs beyond its wheel.

``install TARGET [PINS]``: the overlay's pins (3rdparty/requirements-container.txt) into TARGET, as the env setup's
overlay step runs it inside the container and the container twin runs it on this machine: ``pip wheel --no-deps``
into a wheelhouse (a pinned package published only as a source archive, such as lm-eval's rouge-score, sqlitedict
and word2number, is built into a wheel there), then ``pip install --no-deps --no-index --target`` from it, then
``complete``.

``complete SITE``: Megatron Bridge's ``initialize_megatron()`` calls megatron-core's ``compile_helpers()`` on local
rank 0 of every node; it runs ``make -C <megatron/core/datasets>`` and exits 1 when make fails. The 0.19.2 wheels ship
the prebuilt ``helpers_cpp`` library but no Makefile, so ``complete`` places ``3rdparty/megatron-core-datasets.mk``
there (read its header): make then finds the prebuilt library up to date, or builds it for another Python. Every
place that installs megatron-core calls it, with the folder it installed into:

    python src/pipeline/env/overlay.py install TARGET [PINS]   # the overlay step (in the container), the twin
    python src/pipeline/env/overlay.py complete SITE           # the Bridge harness, the GPU ready check's wheels

Standard library only, run by path: it runs inside the container before the suite's environment exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAKEFILE = ROOT / "3rdparty" / "megatron-core-datasets.mk"
PINS = ROOT / "3rdparty" / "requirements-container.txt"
DATASETS = Path("megatron") / "core" / "datasets"


def datasets_dir(site: Path) -> Path:
    return Path(site) / DATASETS


def complete(site: Path, makefile: Path = MAKEFILE) -> Path:
    """Place the helpers' Makefile in ``site``'s megatron-core (atomically, mode 0644); returns its path. Raises
    FileNotFoundError when ``site`` holds no megatron-core."""
    folder = datasets_dir(site)
    if not (folder / "helpers.cpp").is_file():
        raise FileNotFoundError(f"{site} holds no megatron-core ({DATASETS / 'helpers.cpp'} is missing)")
    target = folder / "Makefile"
    fd, tmp = tempfile.mkstemp(prefix=".Makefile.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(makefile.read_bytes())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def is_complete(site: Path, makefile: Path = MAKEFILE) -> bool:
    """Whether ``site``'s megatron-core has this checkout's helpers Makefile."""
    target = datasets_dir(site) / "Makefile"
    try:
        return target.read_bytes() == makefile.read_bytes()
    except OSError:
        return False


def install(target: Path, pins: Path = PINS, python: str = sys.executable) -> Path:
    """The overlay: ``pins`` built or downloaded as wheels, installed into ``target`` with ``--no-deps`` (the image
    provides the rest; pipeline.env.closure checks that it does), then :func:`complete`. Raises
    subprocess.CalledProcessError when pip fails (its output goes to this process's)."""
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    wheels = Path(tempfile.mkdtemp(prefix=".wheelhouse.", dir=target))
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    try:
        subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), "-r", str(pins)], check=True)
        subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target),
                        *sorted(str(w) for w in wheels.glob("*.whl"))], check=True)
    finally:
        shutil.rmtree(wheels, ignore_errors=True)
    return complete(target)


USAGE = "usage: python src/pipeline/env/overlay.py install TARGET [PINS] | complete SITE"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("install", "complete") or len(args) not in ((2, 3) if args[0] == "install"
                                                                               else (2,)):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        if args[0] == "install":
            made = install(Path(args[1]), Path(args[2]) if len(args) == 3 else PINS)
        else:
            made = complete(Path(args[1]))
        print(f"overlay: {made} (megatron-core's dataset helpers: compile_helpers() runs make here)")
    except (FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"error: pip failed ({exc.returncode}): {' '.join(exc.cmd[:6])} ...", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
