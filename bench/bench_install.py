"""The quickstart's install: pip against uv on the pinned lock, side by side, into fresh venvs.

    python bench/bench_install.py [--rounds 1] [--requirements requirements/local.txt]

Each round creates a fresh venv per variant (``python3.11 -m venv``) and installs the lock into it:

  pip           ``pip install -r LOCK`` with the machine's pip configuration and its warm download cache
  uv, cold      ``uv pip install --compile-bytecode`` (as pip compiles) with pip's sources
                (``src/pipeline/env/installer.py``), an empty uv cache
  uv, warm      the same with uv's cache as the cold run left it (a second checkout on the same machine)

and checks that both installers put the same distributions at the same versions in the venv, and the same files
with the same hashes for torch (the CPU wheel), transformers and numpy (RECORD, less each installer's own
bookkeeping files). Prints seconds per variant and the ratio to pip.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UV_PIN = "uv==0.13.9"


def sh(*cmd, **kw):
    res = subprocess.run([str(c) for c in cmd], text=True, capture_output=True, **kw)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} ... failed ({res.returncode}): {res.stderr[-1500:]}")
    return res


def venv(path: Path) -> Path:
    sh("python3.11", "-m", "venv", path)
    return path / "bin" / "python"


def freeze(py: Path) -> dict[str, str]:
    out = sh(py, "-m", "pip", "list", "--format=freeze").stdout
    return {x.split("==")[0].lower().replace("_", "-"): x.split("==")[1] for x in out.split() if "==" in x}


def record(py: Path, dist: str) -> list[str]:
    site = Path(sh(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    info = next(site.glob(f"{dist}-*.dist-info"))
    skip = (".pyc,", "dist-info/INSTALLER", "dist-info/RECORD", "dist-info/REQUESTED", "direct_url", "uv_cache.json")
    lines = (info / "RECORD").read_text().replace("\r", "").splitlines()
    return sorted(x for x in lines if not any(s in x for s in skip) and not x.startswith(("../", "bin/")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--requirements", type=Path, default=ROOT / "requirements" / "local.txt")
    a = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-install."))
    tool = venv(base / "tool")
    sh(tool, "-m", "pip", "install", "-q", UV_PIN)
    uv = tool.parent / "uv"
    sources = sh(tool, ROOT / "src/pipeline/env/installer.py", "uv-sources").stdout.split()
    times: dict[str, list[float]] = {"pip": [], "uv, cold cache": [], "uv, warm cache": []}
    pys = {}
    for r in range(a.rounds):
        cache = base / f"uv-cache-{r}"
        for name in times:
            py = venv(base / f"{name.replace(', ', '-').replace(' ', '-')}-{r}")
            t0 = time.perf_counter()
            if name == "pip":
                sh(py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", a.requirements)
            else:
                sh(uv, "pip", "install", "--quiet", "--compile-bytecode", "--python", py, *sources, "-r",
                   a.requirements, env={**os.environ, "UV_CACHE_DIR": str(cache)})
            times[name].append(time.perf_counter() - t0)
            pys[name] = py
    same_dists = freeze(pys["pip"]) == freeze(pys["uv, cold cache"]) == freeze(pys["uv, warm cache"])
    same_files = {d: record(pys["pip"], d) == record(pys["uv, cold cache"], d)
                  for d in ("torch", "transformers", "numpy")}
    ref = min(times["pip"])
    print(f"lock {a.requirements.name}: {len(freeze(pys['pip']))} distributions in the venv; {a.rounds} round(s); "
          f"best of rounds")
    print("| installer | seconds | ratio to pip |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.1f} | {min(ts) / ref:.2f} |")
    print(f"same distributions and versions: {'yes' if same_dists else 'NO'}; same files and hashes: "
          + ", ".join(f"{d} {'yes' if ok else 'NO'}" for d, ok in same_files.items()))
    shutil.rmtree(base, ignore_errors=True)
    return 0 if same_dists and all(same_files.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
