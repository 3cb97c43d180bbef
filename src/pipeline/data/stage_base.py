"""What ``prepare``'s stages share: the split names and files, the tokenized layout, the workers' unit of work (a
slice), the timer and progress."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from pipeline.common.log import Progress

log = logging.getLogger("pipeline.data.prepare")  # every stage logs under this one name
SPLITS = ("train", "validation")
SPLIT_FILES = {"train": "training.jsonl", "validation": "validation.jsonl"}
SLICE_CONVERSATIONS = 256  # the unit of work a worker takes: at most this many conversations ...
SLICE_BYTES = 1 << 19  # ... or about this many bytes of exported JSONL (~0.13 M tokens), whichever comes first;
# small, so the workers finish together (the last slice is ~0.2 s of one core) and chunks are written as they go


def tokenized_dir(root: Path, tok_name: str, split: str) -> Path:
    """Where the tokenize stage writes a split's chunks (and the pack stage reads them)."""
    return root / "tokenized" / tok_name / split


def slices(starts: np.ndarray, first: int, last: int) -> list[tuple[int, int]]:
    """Byte ranges covering lines ``first`` .. ``last - 1`` (``starts`` ends with the file size), cut every
    SLICE_CONVERSATIONS lines or SLICE_BYTES bytes. Only the amount of work per task depends on the cut: each
    conversation is encoded on its own, so a chunk's content never does."""
    out, a = [], first
    while a < last:
        b = min(last, a + SLICE_CONVERSATIONS,
                max(a + 1, int(np.searchsorted(starts, starts[a] + SLICE_BYTES, side="right")) - 1))
        out.append((int(starts[a]), int(starts[b])))
        a = b
    return out


class Timer:
    """Seconds per stage, summed over a stage's parts: the summary's ``seconds_per_stage``."""

    def __init__(self):
        self.stages: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = round(self.stages.get(name, 0.0) + time.perf_counter() - t0, 3)


def progress(it: Iterable, quiet: bool, desc: str, unit: str, total: int) -> Iterator:
    """A bar on a terminal; a line every PIPELINE_PROGRESS_INTERVAL seconds in a log file."""
    with Progress(desc, total=total, unit=unit, quiet=quiet, logger=log) as p:
        for x in it:
            yield x
            p.update(1)
