"""Tokenization throughput of the data pipeline's tokenize stage vs the tokenizer's raw batch encoder.

    python bench/bench_tokenize.py [--copies 10] [--repeats 3]

Both sides see the same conversations: the chatterbot corpus, each conversation repeated with a varied user
turn (--copies times). "raw" is the fast tokenizer's batch encode of the already-rendered chat texts (no
template rendering, no offsets, no masks); "prepare" is pipeline.data.chat.tokenize_conversations, what the
tokenize stage runs per chunk: chat-template rendering, batch encoding with offsets, assistant-only masks.
Two raw references: transformers' batch call ``tokenizer(texts)`` and the Rust backend's ``encode_batch``
(no Python list conversion). The last row is the whole tokenize stage of ``prepare`` (JSONL read, chunks,
Parquet write). Runs alternate so machine noise hits every path; ratios of medians are reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pipeline.data.chat import load_tokenizer, tokenize_conversations  # noqa: E402
from pipeline.data.prepare import PrepareOptions, Timer, stage_tokenize  # noqa: E402
from pipeline.data.sources import load_conversations  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--copies", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    tok = load_tokenizer("smollm2-135m")
    base, _ = load_conversations("chatterbot-corpus")
    convs = [{"messages": [dict(m, content=f"{m['content']} ({k})" if m["role"] == "user" else m["content"])
                           for m in c["messages"]]} for k in range(args.copies) for c in base]
    texts = [tok.apply_chat_template(c["messages"], tokenize=False) for c in convs]
    n_tokens = sum(len(x) for x in tok(texts, add_special_tokens=False)["input_ids"])
    tmp = Path(tempfile.mkdtemp(prefix="bench_tok_"))
    with open(tmp / "training.jsonl", "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in convs)
    (tmp / "validation.jsonl").write_text(json.dumps(convs[0]) + "\n")
    times: dict[str, list[float]] = {k: [] for k in ("hf", "rust", "convs", "stage")}
    for r in range(args.repeats):
        t = time.perf_counter()
        tok(texts, add_special_tokens=False, return_attention_mask=False)
        times["hf"].append(time.perf_counter() - t)
        t = time.perf_counter()
        tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        times["rust"].append(time.perf_counter() - t)
        t = time.perf_counter()
        ids, _, _ = tokenize_conversations(tok, convs)
        times["convs"].append(time.perf_counter() - t)
        assert sum(len(x) for x in ids) == n_tokens
        opts = PrepareOptions(dataset="-", dataset_root=tmp, seq_length=4096, force=True, quiet=True)
        t = time.perf_counter()
        stage_tokenize(opts, f"bench{r}", Timer(), tokenizer=tok)
        times["stage"].append(time.perf_counter() - t)
    shutil.rmtree(tmp)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{len(convs):,} conversations, {n_tokens:,} tokens, {args.repeats} alternating repeats (median)\n")
    print("| path | seconds | tokens/s | vs tokenizer(texts) | vs Rust encode_batch |")
    print("|---|---|---|---|---|")
    rows = [("raw: tokenizer(texts), rendered text", "hf"), ("raw: backend encode_batch, rendered text", "rust"),
            ("tokenize_conversations (template + masks)", "convs"),
            ("prepare tokenize stage (+ JSONL read, Parquet write)", "stage")]
    for label, k in rows:
        print(f"| {label} | {med[k]:.2f} | {n_tokens / med[k]:,.0f} | {med['hf'] / med[k]:.0%} | "
              f"{med['rust'] / med[k]:.0%} |")


if __name__ == "__main__":
    main()
