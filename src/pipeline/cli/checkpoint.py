"""pipeline_checkpoint_convert.sh - the checkpoint pipeline's actions.

  export CKPT_DIR --hf-model ID --reasoning|--no-reasoning [--iteration N] [--not-strict] [--push-to-hub]
         [--tp T --pp P --ep E]
         export one iteration (default: the latest complete one) to CKPT_DIR/iter_NNNNNNN/hf/, verified;
         Megatron checkpoints with T*P*E > 1 run one torchrun rank per GPU of this node
  import HF_ID [--output DIR]
         Hugging Face -> a checkpoint in our layout (Megatron via AutoBridge on GPUs; local engine: HF weights);
         in a multi-node allocation it runs once, on the first node
  upload-all CKPT_DIR --hf-model ID --reasoning|--no-reasoning [--poll] [--interval S] [--coherence]
         convert every complete iteration exactly once; with --poll keep watching until training ends

--hf-model names the Hugging Face model the checkpoint belongs to (its architecture and tokenizer for the
Megatron path; recorded for the local engine). The reasoning choice is required, as in the reference:
it sets the exported chat template's enable_thinking default where the template has one.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from pipeline import bridge
from pipeline.checkpoint import export as ex
from pipeline.checkpoint import layout
from pipeline.checkpoint.poll import upload_all
from pipeline.cli.parser import Parser
from pipeline.coherence.run import CoherenceRun
from pipeline.coherence.run import run as run_coherence
from pipeline.common.errors import UserError, cli_main
from pipeline.common.log import setup_logging
from pipeline.config.models import REGISTRY, models_dir
from pipeline.slurm.allocation import torchrun_standalone


def _add_common(p: Parser) -> None:
    p.add_argument("ckpt_dir", type=Path)
    p.add_argument("--hf-model", required=True, help="HF id the checkpoint belongs to (architecture + tokenizer)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--reasoning", dest="reasoning", action="store_true")
    g.add_argument("--no-reasoning", dest="reasoning", action="store_false")
    p.add_argument("--not-strict", action="store_true", help="allow parameter-name mismatches (SFT without MTP)")
    p.add_argument("--atol", type=float, default=1e-3, help="logit tolerance of the verification")
    p.add_argument("--require-quality", action="store_true",
                   help="also fail the verification on model quality (reference loss near a uniform guess, empty "
                        "generations); by default they are reported, and only conversion fidelity decides")
    p.add_argument("--force", action="store_true", help="re-export even when a verified hf/ exists")


def build_parser() -> Parser:
    parser = Parser(prog="pipeline_checkpoint_convert.sh", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True, parser_class=Parser)
    e = sub.add_parser("export", help="export one iteration to HF, verified")
    _add_common(e)
    e.add_argument("--iteration", type=int)
    for flag in ("--tp", "--pp", "--ep"):
        e.add_argument(flag, type=int, default=1, help="model-parallel layout for a Megatron export (ranks = tp*pp*ep)")
    e.add_argument("--push-to-hub", action="store_true")
    e.add_argument("--hub-repo", help="repo id for --push-to-hub (default: <user>/<ckpt-dir-name>-iter<N>)")
    i = sub.add_parser("import", help="HF -> checkpoint")
    i.add_argument("hf_id")
    i.add_argument("--output", type=Path, help="default: $PIPELINE_MODELS_DIR/megatron/<org>__<name>")
    i.add_argument("--force", action="store_true")
    u = sub.add_parser("upload-all", help="convert every complete iteration exactly once")
    _add_common(u)
    u.add_argument("--poll", action="store_true", help="keep watching until training has finished")
    u.add_argument("--interval", type=float, default=60.0, help="seconds between polls")
    u.add_argument("--idle-timeout", type=float, help="stop polling after this many seconds without a new checkpoint")
    u.add_argument("--coherence", action="store_true", help="run the coherence test on each export")
    u.add_argument("--push-to-hub", action="store_true")
    return parser


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    setup_logging()
    if args.action == "import":
        node = int(os.environ.get("SLURM_NODEID") or 0)
        if node > 0:
            print(f"import runs once per allocation: node {node} leaves it to the first node")
            return 0

        spec = REGISTRY.get(args.hf_id)
        megatron = spec is None or not spec.is_local
        out = args.output or models_dir() / ("megatron" if megatron else "local") / args.hf_id.replace("/", "__")
        target = ex.import_hf(spec.hf_id if spec and megatron else args.hf_id, out, megatron=megatron, force=args.force)
        print(f"imported {args.hf_id} -> {target}")
        print(f"use it with: checkpoint.pretrained_checkpoint={out}")
        return 0

    def convert(iter_path: Path) -> dict:
        rec = ex.export_iteration(iter_path, hf_model=args.hf_model, reasoning=args.reasoning,
                                  strict=not args.not_strict, atol=args.atol, force=args.force,
                                  require_quality=args.require_quality,
                                  locked=args.action == "upload-all",  # upload-all holds the iteration's lock
                                  tp=getattr(args, "tp", 1), pp=getattr(args, "pp", 1), ep=getattr(args, "ep", 1))
        if rec.get("verdict") == "rank":  # a non-zero rank of a model-parallel export: rank 0 reports
            return rec
        if getattr(args, "coherence", False):
            rc = run_coherence(CoherenceRun(model=str(iter_path / "hf"), reasoning=args.reasoning, quiet=True))
            rec = {**rec, "coherence_exit_code": rc}
        if args.push_to_hub:
            repo = getattr(args, "hub_repo", None) or f"{args.ckpt_dir.name}-{iter_path.name}"
            rec = {**rec, "hub_url": ex.push_to_hub(iter_path / "hf", repo)}
        return rec

    if args.action == "export":
        iter_path = layout.resolve_iteration(args.ckpt_dir, args.iteration)
        ranks = args.tp * args.pp * args.ep
        if min(args.tp, args.pp, args.ep) < 1:
            raise UserError(f"--tp/--pp/--ep must be >= 1 (got {args.tp}/{args.pp}/{args.ep})")
        if ranks > 1 and "LOCAL_RANK" not in os.environ:
            if layout.engine_of(iter_path) != "megatron":
                raise UserError(f"--tp/--pp/--ep apply to Megatron checkpoints; {iter_path} is a local-engine "
                                "checkpoint")
            bridge.require_bridge(f"exporting the Megatron checkpoint {iter_path}")  # fail here, not on every rank
            cmd = torchrun_standalone(ranks, "pipeline.cli.checkpoint", argv)
            print("launching: " + " ".join(cmd), flush=True)
            os.execvp(cmd[0], cmd)
        try:
            rec = convert(iter_path)
            if rec.get("verdict") == "rank":
                return 0
        except ex.VerificationFailed as exc:
            print(f"error: export of {iter_path} FAILED verification: {exc}", file=sys.stderr)
            print(f"details: {iter_path / ex.FAILED}", file=sys.stderr)
            return 1
        print(json.dumps({k: rec[k] for k in ("verdict", "max_abs_logit_diff", "reference_loss", "uniform_loss")
                          if k in rec}, indent=2))
        print(f"exported: {iter_path / 'hf'}")
        return 0

    if not args.ckpt_dir.is_dir():
        raise UserError(f"checkpoint directory {args.ckpt_dir} does not exist")
    for flag, v in (("--interval", args.interval), ("--idle-timeout", args.idle_timeout)):
        if v is not None and not (math.isfinite(v) and 0 < v <= 7 * 86400):
            raise UserError(f"{flag} {v} must be a number of seconds in (0, 604800]")
    if not args.poll and not layout.list_iterations(args.ckpt_dir) and layout.read_tracker(args.ckpt_dir) is None:
        raise UserError(f"{args.ckpt_dir} holds no iter_NNNNNNN checkpoints (is it the run's checkpoints/ folder? "
                        "--poll waits for the first one)")
    conv, failed = upload_all(args.ckpt_dir, convert, poll=args.poll, interval=args.interval,
                              idle_timeout=args.idle_timeout)
    print(f"upload-all: converted {len(conv)} iteration(s) {conv}; failed {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
