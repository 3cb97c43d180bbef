"""Packing benchmark: pipeline.data.packing.pack_sequences vs Megatron Bridge's first_fit_shuffle and
first_fit_decreasing, loaded from the pinned megatron-bridge wheel (not copied), same lengths, same run.

    python bench/bench_packing.py [--sizes 10000 100000 1000000] [--capacity 8192]

Lengths: a long-tailed chat distribution (lognormal, median ~400 tokens, clipped to [1, capacity]).
Prints a Markdown table of wall times, speed-up ratios and bin counts (with the ceil(sum/capacity) bound).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import types
from pathlib import Path

import numpy as np

from pipeline.data.packing import lower_bound_bins, pack_sequences
from pipeline.training.conformance import fetch_wheel_source, pinned_version

ROOT = Path(__file__).resolve().parents[1]


def load_bridge_algorithms():
    src = fetch_wheel_source(pinned_version(), ROOT / ".cache" / "wheels")
    # algorithms.py imports only megatron.bridge.utils.safe_pickle (for a loader we do not call).
    for name in ("megatron", "megatron.bridge", "megatron.bridge.utils"):
        mod = types.ModuleType(name)
        mod.__path__ = []
        sys.modules[name] = mod
    sp = types.ModuleType("megatron.bridge.utils.safe_pickle")
    sp.safe_load_npy = None
    sys.modules["megatron.bridge.utils.safe_pickle"] = sp
    spec = importlib.util.spec_from_file_location("bridge_algorithms",
                                                  src / "megatron/bridge/data/packing/algorithms.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def chat_lengths(n: int, cap: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(6.0, 1.0, n).astype(np.int64) + 1, cap)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--capacity", type=int, default=8192)
    args = p.parse_args()
    bridge = load_bridge_algorithms()
    print(f"megatron-bridge {pinned_version()} algorithms vs pipeline.data.packing.pack_sequences, "
          f"capacity {args.capacity}\n")
    print("| n | ours (s) | Bridge FFS (s) | Bridge FFD (s) | speed-up vs FFS | speed-up vs FFD | bins ours "
          "| bins FFD | bins FFS | lower bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        lens = chat_lengths(n, args.capacity)
        as_list = lens.tolist()
        ours, t_ours = timed(lambda lens=lens: pack_sequences(lens, args.capacity, seed=0))
        np.random.seed(0)
        ffs, t_ffs = timed(lambda as_list=as_list: bridge.first_fit_shuffle(as_list, args.capacity))
        ffd, t_ffd = timed(lambda as_list=as_list: bridge.first_fit_decreasing(as_list, args.capacity))
        assert sorted(i for b in ours for i in b) == list(range(n))
        print(f"| {n:,} | {t_ours:.3f} | {t_ffs:.2f} | {t_ffd:.2f} | {t_ffs / t_ours:.0f}x | {t_ffd / t_ours:.0f}x | "
              f"{len(ours):,} | {len(ffd):,} | {len(ffs):,} | {lower_bound_bins(lens, args.capacity):,} |", flush=True)


if __name__ == "__main__":
    main()
