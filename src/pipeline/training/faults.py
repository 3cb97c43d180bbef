"""Fault injection for the tests, behind one hook: :class:`FaultHook`.

The tests of the NaN guard, the resume equivalence, the hang detector and the straggler report need a run that
misbehaves on purpose. ``pipeline.local.fault_inject_*`` (config/schema.py) asks for it; ``FaultHook.from_config``
reads those keys once, and the local engine's Trainer and callbacks call the hook's methods at the points where a
fault is injected. A run that sets none of the keys holds an inert hook: each method returns its input unchanged.

  nan_step       the loss becomes NaN from this step on (the NaN guard)
  resume_shift   a resumed run reads the data this many steps off (the resume-equivalence test must catch it)
  hang_step      rank 0 stops making progress at this step, first attempt only (ft_launcher's hang detection;
                 under torchrun the hang lasts until something else kills the job)
  step_sleep     every step this many seconds slower on every rank (a straggler)
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class _Shifted:
    """``ds`` read ``k`` samples further on."""

    def __init__(self, ds, k: int):
        self.ds, self.k = ds, k

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[(i + self.k) % len(self.ds)]


@dataclass(frozen=True)
class FaultHook:
    nan_step: int | None = None
    resume_shift: int = 0
    hang_step: int | None = None  # already narrowed to rank 0 on its first attempt
    step_sleep: float = 0.0

    @classmethod
    def from_config(cls, cfg: Any) -> FaultHook:
        """The hook of a training config (its ``pipeline.local`` section), for this process's rank and attempt."""
        local = cfg.pipeline.local
        first_attempt = (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0  # launcher restarts
                         and int(os.environ.get("SLURM_RESTART_COUNT", "0")) == 0)    # Slurm requeues
        rank0 = int(os.environ.get("RANK", "0")) == 0
        return cls(nan_step=local.fault_inject_nan_step, resume_shift=local.fault_inject_resume_shift or 0,
                   hang_step=local.fault_inject_hang_step if first_attempt and rank0 else None,
                   step_sleep=local.fault_inject_step_sleep or 0.0)

    @property
    def at_step_begin(self) -> bool:
        """Whether :meth:`step_begin` does anything (a callback is added only then)."""
        return self.hang_step is not None or self.step_sleep > 0

    def dataset(self, ds, *, resuming: bool, samples_per_step: int):
        """The training data a (resumed) run reads."""
        if self.resume_shift and resuming:
            return _Shifted(ds, self.resume_shift * samples_per_step)
        return ds

    def loss(self, out, *, step: int, return_outputs: bool):
        """``compute_loss``'s result for the step ``step`` (1-based)."""
        if self.nan_step is None or step < int(self.nan_step):
            return out
        return (out[0] * float("nan"), out[1]) if return_outputs else out * float("nan")

    def step_begin(self, step: int) -> None:
        """Before the step ``step`` (1-based): hang, or sleep."""
        if self.hang_step is not None and step == self.hang_step:
            log.warning("fault injection: rank 0 hangs at step %d (pipeline.local.fault_inject_hang_step)", step)
            while True:  # alive, no progress: only a timeout (or a kill) ends this
                time.sleep(60)
        if self.step_sleep > 0:
            time.sleep(self.step_sleep)
