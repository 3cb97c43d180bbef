"""No module of the suite imports another that imports it back (lazy imports inside functions included), and
``megatron.bridge`` / ``megatron.core`` are imported by exactly one module, ``pipeline/bridge.py`` (through importlib
inside functions; no module has a ``megatron`` import statement), which itself
imports nothing of the suite above ``pipeline.config`` and ``pipeline.common``."""

import ast
from pathlib import Path

from tests.helpers import ROOT

SRC = ROOT / "src"


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module this file imports, anywhere in it (top level or inside functions)."""
    out: set[str] = set()
    me = module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def graph() -> dict[str, set[str]]:
    mods = {module_name(p): p for p in SRC.rglob("*.py")}
    return {m: {i for i in imports_of(p) if i in mods and i != m} for m, p in mods.items()}


def test_no_module_imports_one_that_imports_it_back():
    g = graph()
    pairs = sorted({tuple(sorted((a, b))) for a, deps in g.items() for b in deps
                    if a in g.get(b, set()) and not a.startswith(b + ".") and not b.startswith(a + ".")})
    assert pairs == []


def test_megatron_is_imported_by_one_low_level_module_only():
    users = {}
    for p in SRC.rglob("*.py"):
        ext = {i for i in imports_of(p) if i.split(".")[0] == "megatron"}
        if ext:
            users[module_name(p)] = ext
    # No module imports megatron statically (an import statement, top level or lazy), bridge.py included: Megatron
    # Bridge cannot even be imported without Transformer Engine (CUDA), so the suite must import on any machine.
    assert users == {}, users
    # bridge.py imports megatron.* through importlib with module-name strings: nobody else does.
    dynamic = {}
    for p in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            name = getattr(node, "func", None)
            name = getattr(name, "attr", None) or getattr(name, "id", None)
            if isinstance(node, ast.Call) and name in ("import_module", "_import", "__import__") and node.args \
                    and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str) and node.args[0].value.startswith("megatron"):
                dynamic.setdefault(module_name(p), set()).add(node.args[0].value)
    assert set(dynamic) == {"pipeline.bridge"}, dynamic
    own = {i for i in imports_of(SRC / "pipeline" / "bridge.py") if i.startswith("pipeline.")}
    assert own and all(i.startswith(("pipeline.config", "pipeline.common")) for i in own), own



def path_edits(source: str) -> list[int]:
    """The lines where ``source`` changes the import path: ``sys.path`` assigned, augmented, assigned into or
    mutated by a method call, or ``site.addsitedir``. Reading ``sys.path`` would not be an edit (nothing in the suite
    reads it either: env/closure.py asks a child interpreter without PYTHONPATH for the image's own packages)."""
    mutators = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__", "__iadd__"}

    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    lines = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        if any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)) for t in targets):
            lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr == "addsitedir" or (node.func.attr in mutators and is_sys_path(node.func.value))):
            lines.append(node.lineno)
    return sorted(lines)


def test_nothing_edits_the_import_path():
    # Decision 33: the package is installed (editable), and a top-level pipeline_*.py that cannot import it starts
    # again through common/entry.sh; neither the entry points nor the package touch sys.path.
    files = sorted(ROOT.glob("pipeline_*.py")) + sorted(SRC.rglob("*.py"))
    assert len(files) > 50
    assert {f"{f.relative_to(ROOT)}:{n}" for f in files for n in path_edits(f.read_text())} == set()
    # the checker sees each kind of edit, and a read is none
    sample = ("import site, sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\nsys.path += ['z']\n"
              "sys.path = []\nsite.addsitedir('w')\nkeep = [p for p in sys.path if p]\n")
    assert path_edits(sample) == [2, 3, 4, 5, 6]
