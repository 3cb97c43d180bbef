"""One home per fact (issue 37): the batch scripts' names, the GPU memory overhead and the small helpers written
once in src/pipeline, each imported from its home by every module that needs it."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from pipeline.common import paths
from tests.helpers import ROOT

SRC = ROOT / "src" / "pipeline"
SUBMIT_SCRIPTS = {name: getattr(paths, name) for name in dir(paths) if name.endswith("_SUBMIT")}
# Spelled out in a file another change is editing at the same time (the Super import); it reads
# f"{paths.CHECKPOINT_SUBMIT} import ..." once that change is in. Remove the entry then.
PENDING: set[tuple[str, str]] = set()


def code_strings(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module (f-string parts included), docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def definitions(name: str) -> list[str]:
    """Where src/pipeline defines ``name`` at a module's top level (a function, or an assigned constant)."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                out.append(str(path.relative_to(SRC)))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    out.append(str(path.relative_to(SRC)))
    return out


def test_every_batch_scripts_name_is_written_once_in_common_paths():
    assert len(SUBMIT_SCRIPTS) == 6
    on_disk = sorted(p.name for p in ROOT.glob("pipeline_*_submit.sbatch"))
    assert sorted(SUBMIT_SCRIPTS.values()) == on_disk
    spelled = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        for lineno, text in code_strings(path):
            for script in SUBMIT_SCRIPTS.values():
                if script in text and rel != "common/paths.py" and (rel, script) not in PENDING:
                    spelled.add(f"{rel}:{lineno}: {script}")
    assert spelled == set(), "use pipeline.common.paths' *_SUBMIT names"


def test_the_gpu_memory_overhead_has_one_home():
    assert definitions("OVERHEAD_GB") == ["config/parallel.py"]


def test_pid_alive_and_barrier_have_one_home():
    from pipeline.common.procs import pid_alive

    for name in ("pid_alive", "barrier"):
        assert definitions(name) == ["common/procs.py"], name
        assert definitions(f"_{name}") == [], name
    assert pid_alive(os.getpid()) is True
    assert [pid_alive(p) for p in (0, -1, True, "12", None, 2**80)] == [None] * 6
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert pid_alive(dead.pid) is False


def test_the_did_you_mean_hint_has_one_home_and_one_cutoff():
    from pipeline.common.errors import HINT_CUTOFF, close_matches, did_you_mean

    assert definitions("did_you_mean") == definitions("close_matches") == ["common/errors.py"]
    users = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "difflib" in p.read_text())
    assert users == ["common/errors.py"], "suggest names through pipeline.common.errors.close_matches"
    assert HINT_CUTOFF == 0.75
    assert did_you_mean("train.train_iter", ["train.train_iters", "train.micro_batch_size"]) == \
        " (did you mean 'train.train_iters'?)"
    assert did_you_mean("lrr", ["lr", "min_lr"], prefix="optimizer.") == " (did you mean 'optimizer.lr'?)"
    assert did_you_mean("train.iters", ["train.train_iters"]) == " (did you mean 'train.train_iters'?)"
    assert did_you_mean("iters", ["train_iters"]) == ""  # a fragment: the message lists the valid names
    assert close_matches("pipeline_smok", ["pipeline_smoke", "hellaswag", "pipeline_smoke_2"], n=3) == [
        "pipeline_smoke", "pipeline_smoke_2"]


def test_the_kinds_are_literal_types_in_one_place():
    from pipeline.cli.train import build_parser
    from pipeline.config import kinds
    from pipeline.config.models import REGISTRY

    assert kinds.ENGINES == ("local", "megatron_bridge") and {s.engine for s in REGISTRY.values()} == set(kinds.ENGINES)
    assert kinds.MODES == ("pretrain", "cpt", "sft")
    assert kinds.PHASE_KINDS == ("train", "export", "coherence")
    assert set(kinds.JOB_KINDS) == {*kinds.PHASE_KINDS, "upload-all"}
    (mode,) = [a for a in build_parser()._actions if "--mode" in a.option_strings]
    assert tuple(mode.choices) == kinds.MODES
    for name in ("MODES", "KINDS", "ENGINES", "PHASE_KINDS"):
        assert definitions(name) in ([], ["config/kinds.py"]), name


def test_the_checker_sees_a_spelled_name_and_skips_docstrings(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text('"""Runs pipeline_training_submit.sbatch."""\n\n\ndef f():\n    """pipeline_data_submit.sbatch"""\n'
                   '    return f"isambard_sbatch pipeline_training_submit.sbatch {1}"\n')
    hits = [(n, t) for n, t in code_strings(mod) if re.search(r"_submit\.sbatch", t)]
    assert hits == [(6, "isambard_sbatch pipeline_training_submit.sbatch ")]


def test_one_layout_class_holds_the_parallel_factors():
    """config/parallel.py's Layout is the one class with the parallel factors as int fields: the preflight's plan,
    the run view and the GPU-job plans hold one (none restates tp/pp/ep as its own). A request's optional factors
    (coherence's --tp/--pp/--ep, None: the plan chooses) are what the user asked for, not a layout."""
    factors = {"tp", "pp", "ep"}
    holders = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                          and isinstance(s.target, ast.Name) and ast.unparse(s.annotation) == "int"}
                if factors <= fields:
                    holders.append(f"{path.relative_to(SRC)}:{node.name}")
    assert holders == ["config/parallel.py:Layout"]
    import typing

    from pipeline.checkpoint.plan import JobPlan
    from pipeline.config.parallel import Layout
    from pipeline.training.preflight import Plan
    from pipeline.training.views import RunView

    for cls in (Plan, RunView, JobPlan):
        assert Layout in typing.get_type_hints(cls).values(), cls
