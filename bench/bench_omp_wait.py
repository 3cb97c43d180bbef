"""CPU training steps under OpenMP's default wait policy against OMP_WAIT_POLICY=PASSIVE, alone and two at once.

    python bench/bench_omp_wait.py [--model tiny-qwen3-moe|smollm2-135m] [--steps 20] [--rounds 3] [--threads 2]

Each measurement is a fresh process (libgomp reads OMP_WAIT_POLICY once, when torch loads) that trains ``--steps``
AdamW steps of the model at the local profile's batch (2 sequences of 256 tokens, torch.set_num_threads(--threads)
as the local engine sets it on a 2-core machine) and prints its seconds per step, first step excluded. Four
scenarios alternate within every round so the machine's load hits them alike:

  alone/default   one process, the wait policy unset (libgomp's threads spin before they sleep)
  alone/passive   one process, OMP_WAIT_POLICY=PASSIVE (waiting threads sleep at once)
  pair/default    two processes at once (two test workers, or a training beside an export), each --threads
  pair/passive    the same pair, both PASSIVE

Prints the median seconds per step of each and the ratios default / passive side by side: above 1, PASSIVE is
faster. The numbers are the same either way (the policy only changes how an idle thread waits); the bench prints
each scenario's last loss so a difference would show.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SCENARIOS = ("alone/default", "alone/passive", "pair/default", "pair/passive")


def child(model_name: str, steps: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config.models import build_tiny_config, get_model, require_local_model

    spec = get_model(model_name)
    base = require_local_model(spec)  # a tiny model's is its tokenizer's, as the local engine reads it
    tok = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(1234)
    if spec.tiny_config is not None:
        conf = build_tiny_config(spec, len(tok), tok.pad_token_id or tok.eos_token_id, tok.eos_token_id,
                                 tok.bos_token_id)
        model = AutoModelForCausalLM.from_config(conf)
    else:
        model = AutoModelForCausalLM.from_pretrained(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, len(tok), (2, 256), generator=torch.Generator().manual_seed(0))
    times, loss = [], float("nan")
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        loss = float(out.loss.detach())
    print(f"{statistics.mean(times[1:]):.6f} {loss:.6f}", flush=True)


def measure(args, scenario: str) -> tuple[list[float], list[float]]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if scenario.endswith("passive"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    n = 2 if scenario.startswith("pair") else 1
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--steps", str(args.steps), "--threads",
           str(args.threads)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    outs = [p.communicate()[0].split() for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"error: a {scenario} process failed")
    return [float(o[0]) for o in outs], [float(o[1]) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen3-moe", help="a local registry model (default: tiny-qwen3-moe)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per measurement (default: 20)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the four scenarios (default: 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process (default: 2)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for name, v in (("--steps", args.steps), ("--rounds", args.rounds), ("--threads", args.threads)):
        if not 1 <= v <= 1000:
            ap.error(f"{name} must be between 1 and 1000")
    if args.child:
        child(args.model, args.steps, args.threads)
        return
    per: dict[str, list[float]] = {s: [] for s in SCENARIOS}
    losses: dict[str, set[float]] = {s: set() for s in SCENARIOS}
    print(f"{args.model}: {args.steps} steps per process, {args.threads} threads each, {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs", flush=True)
    for r in range(args.rounds):
        for s in SCENARIOS:
            secs, loss = measure(args, s)
            per[s].extend(secs)
            losses[s].update(loss)
            print(f"  round {r + 1} {s:14s} " + " ".join(f"{x:.3f}" for x in secs) + " s/step", flush=True)
    med = {s: statistics.median(v) for s, v in per.items()}
    print("median seconds per step:")
    for s in SCENARIOS:
        print(f"  {s:14s} {med[s]:.3f}   last loss {sorted(losses[s])}")
    print(f"default / passive: alone {med['alone/default'] / med['alone/passive']:.2f}x, "
          f"pair {med['pair/default'] / med['pair/passive']:.2f}x")
    print(f"pair / alone (what the second process costs): default {med['pair/default'] / med['alone/default']:.2f}x, "
          f"passive {med['pair/passive'] / med['alone/passive']:.2f}x")


if __name__ == "__main__":
    main()
