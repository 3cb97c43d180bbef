"""The Megatron Bridge engine (GPU cluster): one rank of ``pretrain()``/``finetune()`` with the suite's contract.

Megatron Bridge itself is called only through ``pipeline.bridge`` (the one owner of ``megatron.bridge``). This
module adds what both engines share, so a Bridge run behaves like a local one for everything around it:

  run records    ``progress.ndjson`` (one line per step, from a Bridge callback on the last rank, which holds
                 the reduced loss), ``events.ndjson`` (step starts and ends, checkpoint saves),
                 ``metrics_summary.json`` and the completion marker ``TRAINING_DONE`` in the run directory and
                 beside ``checkpoint.save`` (where ``upload-all --poll`` looks)
  time limits    the pre-limit request (the batch script touches ``$PIPELINE_SAVE_REQUEST_FILE`` on USR1, or
                 ``<run_dir>/SAVE_AND_EXIT``) is turned into Megatron's own exit signal on every rank, from the
                 first step on (before it, pretrain() has not installed Megatron's handler and the signal would
                 kill the rank), so Megatron's ``train.exit_signal_handler`` checkpoints at the next step, all
                 ranks agreeing, and calls ``sys.exit(0)``; that exit is caught and, the tracker short of
                 ``train_iters``, recorded as a stop for the requeue (``records.finish_preempted``)
  NaN            megatron-core's own NaN/Inf check raises RuntimeError; this engine writes ``FAILED_NAN`` (which
                 stops restarts) and re-raises
  ft_launcher    NVRx fault tolerance inside Megatron (``launch_overrides``), on a real ``FaultToleranceConfig``
  profiling      the typed ``profiling.*`` fields reach Bridge's ``ProfilingConfig``; ``logger.tensorboard_dir``
                 unset is ``<run_dir>/tb`` (not the recipes' folder in the working directory), so Bridge's trace
                 (``<tensorboard_dir>/../torch_profile/rank-N.json.gz``) lands where the local engine writes its
                 own; each profiled rank records its trace in events.ndjson at the end (training/profiling.py)

Bridge's ``pretrain()`` needs CUDA. The hooks run on Bridge's real callback machinery and ``build_config`` on its
real recipes in the Bridge harness (tests/bridge); the end of a run with stand-ins for ``pretrain()`` in
tests/unit/test_bridge_engine_end.py (docs/decisions.md #51). The watcher and the decisions after training are
plain Python, shared with the local engine through ``records``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from pipeline import bridge
from pipeline.common import layout
from pipeline.common.errors import UserError
from pipeline.config.launchers import FT_LAUNCHER
from pipeline.config.schema import TrainingConfig
from pipeline.training import preflight, profiling, records
from pipeline.training.views import read_view

log = logging.getLogger(__name__)


class SaveRequestWatcher:
    """Polls the save-and-exit request files and, once one appears, sends ``signum`` to this process (once).

    Megatron's ``DistributedSignalHandler`` catches that signal on every rank and the training loop all-reduces
    the flag, so every rank checkpoints at the same step and exits."""

    def __init__(self, files: list[Path], signum: int, interval: float = 2.0):
        self.files, self.signum, self.interval = files, signum, interval
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="save-request-watcher", daemon=True)

    def start(self) -> SaveRequestWatcher:
        self._thread.start()
        return self

    def arm(self) -> None:
        """Start polling, once (later calls do nothing)."""
        if not self._thread.is_alive() and not self._stop.is_set() and self._thread.ident is None:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if any(f.exists() for f in self.files):
                log.warning("save-and-exit requested: signalling %s to checkpoint at the next step and exit",
                            signal.Signals(self.signum).name)
                self.fired.set()
                os.kill(os.getpid(), self.signum)
                return


def launch_overrides(environ: Mapping[str, str]) -> list[str]:
    """The Hydra overrides this launch environment adds to the run's config: under ft_launcher (it sets
    ``TORCHELASTIC_RUN_ID``; the launch script sets ``PIPELINE_LAUNCHER``), NVRx fault tolerance inside Megatron,
    with the section timeouts learnt. Bridge's recipes leave ``ConfigContainer.ft`` unset; ``bridge.build_config``
    gives it a ``FaultToleranceConfig`` first."""
    if "TORCHELASTIC_RUN_ID" in environ and environ.get("PIPELINE_LAUNCHER") == FT_LAUNCHER.name:
        return ["ft.enable_ft_package=true", "ft.calc_ft_timeouts=true"]
    return []


def tensorboard_overrides(cfg: TrainingConfig, run_dir: Path) -> list[str]:
    """With no ``logger.tensorboard_dir`` in the config: ``<run_dir>/tb``. The recipes' default is
    ``./nemo_experiments/default/tb_logs`` in the job's working directory (the checkout, on the cluster), where every
    run of every member wrote its event files into one folder (found by the megatron_cpu tier's finetune() of the
    quickstart, which names none). With the torch profiler on, Bridge then writes the trace to
    ``<run_dir>/torch_profile/rank-N.json.gz`` (its ``<tensorboard_dir>/../torch_profile``), where the local engine
    writes its own."""
    if not cfg.logger.tensorboard_dir:
        return [f"logger.tensorboard_dir={Path(run_dir) / 'tb'}"]
    return []


def bridge_trace(container, rank: int) -> Path | None:
    """The trace Bridge 0.6.2's torch profiler writes on this rank (``initialize_pytorch_profiler``'s handler), or
    None when this rank does not profile (its ``should_profile_rank``: an empty list is every rank)."""
    p = getattr(container, "profiling", None)
    tb = getattr(getattr(container, "logger", None), "tensorboard_dir", None)
    if p is None or not getattr(p, "use_pytorch_profiler", False) or not tb:
        return None
    ranks = list(getattr(p, "profile_ranks", []) or [])
    if ranks and rank not in ranks:
        return None
    return Path(os.path.normpath(f"{tb}/../{profiling.TRACE_DIR}")) / f"rank-{rank}.json.gz"


def record_bridge_trace(run_dir: Path, container, rank: int, resumed_from: int) -> dict | None:
    """This rank's trace, once Bridge has written it, as a ``profile`` event. Bridge's schedule counts from the
    attempt's first step, so a run resumed from iteration R records steps R + window."""
    trace = bridge_trace(container, rank)
    if trace is None or not trace.is_file():
        return None
    p = container.profiling
    steps = profiling.window(int(p.profile_step_start), int(p.profile_step_end))
    rec = {"rank": rank, "steps": [resumed_from + steps[0], resumed_from + steps[1]] if steps else None,
           "trace": str(trace), "memory": None, "engine": "megatron_bridge"}
    if getattr(p, "record_memory_history", False):
        base, ext = os.path.splitext(str(p.memory_snapshot_path))
        rec.update(memory="cuda_memory_history", snapshot=f"{base}_{rank}{ext}")
    records.record_profile(run_dir, rec)
    return rec


class RankHooks:
    """What the suite's Bridge callback (``bridge.StepRecords``) calls on this rank: the run's timeline and
    progress lines, and the save-request watcher (when Megatron's exit-signal handler is on)."""

    def __init__(self, run_dir: Path, container, progress: records.ProgressLog, writer: bool, poll: float = 2.0):
        self.progress, self.writer = progress, writer
        self.iteration = self.last_step = 0  # the iteration begun last, and the last one finished
        self.exit_signal = int(getattr(container.train, "exit_signal", signal.SIGTERM))
        self.watcher: SaveRequestWatcher | None = None
        if getattr(container.train, "exit_signal_handler", False):
            self.watcher = SaveRequestWatcher(records.save_request_files(run_dir), self.exit_signal, poll)

    def step_start(self, iteration: int) -> None:
        # The watcher is armed at the first step: by then pretrain() has installed Megatron's signal handler
        # (GlobalState's cfg setter). Before it, the signal's default action would kill the rank; a request made
        # earlier (already there at the start) waits until here.
        if self.watcher is not None:
            self.watcher.arm()
        self.iteration = iteration
        self.progress.clock.ready()

    def step_end(self, iteration: int, metrics: dict[str, float]) -> None:
        self.last_step = iteration
        self.progress.clock.step(iteration)
        if self.writer and "loss" in metrics:
            self.progress.log(iteration, metrics)

    def save(self, iteration: int) -> None:
        # Bridge has no hook before a save: its time is counted from the previous step's end (Megatron's logging
        # and any evaluation in between count as the save's).
        self.progress.clock.save_end(iteration)

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()


def train(run_dir: Path, cfg: TrainingConfig, launch: dict) -> int:
    bridge.require_bridge(f"training {launch['model']}")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    view = read_view(run_dir)  # resolved and checked once, at launch
    iters, save = view.batch.train_iters, cfg.checkpoint.save
    if records.already_finished(run_dir, save, iters):
        if rank == 0:
            records.print_already_finished(iters, save)
        return 0
    start = records.start_point(cfg)
    if start.origin >= iters:
        raise UserError(f"train.train_iters={iters} is not past iteration {start.origin} of {cfg.checkpoint.load}, "
                        "which this run continues: train_iters counts on from there (the total)")
    container = bridge.build_config(cfg, launch["model"], launch["mode"], launch.get("peft"),
                                    [*launch_overrides(os.environ), *tensorboard_overrides(cfg, run_dir),
                                     *load_overrides(cfg, start), *packed_overrides(view, launch["mode"])])
    pretrain = launch["mode"] == "pretrain" and not launch.get("peft")
    return run_rank(run_dir, container, save=save, iters=iters, tokens_per_step=view.batch.tokens_per_iter,
                    pretrain=pretrain, rank=rank, world=world, start=start)


PACKED_FIELDS = {"train": "packed_train_data_path", "validation": "packed_val_data_path",
                 "metadata": "packed_metadata_path"}


def packed_overrides(view, mode: str) -> list[str]:
    """Our packs, named to Bridge file by file: the packed SFT Parquet the preflight checked (the view's), as
    Bridge's explicit ``offline_packing_specs`` paths. Bridge 0.6.2 looks for packs it did not name under
    ``<dataset_root>/packed/<tokenizer>_pad_seq_to_mult<P>_sft_<fingerprint of its preprocessing settings>``, not
    where our data pipeline writes them (``.../<tokenizer>_pad_seq_to_mult<P>``): finding none there, it re-packed
    ``training.jsonl`` itself with the recipe's SQuAD preprocessing (prompt/completion columns), which fails on chat
    data, and with matching settings would have trained on packs of its own, not ours. Nothing outside SFT (a
    pretraining recipe's dataset has no packing specs)."""
    if mode != "sft":
        return []
    return [f"dataset.offline_packing_specs.{PACKED_FIELDS[k]}={p}" for k, p in sorted(view.data.packed.items())
            if k in PACKED_FIELDS]


def load_overrides(cfg: TrainingConfig, start: records.StartPoint) -> list[str]:
    """What this attempt loads, in Bridge's own fields. A run continuing another's save records
    ``checkpoint.load=<that save>`` (with ``ckpt_step``; Bridge's ``load_checkpoint`` then restores the weights,
    optimizer, scheduler, RNG and ``train_state``, finetune off): its first attempt loads exactly the iteration
    ``start_point`` resolved, and once its own save holds a checkpoint a requeue resumes that instead
    (``load=save``), never the other run's iteration again. Nothing for any other run (``load`` = ``save``)."""
    if preflight.continues_from(cfg) is None:
        return []
    if start.kind == "resume":
        return [f"checkpoint.load={cfg.checkpoint.save}", "checkpoint.ckpt_step=null"]
    return [f"checkpoint.ckpt_step={start.origin}"]


def run_rank(run_dir: Path, container, *, save: str | Path | None, iters: int, tokens_per_step: int, pretrain: bool,
             rank: int, world: int, on_step: bridge.StepHook | None = None,
             start: records.StartPoint | None = None) -> int:
    """This rank's Bridge training with the suite's records: the callback's hooks, ``bridge.run_training``, and
    the run's end (completed or stopped for a requeue), written by the last rank. ``on_step``: called after the
    records' own step hook (the GPU ready check's save-and-exit request, ``pipeline.training.engines.smoke``)."""
    writer = rank == world - 1  # the last rank is on the last pipeline stage, where the reduced loss lives
    progress = records.ProgressLog(run_dir, tokens_per_step=tokens_per_step, writer=writer,
                                   origin=start.origin if start else 0)
    progress.clock.attempt()
    latest = layout.latest_complete(Path(save)) if save else None
    if writer:
        # Megatron resumes from `load`: the steps after it are redone
        progress.start(start.iteration if start else latest or 0)
    hooks = RankHooks(run_dir, container, progress, writer)
    if hooks.watcher is None and rank == 0:
        log.warning("train.exit_signal_handler is off: a time-limit warning cannot checkpoint this run")

    t0 = time.time()
    exited = False
    try:
        def step_end(iteration: int, metrics: dict[str, float]) -> None:
            hooks.step_end(iteration, metrics)
            if on_step is not None:
                on_step(iteration, metrics)

        bridge.run_training(container, pretrain=pretrain, on_step=step_end, on_step_start=hooks.step_start,
                            on_save=hooks.save)
    except SystemExit as exc:
        # train.py's should_exit branch (the exit signal, exit_duration_in_mins, exit_interval): Bridge has saved
        # and calls sys.exit(exit_code). 0 is a stop to record here; any other code (the rerun state machine's)
        # goes on as it came.
        if exc.code not in (None, 0):
            raise
        exited = True
    except RuntimeError as exc:
        if bridge.is_nonfinite_failure(exc):
            it = hooks.iteration
            records.mark_nan(run_dir, progress, it, f"Megatron stopped on a non-finite value at iteration {it}: {exc}")
            log.error("NaN/Inf at iteration %d: the run will not restart (%s); lower optimizer.lr or check the data",
                      it, run_dir / records.NAN_MARKER)
        raise
    finally:
        hooks.stop()
        record_bridge_trace(run_dir, container, rank, latest or 0)
    step = layout.read_tracker(Path(save)) if save else hooks.last_step
    if not writer:
        return 0
    if exited and (step or 0) < iters:  # stopped before train_iters: checkpointed for the requeue
        records.finish_preempted(run_dir, progress, step or 0, iters, time.time() - t0)
        return 0
    records.finish_completed(run_dir, save, progress, iters, time.time() - t0)
    return 0
