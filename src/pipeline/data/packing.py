"""Sequence packing: assign sequences to fixed-capacity bins, fast and tight.

``pack_sequences`` is a best-fit-decreasing packer that works on *length classes* instead of single
items. Items are taken longest first; bins are kept in buckets keyed by their remaining capacity. For
a run of ``c`` items of length ``L``, best fit means "the bins with the smallest remaining space
``r >= L``": each such bin takes ``r // L`` items at once and moves to bucket ``r - k*L``. A sorted
list of the non-empty remaining capacities (``bisect``) finds the next bucket in O(log C). The Python loop runs once
per (length, bucket) event, not once per item, and the item -> bin mapping is produced with numpy at
the end, so 10^6 sequences pack in about a second. Bridge's ``first_fit_*`` loop over every item in
pure Python with a recursive segment tree (see ``bench/bench_packing.py`` for the comparison).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Sequence

import numpy as np


def pack_sequences(lengths: Sequence[int] | np.ndarray, capacity: int, *, seed: int = 0) -> list[list[int]]:
    """Pack sequences into bins of ``capacity``.

    Returns a list of bins, each a list of indices into ``lengths`` whose lengths sum to at most
    ``capacity``. Every index appears exactly once. The result is deterministic for a given
    ``seed``: the seed shuffles which of several equal-length items goes to which bin, and the order
    of the bins (so that a trainer reading bins in order sees a mix of long and short packs).

    Raises ValueError if a length is negative or larger than ``capacity``.
    """
    items, bounds = pack_order(lengths, capacity, seed=seed)
    items_l, bounds_l = items.tolist(), bounds.tolist()
    return [items_l[bounds_l[i]:bounds_l[i + 1]] for i in range(len(bounds_l) - 1)]


def pack_order(lengths: Sequence[int] | np.ndarray, capacity: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pack_sequences` as flat arrays, for callers that vectorise over the packs: ``items`` (int64, every
    index once) and ``bounds`` (int64, ``n_bins + 1``): bin ``b`` holds ``items[bounds[b]:bounds[b + 1]]``."""
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.ndim != 1:
        raise ValueError("lengths must be one-dimensional")
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    n = lens.size
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    if lens.min() < 0:
        raise ValueError("lengths must be non-negative")
    if lens.max() > capacity:
        bad = int(np.argmax(lens > capacity))
        raise ValueError(f"length {int(lens[bad])} at index {bad} exceeds capacity {capacity}")

    rng = np.random.default_rng(seed)
    # Items grouped by length, longest first; within a length, a seeded random order. A stable sort of a
    # 16-bit key is a radix sort in numpy: O(n).
    perm = rng.permutation(n)
    key = (capacity - lens[perm]).astype(np.uint16 if capacity < 65536 else np.int64)
    order = perm[np.argsort(key, kind="stable")]
    counts = np.bincount(lens, minlength=capacity + 1)
    class_lens = np.flatnonzero(counts)[::-1].tolist()  # distinct lengths, longest first
    class_counts = counts[class_lens].tolist()

    buckets: list[list[int]] = [[] for _ in range(capacity + 1)]  # remaining capacity -> bin ids
    nonempty: list[int] = []  # sorted remaining capacities whose bucket holds bins
    n_bins = 0
    # Items are consumed in `order`; each bin listed in ev_bins takes ev_take consecutive items.
    ev_bins: list[int] = []
    ev_take: list[int] = []

    bisect, ins = bisect_left, insort  # local aliases: this loop is the hot path

    for L, count in zip(class_lens, class_counts):
        left = count
        if L == 0:  # zero-length items fit anywhere: put them all in bin 0 (opening it if needed)
            if n_bins == 0:
                n_bins = 1
                ins(nonempty, capacity)
                buckets[capacity].append(0)
            ev_bins.append(0)
            ev_take.append(left)
            continue
        while left > 0:
            j = bisect(nonempty, L)
            if j == len(nonempty):
                # Open new bins: each takes k = capacity // L items (the last one what is left).
                k = capacity // L
                full, rest = divmod(left, k)
                if full:
                    ids = list(range(n_bins, n_bins + full))
                    n_bins += full
                    ev_bins.extend(ids)
                    ev_take.extend([k] * full)
                    rem = capacity - k * L
                    if not buckets[rem]:
                        ins(nonempty, rem)
                    buckets[rem].extend(ids)
                if rest:
                    ev_bins.append(n_bins)
                    ev_take.append(rest)
                    rem = capacity - rest * L
                    if not buckets[rem]:
                        ins(nonempty, rem)
                    buckets[rem].append(n_bins)
                    n_bins += 1
                break
            r = nonempty[j]  # best fit: the smallest remaining capacity >= L
            k = r // L
            bins = buckets[r]
            m = len(bins)
            full = min(m, left // k)
            if full:
                moved = bins[m - full:]
                del bins[m - full:]
                ev_bins.extend(moved)
                ev_take.extend([k] * full)
                left -= full * k
            elif left:
                # Fewer than k items left: one bin takes them all.
                moved = [bins.pop()]
                ev_bins.append(moved[0])
                ev_take.append(left)
                k, left = left, 0
            if not bins:
                del nonempty[j]
            rem = r - k * L
            target = buckets[rem]
            if not target:
                ins(nonempty, rem)
            target.extend(moved)

    # Item -> bin: event e gives ev_take[e] consecutive items (in `order`) to bin ev_bins[e].
    bin_sorted = np.repeat(np.asarray(ev_bins, dtype=np.int64), np.asarray(ev_take, dtype=np.int64))
    by_bin = np.argsort(bin_sorted, kind="stable")
    items = order[by_bin]
    bounds = np.searchsorted(bin_sorted[by_bin], np.arange(n_bins + 1))
    # The bins in a seeded random order: each moved bin's items, gathered segment by segment.
    shuffled = rng.permutation(n_bins)
    sizes = np.diff(bounds)[shuffled]
    new_bounds = np.zeros(n_bins + 1, dtype=np.int64)
    np.cumsum(sizes, out=new_bounds[1:])
    gather = np.arange(n, dtype=np.int64) + np.repeat(bounds[shuffled] - new_bounds[:-1], sizes)
    return items[gather], new_bounds


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
                if sequence_parallel and context_parallel_size > 1 else "2*cp")
        return (f"pad_seq_to_mult({pad_seq_to_mult}) is not a multiple of {rule} = {need}: "
                f"context parallelism needs every packed sequence aligned to {need}; set pad_seq_to_mult={need}")
    return None
