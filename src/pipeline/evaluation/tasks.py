"""Which lm-evaluation-harness tasks an evaluation runs, and whether their data is reachable here, decided before
any model loads.

The suite ships one task whose data is in the checkout (``configs/eval/tasks/pipeline_smoke``: the quickstart's,
the tests' and CI's); ``--tasks-path DIR`` adds a folder of the user's own task YAMLs (AutoExperiment's tasks path).
The harness's built-in tasks download their data from the Hugging Face hub: they run where the hub is reachable
(the cluster profile's ``hub_offline: false``; an exported ``HF_HUB_OFFLINE`` wins) and are refused elsewhere, in
one line naming the task and its dataset. Building the harness's index of its ~10k built-in task files takes a
minute on a busy CPU, so tasks found in the local folders alone never build it, and it is built once per
lm-eval version (cached under the cache folder).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.common import paths
from pipeline.common.errors import UserError, close_matches
from pipeline.common.io import read_json, write_json

LOCAL_TASKS_DIR = Path("configs/eval/tasks")
SMOKE_TASK = "pipeline_smoke"
_SAFE = re.compile(r"[^A-Za-z0-9_.+-]")


def local_tasks_dir() -> Path:
    return paths.repo_root() / LOCAL_TASKS_DIR


def parse_tasks(text: str) -> tuple[str, ...]:
    """``--tasks a,b``: the task names, in order, without repeats; an empty or malformed list is refused."""
    names = [t.strip() for t in str(text).split(",")]
    if not names or any(not t for t in names):
        raise UserError(f"--tasks {text!r}: give task names separated by commas (e.g. --tasks {SMOKE_TASK})")
    bad = [t for t in names if _SAFE.search(t)]
    if bad:
        raise UserError(f"--tasks: {bad[0]!r} is not a task name (letters, digits, '_', '.', '-', '+')")
    return tuple(dict.fromkeys(names))


def results_name(tasks: tuple[str, ...]) -> str:
    """The results file of a task list beside the export: ``hf/eval/<task>[+<task>...].json``."""
    return "+".join(tasks) + ".json"


def hub_offline(profile) -> bool:
    """The hub is unreachable: HF_HUB_OFFLINE exported (it wins), else the cluster profile's hub_offline."""
    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None and env.strip():
        return env.strip().lower() in ("1", "true", "yes", "on")
    return bool(profile.hub_offline)


@dataclass(frozen=True)
class TaskSource:
    name: str
    local: bool        # its data ships in a folder here (the YAML's custom_dataset, or a dataset_path that exists)
    dataset: str = ""  # where its data comes from otherwise (the hub dataset id)


def _entries(folders: list[Path], defaults: bool) -> dict[str, dict]:
    """name -> {yaml, dataset, custom, task}: what the reachability check reads of the harness's task index."""
    from lm_eval.tasks import TaskManager

    out = {}
    for name, e in TaskManager(include_path=[str(f) for f in folders] or None,
                               include_defaults=defaults).task_index.items():
        cfg = e.cfg or {}
        task = cfg.get("task")
        members = task if isinstance(task, list) else []
        out[name] = {"yaml": str(e.yaml_path) if e.yaml_path else "", "dataset": str(cfg.get("dataset_path") or ""),
                     "custom": "custom_dataset" in cfg,
                     "task": [t if isinstance(t, str) else (t or {}).get("task") for t in members]}
    return out


def builtin_entries() -> dict[str, dict]:
    """The harness's built-in tasks, indexed once per lm-eval version under the cache folder (building the index
    reads ~10k YAML files: a minute on a busy CPU; a login node's dry run should not pay it each time)."""
    import lm_eval

    version = getattr(lm_eval, "__version__", "") or "unknown"
    cache = paths.cache_dir() / "lm_eval" / f"task_index-{version}.json"
    try:
        got = read_json(cache)
        if isinstance(got, dict) and got:
            return got
    except (OSError, ValueError):
        pass
    entries = _entries([], defaults=True)
    try:
        write_json(cache, entries)
    except OSError:  # a read-only cache: index again next time
        pass
    return entries


def _source(name: str, index: dict, local_folders: list[Path], seen: frozenset = frozenset()) -> TaskSource:
    entry = index[name]
    if entry["task"]:  # a group: local when every member is
        parts = [_source(t, index, local_folders, seen | {name}) for t in entry["task"]
                 if isinstance(t, str) and t in index and t not in seen]
        remote = next((p for p in parts if not p.local), None)
        return TaskSource(name, remote is None and bool(parts), remote.dataset if remote else "")
    yaml_path = Path(entry["yaml"]).resolve() if entry["yaml"] else None
    in_local = yaml_path is not None and any(yaml_path.is_relative_to(f.resolve()) for f in local_folders)
    dataset = entry["dataset"]
    if (in_local and entry["custom"]) or (dataset and Path(dataset).is_absolute() and Path(dataset).exists()):
        return TaskSource(name, True, dataset)
    return TaskSource(name, False, dataset or "(the task's own download)")


def harness_installed() -> bool:
    """lm-eval is importable here (the venv and the container; not the login node's planner)."""
    return importlib.util.find_spec("lm_eval") is not None


def check_tasks(tasks: tuple[str, ...], tasks_paths: tuple[Path, ...], profile) -> list[str]:
    """The problems of a task list here (one line each, empty when every task can run): an unknown task (with the
    nearest names), a task whose data is on the hub where the hub is offline. Reads task files only. Without lm-eval
    (the login node's planner) only the folders are checked: the job checks the tasks before it loads the model."""
    for p in tasks_paths:
        if not p.is_dir():
            return [f"--tasks-path {p} is not a folder of task YAML files"]
    if not harness_installed():
        return []
    folders = [local_tasks_dir(), *tasks_paths]
    index = _entries(folders, defaults=False)
    if not all(t in index for t in tasks):
        index = {**builtin_entries(), **index}  # the local folders win, as in the harness
    problems = []
    offline = hub_offline(profile)
    for t in tasks:
        if t not in index:
            near = close_matches(t, index, n=3)
            problems.append(f"unknown lm-eval task {t!r}" + (f" (did you mean {', '.join(near)}?)" if near else "") +
                            f"; the local task is {SMOKE_TASK}, and --tasks-path DIR adds a folder of task YAMLs")
            continue
        src = _source(t, index, folders)
        if not src.local and offline:
            problems.append(f"task {t!r} reads its data from the Hugging Face hub ({src.dataset}), which this machine "
                            f"cannot reach (cluster profile '{profile.name}' has hub_offline, or HF_HUB_OFFLINE=1): "
                            f"run it where the profile's hub is online, or use the local task {SMOKE_TASK}")
    return problems
