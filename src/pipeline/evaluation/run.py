"""One evaluation, typed: lm-evaluation-harness (``lm_eval.simple_evaluate`` with its ``HFLM`` model class) on a
Hugging Face export, the results written beside it and to W&B, one line per task in the log.

    <export>/eval/<task>[+<task>...].json   {"harness": the harness's own result object (results, configs,
                                             versions, n-shot, higher_is_better, n-samples, config, ...),
                                             "summary": ours (model, iteration, tasks -> headline metric, ...)}

A file is replaced silently only by an evaluation with the same settings (``EvalRun.settings``: limit, few-shot, task
folders, recorded in the summary); one with other settings is refused in one line without ``--force``.
Written atomically, so a file that exists is a finished evaluation (``upload-all --eval`` and the experiment
status read it; a killed evaluation leaves none and is redone). W&B (offline without a key): one run per
checkpoint directory, resumed by every evaluation of it, so the headline metric of each task is a series over
``iteration``, with a table of every metric per iteration.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.common import layout
from pipeline.common.errors import UserError
from pipeline.common.io import read_json, write_json
from pipeline.config.knobs import wandb_key_present
from pipeline.evaluation.tasks import local_tasks_dir, parse_tasks, results_name

HEADLINE = ("acc", "acc_norm", "exact_match", "f1", "bleu", "mcc", "word_perplexity", "perplexity")


@dataclass(frozen=True)
class EvalRun:
    """What to evaluate and how; the defaults are the command line's."""

    model: str
    tasks: str = "pipeline_smoke"
    tasks_path: tuple[Path, ...] = ()
    num_fewshot: int | None = None
    batch_size: int = 8
    limit: float | None = None
    device: str | None = None
    output_dir: Path | None = None
    wandb_project: str = field(default_factory=lambda: os.environ.get("EVAL_WANDB_PROJECT", "pipeline-evals"))
    no_wandb: bool = False
    quiet: bool = False
    force: bool = False  # replace results of this task list measured with other settings

    @property
    def settings(self) -> dict[str, Any]:
        """Every setting that changes the result of a task list (beside the model): the file of earlier results is
        replaced silently only by a run with the same ones (:func:`overwrite_problem`)."""
        return {"limit": self.limit, "num_fewshot": self.num_fewshot,
                "tasks_path": sorted(str(Path(p).resolve()) for p in self.tasks_path)}

    @property
    def task_names(self) -> tuple[str, ...]:
        return parse_tasks(self.tasks)

    def marker_key(self) -> str:
        """upload-all's marker name for this evaluation: the task list and a digest of every setting that changes its
        result (:attr:`settings`), so a rerun with other settings evaluates again, and a failure under one set of
        settings does not stand for another's."""
        digest = hashlib.sha256(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()[:10]
        return f"{results_name(self.task_names).removesuffix('.json')}.{digest}"

    def check(self) -> None:
        self.task_names  # noqa: B018 - refuses a malformed list
        if self.num_fewshot is not None and not 0 <= self.num_fewshot <= 64:
            raise UserError(f"--num-fewshot {self.num_fewshot} must be in [0, 64]")
        if not 1 <= self.batch_size <= 4096:
            raise UserError(f"--batch-size {self.batch_size} must be in [1, 4096]")
        if self.limit is not None and not (math.isfinite(self.limit) and 0 < self.limit <= MAX_LIMIT and
                                           (self.limit < 1 or float(self.limit).is_integer())):
            raise UserError(f"--limit {self.limit} must be a whole number of examples per task (at most "
                            f"{MAX_LIMIT:.0f}) or a fraction in (0, 1)")

    @property
    def out_file(self) -> Path:
        return (self.output_dir or Path(self.model) / "eval") / results_name(self.task_names)


MAX_LIMIT = 1e9  # examples per task: lm-eval takes the first N; 1e20 overflowed after the model had loaded


def headline(metrics: dict) -> tuple[str, float, float | None] | None:
    """(metric, value, stderr) a task is summarised by: the first of HEADLINE it reports, else its first number."""
    values = {k.split(",")[0]: v for k, v in metrics.items()
              if "," in k and "_stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not values:
        return None
    name = next((h for h in HEADLINE if h in values), next(iter(values)))
    key = next(k for k in metrics if k.split(",")[0] == name and "_stderr" not in k)
    stderr = metrics.get(key.replace(name, f"{name}_stderr", 1))
    return name, float(values[name]), float(stderr) if isinstance(stderr, (int, float)) else None


def summarize(results: dict, cfg: EvalRun, seconds: float) -> dict[str, Any]:
    tasks, metrics = {}, {}
    for task, m in results.get("results", {}).items():
        for k, v in m.items():
            if "," in k and "_stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool):
                metrics[f"{task}/{k.split(',')[0]}"] = float(v)
        h = headline(m)
        if h is not None:
            tasks[task] = {"metric": h[0], "value": h[1], "stderr": h[2],
                           "samples": (results.get("n-samples", {}).get(task) or {}).get("effective")}
    return {"model": cfg.model, "iteration": layout.export_iteration(cfg.model), "tasks": tasks, "metrics": metrics,
            "task_list": list(cfg.task_names), "num_fewshot": cfg.num_fewshot, "limit": cfg.limit,
            "settings": cfg.settings, "batch_size": cfg.batch_size, "seconds": round(seconds, 2),
            "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "lm_eval_version": results.get("lm_eval_version")}


def _device(cfg: EvalRun) -> str:
    import torch

    if cfg.device:
        if cfg.device.startswith("cuda"):
            index = int(cfg.device.partition(":")[2] or 0)
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if index >= count:
                raise UserError(f"--device {cfg.device}: torch sees {count} CUDA device(s) here; use --device cpu "
                                "or leave --device out")
        return cfg.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_dtype(device: str) -> str:
    """bf16 on every CUDA device (``cuda`` and ``cuda:N``: Nano's 31.6B parameters in fp32 fill no single GPU), fp32
    on the CPU."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def evaluate(cfg: EvalRun) -> dict[str, Any]:
    """The harness on the export: its result object (JSON-safe)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    device = _device(cfg)
    import torch

    multi = device == "cuda" and torch.cuda.device_count() > 1 and os.environ.get("PIPELINE_EVAL_PARALLELIZE") == "1"
    model = HFLM(pretrained=cfg.model, batch_size=cfg.batch_size, device=None if multi else device,
                 parallelize=multi, dtype=model_dtype(device))
    folders = [str(local_tasks_dir()), *map(str, cfg.tasks_path)]
    manager = TaskManager(include_path=folders, include_defaults=False)  # seconds; the built-in index: a minute
    if not all(t in manager.all_tasks for t in cfg.task_names):
        manager = TaskManager(include_path=folders, include_defaults=True)
    limit = int(cfg.limit) if cfg.limit is not None and cfg.limit >= 1 else cfg.limit
    out = lm_eval.simple_evaluate(model=model, tasks=list(cfg.task_names), num_fewshot=cfg.num_fewshot,
                                  batch_size=cfg.batch_size, limit=limit, task_manager=manager, log_samples=False,
                                  bootstrap_iters=1000)
    if out is None:  # a non-zero rank of a distributed harness
        return {}
    return json.loads(json.dumps(dict(out), default=str))


def log_wandb(summary: dict, project: str) -> str | None:
    """The headline metric per task as a series over iteration (one W&B run per checkpoint directory, resumed by
    each evaluation) and a table of every metric of this iteration."""
    import wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if wandb_key_present() else "offline")
    model = Path(summary["model"]).resolve()
    series_of = model.parent.parent if summary["iteration"] is not None else model
    run_id = "eval-" + hashlib.sha1(str(series_of).encode()).hexdigest()[:12]
    name = f"eval-{series_of.parent.name if series_of.name == 'checkpoints' else series_of.name}"
    run = wandb.init(project=project, name=name, id=run_id, resume="allow", mode=mode, job_type="eval",
                     dir=os.environ.get("WANDB_DIR") or None, settings=wandb.Settings(silent=True))
    run.define_metric("iteration")
    run.define_metric("eval/*", step_metric="iteration")
    it = summary["iteration"] if summary["iteration"] is not None else 0
    table = wandb.Table(columns=["iteration", "task", "metric", "value"])
    for key, v in sorted(summary["metrics"].items()):
        task, metric = key.rsplit("/", 1)
        table.add_data(it, task, metric, v)
    run.log({"iteration": it, **{f"eval/{t}/{h['metric']}": h["value"] for t, h in summary["tasks"].items()},
             f"eval_table/{layout.iter_dirname(it)}": table})
    path = run.dir
    run.finish()
    return path


def existing(cfg: EvalRun) -> dict | None:
    """The finished results of this task list beside the export, None when there are none."""
    try:
        rec = read_json(cfg.out_file)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("summary"), dict) else None


def _model_key(model: str) -> str:
    """A model as results name it: a local folder by its resolved path (a relative and an absolute spelling are one
    model), a hub id as written."""
    p = Path(model)
    try:
        return str(p.resolve()) if p.exists() else model
    except OSError:
        return model


def _same(a: Any, b: Any) -> bool:
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


FORCE_FIX = "--force to replace them, or --output-dir for another folder"


def overwrite_problem(cfg: EvalRun, fix: str = FORCE_FIX) -> str | None:
    """One line when ``cfg.out_file`` holds results of this task list for another model, or measured with other
    settings (:attr:`EvalRun.settings`: limit, few-shot, the task folders), and ``--force`` is not given: a run never
    replaces them silently. Results written before the task folders were recorded are compared on limit and few-shot."""
    old = existing(cfg)
    if old is None and (cfg.out_file.exists() or cfg.out_file.is_symlink()):
        # a file that is not results of ours (a user's, a FIFO) was replaced silently: never, --force or not
        return (f"{cfg.out_file} exists and is not results of this suite: move it away, or --output-dir for "
                "another folder")
    if old is None or cfg.force:
        return None
    summary = old["summary"]
    model = summary.get("model")
    if isinstance(model, str) and _model_key(model) != _model_key(cfg.model):
        # another model's results: the settings matching says nothing, and they must not be replaced
        return (f"{cfg.out_file} holds results of {'+'.join(cfg.task_names)} for another model ({model}); this run "
                f"evaluates {cfg.model}: {fix}")
    recorded = summary.get("settings") if isinstance(summary.get("settings"), dict) else \
        {k: summary.get(k) for k in ("limit", "num_fewshot")}
    differ = {k: (recorded[k], v) for k, v in cfg.settings.items() if k in recorded and not _same(recorded[k], v)}
    if not differ:
        return None
    had = ", ".join(f"{k} {v!r}" for k, v in recorded.items())
    new = ", ".join(f"{k} {v!r}" for k, (_, v) in differ.items())
    return f"{cfg.out_file} holds results of {'+'.join(cfg.task_names)} with {had}; this run has {new}: {fix}"


def run(cfg: EvalRun, fix: str = FORCE_FIX) -> dict[str, Any]:
    """Evaluate, write ``<export>/eval/<tasks>.json`` atomically (and W&B), log one line per task; the summary."""
    cfg.check()
    if not Path(cfg.model, "config.json").is_file():
        raise UserError(f"{cfg.model} is not a Hugging Face export (no config.json): evaluate an iteration's hf/")
    problem = overwrite_problem(cfg, fix)  # before the model loads
    if problem:
        raise UserError(problem)
    t0 = time.time()
    results = evaluate(cfg)
    if not results:
        return {}
    summary = summarize(results, cfg, time.time() - t0)
    if not summary["tasks"]:
        raise UserError(f"the harness reported no metric for {cfg.tasks} (see its log above)")
    if not cfg.no_wandb:
        summary["wandb_dir"] = log_wandb(summary, cfg.wandb_project)
    write_json(cfg.out_file, {"harness": results, "summary": summary})
    for task, h in summary["tasks"].items():
        err = f" +- {h['stderr']:.4f}" if h["stderr"] is not None else ""
        it = f" iter {summary['iteration']}" if summary["iteration"] is not None else ""
        print(f"eval{it} {task}: {h['metric']} {h['value']:.4f}{err} ({h['samples']} examples)", flush=True)
    print(f"results: {cfg.out_file}" + (f"; W&B: {summary['wandb_dir']}" if summary.get("wandb_dir") else ""))
    return summary


def read_results(save: Path | None) -> list[dict[str, Any]]:
    """Every finished evaluation under a checkpoint directory (``iter_N/hf/eval/*.json``), oldest iteration first:
    the summaries (iteration, tasks -> headline metric, metrics) the experiment status and plots read."""
    if save is None or not Path(save).is_dir():
        return []
    out = []
    found = [(n, f) for n in layout.list_iterations(Path(save))
             for f in sorted((layout.iter_dir(Path(save), n) / "hf" / "eval").glob("*.json"))]
    for it, f in found:
        try:
            rec = read_json(f)
        except (OSError, ValueError):
            continue
        s = rec.get("summary") if isinstance(rec, dict) else None
        if isinstance(s, dict) and isinstance(s.get("tasks"), dict) and isinstance(s.get("metrics"), dict):
            out.append({**s, "iteration": it, "file": str(f)})
    return sorted(out, key=lambda s: (s["iteration"] if s["iteration"] is not None else -1, s["file"]))
