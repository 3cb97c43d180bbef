"""The local engine: real training with transformers' ``Trainer`` on CPU (or one local GPU).

Runs the same configs, data files and checkpoint layout as the Megatron Bridge engine, at small scale:
packed SFT Parquet from the data pipeline (block-diagonal attention from per-sequence position ids,
loss on the rolled assistant mask) or Megatron indexed ``.bin``/``.idx`` pretraining data. Checkpoints
are written by the Trainer into a staging folder and moved atomically to ``<save>/iter_NNNNNNN/``, then
``latest_checkpointed_iteration.txt`` is updated: an interrupted save is never the latest. A restarted
process resumes from the latest complete iteration (weights, optimizer, scheduler, RNG, data position).

Known limit: the Mamba layers of the tiny NemotronH model do not reset their state at pack boundaries in
transformers' PyTorch fallback (attention layers do); Megatron's THD path resets both.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np

from pipeline.common import layout
from pipeline.common.errors import UserError
from pipeline.common.mappings import flatten
from pipeline.config.models import ModelSpec, build_tiny_config, get_model, require_local_model
from pipeline.config.schema import TrainingConfig
from pipeline.data import packed_parquet
from pipeline.data.indexed import read_index
from pipeline.training import fault_tolerance, profiling, records
from pipeline.training.faults import FaultHook
from pipeline.training.views import RunView, read_view

log = logging.getLogger(__name__)



# ---- data -----------------------------------------------------------------------------------------
class PackedSFTDataset:
    """Packed rows -> input_ids, position_ids reset at each sequence start, labels from the rolled mask.

    The documents of a row stay apart because the models see the per-document ``position_ids`` (transformers then
    masks attention per document; ``use_cache`` must be off, which ``build_model_and_tokenizer`` sets: with it on,
    attention crosses documents). ``unpack``: one document per sample, for a model that cannot keep packed
    documents apart (``ModelSpec.isolates_packed``)."""

    def __init__(self, path: Path, unpack: bool = False):
        self.rows = packed_parquet.read(path)
        if not self.rows:
            raise UserError(f"packed dataset {path} is empty")
        if unpack:
            docs = []
            for r in self.rows:
                starts = list(r["seq_start_id"]) + [len(r["input_ids"])]
                docs += [{"input_ids": r["input_ids"][a:b], "loss_mask": r["loss_mask"][a:b], "seq_start_id": [0]}
                         for a, b in zip(starts[:-1], starts[1:]) if b > a]
            self.rows = docs

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        ids = np.asarray(r["input_ids"], dtype=np.int64)
        mask = np.asarray(r["loss_mask"], dtype=np.int64)
        starts = list(r["seq_start_id"]) + [len(ids)]
        pos = np.concatenate([np.arange(b - a) for a, b in zip(starts[:-1], starts[1:])])
        labels = np.full_like(ids, -100)
        # rolled mask: mask[t] == 1 means token t+1 is a target; HF shifts labels by one internally.
        tgt = np.nonzero(mask[:-1])[0] + 1
        labels[tgt] = ids[tgt]
        return {"input_ids": ids, "position_ids": pos, "labels": labels}


class IndexedPretrainDataset:
    """Contiguous windows of ``seq_length`` tokens from Megatron ``.bin``/``.idx`` files."""

    def __init__(self, prefixes: list[Path], seq_length: int):
        chunks = []
        for p in prefixes:
            dtype, _, _, _ = read_index(p.with_suffix(".idx"))
            chunks.append(np.fromfile(p.with_suffix(".bin"), dtype=dtype).astype(np.int64))
        self.tokens = np.concatenate(chunks)
        self.seq = seq_length
        self.n = len(self.tokens) // seq_length
        if self.n == 0:
            raise UserError(f"pretraining data has {len(self.tokens)} tokens, fewer than one sequence of {seq_length}")

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = self.tokens[i * self.seq:(i + 1) * self.seq]
        return {"input_ids": ids, "position_ids": np.arange(self.seq), "labels": ids.copy()}


def collate(pad_id: int):
    import torch

    def fn(batch):
        n = max(len(b["input_ids"]) for b in batch)
        out: dict[str, list] = {"input_ids": [], "position_ids": [], "labels": []}
        for b in batch:
            k = n - len(b["input_ids"])
            last = int(b["position_ids"][-1]) + 1
            out["input_ids"].append(np.concatenate([b["input_ids"], np.full(k, pad_id)]))
            out["position_ids"].append(np.concatenate([b["position_ids"], np.arange(last, last + k)]))
            out["labels"].append(np.concatenate([b["labels"], np.full(k, -100)]))
        return {k: torch.as_tensor(np.stack(v), dtype=torch.long) for k, v in out.items()}

    return fn


def unpacks(spec: ModelSpec) -> bool:
    """Whether the packed rows of this model's data are trained one document per sample (see ``isolates_packed``)."""
    return not spec.isolates_packed


def build_dataset(view: RunView, spec: ModelSpec | None = None):
    """The training data the launch resolved (``view.data``): packed SFT Parquet, else (pretraining) the Megatron
    indexed prefixes under the dataset root. Packed rows are un-packed for a model that cannot keep their documents
    apart (said in the log)."""
    data, mode = view.data, view.mode
    if data.dataset_root is None:
        raise UserError("dataset.dataset_root is not set")
    train = data.packed.get("train")
    if train is not None and train.exists():
        unpack = spec is not None and unpacks(spec)
        ds = PackedSFTDataset(train, unpack=unpack)
        if spec is not None and unpack:
            log.warning("%s cannot keep packed documents apart (its Mamba layers, in transformers' PyTorch fallback, "
                        "scan the whole row): training one document per sample (%d documents)", spec.name, len(ds))
        return ds, "packed_sft"
    prefixes = data.indexed_prefixes()
    if mode != "sft" and prefixes:
        return IndexedPretrainDataset(prefixes, view.batch.seq_length), "indexed"
    raise UserError(f"no training data under {data.dataset_root}: expected {train or 'packed Parquet'}"
                    + (" or *_text_document.bin/.idx" if mode != "sft" else ""))


# ---- model -----------------------------------------------------------------------------------------
def build_model_and_tokenizer(cfg: TrainingConfig, spec: ModelSpec, mode: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, cfg.pipeline.local.dtype)
    seed = 1234 if cfg.rng.seed is None else cfg.rng.seed
    base = require_local_model(spec)
    tokenizer = AutoTokenizer.from_pretrained(base)
    pretrained = cfg.checkpoint.pretrained_checkpoint
    if pretrained:
        src = Path(pretrained)
        if (src / layout.TRACKER).exists():
            src = layout.resolve_iteration(src, None)
        log.info("initialising from %s", src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    elif spec.tiny_config is not None:
        torch.manual_seed(seed)
        conf = build_tiny_config(spec, len(tokenizer), tokenizer.pad_token_id or tokenizer.eos_token_id,
                                 tokenizer.eos_token_id, tokenizer.bos_token_id)
        model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
        log.info("random-initialised %s (%.1fM parameters)", spec.name, model.num_parameters() / 1e6)
    elif mode == "pretrain":
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base), dtype=dtype)
        log.info("pretrain: random-initialised %s architecture", spec.name)
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        log.info("initialising from the base model %s", base)
    model.config.use_cache = False
    if cfg.pipeline.local.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, tokenizer


def restore_weights(model, iter_path: Path) -> None:
    """The weights of a checkpoint, loaded through transformers' own loader before Trainer resumes from it.

    Trainer's resume loads the file's state dict as saved, with ``strict=False``; transformers 5 stores an MoE's
    experts one tensor per expert but holds them fused in memory (``experts.gate_up_proj``), so those keys did not
    match and the experts silently restarted from their initial values (a resumed tiny Qwen3-MoE run differed from
    the uninterrupted one from its first resumed step). ``from_pretrained`` applies the on-disk -> in-memory
    conversion; every parameter must then load (strict), and Trainer's own load after this rewrites the matching
    ones with the same values."""
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(iter_path, dtype=model.dtype)
    model.load_state_dict(src.state_dict(), strict=True)
    del src


def bf16_autocast(mode: str, device: str, *, cuda_bf16: bool, cpu_amx: bool, cpu_avx512_bf16: bool) -> bool:
    """``pipeline.local.autocast`` decided from the machine's facts (pure: testable without the device). ``bf16``
    and ``off`` are what they say; ``auto`` is bf16 on a CUDA GPU that computes it (``torch.cuda.is_bf16_supported``:
    Ampere and later, GH200 included), and on a CPU only with AMX tiles or AVX512-BF16 (there it measured 0.74x
    fp32's step time on the quickstart, docs/benchmarks.md; elsewhere bf16 on CPU is emulated and slower)."""
    if mode == "bf16":
        return True
    if mode != "auto":
        return False
    if device == "cuda":
        return cuda_bf16
    return cpu_amx or cpu_avx512_bf16


def use_bf16_autocast(cfg: TrainingConfig) -> bool:
    """:func:`bf16_autocast` on this machine: the training device is CUDA when torch sees a GPU (as the Trainer's
    ``use_cpu`` decides), else the CPU."""
    import torch

    cuda = torch.cuda.is_available()
    cpu = getattr(torch, "cpu", None)
    fact = lambda name: not cuda and bool(getattr(cpu, name, lambda: False)())
    return bf16_autocast(cfg.pipeline.local.autocast, "cuda" if cuda else "cpu",
                         cuda_bf16=cuda and bool(torch.cuda.is_bf16_supported()),
                         cpu_amx=fact("_is_amx_tile_supported"), cpu_avx512_bf16=fact("_is_avx512_bf16_supported"))


def _scheduler(cfg: TrainingConfig) -> tuple[str, dict]:
    style = cfg.scheduler.lr_decay_style or "cosine"
    min_lr = float(cfg.optimizer.min_lr or 0.0)
    if style == "cosine":
        return "cosine_with_min_lr", {"min_lr": min_lr}
    if style == "linear":
        return "linear", {}
    if style == "constant":
        return "constant_with_warmup", {}
    if style == "WSD":
        # Megatron's WSD: stable until lr_decay_iters - lr_wsd_decay_iters, then the final decay (a cooldown) of
        # lr_wsd_decay_iters ending at lr_decay_iters (default train_iters: Trainer's max_steps here)
        sc = cfg.scheduler
        decay = {"linear": "linear", "cosine": "cosine", "minus_sqrt": "1-sqrt"}.get(str(sc.lr_wsd_decay_style))
        if decay is None:
            raise UserError(f"scheduler.lr_wsd_decay_style={sc.lr_wsd_decay_style!r}: the local engine's WSD decays "
                            "linear, cosine or minus_sqrt (Megatron's default, exponential, is not one); set it")
        if sc.lr_decay_iters is not None and sc.lr_decay_iters != cfg.train.train_iters:
            raise UserError(f"scheduler.lr_decay_iters={sc.lr_decay_iters} with WSD: the local engine's decay ends "
                            f"at train.train_iters ({cfg.train.train_iters}); leave lr_decay_iters unset")
        lr = float(cfg.optimizer.lr or 0.0)
        return "warmup_stable_decay", {"num_decay_steps": sc.lr_wsd_decay_iters or 0, "decay_type": decay,
                                       "min_lr_ratio": min_lr / lr if lr else 0.0}
    raise UserError(f"scheduler.lr_decay_style={style!r} is not supported by the local engine "
                    "(cosine, linear, constant, WSD)")


def training_arguments(cfg: TrainingConfig, view: RunView, spec: ModelSpec, run_dir: Path, save: Path, *,
                       world: int, accum: int, bf16: bool):
    """transformers' TrainingArguments of the run: the view's batch and iterations, the config's optimizer,
    schedule, intervals and seeds; checkpoints staged under ``<save>/.staging`` (moved into place on save)."""
    import torch
    from transformers import TrainingArguments

    iters, mbs = view.batch.train_iters, view.batch.micro_batch_size
    lg, opt = cfg.logger, cfg.optimizer
    sched, sched_kwargs = _scheduler(cfg)
    save_interval = cfg.checkpoint.save_interval or iters
    eval_interval = cfg.validation.eval_interval or 0
    # Optimizer values the config leaves unset take TrainingArguments' own defaults (Adam 0.9 / 0.999 / 1e-8,
    # no weight decay, clipping at 1.0, no warm-up); the local recipe (config/models.py) sets them all.
    optim = {k: v for k, v in {"learning_rate": opt.lr, "weight_decay": opt.weight_decay,
                               "adam_beta1": opt.adam_beta1, "adam_beta2": opt.adam_beta2,
                               "adam_epsilon": opt.adam_eps, "max_grad_norm": opt.clip_grad,
                               "warmup_steps": cfg.scheduler.lr_warmup_iters}.items() if v is not None}
    return TrainingArguments(
        output_dir=str(save / ".staging"),
        run_name=str(lg.wandb_exp_name or run_dir.name),
        max_steps=iters,
        per_device_train_batch_size=mbs,
        gradient_accumulation_steps=accum,
        **optim,
        lr_scheduler_type=sched,
        lr_scheduler_kwargs=sched_kwargs,
        logging_steps=lg.log_interval or 1,
        save_strategy="steps",
        save_steps=save_interval,
        save_only_model=cfg.checkpoint.save_optim is False,
        eval_strategy="steps" if eval_interval else "no",
        eval_steps=eval_interval or None,
        seed=view.seed,
        data_seed=cfg.dataset.seed or view.seed,
        dataloader_num_workers=cfg.dataset.num_workers or 0,
        remove_unused_columns=False,
        report_to=[],  # W&B: the WandbRun callback (local_trainer.py), started through wandb's API
        use_cpu=not torch.cuda.is_available(),
        bf16=bf16,
        ddp_backend="gloo" if not torch.cuda.is_available() else None,
        # MoE layers leave unselected experts without gradients in a step; dense models never do.
        ddp_find_unused_parameters=bool(spec.tiny_config) and world > 1,
        disable_tqdm=not os.isatty(2),
        logging_nan_inf_filter=False,  # a NaN loss must reach the NaN guard, not be averaged away
    )


def train(run_dir: Path, cfg: TrainingConfig, launch: dict) -> int:
    import torch
    import transformers

    from pipeline.training.engines.local_trainer import (  # noqa: PLC0415  (it imports torch and transformers)
        LocalTrainer,
        StopRequest,
        TrainerHooks,
        WandbTarget,
        callbacks,
    )

    view = read_view(run_dir)  # resolved and checked once, at launch
    spec = get_model(view.model)
    mode = view.mode
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if view.save is None:
        raise UserError("checkpoint.save is not set")
    save = view.save
    iters, mbs = view.batch.train_iters, view.batch.micro_batch_size
    accum = view.batch.grad_accum_for(world)
    transformers.set_seed(view.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))

    start = records.start_point(cfg)  # resume this run's save, continue another run's, or init
    latest = start.iteration if start.kind == "resume" else None
    if records.already_finished(run_dir, save, iters):
        if rank == 0:
            records.print_already_finished(iters, save)
        return 0

    ignored = [f"+{k}" for k in flatten(cfg.extra)]
    if ignored and rank == 0:
        log.warning("the local engine ignores keys added for Megatron Bridge: %s", ", ".join(ignored))
    capture = profiling.Capture.for_rank(cfg.profiling, rank, run_dir, cuda=torch.cuda.is_available())
    recorder = profiling.Recorder(capture, cuda=torch.cuda.is_available()) if capture is not None else None
    if capture is not None:
        memory = ""
        if capture.memory:
            memory = (" (memory: CUDA allocator history + profile_memory)" if capture.snapshot else
                      " (memory: the profiler's profile_memory; CUDA's allocator history needs a GPU)")
        log.info("profiler: rank %d records steps %d-%d with torch.profiler%s -> %s", rank, capture.first,
                 capture.last, memory, capture.trace)

    if start.kind == "continue" and start.path is not None and not (start.path / "optimizer.pt").exists():
        raise UserError(f"{start.path} has no optimizer state (saved with checkpoint.save_optim=false): it cannot be "
                        "continued; start from its weights (checkpoint.pretrained_checkpoint) instead")
    if start.origin >= iters:
        raise UserError(f"train.train_iters={iters} is not past iteration {start.origin} of {cfg.checkpoint.load}, "
                        "which this run continues: train_iters counts on from there (the total)")
    progress = records.ProgressLog(run_dir, tokens_per_step=view.batch.tokens_per_iter, writer=rank == 0,
                                   origin=start.origin)
    progress.clock.attempt()
    ft = fault_tolerance.start(cfg)  # under ft_launcher: the rank monitor client, 'setup' section open
    model, tokenizer = build_model_and_tokenizer(cfg, spec, mode)
    faults = FaultHook.from_config(cfg)  # the tests' fault injection (training/faults.py); inert otherwise
    dataset, kind = build_dataset(view, spec)
    dataset = faults.dataset(dataset, resuming=latest is not None, samples_per_step=mbs * accum * world)
    log.info("data: %d %s samples; world %d, mbs %d, grad accum %d, %d iterations", len(dataset), kind, world, mbs,
             accum, iters)

    stop = StopRequest(files=tuple(records.save_request_files(run_dir)))
    signal.signal(signal.SIGUSR1, stop.on_signal)
    if world == 1:
        signal.signal(signal.SIGTERM, stop.on_signal)

    lg = cfg.logger
    wandb = None  # rank 0 logs to W&B (wandb.init with the config's project, entity and directory)
    if lg.wandb_project and os.environ.get("WANDB_MODE") != "disabled" and rank == 0:
        wandb = WandbTarget(project=str(lg.wandb_project), directory=Path(lg.wandb_save_dir or run_dir),
                            entity=str(lg.wandb_entity) if lg.wandb_entity else None)
    bf16 = use_bf16_autocast(cfg)
    if rank == 0:
        log.info("compute: %s weights, %s; %d threads", cfg.pipeline.local.dtype,
                 "bf16 autocast" if bf16 else "no autocast", torch.get_num_threads())
    eval_interval = cfg.validation.eval_interval or 0
    args = training_arguments(cfg, view, spec, run_dir, save, world=world, accum=accum, bf16=bf16)
    if rank == 0:
        dropped = progress.start(start.iteration)  # resuming from it: the steps after it are redone
        if dropped:
            log.info("progress.ndjson: %d line(s) past the resumed step %d superseded", dropped, start.iteration)

    eval_ds = None
    if eval_interval:
        val = view.data.packed.get("validation")
        eval_ds = PackedSFTDataset(val, unpack=unpacks(spec)) if val is not None and val.exists() else None
    trainer = LocalTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=eval_ds,
                           data_collator=collate(tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                                 else tokenizer.eos_token_id),
                           processing_class=tokenizer,
                           callbacks=callbacks(run_dir, save, spec, mode, progress, stop, recorder, wandb)
                           + fault_tolerance.callbacks(ft, faults),
                           hooks=TrainerHooks(clock=progress.clock, recorder=recorder, faults=faults))
    if recorder is not None:
        # The backward pass as its own range: Trainer.training_step ends in accelerator.backward(loss), which no
        # callback brackets. No range outside the window (Recorder.span).
        backward = trainer.accelerator.backward

        def ranged_backward(loss, **kw):
            with recorder.span("backward"):
                return backward(loss, **kw)

        trainer.accelerator.backward = ranged_backward
    resume = str(start.path) if start.path is not None else None
    if resume:
        restore_weights(model, Path(resume))
        if rank == 0 and start.kind == "continue":
            log.info("continuing from %s: its weights, optimizer, scheduler and RNG state, iterations %d..%d "
                     "(checkpoints to %s)", resume, start.origin + 1, iters, save)
        elif rank == 0:
            log.info("resuming from %s", resume)
    t0 = time.time()
    trainer.train(resume_from_checkpoint=resume)
    step = trainer.state.global_step
    if rank == 0:
        shutil.rmtree(save / ".staging", ignore_errors=True)
    if stop.stopping and step < iters:
        if rank == 0:
            records.finish_preempted(run_dir, progress, step, iters, time.time() - t0)
        return 0
    if rank == 0:
        records.finish_completed(run_dir, save, progress, step, time.time() - t0)
    return 0


__all__ = ["train", "PackedSFTDataset", "IndexedPretrainDataset"]
