"""A pretraining corpus split over nodes: each shard is a contiguous run of the corpus's files, in the order one node
reads them, cut where the running size reaches each node's share of the bytes. Contiguous runs are what make the
merge exact: the shards' documents, one after another, are the one-node run's documents in its order, so their
``.bin`` files concatenated and their sequence lengths joined are byte for byte the one-node ``.bin``/``.idx``.

A shard is tokenized into ``<output>/.shards/shard_IIIII_of_NNNNN/`` (its own ``.bin``/``.idx``, which megatron-core
reads as an indexed dataset of its own, and its ``token_count.json``), resumable by itself; the merge
(``indexed.merge_shards``) writes the output once every shard is finished."""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.common.errors import UserError

SHARDS_DIR = ".shards"
LIMIT_NOT_SHARDABLE = ("--limit takes the first N documents of the whole corpus, which one node reads: it cannot be "
                       "split into shards")
MAX_SHARDS = 4096
CHUNK_SIZE = 2048  # prepare's conversations per tokenized chunk: its resume unit, and what its shards are made of
_SPEC = re.compile(r"(\d+)/(\d+)")


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: its files (a contiguous run of the corpus's) and their total size in bytes."""

    index: int
    count: int
    files: tuple[Path, ...]
    size: int

    @property
    def name(self) -> str:
        return shard_name(self.index, self.count)


def shard_name(index: int, count: int) -> str:
    return f"shard_{index:05d}_of_{count:05d}"


def shard_dir(out_dir: Path, index: int, count: int) -> Path:
    return Path(out_dir) / SHARDS_DIR / shard_name(index, count)


def check_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SHARDS:
        raise UserError(f"the shard count must be an integer in [1, {MAX_SHARDS}], got {count!r}")


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` (shard I of N, counted from 0) as (I, N); a malformed or out-of-range one is one line."""
    m = _SPEC.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise UserError(f"--shard {text!r} must be I/N: shard I of N, counted from 0 (for example 0/3)")
    index, count = int(m.group(1)), int(m.group(2))
    check_count(count)
    if index >= count:
        raise UserError(f"--shard {text}: the shard index must be below the count ({count}); shards are 0..{count - 1}")
    return index, count


def balanced_bounds(sizes: list[int], count: int) -> list[int]:
    """``count`` contiguous, non-empty runs of items with these sizes, as ``count + 1`` bounds: each run ends where the
    running size first reaches its share of the total (so each node gets about the same bytes)."""
    total = sum(sizes)
    running = list(itertools.accumulate(sizes))
    bounds = [0]
    for k in range(1, count):
        end = bisect.bisect_left(running, total * k / count) + 1  # the run reaching k shares of the bytes
        bounds.append(min(max(end, bounds[-1] + 1), len(sizes) - (count - k)))
    bounds.append(len(sizes))
    return bounds


def split_files(files: list[Path], count: int) -> list[Shard]:
    """The corpus's files (in reading order) as ``count`` contiguous, non-empty runs balanced by size
    (:func:`balanced_bounds`)."""
    check_count(count)
    if count > len(files):
        raise UserError(f"{count} shards of a corpus of {len(files)} file(s): a shard is at least one whole file, so "
                        f"use at most {len(files)} node(s) (or tokenize it on one)")
    try:
        sizes = [f.stat().st_size for f in files]
    except OSError as exc:
        raise UserError(f"cannot read the corpus's files: {exc.strerror or exc}") from None
    bounds = balanced_bounds(sizes, count)
    return [Shard(k, count, tuple(files[bounds[k]:bounds[k + 1]]), sum(sizes[bounds[k]:bounds[k + 1]]))
            for k in range(count)]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def describe(shards: list[Shard], source: Path, out_dir: Path, output_name: str) -> list[str]:
    """The split as the plan prints it: the whole, each shard's files and folder, then the merge."""
    files = sum(len(s.files) for s in shards)
    count = len(shards)

    def rel(f: Path) -> str:
        return str(f.relative_to(source)) if source.is_dir() and f.is_relative_to(source) else str(f)

    lines = [f"tokenize across {count} nodes: {files} file(s), {_size(sum(s.size for s in shards))} of {source}, split "
             "into contiguous runs in reading order, balanced by size (one shard per node, each retried by itself):"]
    for s in shards:
        span = rel(s.files[0]) if len(s.files) == 1 else f"{rel(s.files[0])} .. {rel(s.files[-1])}"
        lines.append(f"  shard {s.index}/{count}: {len(s.files)} file(s), {_size(s.size)} ({span}) -> "
                     f"{shard_dir(out_dir, s.index, count)}")
    prefix = Path(out_dir) / f"{output_name}_text_document"
    lines.append(f"  then the merge: {prefix}.{{bin,idx}} and token_count.json, byte for byte what one node writes")
    return lines


def ranges(indices: list[int]) -> str:
    """0, 2-5, 9: consecutive indices as ranges."""
    out, start = [], None
    for a, b in itertools.zip_longest(indices, indices[1:]):
        start = a if start is None else start
        if b != a + 1:
            out.append(str(a) if start == a else f"{start}-{a}")
            start = None
    return ", ".join(out)
