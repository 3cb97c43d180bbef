"""Check every Megatron Bridge name the suite uses against the source of the pinned wheel - parsed, not
imported (Bridge cannot be imported without Transformer Engine and CUDA).

    python -m pipeline.training.conformance                 # download (cached) the pinned wheel and check
    python -m pipeline.training.conformance --source DIR    # check an unpacked source tree instead

The names come from ``pipeline.bridge.BRIDGE_API``: (module, qualified name, keyword arguments).
A name is found when the module defines it (def, class, assignment) or re-exports it with an import,
which is followed to the defining module; keyword arguments must be parameters of the function (or the
keyword arguments must be named parameters of the function (a ``**kwargs`` catch-all does not count:
passing a renamed parameter through it fails at run time).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from pipeline.bridge import BRIDGE_API
from pipeline.common import paths
from pipeline.common.errors import UserError, cli_main
from pipeline.config.models import REGISTRY

ROOT = paths.repo_root()  # evaluated at import: PIPELINE_ROOT of the process


def pinned_version(package: str = "megatron-bridge") -> str:
    text = (ROOT / "3rdparty" / "requirements-container.txt").read_text()
    m = re.search(rf"^{re.escape(package)}==(\S+)", text, re.M)
    if not m:
        raise UserError(f"{package} is not pinned in 3rdparty/requirements-container.txt")
    return m.group(1)


def fetch_wheel_source(version: str, cache: Path, package: str = "megatron-bridge") -> Path:
    """Download a wheel for Python 3.12 (from any interpreter) once and unpack it; returns the source root."""
    stem = package.replace("-", "_")
    dest = cache / f"{stem}-{version}"
    if (dest / "megatron").is_dir():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    wheels = list(cache.glob(f"{stem}-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--python-version", "3.12",
                        "--only-binary=:all:", f"{package}=={version}", "-d", str(cache)], check=True,
                       capture_output=True, text=True)
        wheels = list(cache.glob(f"{stem}-{version}-*.whl"))
    tmp = dest.with_suffix(".tmp")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(tmp)
    os.replace(tmp, dest)
    return dest


class Source:
    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._cache:
            base = self.root / Path(*name.split("."))
            path = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
            self._cache[name] = ast.parse(path.read_text()) if path.exists() else None
        return self._cache[name]

    def find(self, module: str, name: str, depth: int = 0):
        """The AST node defining ``name`` in ``module`` (following re-exports), or None."""
        tree = self.module(module)
        if tree is None or depth > 6:
            return None
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                if isinstance(node.value, ast.Name):  # alias = other_name
                    return self.find(module, node.value.id, depth + 1)
                return node
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        src = node.module or ""
                        if node.level:
                            parts = module.split(".")
                            is_pkg = (self.root / Path(*parts) / "__init__.py").exists()
                            base = parts if is_pkg else parts[:-1]
                            base = base[: len(base) - (node.level - 1)]
                            src = ".".join(base + ([src] if src else []))
                        return self.find(src, alias.name, depth + 1)
        return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    return {x.arg for x in a.args + a.kwonlyargs}


def check(source_root: Path, api) -> list[str]:
    src = Source(source_root)
    problems = []
    for module, qualname, kwargs in api:
        first, *rest = qualname.split(".")
        node = src.find(module, first)
        if node is None:
            problems.append(f"{module}.{qualname}: '{first}' not found")
            continue
        for attr in rest:
            if not isinstance(node, ast.ClassDef):
                problems.append(f"{module}.{qualname}: '{first}' is not a class")
                node = None
                break
            node = next((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and n.name == attr), None)
            if node is None:
                problems.append(f"{module}.{qualname}: method '{attr}' not found")
                break
        if node is None or not kwargs:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = _params(node)
            missing = [k for k in kwargs if k not in names]
            if missing:
                problems.append(f"{module}.{qualname}: no keyword argument(s) {missing}")
    return problems


@cli_main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, help="an unpacked megatron-bridge source tree (default: the pinned wheel)")
    args = p.parse_args(argv)

    root = args.source or fetch_wheel_source(pinned_version(), ROOT / ".cache" / "wheels")
    problems = check(root, BRIDGE_API) + check_recipe_facts(root, REGISTRY)
    for prob in problems:
        print(f"MISSING {prob}")
    print(f"conformance: {len(BRIDGE_API) - len(problems)} of {len(BRIDGE_API)} names found in {root}")
    return 1 if problems else 0



# ---- recipe values ------------------------------------------------------------------------------------------
_SECTIONS = {"train", "model", "dataset", "optimizer", "scheduler", "checkpoint", "logger", "validation", "rng"}


def _const(node, local: dict):
    if isinstance(node, ast.Constant):
        return True, node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
            and isinstance(node.operand.value, (int, float, complex))):
        return True, -node.operand.value
    if isinstance(node, ast.Name) and node.id in local:
        return True, local[node.id]
    return False, None


def _attr_chain(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def recipe_values(src: Source, module: str, func: str, depth: int = 0) -> dict[str, object]:
    """``section.field -> value`` that a recipe function sets unconditionally: top-level assignments of
    constants (``cfg.model.x = 1``), keyword arguments of the section constructors it calls, and the same
    inside the helper functions whose result it assigns (``cfg = _sft_common()``, ``cfg.model = _helper()``).
    Statements under ``if`` are conditional and not defaults, so they are not followed."""
    node = src.find(module, func)
    if not isinstance(node, ast.FunctionDef) or depth > 4:
        return {}
    home = _defining_module(src, module, func)
    out: dict[str, object] = {}
    local: dict[str, object] = {}

    def from_call(call: ast.Call, section: str | None) -> None:
        callee = call.func.id if isinstance(call.func, ast.Name) else None
        if section is None and callee == "ConfigContainer":
            for kw in call.keywords:
                if kw.arg in _SECTIONS and isinstance(kw.value, ast.Call):
                    from_call(kw.value, kw.arg)
            return
        if section is not None:
            for kw in call.keywords:
                ok, v = _const(kw.value, local)
                if ok and kw.arg:
                    out[f"{section}.{kw.arg}"] = v
        if callee and src.find(home, callee) is not None and isinstance(src.find(home, callee), ast.FunctionDef):
            sub = recipe_values(src, home, callee, depth + 1)
            for k, v in sub.items():
                if section is None:
                    out[k] = v
                elif k.startswith("model."):  # a provider helper: its `model.x = ...` lines
                    out[f"{section}.{k[6:]}"] = v

    for stmt in node.body:
        if isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Call):
            from_call(stmt.value, None)
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            continue
        chain = _attr_chain(stmt.targets[0])
        if chain is None:
            continue
        ok, v = _const(stmt.value, local)
        if len(chain) == 1:  # a local variable or `cfg = helper()`
            if ok:
                local[chain[0]] = v
            elif isinstance(stmt.value, ast.Call):
                from_call(stmt.value, None)
        elif len(chain) == 2 and chain[1] in _SECTIONS and isinstance(stmt.value, ast.Call):
            from_call(stmt.value, chain[1])  # cfg.model = Provider(...) / helper()
        elif len(chain) == 2 and ok and chain[0] == "model":
            out[f"model.{chain[1]}"] = v  # inside a provider helper
        elif len(chain) == 3 and chain[1] in _SECTIONS and ok:
            out[f"{chain[1]}.{chain[2]}"] = v
    return out


def _defining_module(src: Source, module: str, name: str, depth: int = 0) -> str:
    tree = src.module(module)
    if tree is None or depth > 6:
        return module
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return module
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name and node.module:
                    return _defining_module(src, node.module, alias.name, depth + 1)
    return module


def check_recipe_facts(source_root: Path, registry) -> list[str]:
    """Every recipe value restated in the model registry equals what the pinned recipe sets."""
    src = Source(source_root)
    problems = []
    for spec in registry.values():
        if not spec.trains_on.bridge_rules:  # no recipe to check against
            continue
        for mode, facts in spec.recipes.items():
            fn = spec.recipe_function.format(mode=mode)
            values = recipe_values(src, spec.recipe_module, fn)
            for section, fields in facts.items():
                for field, want in fields.items():
                    key = f"{section}.{field}"
                    if key not in values:
                        problems.append(f"{spec.name}/{mode}: {key} is not set unconditionally by {fn}")
                    elif values[key] != want:
                        problems.append(f"{spec.name}/{mode}: {key} = {values[key]!r} in {fn}, registry says {want!r}")
    return problems


if __name__ == "__main__":
    sys.exit(main())
