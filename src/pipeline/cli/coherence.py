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

import os
import sys
from pathlib import Path

from pipeline import bridge
from pipeline.cli.parser import Parser
from pipeline.coherence.run import BACKENDS, CoherenceRun, megatron_iteration, run
from pipeline.common.errors import cli_main
from pipeline.common.log import setup_logging
from pipeline.slurm.allocation import torchrun_standalone


def build_parser() -> Parser:
    p = Parser(prog="pipeline_coherence_test.py", description=__doc__)
    p.add_argument("model", help="HF directory or hub id (hf), served model id (endpoint), Megatron ckpt (megatron)")
    p.add_argument("--compare", action="append", default=[], metavar="MODEL",
                   help="another model to run on the same prompts, side by side in one report (repeatable)")
    p.add_argument("--backend", choices=BACKENDS, default="hf")
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
    p.add_argument("--iteration", type=int,
                   help="megatron backend: the iteration of a checkpoint root (default: latest complete)")
    p.add_argument("--output-dir", type=Path, help="default: MODEL/coherence/ for a local model")
    p.add_argument("--wandb-project", default=os.environ.get("COHERENCE_WANDB_PROJECT", "pipeline-gen-tests"))
    p.add_argument("--no-wandb", action="store_true")
    p.add_argument("--allow-empty", action="store_true", help="exit 0 even when a response is empty")
    p.add_argument("--quiet", action="store_true")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = CoherenceRun(**vars(build_parser().parse_args(argv)))
    setup_logging(quiet=cfg.quiet)
    cfg.check()
    if cfg.ranks > 1 and "LOCAL_RANK" not in os.environ:
        megatron_iteration(cfg.model, cfg.iteration)  # a bad path fails here, before any rank starts
        bridge.require_bridge("the megatron backend")
        cmd = torchrun_standalone(cfg.ranks, "pipeline.cli.coherence", argv)
        print("launching: " + " ".join(cmd), flush=True)
        os.execvp(cmd[0], cmd)
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
