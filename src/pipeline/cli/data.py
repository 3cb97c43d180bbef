"""pipeline_data_prepare.py - the data pipeline's actions.

  prepare   --dataset ORG/NAME|PATH|chatterbot-corpus --seq-length S [--model M] [--tokenizer T] [...]
  prepare   --config CONFIG   (the dataset, root, sequence length, tokenizer and pad multiple the config reads)
            load, apply the chat template with loss on assistant turns only, tokenise, export, pack:
            <dataset-root>/packed/<tokenizer>_pad_seq_to_mult<N>/training_<S>.idx.parquet
            The dataset root defaults to <the profile's data_root>/<org>__<name> ($PIPELINE_DATA_ROOT wins), the
            tokenizer and pad multiple to the model's. The local (CPU) profile's model is smollm2-135m; a GPU
            profile trains several, so there --model (or --config, or --tokenizer) is required. --dry-run prints
            the plan (root, tokenizer, pad multiple, packed paths) and stops.
  prepare   ... --export-only      the export stage alone (one node: the splits are global)
  prepare   ... --shard I/N        only shard I of N of the export's tokenize chunks (a contiguous run, balanced by
                                   size), into DATASET_ROOT/.shards/: one per node, each resumable by itself
  prepare   ... --merge-shards N   the N finished shards' chunks, then the pack: byte for byte what one run writes
  tokenize  DATASET_ROOT TOKENIZER OUTPUT_NAME
            pretraining corpus (text files, or JSONL/Parquet with a text field) -> Megatron .bin/.idx
            at DATASET_ROOT/OUTPUT_NAME/, with an exact token count in token_count.json
  tokenize  ... --shard I/N     only shard I of N (a contiguous run of the corpus's files, balanced by size), into
                                OUTPUT/.shards/: one per node, each resumable by itself
  tokenize  ... --merge-shards N  the output from the N finished shards: byte for byte what one run writes
  pack      DATASET_ROOT TOKENIZER SEQ_LENGTH [PAD_SEQ_TO_MULT]
            pack an already tokenised export (the output of prepare's tokenize stage), CPU only

Every stage is resumable: re-running skips finished work with a message when it was made from the same
input and options (its recorded fingerprint); a changed input or option redoes it, naming the difference;
--force redoes it. The default root of a local file or folder is <stem>-<hash of its path>, so two
datasets with the same file name never share one. Bad input is one line "error: ..." and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.cli.parser import Parser, name_arg, path_arg, positive_int
from pipeline.common import paths
from pipeline.common.errors import UserError, cli_main
from pipeline.common.log import setup_logging
from pipeline.config.cluster import resolve_profile
from pipeline.config.knobs import effective_knobs
from pipeline.config.models import REGISTRY, get_model
from pipeline.data.shards import CHUNK_SIZE, LIMIT_NOT_SHARDABLE, describe, parse_shard, shard_dir


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
    p.add_argument("--dataset",
                   help="HF dataset id ORG/NAME, a local dir/.jsonl/.parquet, or chatterbot-corpus (required unless "
                        "--config names it)")
    p.add_argument("--seq-length", type=int, help="packed sequence length S (required unless --config)")
    p.add_argument("--config", type=Path,
                   help="a training config: prepare exactly the packs it reads (its dataset.dataset_name, "
                        "dataset_root, seq_length, offline_packing_specs' tokenizer and pad multiple)")
    p.add_argument("--cluster", type=name_arg, help="cluster profile (default: $PIPELINE_CLUSTER, else local_cpu)")
    p.add_argument("--tokenizer", help="registry model name, local dir or HF id (default: --model's tokenizer)")
    p.add_argument("--model",
                   help="the model the data is for (registry name: nano, super, smollm2-135m, ...): its tokenizer and "
                        "pad multiple are used unless given (default on the local CPU profile: smollm2-135m; "
                        "required on a GPU profile)")
    p.add_argument("--dataset-root", type=path_arg,
                   help="output root (default: <profile data_root or $PIPELINE_DATA_ROOT>/<org>__<name>)")
    p.add_argument("--pad-seq-to-mult", type=int,
                   help="pad every sequence to this multiple (CP: >= 2*CP; default: the model's, else 1)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (root, tokenizer, packed paths) and stop")
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
    p.add_argument("--force", action="store_true", help="redo every stage (with --shard: that shard's chunks; with "
                   "--merge-shards: the pack)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    nodes = p.add_mutually_exclusive_group()
    nodes.add_argument("--export-only", action="store_true",
                       help="run the export stage alone (the splits the shards tokenize), on one node")
    nodes.add_argument("--shard", metavar="I/N", type=_shard_arg,
                       help="tokenize only shard I of N (counted from 0) of the export's chunks, into "
                            "DATASET_ROOT/.shards/; run --export-only first, every shard, then --merge-shards N")
    nodes.add_argument("--merge-shards", metavar="N", type=positive_int,
                       help="move the N finished shards' chunks into DATASET_ROOT/tokenized/ and pack: byte for byte "
                            "what one run without --shard writes")

    t = sub.add_parser("tokenize", help="pretraining corpus -> Megatron .bin/.idx")
    t.add_argument("dataset_root", type=_corpus_arg,
                   help="corpus: a folder of text files, or JSONL/Parquet (file or folder)")
    t.add_argument("tokenizer")
    t.add_argument("output_name")
    t.add_argument("--output-dir", type=path_arg,
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
    split = t.add_mutually_exclusive_group()
    split.add_argument("--shard", metavar="I/N", type=_shard_arg,
                       help="tokenize only shard I of N (counted from 0): a contiguous run of the corpus's files, "
                            "balanced by size, into OUTPUT/.shards/; run every shard, then --merge-shards N")
    split.add_argument("--merge-shards", metavar="N", type=positive_int,
                       help="write the output from the N finished shards (the same input and options), byte for "
                            "byte what one run without --shard writes, and remove the shards")
    t.add_argument("--force", action="store_true")
    t.add_argument("--quiet", action="store_true")

    k = sub.add_parser("pack", help="pack an already tokenised export")
    k.add_argument("dataset_root", type=path_arg)
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


def _corpus_arg(text: str) -> str:
    """tokenize's corpus: a path (not empty) or a hub id, kept as written."""
    path_arg(text)
    return text


def _shard_arg(text: str) -> tuple[int, int]:
    try:
        return parse_shard(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--shard {text!r} ").removeprefix("--shard ")) \
            from None


def _registry_names() -> set[str]:
    return set(REGISTRY)


def _is_hub_id(name: str) -> bool:
    """A hub id ORG/NAME, not a local path (which is checked now)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith("/")


def check_submission(argv: list[str], inputs_later: bool = False, nodes: int = 1) -> None:
    """isambard_sbatch's check of ``pipeline_data_prepare.py ARGS`` before queueing (UserError, one line): this parser,
    then the paths the job reads, then the packing arguments (data.prepare.check_pack_args, where numpy is there:
    a bare login node gets the parser's and the paths' checks). ``inputs_later``: the job waits for another,
    whose outputs are its dataset root; that root is then checked by the job. ``nodes`` > 1: a tokenize job split
    across nodes, whose split is printed (:func:`plan_split`)."""
    args = build_parser().parse_args(argv)
    if nodes > 1 and args.action == "pack":
        raise UserError("pack runs on one node (its best fit is over the whole split): only tokenize and prepare are "
                        "split across nodes (submit with --nodes=1)")
    if args.action == "prepare":
        if nodes > 1 and (args.shard is not None or args.merge_shards is not None or args.export_only):
            raise UserError("--export-only, --shard and --merge-shards are the job's own steps: a submission across "
                            "nodes exports, splits and merges by itself (drop them, or submit with --nodes=1)")
        problems = _prepare_value_problems(args)
        if problems:
            raise UserError("prepare: " + "; ".join(problems))
        try:
            resolved = _resolve_prepare(args)
        except ImportError:  # a bare login node (no PyYAML, no numpy): the job resolves it when it starts
            if nodes > 1:
                print(f"prepare across {nodes} nodes: the export, the split of its tokenize chunks and the merge are "
                      "planned when the job starts (no login-node planner here)", file=sys.stderr)
            return
        dataset = resolved["dataset"]
        if dataset != "chatterbot-corpus" and not _is_hub_id(dataset) and not Path(dataset).exists():
            raise UserError(f"prepare: dataset {dataset} does not exist")
        args.seq_length, args.pad_seq_to_mult = resolved["seq_length"], resolved["pad_seq_to_mult"]
        args.context_parallel_size = resolved["context_parallel_size"]
        args.tensor_parallel_size = resolved["tensor_parallel_size"]
        args.sequence_parallel = resolved["sequence_parallel"]
        if nodes > 1:
            plan_prepare_split(args, nodes, Path(resolved["dataset_root"]))
    elif not inputs_later and not Path(args.dataset_root).exists() and not (
            args.action == "tokenize" and _is_hub_id(str(args.dataset_root))):
        raise UserError(f"{args.action}: dataset root {args.dataset_root} does not exist")
    if args.action == "tokenize":
        if nodes > 1:
            plan_split(args, nodes, inputs_later)
        return
    try:
        from pipeline.data.prepare import check_pack_args
    except ImportError:  # a bare login node: the job checks them when it starts
        return
    problems = check_pack_args(args.seq_length, args.pad_seq_to_mult, args.context_parallel_size,
                               args.tensor_parallel_size, args.sequence_parallel, args.seed)
    if problems:
        raise UserError(f"{args.action}: " + "; ".join(problems))


def _tokenize_output(args) -> Path:
    src = Path(args.dataset_root)
    return args.output_dir or ((src if src.is_dir() else paths.data_root()) / args.output_name)


def plan_split(args, nodes: int, inputs_later: bool) -> None:
    """A tokenize job across ``nodes`` nodes (the batch script runs shard I of N on each, then the merge): what cannot
    be split is refused in one line; the split is printed (stderr), or said to be made when the job starts where the
    corpus is not there yet or this login node has no planner."""
    if args.shard is not None or args.merge_shards is not None:
        raise UserError("--shard and --merge-shards are the job's own steps: a submission across nodes splits and "
                        "merges by itself (drop them, or submit with --nodes=1)")
    if args.limit is not None:
        raise UserError(f"{LIMIT_NOT_SHARDABLE} (submit with --nodes=1)")
    if _is_hub_id(str(args.dataset_root)) and not Path(args.dataset_root).exists():
        raise UserError(f"corpus {args.dataset_root} is a hub dataset, not local files, so it cannot be split across "
                        "nodes: download it to a folder first, or submit with --nodes=1")
    if inputs_later:
        print(f"tokenize across {nodes} nodes: the split of {args.dataset_root} is made when the job starts (it "
              "waits for the job that writes it)", file=sys.stderr)
        return
    try:
        from pipeline.data.sources import corpus_shards
    except ImportError:  # a bare login node: the job splits the corpus the same way when it starts
        print(f"tokenize across {nodes} nodes: the split of {args.dataset_root} is made when the job starts (no "
              "login-node planner here to read it)", file=sys.stderr)
        return
    out = _tokenize_output(args)
    shards = corpus_shards(str(args.dataset_root), out, args.glob, nodes)
    print("\n".join(describe(shards, Path(args.dataset_root), out, args.output_name)), file=sys.stderr)


def _prepare_value_problems(args) -> list[str]:
    """The prepare options checked before anything is read (``PrepareOptions.validate`` checks them again in the
    job): so a submission with a bad one is refused at once, not after the queue."""
    problems = []
    if args.chunk_size is not None and args.chunk_size < 1:
        problems.append(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.limit is not None and args.limit < 1:
        problems.append(f"--limit must be >= 1, got {args.limit}")
    if not 0 <= args.val_fraction < 1:
        problems.append(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    return problems


def plan_prepare_split(args, nodes: int, root: Path) -> None:
    """A chat prepare job across ``nodes`` nodes (the batch script runs the export, shard I of N on each node, then
    the merge and the pack): the plan is printed (stderr). The chunks are split once the export has written them,
    so the plan gives the rule and the folders, not the chunk runs."""
    size = CHUNK_SIZE if args.chunk_size is None else args.chunk_size
    print(f"prepare across {nodes} nodes: the export of {args.dataset} on one node into {root} "
          f"(training.jsonl, validation.jsonl); then its tokenize chunks of {size} conversations, split into {nodes} "
          "contiguous runs balanced by size (one shard per node, each retried by itself):", file=sys.stderr)
    for i in range(nodes):
        print(f"  shard {i}/{nodes} -> {shard_dir(root, i, nodes) / 'tokenized'}", file=sys.stderr)
    print(f"  then the merge and the pack on one node into {root / 'packed'}, byte for byte what one node writes",
          file=sys.stderr)


def _tokenizer_of_config(tok_model_name: str, config: Path) -> str:
    """The registry model whose tokenizer a config's offline_packing_specs.tokenizer_model_name names."""
    for spec in REGISTRY.values():
        if not spec.tokenizer_from and spec.hf_id.replace("/", "--") == tok_model_name:
            return spec.name
    raise UserError(f"prepare: {config}: dataset.offline_packing_specs.tokenizer_model_name {tok_model_name} is no "
                    "registry model's tokenizer; pass --tokenizer (its packed folder name must match)")


def _from_config(args) -> dict:
    """What a training config reads: dataset, root, sequence length, tokenizer, pad multiple (and its parallelism,
    which the pad multiple is checked against). A command-line value that disagrees is refused."""
    from pipeline.config.loader import load_config
    from pipeline.data.chat import tokenizer_model_name
    from pipeline.data.packed_parquet import packed_paths

    cfg = load_config(args.config)
    ds, specs = cfg.dataset, cfg.dataset.offline_packing_specs
    if not ds.dataset_name or not ds.dataset_root:
        raise UserError(f"prepare: {args.config} names no dataset.dataset_name/dataset_root to prepare")
    seq = specs.packed_sequence_size or ds.seq_length or cfg.model.seq_length
    tok = specs.tokenizer_model_name
    if not seq or not tok:
        raise UserError(f"prepare: {args.config} names no sequence length or "
                        "dataset.offline_packing_specs.tokenizer_model_name")
    tokenizer = args.tokenizer or _tokenizer_of_config(tok, args.config)
    root, seq_length, pad = Path(ds.dataset_root), int(seq), specs.pad_seq_to_mult or 1
    out = {"dataset": ds.dataset_name, "dataset_root": root, "seq_length": seq_length,
           "tokenizer": tokenizer, "pad_seq_to_mult": pad,
           "context_parallel_size": cfg.model.context_parallel_size or 1,
           "tensor_parallel_size": cfg.model.tensor_model_parallel_size or 1,
           "sequence_parallel": bool(cfg.model.sequence_parallel)}
    given = {"dataset": args.dataset, "dataset_root": args.dataset_root, "seq_length": args.seq_length,
             "pad_seq_to_mult": args.pad_seq_to_mult}
    differ = [f"--{k.replace('_', '-')} {v} (the config: {out[k]})" for k, v in given.items()
              if v is not None and v != out[k]]
    if args.tokenizer and tokenizer_model_name(args.tokenizer) != tok:
        differ.append(f"--tokenizer {args.tokenizer} (the config reads {tok})")
    if differ:
        raise UserError(f"prepare: disagrees with {args.config}: " + "; ".join(differ)
                        + "; drop them to prepare what the config reads")
    explicit = {k: v for k, v in (("train", specs.packed_train_data_path), ("validation", specs.packed_val_data_path),
                                  ("metadata", specs.packed_metadata_path)) if v}
    planned = packed_paths(root, tok, pad, seq_length)
    wrong = [f"{k} {v} (prepare writes {planned[k]})" for k, v in explicit.items() if Path(v) != planned[k]]
    if wrong:
        raise UserError(f"prepare: {args.config} reads explicit packed paths prepare does not write: "
                        + "; ".join(wrong))
    return out


def _resolve_prepare(args, environ=None) -> dict:
    """The prepare action's dataset, root, sequence length, tokenizer and pad multiple: from --config, else the
    command with the profile's data root and the model's tokenizer and pad multiple. On a GPU profile a command
    that names no model (nor --tokenizer) is refused: it would pack with the local quickstart's SmolLM2."""
    from pipeline.data.sources import dataset_dirname

    profile = resolve_profile(args.cluster, environ=environ)
    if args.config is not None:
        return _from_config(args)
    if not args.dataset or args.seq_length is None:
        raise UserError("prepare: --dataset and --seq-length are required (or --config CONFIG)")
    model = args.model
    if model is None and args.tokenizer is None:
        if profile.has_gpus:
            names = ", ".join(n for n, s in REGISTRY.items() if s.trains_on.needs_gpus)
            raise UserError(f"prepare: cluster profile {profile.name} trains several models ({names}): name the one "
                            "the data is for with --model (e.g. --model nano), or --config CONFIG")
        model = "smollm2-135m"
    args.model = model
    spec = get_model(model) if model else None
    if args.tokenizer:
        tokenizer = args.tokenizer
    elif spec is not None:
        tokenizer = spec.tokenizer_from or spec.name
    else:  # an empty --model and no --tokenizer
        raise UserError("prepare: name the model with --model (or the tokenizer with --tokenizer)")
    pad = args.pad_seq_to_mult if args.pad_seq_to_mult is not None else (spec.pad_seq_to_mult if spec else 1)
    if args.dataset_root is not None:
        root = args.dataset_root
    elif profile.has_gpus:  # the profile's data_root; an exported PIPELINE_DATA_ROOT still wins
        root = Path(effective_knobs(profile, environ)["PIPELINE_DATA_ROOT"]) / dataset_dirname(args.dataset)
    else:
        root = paths.data_root(environ) / dataset_dirname(args.dataset)
    return {"dataset": args.dataset, "dataset_root": root, "seq_length": args.seq_length, "tokenizer": tokenizer,
            "pad_seq_to_mult": pad, "context_parallel_size": args.context_parallel_size,
            "tensor_parallel_size": args.tensor_parallel_size, "sequence_parallel": args.sequence_parallel}


def plan_prepare(args, environ=None):
    """The prepare action's options and the packed paths it writes (``packed_paths``), without reading data or
    loading a tokenizer."""
    from pipeline.data import prepare as prep
    from pipeline.data.chat import tokenizer_model_name
    from pipeline.data.packed_parquet import packed_paths

    r = _resolve_prepare(args, environ)
    opts = prep.PrepareOptions(
        dataset=r["dataset"], dataset_root=r["dataset_root"], seq_length=r["seq_length"], tokenizer=r["tokenizer"],
        pad_seq_to_mult=r["pad_seq_to_mult"], context_parallel_size=r["context_parallel_size"],
        tensor_parallel_size=r["tensor_parallel_size"], sequence_parallel=r["sequence_parallel"],
        val_fraction=args.val_fraction, seed=args.seed, overlong=args.overlong, limit=args.limit,
        chunk_size=prep.CHUNK_SIZE if args.chunk_size is None else args.chunk_size, workers=args.workers,
        force=args.force, quiet=args.quiet)
    return opts, packed_paths(opts.dataset_root, tokenizer_model_name(opts.tokenizer), opts.pad_seq_to_mult,
                              opts.seq_length)


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(quiet=getattr(args, "quiet", False))

    from pipeline.data import prepare as prep
    from pipeline.data import prepare_shards

    if args.action == "prepare":
        tokenizer_given = args.tokenizer is not None
        opts, planned = plan_prepare(args)
        if not tokenizer_given and opts.tokenizer in _registry_names():
            whose = f"--config {args.config}" if args.config is not None else f"--model {args.model}"
            print(f"tokenizer: {opts.tokenizer} ({get_model(opts.tokenizer).hf_id}), the tokenizer of {whose}; pass "
                  "--tokenizer to choose another", file=sys.stderr)
        print(f"prepare: {opts.dataset} -> {planned['train']} (pad multiple {opts.pad_seq_to_mult})", file=sys.stderr)
        if args.dry_run:
            opts.validate()
            step: dict = {}  # a step of a prepare across nodes: which one, and where a shard writes
            if args.export_only:
                step = {"step": "the export stage alone"}
            elif args.shard is not None:
                step = {"step": f"tokenize shard {args.shard[0]}/{args.shard[1]} of the export's chunks",
                        "shard_folder": str(shard_dir(opts.dataset_root, *args.shard) / "tokenized")}
            elif args.merge_shards is not None:
                step = {"step": f"merge {args.merge_shards} shards' chunks, then pack"}
            print(json.dumps({"dataset": opts.dataset, "dataset_root": str(opts.dataset_root),
                              "tokenizer": opts.tokenizer, "pad_seq_to_mult": opts.pad_seq_to_mult,
                              "seq_length": opts.seq_length, "paths": {k: str(v) for k, v in planned.items()},
                              **step}, indent=2))
            return 0
        if args.export_only:
            res = prepare_shards.export_only(opts)
            print(json.dumps(res, indent=2))
            return 0
        if args.shard is not None:
            res = prepare_shards.prepare_shard(opts, *args.shard)
            print(json.dumps(res, indent=2))
            return 0
        if args.merge_shards is not None:
            summary = prepare_shards.merge_shards(opts, args.merge_shards)
        else:
            summary = prep.prepare(opts)
        print(json.dumps(summary, indent=2)) if args.json else _print_summary(summary)
        return 0

    if args.action == "tokenize":
        from pipeline.data.indexed import merge_shards, tokenize_corpus

        src = Path(args.dataset_root)
        if not src.exists() and not _is_hub_id(args.dataset_root):
            raise UserError(f"corpus {src} does not exist")
        if args.docs_per_part < 1:
            raise UserError(f"--docs-per-part must be >= 1, got {args.docs_per_part}")
        if args.limit is not None and args.limit < 1:
            raise UserError(f"--limit must be >= 1, got {args.limit}")
        out = _tokenize_output(args)
        if args.merge_shards is not None:
            if args.limit is not None:
                raise UserError(LIMIT_NOT_SHARDABLE)
            res = merge_shards(args.dataset_root, args.tokenizer, out, args.output_name, args.merge_shards,
                               text_field=args.text_field, docs_per_part=args.docs_per_part, glob=args.glob,
                               force=args.force)
        else:
            res = tokenize_corpus(args.dataset_root, args.tokenizer, out, args.output_name,
                                  text_field=args.text_field, docs_per_part=args.docs_per_part, limit=args.limit,
                                  force=args.force, quiet=args.quiet, workers=args.workers, glob=args.glob,
                                  shard=args.shard)
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
