"""The tokenize stage of ``prepare`` at 1..N worker processes vs the tokenizer's own render + encode at 1..N threads.

    python bench/bench_tokenize.py [--conversations 20000] [--repeats 3] [--min-workers 1] [--max-workers N]
                                   [--reference-src DIR]

Both sides see the same conversations: chatterbot-corpus conversations joined deterministically into longer
ones (3 exchanges, each turn joining 6 corpus turns; 20,000 of them are ~10.4 M tokens, ~520 per conversation).

  tokenizer(k)  the fast tokenizer itself with k Rust threads (RAYON_NUM_THREADS=k): transformers'
                ``apply_chat_template(all, tokenize=False)`` (render) then the Rust ``encode_batch`` of the texts
                (encode; no offsets read, no masks, no Python lists, nothing written). Also timed in the same
                process: its ``encode_batch_fast`` (the same ids, no offsets tracked), the fastest encode it offers.
  stage(k)      ``stage_tokenize`` with ``workers=k`` on the same conversations exported as JSONL: reading them back,
                rendering, encoding, assistant-only masks, Parquet chunks; worker start-up included.
  prepare       ``pipeline_data_prepare.py prepare`` end to end (export + tokenize + pack, a fresh process, default
                workers) on the same conversations, vs tokenizer(N) (render + encode).
  reference(k)  with --reference-src DIR: stage(k) as another checkout's src/ has it (the change measured side by
                side with what it replaced).

Each measurement runs in its own process (the Rust thread pool is sized once per process); the kinds alternate
within every repeat so machine noise hits all of them; medians are reported. Fitted parts: T(k) = serial +
parallel / k, least squares over k = 1..N (exact for N = 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def synth(n: int, exchanges: int = 3, per_turn: int = 6) -> list[dict]:
    from pipeline.data.sources import load_conversations

    base, _ = load_conversations("chatterbot-corpus")
    out = []
    for i in range(n):
        msgs = []
        for x in range(exchanges):
            turns = [base[(i * 7919 + (x * per_turn + j) * 131) % len(base)]["messages"] for j in range(per_turn)]
            msgs.append({"role": "user", "content": f"({i}.{x}) " + " ".join(t[0]["content"] for t in turns)})
            msgs.append({"role": "assistant", "content": "\n".join(t[1]["content"] for t in turns)})
        out.append({"messages": msgs})
    return out


def child(kind: str, k: int, data: Path) -> dict:
    from pipeline.data.chat import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    if kind == "tokenizer":
        convs = [json.loads(line)["messages"] for line in open(data / "training.jsonl", encoding="utf-8")]
        t0 = time.perf_counter()
        texts = tok.apply_chat_template(convs, tokenize=False)
        t1 = time.perf_counter()
        encs = tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        t2 = time.perf_counter()
        fast = tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        t3 = time.perf_counter()
        assert [e.ids for e in fast] == [e.ids for e in encs]
        return {"render": t1 - t0, "encode": t2 - t1, "total": t2 - t0, "encode_fast": t3 - t2,
                "total_fast": t1 - t0 + t3 - t2, "tokens": sum(len(e) for e in encs)}
    from pipeline.data.stage_base import Timer
    from pipeline.data.stage_tokenize import TokenizeOptions, stage_tokenize

    opts = TokenizeOptions(dataset_root=data, tok_name="bench", force=True, quiet=True, workers=k)
    t0 = time.perf_counter()
    res = stage_tokenize(opts, Timer(), tokenizer=tok)
    return {"total": time.perf_counter() - t0, "tokens": res["train"]["tokens"]}


def run_child(kind: str, k: int, data: Path, reference_src: Path | None = None) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS=str(k), TOKENIZERS_PARALLELISM="true", HF_HUB_OFFLINE="1")
    if kind == "reference":  # the stage as another checkout's src/ has it (its workers inherit the path)
        env["PYTHONPATH"] = os.pathsep.join([str(reference_src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        kind = "stage"
    res = subprocess.run([sys.executable, __file__, "--child", kind, str(k), str(data)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def fit(ks: list[int], ts: list[float]) -> tuple[float, float]:
    """Least squares of t = serial + parallel / k."""
    xs = [1 / k for k in ks]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    parallel = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return mt - parallel * mx, parallel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-workers", type=int, default=1, help="the smallest k measured (a fit needs two)")
    p.add_argument("--max-workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--reference-src", type=Path, help="another checkout's src/ (e.g. a worktree of an earlier "
                   "commit): its stage is measured too, in the same alternating repeats, as 'reference'")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), Path(args.child[2]))))
        return
    ks = list(range(args.min_workers, args.max_workers + 1))
    tmp = Path(tempfile.mkdtemp(prefix="bench_tok_"))
    try:
        convs = synth(args.conversations)
        data = tmp / "stage"
        data.mkdir()
        with open(data / "training.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(c, ensure_ascii=False) + "\n" for c in convs)
        (data / "validation.jsonl").write_text("")
        shutil.copy(data / "training.jsonl", tmp / "chat.jsonl")
        times: dict[str, list] = {}
        tokens = None
        for r in range(args.repeats):
            kinds = ("tokenizer", "stage") + (("reference",) if args.reference_src else ())
            order = [(kind, k) for k in ks for kind in kinds]
            for kind, k in (order if r % 2 == 0 else order[::-1]):
                res = run_child(kind, k, data, args.reference_src)
                assert tokens in (None, res["tokens"]), (tokens, res)  # both sides encode the same tokens
                tokens = res["tokens"]
                times.setdefault(f"{kind}{k}", []).append(res)
                print(f"repeat {r}: {kind}({k}) {res['total']:.2f} s", file=sys.stderr)
            cmd = [sys.executable, str(ROOT / "pipeline_data_prepare.py"), "prepare", "--dataset",
                   str(tmp / "chat.jsonl"), "--dataset-root", str(tmp / "prep"), "--seq-length", "4096",
                   "--val-fraction", "0", "--force", "--quiet", "--json"]
            t0 = time.perf_counter()
            env = dict(os.environ, HF_HUB_OFFLINE="1")
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            wall = time.perf_counter() - t0
            summary = json.loads(out.stdout)
            times.setdefault("prepare", []).append({"total": wall, "stages": summary["seconds_per_stage"]})
            print(f"repeat {r}: prepare {wall:.2f} s {summary['seconds_per_stage']}", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def med(key, field="total"):
        return statistics.median(x[field] for x in times[key])

    n = ks[-1]
    render = statistics.median(x["render"] for k in ks for x in times[f"tokenizer{k}"])
    print(f"{len(convs):,} conversations, {tokens:,} tokens, {args.repeats} alternating repeats (medians), "
          f"{len(os.sched_getaffinity(0))} usable CPUs\n")
    print("| k | tokenizer render (s) | tokenizer encode (s) | tokenizer render + encode (s) | stage, k workers (s) "
          "| stage speed vs tokenizer |")
    print("|---|---|---|---|---|---|")
    for k in ks:
        tt, ts = med(f"tokenizer{k}"), med(f"stage{k}")
        print(f"| {k} | {med(f'tokenizer{k}', 'render'):.2f} | {med(f'tokenizer{k}', 'encode'):.2f} | {tt:.2f} | "
              f"{ts:.2f} | {tt / ts:.0%} |")
    print("\nThe same tokenizer with its encoding that tracks no offsets (encode_batch_fast), same medians:\n")
    print("| k | tokenizer render + encode_batch_fast (s) | stage, k workers (s) | stage speed vs it |"
          + (" reference stage (s) | reference vs it | stage vs reference |" if args.reference_src else ""))
    print("|---|---|---|---|" + ("---|---|---|" if args.reference_src else ""))
    for k in ks:
        tf, ts = med(f"tokenizer{k}", "total_fast"), med(f"stage{k}")
        ref = ""
        if args.reference_src:
            tr = med(f"reference{k}")
            ref = f" {tr:.2f} | {tf / tr:.0%} | {tr / ts:.2f}x |"
        print(f"| {k} | {tf:.2f} | {ts:.2f} | {tf / ts:.0%} |{ref}")
    if args.repeats > 1:
        print(f"\nper repeat, k = {ks[-1]} (stage, then prepare, vs the tokenizer of the same repeat): " + ", ".join(
            f"{t['total'] / s['total']:.0%} / {t['total'] / p['total']:.0%}" for t, s, p in
            zip(times[f"tokenizer{ks[-1]}"], times[f"stage{ks[-1]}"], times["prepare"], strict=True)))
    if len(ks) < 2:
        s_tok = p_tok = s_stage = p_stage = float("nan")
    else:
        s_tok, p_tok = fit(ks, [med(f"tokenizer{k}") for k in ks])
        s_stage, p_stage = fit(ks, [med(f"stage{k}") for k in ks])
    print(f"\nfitted T(k) = serial + parallel/k: tokenizer serial {s_tok:.2f} s + parallel {p_tok:.2f} s; "
          f"stage serial {s_stage:.2f} s + parallel {p_stage:.2f} s; the tokenizer's rendering alone {render:.2f} s "
          f"-> stage serial / tokenizer rendering = {s_stage / render:.2f}")
    stages = {k: round(statistics.median(x["stages"].get(k, 0) for x in times["prepare"]), 2)
              for k in ("export", "tokenize", "pack")}
    print(f"\nprepare end to end ({n} workers, fresh process, export + tokenize + pack): {med('prepare'):.2f} s "
          f"(stages {stages}); tokenizer render + encode at {n} threads {med(f'tokenizer{n}'):.2f} s -> "
          f"prepare speed vs tokenizer = {med(f'tokenizer{n}') / med('prepare'):.0%}")


if __name__ == "__main__":
    main()
