"""The local engine's Trainer and its callbacks (``training/engines/local.py`` builds them in ``train``).

Each callback is given what it reads and writes; the only state they share is a :class:`StopRequest` (a
save-and-exit asked for by a signal or a request file, and whether the ranks agreed to stop). W&B is set up
through wandb's API (:class:`WandbRun`), not the environment; the tests' fault injection goes through one hook
(``training/faults.py``). Imported only by a training process: it imports transformers.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback
from transformers.integrations import WandbCallback

from pipeline.common import layout
from pipeline.common.log import Progress
from pipeline.common.procs import barrier
from pipeline.config.models import ModelSpec
from pipeline.training import profiling, records
from pipeline.training.faults import FaultHook

log = logging.getLogger("pipeline.training.engines.local")


@dataclass
class StopRequest:
    """A save-and-exit: asked for by a time-limit signal (SIGUSR1; SIGTERM on one process, ``on_signal``) or a
    request file (``files``); ``stopping`` once the ranks agreed and the Trainer was told to save and stop."""

    files: tuple[Path, ...] = ()
    signal: int | None = None
    stopping: bool = False

    def on_signal(self, signum, frame) -> None:
        self.signal = signum

    def wanted(self) -> bool:
        return self.signal is not None or any(f.exists() for f in self.files)


def all_ranks_any(flag: bool) -> bool:
    """True on every rank when it is True on one (an all-reduce under torch.distributed)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())
    return flag


class CheckpointLayout(TrainerCallback):
    """Move the Trainer's checkpoint-N into <save>/iter_000000N, then update the tracker (written last)."""

    def __init__(self, run_dir: Path, save: Path, spec: ModelSpec, mode: str):
        self.run_dir, self.save, self.spec, self.mode = run_dir, save, spec, mode

    def on_save(self, args, st, control, **kw):
        barrier()
        if st.is_world_process_zero:
            staged = Path(args.output_dir) / f"checkpoint-{st.global_step}"
            if staged.is_dir():
                target = layout.publish_iteration(staged, self.save, st.global_step, {
                    "engine": "local", "model": self.spec.name, "hf_id": self.spec.hf_id, "mode": self.mode,
                    "iteration": st.global_step, "run_dir": str(self.run_dir), "time": time.time()})
                log.info("saved checkpoint %s", target)
        barrier()
        return control


class Records(TrainerCallback):
    """Each logged step into progress.ndjson; a loss or gradient norm that is not finite stops the run for good
    (records.mark_nan: the run will not restart)."""

    def __init__(self, run_dir: Path, progress: records.ProgressLog):
        self.run_dir, self.progress = run_dir, progress

    def on_log(self, args, st, control, logs=None, **kw):
        logs = dict(logs or {})
        loss, gn = logs.get("loss"), logs.get("grad_norm")
        bad = [k for k, v in (("loss", loss), ("grad_norm", gn)) if isinstance(v, float) and not math.isfinite(v)]
        if st.is_world_process_zero and "loss" in logs:
            self.progress.log(st.global_step, {k: v for k, v in logs.items() if isinstance(v, (int, float))})
        if bad:
            msg = f"{' and '.join(bad)} became {loss if 'loss' in bad else gn} at step {st.global_step}"
            if st.is_world_process_zero:
                records.mark_nan(self.run_dir, self.progress, st.global_step, msg)
            raise FloatingPointError(f"stopping: {msg}; lower optimizer.lr or check the data "
                                     f"(the run will not restart: {self.run_dir / records.NAN_MARKER})")
        return control


class SaveAndExit(TrainerCallback):
    """A time-limit warning (SIGUSR1/SIGTERM, or a request file) -> checkpoint at this step, exit.
    The ranks agree on the decision (all-reduce), so every rank stops at the same step."""

    def __init__(self, stop: StopRequest):
        self.stop = stop

    def on_step_end(self, args, st, control, **kw):
        if all_ranks_any(self.stop.wanted()):
            if not self.stop.stopping:
                log.warning("save-and-exit requested: checkpointing at step %d and stopping", st.global_step)
            self.stop.stopping = True
            control.should_save = True
            control.should_training_stop = True
        return control


class ProgressLines(TrainerCallback):
    """Step / total, rate, ETA and loss as a plain line every PIPELINE_PROGRESS_INTERVAL seconds when the
    output is a log file (the Trainer's bar only shows on a terminal)."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_train_begin(self, args, st, control, **kw):
        if st.is_world_process_zero and not os.isatty(2):
            self.bar = Progress("train", total=st.max_steps, unit="step", logger=log)
            self.bar.n = self.bar.n0 = st.global_step
        return control

    def on_log(self, args, st, control, logs=None, **kw):
        if self.bar is not None:
            extra = {k: float(v) for k, v in (logs or {}).items() if k in ("loss", "grad_norm")
                     and isinstance(v, (int, float))}
            self.bar.update(st.global_step - self.bar.n, **extra)
        return control

    def on_train_end(self, args, st, control, **kw):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        return control


class Timeline(TrainerCallback):
    """The run's events (goodput): the first step's begin, each step's end and each save's end (after the
    checkpoint is published; its begin is marked by ``LocalTrainer._save_checkpoint``)."""

    def __init__(self, clock):
        self.clock = clock

    def on_step_begin(self, args, st, control, **kw):
        self.clock.ready()
        return control

    def on_step_end(self, args, st, control, **kw):
        self.clock.step(st.global_step)
        return control

    def on_save(self, args, st, control, **kw):
        self.clock.save_end(st.global_step)
        return control


class Profile(TrainerCallback):
    """torch.profiler over the profiling window (training/profiling.py): started at its first step, stopped and
    written at its last (or at the run's end inside it), the capture recorded in events.ndjson. First in the
    list, so the trace's export counts in the window's last step (events.ndjson), not the next one."""

    def __init__(self, run_dir: Path, recorder: profiling.Recorder):
        self.run_dir, self.recorder = run_dir, recorder

    def on_step_begin(self, args, st, control, **kw):
        self.recorder.begin(st.global_step + 1)
        return control

    def on_pre_optimizer_step(self, args, st, control, **kw):
        self.recorder.open("optimizer")
        return control

    def on_optimizer_step(self, args, st, control, **kw):
        self.recorder.close("optimizer")
        return control

    def on_step_end(self, args, st, control, **kw):
        final = st.global_step >= st.max_steps or bool(control.should_training_stop)
        self.written(self.recorder.end(st.global_step, final=final))
        return control

    def on_train_end(self, args, st, control, **kw):
        self.written(self.recorder.finish())
        return control

    def written(self, rec) -> None:
        if rec is not None:
            records.record_profile(self.run_dir, rec)
            log.info("profiler: steps %d-%d of rank %d written to %s (%.1f s)", rec["steps"][0],
                     rec["steps"][1], rec["rank"], rec["trace"], rec["export_seconds"])


@dataclass(frozen=True)
class WandbTarget:
    """Where the run logs to W&B (the config's logger section): ``wandb.init``'s project, entity and directory."""

    project: str
    directory: Path
    entity: str | None = None


class WandbRun(WandbCallback):
    """transformers' W&B callback on a run started with ``wandb.init`` and the config's project, entity and
    directory (it starts its own only when none is running, from the environment: this one is running first)."""

    def __init__(self, target: WandbTarget):
        super().__init__()
        self.target = target

    def setup(self, args, state, model, **kwargs):
        if self._wandb is not None and state.is_world_process_zero and self._wandb.run is None:
            self.target.directory.mkdir(parents=True, exist_ok=True)
            self._wandb.init(project=self.target.project, entity=self.target.entity,
                             dir=str(self.target.directory), name=args.run_name)
        super().setup(args, state, model, **kwargs)


def callbacks(run_dir: Path, save: Path, spec: ModelSpec, mode: str, progress: records.ProgressLog,
              stop: StopRequest, recorder: profiling.Recorder | None = None,
              wandb: WandbTarget | None = None) -> list[TrainerCallback]:
    """The local engine's callbacks, in the order they run: W&B first (where report_to put transformers' own: it logs
    a non-finite step before Records stops the run, and sees a save's checkpoint-N before CheckpointLayout moves
    it), then the profiler (its trace export counts in the window's last step), then the rest."""
    first: list[TrainerCallback] = [WandbRun(wandb)] if wandb is not None else []
    if recorder is not None:
        first.append(Profile(run_dir, recorder))
    return first + [CheckpointLayout(run_dir, save, spec, mode), Records(run_dir, progress), SaveAndExit(stop),
                    ProgressLines(), Timeline(progress.clock)]


@dataclass
class TrainerHooks:
    """What the Trainer subclass reads beside its arguments: the run's clock (a save's begin), the profiler's
    recorder (the forward's range) and the tests' fault hook (a NaN loss)."""

    clock: Any
    recorder: profiling.Recorder | None = None
    faults: FaultHook = field(default_factory=FaultHook)


class LocalTrainer(Trainer):
    """transformers' Trainer with the local engine's differences: the forward in the profiler's range and the
    tests' NaN injection, a save's begin in the run's timeline, this config's intervals and hyperparameters over
    those a loaded checkpoint brings."""

    def __init__(self, *args, hooks: TrainerHooks, **kwargs):
        super().__init__(*args, **kwargs)
        self.hooks = hooks

    def compute_loss(self, model, inputs, return_outputs=False, **kw):
        recorder = self.hooks.recorder
        if recorder is not None:
            with recorder.span("forward"):
                out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
        else:
            out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
        return self.hooks.faults.loss(out, step=self.state.global_step + 1, return_outputs=return_outputs)

    def _save_checkpoint(self, model, trial):
        self.hooks.clock.save_begin()
        return super()._save_checkpoint(model, trial)

    def _init_training_state(self, max_steps, *args, **kwargs):
        out = super()._init_training_state(max_steps, *args, **kwargs)
        # A loaded TrainerState brings its run's logging/eval/save intervals; a run continuing another (a
        # cooldown with its own checkpoint.save_interval) keeps this config's, as Megatron does.
        self.state.compute_steps(self.args, max_steps)
        return out

    def _load_optimizer_and_scheduler(self, checkpoint):
        # The checkpoint's moments and step count with this config's hyperparameters and schedule (Megatron's
        # override_opt_param_scheduler, which the launcher sets for a run continuing another): torch's
        # load_state_dict brings back the saved lr, betas, eps and weight decay, and LambdaLR its saved
        # base_lrs, so the fresh optimizer's values (from this config) are put back after the load.
        keys = ("initial_lr", "betas", "eps", "weight_decay")
        fresh = [{k: g[k] for k in keys if k in g} for g in self.optimizer.param_groups]
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        sched = self.lr_scheduler
        for group, values in zip(self.optimizer.param_groups, fresh):
            group.update(values)
        sched.base_lrs = [g.get("initial_lr", self.args.learning_rate) for g in self.optimizer.param_groups]
        lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs
