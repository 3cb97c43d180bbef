"""Sequence packing: assign sequences to fixed-capacity bins, fast and tight.

``pack_sequences`` is a best-fit-decreasing packer that works on *length classes* instead of single
items. Items are taken longest first; bins are kept in buckets keyed by their remaining capacity. For
a run of ``c`` items of length ``L``, best fit means "the bins with the smallest remaining space
``r >= L``": each such bin takes ``r // L`` items at once and moves to bucket ``r - k*L``. A Fenwick
tree over remaining capacities finds the next non-empty bucket in O(log C). The Python loop runs once
per (length, bucket) event, not once per item, and the item -> bin mapping is produced with numpy at
the end, so 10^6 sequences pack in about a second. Bridge's ``first_fit_*`` loop over every item in
pure Python with a recursive segment tree (see ``bench/bench_packing.py`` for the comparison).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


class _Fenwick:
    """Counts of bins per remaining capacity 0..C, with 'first non-empty index >= x' queries."""

    def __init__(self, size: int):
        self.n = size
        self.tree = [0] * (size + 1)
        self.log = 1 << (size.bit_length())

    def add(self, i: int, delta: int) -> None:
        i += 1
        while i <= self.n:
            self.tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:  # sum of counts[0..i-1]
        s = 0
        while i > 0:
            s += self.tree[i]
            i -= i & -i
        return s

    def kth(self, k: int) -> int:
        """Smallest index whose prefix count reaches k (1-based k)."""
        pos = 0
        step = self.log
        while step:
            nxt = pos + step
            if nxt <= self.n and self.tree[nxt] < k:
                pos = nxt
                k -= self.tree[nxt]
            step >>= 1
        return pos  # 0-based index

    def first_at_least(self, x: int) -> int:
        """First index >= x with a non-zero count, or -1."""
        before = self.prefix(x)
        total = self.prefix(self.n)
        if total == before:
            return -1
        return self.kth(before + 1)


def pack_sequences(lengths: Sequence[int] | np.ndarray, capacity: int, *, seed: int = 0) -> list[list[int]]:
    """Pack sequences into bins of ``capacity``.

    Returns a list of bins, each a list of indices into ``lengths`` whose lengths sum to at most
    ``capacity``. Every index appears exactly once. The result is deterministic for a given
    ``seed``: the seed shuffles which of several equal-length items goes to which bin, and the order
    of the bins (so that a trainer reading bins in order sees a mix of long and short packs).

    Raises ValueError if a length is negative or larger than ``capacity``.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.ndim != 1:
        raise ValueError("lengths must be one-dimensional")
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    n = lens.size
    if n == 0:
        return []
    if lens.min() < 0:
        raise ValueError("lengths must be non-negative")
    if lens.max() > capacity:
        bad = int(np.argmax(lens > capacity))
        raise ValueError(f"length {int(lens[bad])} at index {bad} exceeds capacity {capacity}")

    rng = np.random.default_rng(seed)
    # Items grouped by length, longest first; within a length, a seeded random order.
    perm = rng.permutation(n)
    order = perm[np.argsort(-lens[perm], kind="stable")]
    sorted_lens = lens[order]
    uniq, starts, counts = np.unique(-sorted_lens, return_index=True, return_counts=True)
    class_lens = (-uniq).tolist()
    class_starts = starts.tolist()
    class_counts = counts.tolist()

    buckets: list[list[int]] = [[] for _ in range(capacity + 1)]  # remaining capacity -> bin ids
    fen = _Fenwick(capacity + 1)
    n_bins = 0
    # Events: (first position in `order`, number of items, bin ids array, items per bin)
    ev_bins: list[np.ndarray] = []
    ev_take: list[int] = []
    ev_pos: list[int] = []

    for L, start, count in zip(class_lens, class_starts, class_counts):
        pos = start
        left = count
        if L == 0:
            # Zero-length items fit anywhere: put them in the first bin (or a new one).
            if n_bins == 0:
                n_bins = 1
                buckets[capacity].append(0)
                fen.add(capacity, 1)
            ev_bins.append(np.zeros(1, dtype=np.int64))
            ev_take.append(left)
            ev_pos.append(pos)
            continue
        while left > 0:
            r = fen.first_at_least(L)
            if r == -1:
                # Open new bins: each takes k = capacity // L items.
                k = capacity // L
                nb = -(-left // k)
                full = left // k
                ids = np.arange(n_bins, n_bins + nb, dtype=np.int64)
                n_bins += nb
                if full:
                    ev_bins.append(ids[:full])
                    ev_take.append(k)
                    ev_pos.append(pos)
                    rem = capacity - k * L
                    buckets[rem].extend(ids[:full].tolist())
                    fen.add(rem, full)
                    pos += full * k
                    left -= full * k
                if left:
                    ev_bins.append(ids[full:])
                    ev_take.append(left)
                    ev_pos.append(pos)
                    rem = capacity - left * L
                    buckets[rem].append(int(ids[-1]))
                    fen.add(rem, 1)
                    pos += left
                    left = 0
                continue
            k = r // L
            bins = buckets[r]
            m = len(bins)
            full = min(m, left // k)
            if full:
                moved = bins[m - full:]
                del bins[m - full:]
                fen.add(r, -full)
                ev_bins.append(np.asarray(moved, dtype=np.int64))
                ev_take.append(k)
                ev_pos.append(pos)
                rem = r - k * L
                buckets[rem].extend(moved)
                fen.add(rem, full)
                pos += full * k
                left -= full * k
            if left and left < k and bins:
                # One more bin takes the remaining (< k) items.
                b = bins.pop()
                fen.add(r, -1)
                ev_bins.append(np.asarray([b], dtype=np.int64))
                ev_take.append(left)
                ev_pos.append(pos)
                rem = r - left * L
                buckets[rem].append(b)
                fen.add(rem, 1)
                pos += left
                left = 0

    # Materialise item -> bin: event e assigns ev_take[e] consecutive items to each of its bins.
    bin_of = np.empty(n, dtype=np.int64)
    for bins_e, take, pos in zip(ev_bins, ev_take, ev_pos):
        span = bins_e.size * take
        bin_of[order[pos:pos + span]] = np.repeat(bins_e, take)[:span]

    # Group item indices by bin (stable: within a bin, longest first as assigned), shuffle bin order.
    by_bin = np.argsort(bin_of[order], kind="stable")
    items_sorted = order[by_bin]
    bounds = np.searchsorted(bin_of[items_sorted], np.arange(n_bins + 1))
    bin_order = rng.permutation(n_bins)
    flat = items_sorted.tolist()
    b = bounds.tolist()
    return [flat[b[i]:b[i + 1]] for i in bin_order.tolist()]


def lower_bound_bins(lengths: Sequence[int] | np.ndarray, capacity: int) -> int:
    """The optimum needs at least ceil(sum / capacity) bins."""
    total = int(np.asarray(lengths, dtype=np.int64).sum())
    return max(1, math.ceil(total / capacity)) if len(lengths) else 0


def required_pad_multiple(context_parallel_size: int = 1, tensor_parallel_size: int = 1,
                          sequence_parallel: bool = False) -> int:
    """The packing alignment that context parallelism needs.

    THD context parallelism splits each sequence into 2*CP chunks, so every sequence must be a
    multiple of 2*CP; with sequence parallelism on top, also of TP*CP: lcm(2*CP, TP*CP).
    """
    cp, tp = int(context_parallel_size), int(tensor_parallel_size)
    if cp <= 1:
        return tp if sequence_parallel and tp > 1 else 1
    base = 2 * cp
    return math.lcm(base, tp * cp) if sequence_parallel else base


def check_pad_multiple(pad_seq_to_mult: int, context_parallel_size: int = 1, tensor_parallel_size: int = 1,
                       sequence_parallel: bool = False) -> str | None:
    """Return a one-line problem description, or None when ``pad_seq_to_mult`` satisfies the CP rule."""
    need = required_pad_multiple(context_parallel_size, tensor_parallel_size, sequence_parallel)
    if pad_seq_to_mult < 1:
        return f"pad_seq_to_mult({pad_seq_to_mult}) must be >= 1"
    if pad_seq_to_mult % need:
        rule = (f"lcm(2*cp, tp*cp) = lcm({2 * context_parallel_size}, {tensor_parallel_size * context_parallel_size})"
                if sequence_parallel and context_parallel_size > 1 else f"2*cp = {2 * context_parallel_size}")
        return (f"pad_seq_to_mult({pad_seq_to_mult}) is not a multiple of {rule} = {need}: "
                f"context parallelism needs every packed sequence aligned to {need}; set pad_seq_to_mult={need}")
    return None
