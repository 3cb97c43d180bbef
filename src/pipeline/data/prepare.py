"""The ``prepare`` action: conversations -> chat template + loss masks -> packed Parquet.

Stages, each resumable (outputs are written atomically and a finished stage is skipped), one module each:
  1. export    (:mod:`pipeline.data.stage_export`) load + normalise + split -> ``<root>/training.jsonl``,
               ``<root>/validation.jsonl`` (a JSONL dataset is read by the tokenize workers, a byte range each)
  2. tokenize  (:mod:`pipeline.data.stage_tokenize`) chat template + assistant-only loss mask, in chunks, by the
               workers -> ``<root>/tokenized/<tokenizer>/<split>/chunk_NNNNN.parquet`` (a killed run resumes at the
               first missing chunk)
  3. pack      (:mod:`pipeline.data.stage_pack`, also the ``pack`` action) pad to ``pad_seq_to_mult``, roll the
               loss mask, ``pack_order``, vectorised over the split ->
               ``<root>/packed/<tokenizer>_pad_seq_to_mult<N>/training_<S>.idx.parquet`` (+ validation,
               ``<S>_metadata.jsonl``)

Resume by fingerprint, not by path (:mod:`pipeline.data.fingerprint`): each stage records what it was made from
(the input's identity and every option that changes its output, plus the upstream stage's fingerprint) in its
marker (``export_stats.json``, ``_DONE.json``, ``<S>_summary.json``). A finished stage is skipped only when the
fingerprint is identical; otherwise it is redone (and so is everything downstream), with one log line naming
the difference (``input changed: size 1234 -> 5678``, ``--limit 5 -> 40``). One run per data root at a time:
a second ``prepare``/``pack`` on a root in use is refused (``<root>/.prepare.lock``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.common.errors import UserError
from pipeline.common.locks import exclusive_lock
from pipeline.data.chat import load_tokenizer, tokenizer_files, tokenizer_model_name
from pipeline.data.sources import input_files
from pipeline.data.stage_base import SPLIT_FILES, Timer
from pipeline.data.stage_export import ExportOptions, export_fingerprint, stage_export
from pipeline.data.stage_pack import PackOptions, check_pack_args, stage_pack
from pipeline.data.stage_tokenize import (
    CHUNK_SIZE,
    TokenizeOptions,
    stage_tokenize,
    start_pool,
    tokenize_fingerprint,
    tokenize_pending,
)


def root_lock(root: Path):
    """One ``prepare`` or ``pack`` per data root at a time (``<root>/.prepare.lock``)."""
    return exclusive_lock(Path(root) / ".prepare.lock", f"data root {root}")


@dataclasses.dataclass
class PrepareOptions:
    """Every option of the ``prepare`` action; each stage gets its own part (:meth:`for_export`,
    :meth:`for_tokenize`, :meth:`for_pack`)."""

    dataset: str  # HF id ORG/NAME, a local dir/.jsonl/.parquet, or chatterbot-corpus
    dataset_root: Path  # the data root every stage writes under
    seq_length: int  # the packed sequence length S
    tokenizer: str = "smollm2-135m"  # registry model name, local dir or HF id
    pad_seq_to_mult: int = 1  # every sequence is padded to a multiple of this
    context_parallel_size: int = 1  # checked against pad_seq_to_mult
    tensor_parallel_size: int = 1  # checked against pad_seq_to_mult
    sequence_parallel: bool = False  # checked against pad_seq_to_mult
    val_fraction: float = 0.05  # the share of conversations in the validation split
    seed: int = 0  # the split's permutation and pack_order's seed
    overlong: str = "drop"  # drop | truncate
    limit: int | None = None  # use only the first N usable conversations
    chunk_size: int = CHUNK_SIZE  # conversations per tokenized chunk (the resume unit)
    workers: int | None = None  # tokenize worker processes; None: every usable CPU (not in any fingerprint)
    force: bool = False  # redo every stage
    quiet: bool = False  # no progress bars or periodic progress lines

    def validate(self) -> None:
        problems = check_pack_args(self.seq_length, self.pad_seq_to_mult, self.context_parallel_size,
                                   self.tensor_parallel_size, self.sequence_parallel)
        if self.limit is not None and self.limit < 1:
            problems.append(f"--limit must be >= 1, got {self.limit}")
        if self.seed < 0:
            problems.append(f"--seed must be >= 0, got {self.seed}")
        if self.dataset_root.exists() and self.dataset_root.is_dir():
            outputs = {(self.dataset_root / f).resolve() for f in SPLIT_FILES.values()}
            problems += [f"--dataset-root {self.dataset_root} would overwrite the dataset's own {f.name}; choose "
                         "another --dataset-root" for f in input_files(self.dataset) if f.resolve() in outputs]
        if self.chunk_size < 1:
            problems.append(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            problems.append(f"--workers must be an integer >= 1, got {self.workers!r}")
        if self.dataset_root.exists() and not self.dataset_root.is_dir():
            problems.append(f"--dataset-root {self.dataset_root} exists and is not a directory")
        if not 0 <= self.val_fraction < 1:
            problems.append(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.overlong not in ("drop", "truncate"):
            problems.append(f"--overlong must be drop or truncate, got {self.overlong}")
        if problems:
            raise UserError("; ".join(problems))

    def for_export(self) -> ExportOptions:
        """The export stage's options."""
        return ExportOptions(dataset=self.dataset, dataset_root=self.dataset_root, limit=self.limit, seed=self.seed,
                             val_fraction=self.val_fraction, force=self.force, quiet=self.quiet)

    def for_tokenize(self, tok_name: str) -> TokenizeOptions:
        """The tokenize stage's options (``tok_name``: the tokenizer's folder name under ``<root>/tokenized/``)."""
        return TokenizeOptions(dataset_root=self.dataset_root, tok_name=tok_name, tokenizer=self.tokenizer,
                               chunk_size=self.chunk_size, workers=self.workers, force=self.force, quiet=self.quiet)

    def for_pack(self, tok_name: str) -> PackOptions:
        """The pack stage's options."""
        return PackOptions(dataset_root=self.dataset_root, tok_name=tok_name, tokenizer=self.tokenizer,
                           seq_length=self.seq_length, pad_seq_to_mult=self.pad_seq_to_mult, seed=self.seed,
                           overlong=self.overlong, force=self.force)


def prepare(opts: PrepareOptions) -> dict:
    """Export, tokenize, pack. When the tokenize stage has work and the tokenizer's files are in the plain
    layout, its workers start before the export (no transformers import in this process at all)."""
    opts.validate()
    timer = Timer()
    tok_name = tokenizer_model_name(opts.tokenizer)
    export_opts, tokenize_opts = opts.for_export(), opts.for_tokenize(tok_name)
    loaded: list = []

    def get_tokenizer():  # loaded at most once, and only when the tokenize or pack stage has work to do
        if not loaded:
            loaded.append(load_tokenizer(opts.tokenizer))
        return loaded[0]

    with root_lock(opts.dataset_root):
        export_fp = export_fingerprint(export_opts)
        files = pool = None
        if tokenize_pending(tokenize_opts, tokenize_fingerprint(tokenize_opts, {"fingerprint": export_fp})):
            files = tokenizer_files(opts.tokenizer)
            pool = start_pool(tokenize_opts, files) if files is not None else None
        kept: dict = {}
        try:
            export = stage_export(export_opts, timer, fp=export_fp, pool=pool)
            tokenized = stage_tokenize(tokenize_opts, timer, tokenizer=get_tokenizer, export=export, pool=pool,
                                       keep=kept)
        finally:
            if pool is not None:
                pool.close()
        pad_id = loaded[0].eos_token_id if loaded else (files["eos_id"] if files is not None else None)
        packed = stage_pack(opts.for_pack(tok_name), timer, pad_id=pad_id, kept=kept, tokenized=tokenized)
    summary = {"dataset": opts.dataset, "dataset_root": str(opts.dataset_root), "tokenizer": tok_name,
               "seq_length": opts.seq_length, "pad_seq_to_mult": opts.pad_seq_to_mult,
               "export": export, "tokenize": tokenized, "pack": packed, "seconds_per_stage": timer.stages}
    return summary
