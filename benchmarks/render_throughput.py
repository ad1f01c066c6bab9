#!/usr/bin/env python3
"""Render-and-mask throughput of tinker_sft.py's chat renderer on one core (conversations/second).

Run:
    python benchmarks/render_throughput.py                          # 10,000 Qwen3 conversations
    python benchmarks/render_throughput.py --model Qwen3-8B --n 2000 --train-on all-assistant

It builds (or reuses) the offline tokenizer folder of tests/assets/build_tokenizers.py, makes N
synthetic conversations (seeded: system prompt on half, 1-3 user/assistant turns, 5-80 words per
message), pins the process to one CPU and the tokenizer to one thread, and times
tinker_sft.render_example over all of them (the work the SFT script does before its first step).
Each rendered datum is checked (weights only on the assistant turns, last token a stop token), so
a fast wrong renderer cannot post a number. Prints a table on stderr and one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core: no Rust thread pool
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]

WORDS = ("the model learns to answer with short exact sentences about numbers cities weather code "
         "and lists while the prompt stays masked so only assistant tokens carry loss 42 3.14 "
         "Paris Tokyo function returns value because however therefore").split()


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": sentence(rng, 5, 20)})
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": sentence(rng, 5, 60)})
        messages.append({"role": "assistant", "content": sentence(rng, 5, 80)})
    return {"messages": messages}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen3-8B", help="offline tokenizer folder name (build_tokenizers.NAMES)")
    p.add_argument("--n", type=int, default=10_000, help="number of synthetic conversations")
    p.add_argument("--train-on", default="last-assistant", choices=("last-assistant", "all-assistant"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import tinker_sft
    from assets import build_tokenizers

    t0 = time.perf_counter()
    folder = build_tokenizers.build(args.model)
    tok = tinker_sft.load_tokenizer(str(folder))
    fmt = tinker_sft.chat_format(tok, name=args.model)
    setup_s = time.perf_counter() - t0

    rng = random.Random(args.seed)
    examples = [conversation(rng) for _ in range(args.n)]
    t0 = time.perf_counter()
    rendered = [tinker_sft.render_example(ex, tok, fmt, train_on=args.train_on) for ex in examples]
    render_s = time.perf_counter() - t0

    datums = [r for rs in rendered for r in rs]
    stops = set(fmt["stop"])
    assert all(r.tokens[-1] in stops and r.weights[-1] == 1.0 and r.weights[0] == 0.0 for r in datums)
    tokens = sum(len(r.tokens) for r in datums)
    trained = int(sum(sum(r.weights) for r in datums))
    result = {
        "model": args.model, "train_on": args.train_on, "conversations": args.n, "datums": len(datums),
        "tokens": tokens, "trained_tokens": trained, "seconds": round(render_s, 2),
        "conversations_per_s": round(args.n / render_s, 1), "tokens_per_s": round(tokens / render_s),
        "setup_seconds": round(setup_s, 2), "cpus": 1,
    }
    print(f"{'model':<10} {'train_on':<15} {'convs':>6} {'datums':>7} {'tokens':>9} {'s':>7} {'conv/s':>8}",
          file=sys.stderr)
    print(f"{args.model:<10} {args.train_on:<15} {args.n:>6} {len(datums):>7} {tokens:>9} "
          f"{render_s:>7.2f} {args.n / render_s:>8.1f}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
