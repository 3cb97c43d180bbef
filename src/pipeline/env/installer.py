"""The package installer of ``pipeline_env_setup.sh``: uv where it can be had, with pip's own sources.

uv installs the pinned lock several times faster than pip (``docs/benchmarks.md``), but it does not read pip's
configuration: a machine whose pip is pointed at a wheel folder, a mirror or a constraints file (``pip config``,
``PIP_*`` variables) would have uv fetch other files than pip does. ``uv-sources`` turns pip's configured sources
into uv's options, so both take the same wheels from the same places; ``--index-strategy unsafe-best-match`` is
pip's rule (the best matching version across every index, not the first index that has the name).

    python src/pipeline/env/installer.py uv-sources     # one uv option or value per line

Standard library only, run by path: it runs before the suite is installed.
"""

from __future__ import annotations

import subprocess
import sys

# pip option -> uv option; the values of each are space-separated lists in pip's configuration
OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
           "constraint": "--constraint"}


def uv_sources(pip_config_list: str) -> list[str]:
    """uv's options for the sources in ``pip config list``'s output (``section.key='value'`` lines; later
    lines win for the single-valued index-url, as pip's environment variables win over its files)."""
    seen: dict[str, list[str]] = {k: [] for k in OPTIONS}
    for line in pip_config_list.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        name = key.rsplit(".", 1)[-1].strip()
        if name not in OPTIONS:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values = value.split()
        if name == "index-url":
            seen[name] = values[-1:]
        else:
            seen[name] += [v for v in values if v not in seen[name]]
    out = ["--index-strategy", "unsafe-best-match"]
    for name, values in seen.items():
        for v in values:
            out += [OPTIONS[name], v]
    return out


def main(argv: list[str]) -> int:
    if argv[:1] != ["uv-sources"]:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    res = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    print("\n".join(uv_sources(res.stdout if res.returncode == 0 else "")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
