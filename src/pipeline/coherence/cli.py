"""pipeline_coherence_test.py MODEL [--compare MODEL2 ...] [options]

Generates responses to 8 diverse prompts (or --prompts FILE) and reports a table of prompt, response,
response length and empty flag, plus summary metrics that catch more than emptiness (truncation at the
token limit, repetition loops, chat-template artefacts). Results go to W&B (offline without an API key)
and to JSON + Markdown beside the model (MODEL/coherence/, or --output-dir).

Backends: hf (local HF directory or hub id), endpoint (a running OpenAI-compatible server:
--endpoint-url URL or --discovery-file FILE), megatron (a Megatron checkpoint, GPUs; --hf-model ID).
Exit code 1 when any response is empty (a broken model), unless --allow-empty.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.common.errors import UserError, cli_main
from pipeline.common.io import write_json, write_text
from pipeline.common.log import setup_logging

log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pipeline_coherence_test.py", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF directory or hub id (hf), served model id (endpoint), Megatron ckpt (megatron)")
    p.add_argument("--compare", action="append", default=[], metavar="MODEL",
                   help="another model to run on the same prompts, side by side in one report (repeatable)")
    p.add_argument("--backend", choices=["hf", "endpoint", "megatron"], default="hf")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", type=Path, help="prompt file: one per line, a JSON list, or JSONL with 'prompt'")
    p.add_argument("--reasoning", action="store_true", help="enable thinking in chat templates that support it")
    p.add_argument("--endpoint-url", help="base URL of an OpenAI-compatible server (endpoint backend)")
    p.add_argument("--discovery-file", type=Path, help="file a serving job writes with its URL (endpoint backend)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="endpoint backend: seconds per request (default 120)")
    p.add_argument("--deadline", type=float,
                   help="endpoint backend: seconds for the whole run (default: --timeout x the number of prompts)")
    p.add_argument("--hf-model", help="HF id of a Megatron checkpoint's architecture (megatron backend)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--iteration", type=int, help="megatron backend: the iteration of a checkpoint root (default: latest "
                                                  "complete)")
    p.add_argument("--output-dir", type=Path, help="default: MODEL/coherence/ for a local model")
    p.add_argument("--wandb-project", default=os.environ.get("COHERENCE_WANDB_PROJECT", "pipeline-gen-tests"))
    p.add_argument("--no-wandb", action="store_true")
    p.add_argument("--allow-empty", action="store_true", help="exit 0 even when a response is empty")
    p.add_argument("--quiet", action="store_true")
    return p


def _generate(args, model: str, prompts: list[str]):
    from pipeline.coherence import backends

    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    import math

    for name in ("timeout", "deadline"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise UserError(f"--{name} must be a positive number of seconds, got {v}")
    if args.backend == "hf":
        return backends.hf_generate(model, prompts, args.max_tokens, args.reasoning)
    if args.backend == "endpoint":
        if args.discovery_file:
            url = backends.read_discovery_file(args.discovery_file)
        elif args.endpoint_url:
            url = args.endpoint_url
        else:
            raise UserError("the endpoint backend needs --endpoint-url URL or --discovery-file FILE")
        return backends.endpoint_generate(url, model, prompts, args.max_tokens, args.reasoning,
                                          timeout=args.timeout, deadline=args.deadline)
    if not args.hf_model:
        raise UserError("the megatron backend needs --hf-model ID (the checkpoint's architecture and tokenizer)")
    from pipeline import bridge

    bridge.require_bridge("the megatron backend")
    return bridge.generate(megatron_iteration(model, args.iteration), args.hf_model, prompts, args.max_tokens,
                           tp=args.tp, pp=args.pp, ep=args.ep, reasoning=args.reasoning)


def megatron_iteration(model: str, iteration: int | None) -> Path:
    """The exact iteration directory to generate from: a checkpoint root resolves to ``--iteration`` or its latest
    complete iteration (never a later or half-written one); an ``iter_NNNNNNN`` directory must be complete."""
    from pipeline.checkpoint import layout

    path = Path(model)
    if path.name.startswith("iter_") and (path.parent / layout.TRACKER).exists():
        if iteration is not None:
            raise UserError(f"{path} is already an iteration directory; drop --iteration or pass the checkpoint root")
        return layout.resolve_iteration(path.parent, int(path.name.split("_")[-1]))
    return layout.resolve_iteration(path, iteration)


def run_model(args, model: str, prompts: list[str]) -> dict[str, Any]:
    from pipeline.coherence.metrics import score, summarize

    t0 = time.time()
    gens = _generate(args, model, prompts)
    rows = []
    for prompt, (text, n_tok, finished) in zip(prompts, gens):
        rows.append({"prompt": prompt, "response": text, **score(text, n_tok, args.max_tokens, finished, args.reasoning)})
    summary = summarize(rows)
    summary["seconds"] = round(time.time() - t0, 2)
    return {"model": model, "backend": args.backend, "rows": rows, "summary": summary}


def _md_cell(s: str) -> str:
    return re.sub(r"\s+", " ", s.replace("|", "\\|")).strip() or "*(empty)*"


def markdown(report: dict) -> str:
    lines = [f"# Coherence test - {report['time']}", ""]
    for res in report["results"]:
        s = res["summary"]
        lines += [f"## {res['model']} ({res['backend']})", "",
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


def log_wandb(report: dict, project: str, name: str) -> str | None:
    import wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    run = wandb.init(project=project, name=name, mode=mode, job_type="coherence",
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
    root = Path(os.environ.get("PIPELINE_RUNS_DIR") or Path(os.environ.get("PIPELINE_ROOT", ".")) / "runs")
    return root / "coherence" / model.replace("/", "__")


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(quiet=args.quiet)
    ranks = args.tp * args.pp * args.ep
    if min(args.tp, args.pp, args.ep) < 1:
        raise UserError(f"--tp/--pp/--ep must be >= 1 (got {args.tp}/{args.pp}/{args.ep})")
    if ranks > 1 and args.backend != "megatron":
        raise UserError("--tp/--pp/--ep apply to the megatron backend only")
    if ranks > 1 and "LOCAL_RANK" not in os.environ:
        from pipeline.slurm.allocation import torchrun_standalone

        from pipeline import bridge

        megatron_iteration(args.model, args.iteration)  # a bad path fails here, before any rank starts
        bridge.require_bridge("the megatron backend")
        cmd = torchrun_standalone(ranks, "pipeline.coherence.cli", list(sys.argv[1:] if argv is None else argv))
        print("launching: " + " ".join(cmd), flush=True)
        os.execvp(cmd[0], cmd)
    from pipeline.coherence.prompts import load_prompts

    prompts = load_prompts(args.prompts)
    results = [run_model(args, m, prompts) for m in [args.model, *args.compare]]
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # model-parallel generation: every rank generated, rank 0 reports
    report = {"time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "prompts": prompts,
              "max_tokens": args.max_tokens, "reasoning": args.reasoning, "results": results}
    out_dir = args.output_dir or default_output_dir(args.model)
    stem = f"coherence_{args.backend}"
    if not args.no_wandb:
        report["wandb_dir"] = log_wandb(report, args.wandb_project, f"coherence-{Path(args.model).name}")
    write_json(out_dir / f"{stem}.json", report)
    write_text(out_dir / f"{stem}.md", markdown(report))
    for res in results:
        s = res["summary"]
        print(f"{res['model']}: {s['num_prompts']} prompts, empty {s['empty_pct']}%, truncated {s['truncated_pct']}%, "
              f"repetitive {s['repetitive_pct']}%, template leaks {s['template_leak_pct']}%, "
              f"mean length {s['mean_response_length']} chars")
        if not args.quiet:
            for r in res["rows"]:
                print(f"  - {r['prompt']}\n    -> {r['response'][:200]!r}")
    print(f"report: {out_dir / (stem + '.json')} and {out_dir / (stem + '.md')}"
          + (f"; W&B: {report['wandb_dir']}" if report.get("wandb_dir") else ""))
    empty = sum(r["empty"] for res in results for r in res["rows"])
    if empty and not args.allow_empty:
        print(f"error: {empty} empty response(s): the model is broken or its chat template is wrong", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
