"""The local engine under ft_launcher (nvidia-resiliency-ext): hang detection by timed sections.

ft_launcher starts one rank monitor per worker and exports its socket to the worker
(``FT_RANK_MONITOR_IPC_SOCKET``; pipeline_training_launch.sh also exports ``PIPELINE_LAUNCHER=ft_launcher``).
The worker connects a ``RankMonitorClient`` and wraps its work in the sections the cluster profile times
(``ft_section_timeouts``, rendered into ``--ft-rank_section_timeouts``):

  setup          from process start-up to the first training step (model, data, resume)
  step           each optimizer step (forward, backward, all-reduce, update)
  checkpointing  a checkpoint save, from the step that asked for it to the iter_N folder and tracker

Time outside every section is bounded by ``ft_out_of_section_timeout`` (logging, evaluation, the final
records). When a section (or the out-of-section time) runs past its timeout, the rank monitor logs
"Section 'step' has been open for ... Timeout is ..." / "FT timeout elapsed.", kills the rank, and
ft_launcher restarts the worker group, which resumes from the latest complete checkpoint.

Under torchrun (or without a monitor socket) everything here is a no-op. The tests' fault injection
(training/faults.py: a rank-0 hang on the first attempt, a slow step on every rank) runs inside the ``step``
section, so the monitor times it as a real hang or straggler would be.
"""

from __future__ import annotations

import logging
import os

from pipeline.config.launchers import FT_LAUNCHER
from pipeline.config.schema import TrainingConfig
from pipeline.training.faults import FaultHook

log = logging.getLogger(__name__)
SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # set by ft_launcher for each worker (nvidia_resiliency_ext data.py)
SECTIONS = ("setup", "step", "checkpointing")


class FaultTolerance:
    """A connected RankMonitorClient; sections the monitor does not time are skipped (it would fail on them)."""

    def __init__(self, client):
        self.client = client
        self.timed = set(client.cfg.rank_section_timeouts or {})
        self.open: set[str] = set()
        missing = [s for s in SECTIONS if s not in self.timed]
        if missing:
            log.warning("ft_launcher times no %s section(s): add them to the cluster profile's "
                        "ft_section_timeouts", ", ".join(missing))
        log.info("fault tolerance: rank monitor connected (section timeouts %s, out of section %s s)",
                 dict(client.cfg.rank_section_timeouts or {}), client.cfg.rank_out_of_section_timeout)

    @classmethod
    def connect(cls) -> FaultTolerance | None:
        """The client when this process runs under ft_launcher, else None."""
        under_ft = os.environ.get("PIPELINE_LAUNCHER") == FT_LAUNCHER.name
        if not os.environ.get(SOCKET_ENV):
            if under_ft:
                log.warning("PIPELINE_LAUNCHER=ft_launcher but %s is not set: no hang detection", SOCKET_ENV)
            return None
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        client = RankMonitorClient()
        client.init_workload_monitoring()
        return cls(client)

    def start(self, section: str):
        if section in self.timed and section not in self.open:
            self.client.start_section(section)
            self.open.add(section)

    def end(self, section: str):
        if section in self.open:
            self.client.end_section(section)
            self.open.discard(section)

    def end_all(self):
        if self.open:
            self.client.end_all_sections()
            self.open.clear()


def start(cfg: TrainingConfig) -> FaultTolerance | None:
    """Connect to the rank monitor (under ft_launcher) and open the ``setup`` section."""
    ft = FaultTolerance.connect()
    if ft is not None:
        ft.start("setup")
    return ft


def callbacks(ft: FaultTolerance | None, faults: FaultHook) -> list:
    """Trainer callbacks: the FT sections (under ft_launcher) and the tests' hang/slow-step injection (training/
    faults.py). Put them after the other callbacks so a save requested at step end (SaveAndExit) is timed too."""
    from transformers import TrainerCallback

    class Sections(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            if ft is not None:
                ft.end("setup")
                ft.start("step")
            faults.step_begin(st.global_step + 1)
            return control

        def on_step_end(self, args, st, control, **kw):
            if ft is not None:
                ft.end("step")
                if control.should_save:
                    ft.start("checkpointing")
            return control

        def on_save(self, args, st, control, **kw):
            if ft is not None:
                ft.end("checkpointing")
            return control

        def on_train_end(self, args, st, control, **kw):
            if ft is not None:
                ft.end_all()
            return control

    return [Sections()] if ft is not None or faults.at_step_begin else []
