"""pipeline_data_prepare.py - the data pipeline's actions.

  prepare   --dataset ORG/NAME|PATH|chatterbot-corpus --seq-length S [--tokenizer T] [...]
            load, apply the chat template with loss on assistant turns only, tokenise, export, pack:
            <dataset-root>/packed/<tokenizer>_pad_seq_to_mult<N>/training_<S>.idx.parquet
  tokenize  DATASET_ROOT TOKENIZER OUTPUT_NAME
            pretraining corpus (text files, or JSONL/Parquet with a text field) -> Megatron .bin/.idx
            at DATASET_ROOT/OUTPUT_NAME/, with an exact token count in token_count.json
  pack      DATASET_ROOT TOKENIZER SEQ_LENGTH [PAD_SEQ_TO_MULT]
            pack an already tokenised export (the output of prepare's tokenize stage), CPU only

Every stage is resumable: re-running skips finished work with a message when it was made from the same
input and options (its recorded fingerprint); a changed input or option redoes it, naming the difference;
--force redoes it. The default root of a local file or folder is <stem>-<hash of its path>, so two
datasets with the same file name never share one. Bad input is one line "error: ..." and exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.cli.parser import Parser, positive_int
from pipeline.common import paths
from pipeline.common.errors import UserError, cli_main
from pipeline.common.log import setup_logging


def _print_summary(summary: dict) -> None:
    ex, pk = summary["export"], summary["pack"]
    print("== data prepare summary ==")
    print(f"examples in: {ex['rows_in']}  kept: {ex['kept']}  dropped: {ex['dropped'] or 'none'}")
    for split in ("train", "validation"):
        s = pk.get(split, {})
        extra = {k: v for k, v in s.items() if k.startswith(("dropped_", "truncated"))}
        print(f"{split:>10}: {s.get('sequences', 0)} sequences, {s.get('tokens', 0)} tokens -> "
              f"{s.get('packs', 0)} packs, fill {s.get('packing_efficiency', 0)}%"
              + (f", {extra}" if extra else ""))
    print(f"seconds per stage: {summary['seconds_per_stage'] or 'all stages skipped (already done)'}")
    for k, v in pk.get("paths", {}).items():
        print(f"{k:>10}: {v}")


def build_parser() -> Parser:
    """The data pipeline's parser (standard library only: isambard_sbatch checks a submission with it)."""
    parser = Parser(prog="pipeline_data_prepare.py", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)

    p = sub.add_parser("prepare", help="load + chat template + tokenise + export + pack")
    p.add_argument("--dataset", required=True,
                   help="HF dataset id ORG/NAME, a local dir/.jsonl/.parquet, or chatterbot-corpus")
    p.add_argument("--seq-length", type=int, required=True, help="packed sequence length S")
    p.add_argument("--tokenizer", help="registry model name, local dir or HF id (default: --model's tokenizer)")
    p.add_argument("--model", default="smollm2-135m",
                   help="the model the data is for (registry name: nano, super, smollm2-135m, ...): its tokenizer is "
                        "used unless --tokenizer is given (default smollm2-135m, the local quickstart's)")
    p.add_argument("--dataset-root", type=Path, help="output root (default: $PIPELINE_DATA_ROOT/<org>__<name>)")
    p.add_argument("--pad-seq-to-mult", type=int, default=1, help="pad every sequence to this multiple (CP: >= 2*CP)")
    p.add_argument("--context-parallel-size", type=int, default=1, help="validate the pad multiple against this CP")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--overlong", choices=["drop", "truncate"], default="drop",
                   help="what to do with examples longer than the sequence length (counted either way)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, help="use only the first N usable conversations")
    p.add_argument("--chunk-size", type=int,
                   help="conversations per tokenised chunk (resume unit; default: data.prepare.CHUNK_SIZE, in the "
                        "fingerprint)")
    p.add_argument("--workers", type=positive_int, help="tokenize worker processes (default: every usable CPU); "
                   "the output is the same for any number")
    p.add_argument("--force", action="store_true", help="redo every stage")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")

    t = sub.add_parser("tokenize", help="pretraining corpus -> Megatron .bin/.idx")
    t.add_argument("dataset_root", help="corpus: a folder of text files, or JSONL/Parquet (file or folder)")
    t.add_argument("tokenizer")
    t.add_argument("output_name")
    t.add_argument("--output-dir", type=Path,
                   help="default: DATASET_ROOT/OUTPUT_NAME (or $PIPELINE_DATA_ROOT/OUTPUT_NAME for a file)")
    t.add_argument("--text-field", default="text")
    t.add_argument("--docs-per-part", type=int, default=2000)
    t.add_argument("--workers", type=positive_int, help="worker processes (default: every usable CPU); the output "
                   "is the same for any number")
    t.add_argument("--glob", metavar="PATTERN",
                   help="the files of a corpus folder to read, matched against their path in the folder (fnmatch: "
                        "'*' crosses folders, e.g. '*.py' or 'docs/*.md'; default: every file with a common text "
                        "suffix: .txt .md .py .rst ...); binary files are skipped and counted")
    t.add_argument("--limit", type=int)
    t.add_argument("--force", action="store_true")
    t.add_argument("--quiet", action="store_true")

    k = sub.add_parser("pack", help="pack an already tokenised export")
    k.add_argument("dataset_root", type=Path)
    k.add_argument("tokenizer")
    k.add_argument("seq_length", type=int)
    k.add_argument("pad_seq_to_mult", type=int, nargs="?", default=1)
    k.add_argument("--context-parallel-size", type=int, default=1)
    k.add_argument("--tensor-parallel-size", type=int, default=1)
    k.add_argument("--sequence-parallel", action="store_true")
    k.add_argument("--overlong", choices=["drop", "truncate"], default="drop")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--force", action="store_true")
    k.add_argument("--quiet", action="store_true")
    return parser


def _is_hub_id(name: str) -> bool:
    """A hub id ORG/NAME, not a local path (which is checked now)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith("/")


def check_submission(argv: list[str], inputs_later: bool = False) -> None:
    """isambard_sbatch's check of ``pipeline_data_prepare.py ARGS`` before queueing (UserError, one line): this parser,
    then the paths the job reads, then the packing arguments (data.prepare.check_pack_args, where numpy is there:
    a bare login node gets the parser's and the paths' checks). ``inputs_later``: the job waits for another,
    whose outputs are its dataset root; that root is then checked by the job."""
    args = build_parser().parse_args(argv)
    if args.action == "prepare":
        if args.dataset != "chatterbot-corpus" and not _is_hub_id(args.dataset) and not Path(args.dataset).exists():
            raise UserError(f"prepare: dataset {args.dataset} does not exist")
    elif not inputs_later and not Path(args.dataset_root).exists() and not (
            args.action == "tokenize" and _is_hub_id(str(args.dataset_root))):
        raise UserError(f"{args.action}: dataset root {args.dataset_root} does not exist")
    if args.action == "tokenize":
        return
    try:
        from pipeline.data.prepare import check_pack_args
    except ImportError:  # a bare login node: the job checks them when it starts
        return
    problems = check_pack_args(args.seq_length, args.pad_seq_to_mult, args.context_parallel_size,
                               args.tensor_parallel_size, args.sequence_parallel, args.seed)
    if problems:
        raise UserError(f"{args.action}: " + "; ".join(problems))


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(quiet=getattr(args, "quiet", False))

    from pipeline.data import prepare as prep

    if args.action == "prepare":
        from pipeline.data.sources import dataset_dirname

        root = args.dataset_root or paths.data_root() / dataset_dirname(args.dataset)
        if args.tokenizer is None:
            from pipeline.config.models import get_model

            spec = get_model(args.model)
            args.tokenizer = spec.tokenizer_from or spec.name
            print(f"tokenizer: {args.tokenizer} ({get_model(args.tokenizer).hf_id}), the tokenizer of --model "
                  f"{args.model}; pass --tokenizer to choose another", file=sys.stderr)
        opts = prep.PrepareOptions(
            dataset=args.dataset, dataset_root=root, seq_length=args.seq_length, tokenizer=args.tokenizer,
            pad_seq_to_mult=args.pad_seq_to_mult, context_parallel_size=args.context_parallel_size,
            tensor_parallel_size=args.tensor_parallel_size, sequence_parallel=args.sequence_parallel,
            val_fraction=args.val_fraction, seed=args.seed, overlong=args.overlong, limit=args.limit,
            chunk_size=prep.CHUNK_SIZE if args.chunk_size is None else args.chunk_size, workers=args.workers,
            force=args.force, quiet=args.quiet)
        summary = prep.prepare(opts)
        print(json.dumps(summary, indent=2)) if args.json else _print_summary(summary)
        return 0

    if args.action == "tokenize":
        from pipeline.data.indexed import tokenize_corpus

        src = Path(args.dataset_root)
        if not src.exists() and not _is_hub_id(args.dataset_root):
            raise UserError(f"corpus {src} does not exist")
        if args.docs_per_part < 1:
            raise UserError(f"--docs-per-part must be >= 1, got {args.docs_per_part}")
        if args.limit is not None and args.limit < 1:
            raise UserError(f"--limit must be >= 1, got {args.limit}")
        out = args.output_dir or ((src if src.is_dir() else paths.data_root()) / args.output_name)
        res = tokenize_corpus(args.dataset_root, args.tokenizer, out, args.output_name, text_field=args.text_field,
                              docs_per_part=args.docs_per_part, limit=args.limit, force=args.force, quiet=args.quiet,
                              workers=args.workers, glob=args.glob)
        print(json.dumps(res, indent=2))
        return 0

    # pack
    from pipeline.data.chat import tokenizer_model_name

    problems = prep.check_pack_args(args.seq_length, args.pad_seq_to_mult, args.context_parallel_size,
                                    args.tensor_parallel_size, args.sequence_parallel, args.seed)
    if problems:
        raise UserError("; ".join(problems))
    if not args.dataset_root.is_dir():
        raise UserError(f"dataset root {args.dataset_root} does not exist (or is not a directory)")
    with prep.root_lock(args.dataset_root):
        opts = prep.PackOptions(dataset_root=args.dataset_root, tok_name=tokenizer_model_name(args.tokenizer),
                                tokenizer=args.tokenizer, seq_length=args.seq_length,
                                pad_seq_to_mult=args.pad_seq_to_mult, seed=args.seed, overlong=args.overlong,
                                force=args.force)
        res = prep.stage_pack(opts, prep.Timer())
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
