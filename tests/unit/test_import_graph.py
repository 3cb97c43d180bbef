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
                node.func.attr in ("addsitedir", "syspath_prepend")
                or (node.func.attr in mutators and is_sys_path(node.func.value))):
            lines.append(node.lineno)
    return sorted(lines)


# Scripts that run as child processes of their own, where the import path is theirs to set: the Bridge harness's
# sitecustomize (it scopes a package's import to the modules that need it) and the megatron_cpu tier's torchrun
# worker (a script started by path, which reaches the test helpers from the checkout).
CHILD_SCRIPTS = {"tests/bridge/shim/sitecustomize.py", "tests/megatron_cpu/worker.py"}


def test_nothing_edits_the_import_path():
    # Decision 33: the package is installed (editable), and a top-level pipeline_*.py that cannot import it starts
    # again through common/entry.sh; neither the entry points, the package, the tests nor the benches touch
    # sys.path (a test that needs a module on the path gives it to a child interpreter's PYTHONPATH).
    files = sorted(ROOT.glob("pipeline_*.py")) + sorted(SRC.rglob("*.py"))
    files += [f for d in ("tests", "bench") for f in sorted((ROOT / d).rglob("*.py"))
              if "_scoped" not in f.parts and str(f.relative_to(ROOT)) not in CHILD_SCRIPTS]
    assert len(files) > 200
    assert {f"{f.relative_to(ROOT)}:{n}" for f in files for n in path_edits(f.read_text())} == set()
    assert all((ROOT / f).is_file() for f in CHILD_SCRIPTS)
    # the checker sees each kind of edit, and a read is none
    sample = ("import site, sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\nsys.path += ['z']\n"
              "sys.path = []\nsite.addsitedir('w')\nkeep = [p for p in sys.path if p]\n"
              "monkeypatch.syspath_prepend('v')\n")
    assert path_edits(sample) == [2, 3, 4, 5, 6, 8]


MAX_LOCAL_SUITE_IMPORTS = 40


def local_suite_imports(source: str) -> list[int]:
    """The lines of ``source`` that import a module of the suite inside a function or class (not at the top)."""
    lines = []
    for scope in ast.walk(ast.parse(source)):
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(scope):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "pipeline") \
                    or isinstance(node, ast.Import) and any(a.name.split(".")[0] == "pipeline" for a in node.names):
                lines.append(node.lineno)
    return sorted(set(lines))


def test_the_suite_imports_its_own_modules_at_the_top():
    """Imports sit at the top (ruff's PLC0415 in CI, with its exceptions in pyproject.toml saying why); the few of
    the suite's own modules imported inside functions are those isambard_sbatch must not load with the standard
    library alone, and the local engine's trainer (torch). Checked here by count, so a new one is a decision."""
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted(SRC.rglob("*.py"))
             for n in local_suite_imports(p.read_text())]
    assert len(found) <= MAX_LOCAL_SUITE_IMPORTS, "\n".join(found)
    # the counter sees an import in a function, a method and a class body, relative ones too, and no other package
    sample = ("from pipeline import a\ndef f():\n    from pipeline.b import c\n    import os\nclass K:\n"
              "    import pipeline.d\n    def m(self):\n        from . import e\n")
    assert local_suite_imports(sample) == [3, 6, 8]
