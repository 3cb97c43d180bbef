"""One coherence run, typed: generate on the prompts with a backend, score the responses, write the JSON and
Markdown report (and W&B), print the summary. ``pipeline_coherence_test.py`` (:mod:`pipeline.cli.coherence`) and
``upload-all --coherence`` (:mod:`pipeline.cli.checkpoint`) both call :func:`run` with a :class:`CoherenceRun`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import bridge
from pipeline.checkpoint.plan import hub_repo_name
from pipeline.coherence import backends
from pipeline.coherence.metrics import score, summarize
from pipeline.coherence.prompts import load_prompts
from pipeline.common import layout, paths
from pipeline.common.errors import UserError
from pipeline.common.io import write_json, write_text
from pipeline.config.cluster import resolve_profile
from pipeline.config.knobs import wandb_key_present
from pipeline.slurm.badnodes import printable

BACKENDS = backends.NAMES

log = logging.getLogger(__name__)


MAX_TOKENS = 1 << 20  # generated tokens per response: past the longest context of the registry's models
MAX_SECONDS = 7 * 24 * 3600  # --timeout/--deadline: 1e308 overflowed the socket's timeout (a traceback)


@dataclass(frozen=True)
class CoherenceRun:
    """What to test and how; the defaults are the command line's."""

    model: str
    compare: list[str] = field(default_factory=list)
    backend: str = "hf"
    max_tokens: int = 128
    prompts: Path | None = None
    reasoning: bool = False
    endpoint_url: str | None = None
    discovery_file: Path | None = None
    timeout: float = 120.0
    deadline: float | None = None
    hf_model: str | None = None
    tp: int | None = None  # megatron backend layout; None: chosen by the plan (coherence/plan.py)
    pp: int | None = None
    ep: int | None = None
    iteration: int | None = None
    output_dir: Path | None = None
    wandb_project: str | None = None  # None: COHERENCE_WANDB_PROJECT, else the cluster profile's (wandb_target)
    wandb_entity: str | None = None  # None: WANDB_ENTITY, else the cluster profile's (None: the key's default)
    no_wandb: bool = False
    allow_empty: bool = False
    quiet: bool = False

    def check(self) -> None:
        """Refuse a layout that cannot run (one line each)."""
        given = [v for v in (self.tp, self.pp, self.ep) if v is not None]
        if any(v < 1 for v in given):
            raise UserError(f"--tp/--pp/--ep must be >= 1 (got {self.tp}/{self.pp}/{self.ep})")
        known = backends.BY_NAME.get(self.backend)
        if any(v > 1 for v in given) and not (known and known.model_parallel):
            raise UserError("--tp/--pp/--ep apply to the megatron backend only")
        b = backends.backend(self.backend)  # an unknown one: one line
        if not 1 <= self.max_tokens <= MAX_TOKENS:
            raise UserError(f"--max-tokens must be in [1, {MAX_TOKENS}], got {self.max_tokens}")
        for name in ("timeout", "deadline"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and 0 < v <= MAX_SECONDS):
                raise UserError(f"--{name} must be a positive number of seconds, at most {MAX_SECONDS} (a week), "
                                f"got {v}")
        if b.remote and not (self.endpoint_url or self.discovery_file):
            raise UserError("the endpoint backend needs --endpoint-url URL or --discovery-file FILE")
        if self.prompts is not None:
            load_prompts(self.prompts)  # the file's shape, checked by the plan before any job
        if self.iteration is not None and self.iteration < 0:
            raise UserError(f"--iteration {self.iteration} must be >= 0")


def generate(cfg: CoherenceRun, model: str, prompts: list[str],
             on_layout: Callable[[dict[str, Any]], None] | None = None):
    """The backend's generations; ``on_layout`` gets the megatron backend's model layout (``bridge.model_layout``)."""
    cfg.check()  # the bounds of max_tokens, timeout and deadline (also checked by the plan, before any job)
    b = backends.backend(cfg.backend)
    if b.reads_hf:
        return backends.hf_generate(model, prompts, cfg.max_tokens, cfg.reasoning)
    if b.remote:
        if cfg.discovery_file:
            url = backends.read_discovery_file(cfg.discovery_file)
        elif cfg.endpoint_url:
            url = cfg.endpoint_url
        else:
            raise UserError("the endpoint backend needs --endpoint-url URL or --discovery-file FILE")
        return backends.endpoint_generate(url, model, prompts, cfg.max_tokens, cfg.reasoning,
                                          timeout=cfg.timeout, deadline=cfg.deadline)
    if not cfg.hf_model:
        raise UserError("the megatron backend needs --hf-model ID (the checkpoint's architecture and tokenizer)")
    bridge.require_bridge("the megatron backend")
    return bridge.generate(megatron_iteration(model, cfg.iteration), cfg.hf_model, prompts, cfg.max_tokens,
                           tp=cfg.tp or 1, pp=cfg.pp or 1, ep=cfg.ep or 1, reasoning=cfg.reasoning,
                           on_layout=on_layout)


def megatron_iteration(model: str, iteration: int | None) -> Path:
    """The exact iteration directory to generate from: a checkpoint root resolves to ``--iteration`` or its latest
    complete iteration (never a later or half-written one); an ``iter_NNNNNNN`` directory must be complete."""
    path = Path(model)
    it = layout.iteration_of(path)
    if it is not None and (path.parent / layout.TRACKER).exists():
        if iteration is not None:
            raise UserError(f"{path} is already an iteration directory; drop --iteration or pass the checkpoint root")
        return layout.resolve_iteration(path.parent, it)
    return layout.resolve_iteration(path, iteration)


def run_model(cfg: CoherenceRun, model: str, prompts: list[str]) -> dict[str, Any]:
    t0 = time.time()
    layouts: list[dict[str, Any]] = []
    gens = generate(cfg, model, prompts, on_layout=layouts.append)
    rows = []
    for prompt, (text, n_tok, finished, *known) in zip(prompts, gens, strict=True):
        rows.append({"prompt": prompt, "response": text,
                     **score(text, n_tok, cfg.max_tokens, finished, cfg.reasoning, *known)})
        if known and known[1]:
            rows[-1]["context"] = known[1]
    summary = summarize(rows)
    summary["seconds"] = round(time.time() - t0, 2)
    res = {"model": model, "backend": cfg.backend, "rows": rows, "summary": summary}
    if layouts:  # the megatron backend: what the model ran on (parallel sizes, experts, the MoE token dispatcher)
        res["layout"] = layouts[0]
        log.info("%s: megatron model on %s", model, ", ".join(f"{k} {v}" for k, v in layouts[0].items()))
    return res


def _escaped(s: str) -> str:
    """Control characters (terminal escapes among them) shown escaped: a model's or an endpoint's reply is never
    replayed into the terminal of whoever reads the report with cat (the bad-node log's rule)."""
    return printable(s)


def _md_cell(s: str) -> str:
    return _escaped(re.sub(r"\s+", " ", s.replace("|", "\\|")).strip()) or "*(empty)*"


def markdown(report: dict) -> str:
    lines = [f"# Coherence test - {report['time']}", ""]
    for res in report["results"]:
        s = res["summary"]
        lines += [f"## {_escaped(str(res['model']))} ({res['backend']})", "",
                  "| metric | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in s.items()], "",
                  "| # | prompt | response | length | empty | truncated | repetitive | template leak |",
                  "|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(res["rows"], 1):
            lines.append(f"| {i} | {_md_cell(r['prompt'])} | {_md_cell(r['response'])} | {r['response_length']} | "
                         f"{r['empty']} | {r['truncated']} | {r['repetitive']} | {r['template_leak'] or '-'} |")
        lines.append("")
    if len(report["results"]) > 1:
        heads = [r["model"] for r in report["results"]]
        lines += ["## Side by side", "", "| prompt | " + " | ".join(heads) + " |",
                  "|---|" + "---|" * len(heads)]
        for i, prompt in enumerate(report["prompts"]):
            cells = [_md_cell(r["rows"][i]["response"]) for r in report["results"]]
            lines.append(f"| {_md_cell(prompt)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("Read a few generations yourself: empty_pct == 0 alone does not catch drift or off-topic output.")
    return "\n".join(lines) + "\n"


def wandb_target(cfg: CoherenceRun, profile=None) -> tuple[str, str | None]:
    """(project, entity) of the coherence run in W&B: the command line's, else the environment's
    (``COHERENCE_WANDB_PROJECT``, ``WANDB_ENTITY``: an export wins), else the cluster profile's
    (``coherence_wandb_project``, ``wandb_entity``)."""
    if profile is None:
        profile = resolve_profile()
    project = cfg.wandb_project or os.environ.get("COHERENCE_WANDB_PROJECT") or profile.coherence_wandb_project
    entity = cfg.wandb_entity or os.environ.get("WANDB_ENTITY") or profile.wandb_entity or None
    return project, entity


def _iteration_name(path: Path) -> tuple[str, str | None]:
    """(the run's name, ``iter_NNNNNNN`` or None) of a local model: an export's ``hf/`` from its
    ``pipeline_export.json`` (the Megatron iteration it came from), else from a ``.../<run>/[checkpoints/]iter_N[/hf]``
    path; any other folder is its own name."""
    meta = path / "pipeline_export.json"
    src = None
    if meta.is_file():
        try:
            data = json.loads(meta.read_text())
            src = Path(data["source"]) if isinstance(data, dict) and data.get("source") else None
        except (OSError, ValueError):
            src = None
    if src is None:
        p = path.parent if path.name == "hf" else path
        src = p if layout.is_iteration_dir(p) else None
    if src is None or not layout.is_iteration_dir(src):
        return path.name, None
    run, _, it = hub_repo_name(src.parent, src.name).rpartition("-")
    return run, it


def wandb_run_name(cfg: CoherenceRun) -> str:
    """``coherence-<model>[-iter_NNNNNNN]-<backend>``: the run and iteration of a checkpoint (an export's hf/ or
    a Megatron root at the iteration it generates from), else the model's or served id's last part; with
    ``--compare``, ``+N`` for the other models. Never one name for every run."""
    path = Path(cfg.model)
    resolved = None
    b = backends.backend(cfg.backend)
    if b.reads_checkpoint and path.exists():
        try:
            resolved = megatron_iteration(cfg.model, cfg.iteration)
        except UserError:  # not complete yet (a plan of a job that waits for the training): the root's name
            resolved = None
    if resolved is not None:
        model, it = _iteration_name(resolved)
    elif b.reads_hf and path.is_dir():
        model, it = _iteration_name(path.resolve())
    else:
        model, it = cfg.model.rstrip("/").rsplit("/", 1)[-1] or cfg.model, None
    more = f"+{len(cfg.compare)}" if cfg.compare else ""
    return "-".join(["coherence", model + more, *([it] if it else []), cfg.backend])


def log_wandb(report: dict, project: str, name: str, entity: str | None = None) -> str | None:
    import wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if wandb_key_present() else "offline")
    run = wandb.init(project=project, entity=entity, name=name, mode=mode, job_type="coherence",
                     dir=os.environ.get("WANDB_DIR") or None, settings=wandb.Settings(silent=True))
    cols = ["model", "prompt", "response", "response_length", "empty", "truncated", "repetitive", "template_leak"]
    table = wandb.Table(columns=cols)
    multi = len(report["results"]) > 1
    for res in report["results"]:
        for r in res["rows"]:
            table.add_data(res["model"], r["prompt"], r["response"], r["response_length"], r["empty"],
                           r["truncated"], r["repetitive"], r["template_leak"])
        prefix = f"{Path(res['model']).name}/" if multi else ""
        run.summary.update({f"{prefix}{k}": v for k, v in res["summary"].items()})
    run.log({"generations": table})
    path = run.dir
    run.finish()
    return path


def default_output_dir(model: str) -> Path:
    p = Path(model)
    if p.is_dir():
        return p / "coherence"
    return paths.runs_dir() / "coherence" / model.replace("/", "__")


def run(cfg: CoherenceRun) -> int:
    """Generate, score and report; 1 when a response is empty (a broken model) unless ``allow_empty``."""
    cfg.check()
    prompts = load_prompts(cfg.prompts)
    results = [run_model(cfg, m, prompts) for m in [cfg.model, *cfg.compare]]
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # model-parallel generation: every rank generated, rank 0 reports
    report = {"time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "prompts": prompts,
              "max_tokens": cfg.max_tokens, "reasoning": cfg.reasoning, "results": results}
    out_dir = cfg.output_dir or default_output_dir(cfg.model)
    stem = f"coherence_{cfg.backend}"
    if not cfg.no_wandb:
        project, entity = wandb_target(cfg)
        report["wandb_dir"] = log_wandb(report, project, wandb_run_name(cfg), entity)
    write_json(out_dir / f"{stem}.json", report)
    write_text(out_dir / f"{stem}.md", markdown(report))
    for res in results:
        s = res["summary"]
        print(f"{res['model']}: {s['num_prompts']} prompts, empty {s['empty_pct']}%, truncated {s['truncated_pct']}%, "
              f"repetitive {s['repetitive_pct']}%, template leaks {s['template_leak_pct']}%, "
              f"mean length {s['mean_response_length']} chars")
        if not cfg.quiet:
            for r in res["rows"]:
                print(f"  - {r['prompt']}\n    -> {r['response'][:200]!r}")
    print(f"report: {out_dir / (stem + '.json')} and {out_dir / (stem + '.md')}"
          + (f"; W&B: {report['wandb_dir']}" if report.get("wandb_dir") else ""))
    empty = [(i, r) for res in results for i, r in enumerate(res["rows"], 1) if r["empty"]]
    if empty and not cfg.allow_empty:
        print(f"error: {empty_message(empty)}", file=sys.stderr)
        return 1
    return 0


def empty_message(empty: list[tuple[int, dict]]) -> str:
    """Why responses are empty: a prompt that filled the model's context is named with its length (it is not the
    model's or the template's fault); only the others point at the model and its chat template."""
    full = [(i, r) for i, r in empty if r.get("context_full")]
    parts = [f"prompt {i} is {r['prompt_tokens']} tokens, which fills the model's context of {r['context']} "
             "(shorten it)" for i, r in full[:3]] + (["..."] if len(full) > 3 else [])
    rest = len(empty) - len(full)
    if rest:
        parts.append(f"{rest} with room to answer: the model is broken or its chat template is wrong")
    return f"{len(empty)} empty response(s): " + "; ".join(parts)
