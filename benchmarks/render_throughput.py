#!/usr/bin/env python3
"""Render-and-mask throughput of tinker_sft.py (conversations/second): before and after the batch renderer, side by side.

Run:
    .venv/bin/python benchmarks/render_throughput.py                        # 10,000 Qwen3 conversations
    .venv/bin/python benchmarks/render_throughput.py --model Qwen3-8B --n 4000 --train-on all-assistant --repeats 3

It builds (or reuses) the offline tokenizer folder of tests/assets/build_tokenizers.py, makes N
synthetic conversations (seeded: system prompt on half, 1-3 user/assistant turns, 5-80 words per
message), and times tinker_sft.render_all over all of them (the work the SFT script does before its
first step) four ways, interleaved (ABAB) over --repeats rounds so machine load hits all alike:
    before, 1 process   render_all(fast=False): render_example per conversation (Jinja twice, tokenizer twice)
    after, 1 process    render_all(): BatchRenderer (template once per conversation shape, batched tokenizer)
    before, pool        the same over a process pool of every core (what the script did before)
    after, pool         the same over a process pool of every core (what the script does now)
The per-datum checks stay on in every mode, and every datum of "after" is compared with "before"
(exit 1 if one differs), so a fast wrong renderer cannot post a number. Prints a table on stderr
(median and min-max per mode, the after/before ratios) and one JSON object on stdout.

Measured 2026-12-04, Qwen3, 10,000 conversations, 3 rounds, 2 cores shared with other jobs;
conversations/s median (min-max):
  15:28-15:30 UTC, load 2.9-3.8: before 695 (660-907), after 2,189 (2,047-2,226) in 1 process: 3.15x;
      before 549 (549-678), after 1,527 (1,479-1,617) in the pool: 2.78x
  15:32-15:37 UTC, load 2.7-7.7: before 332 (285-884), after 946 (879-1,671) in 1 process: 2.85x;
      before 214 (207-253), after 728 (585-815) in the pool: 3.41x; CPU per conversation (this
      process + workers) before 1.54 ms, after 0.49 ms in 1 process; 2.03 / 0.66 ms in the pool
The rate is the free CPU divided by ~0.45-0.5 ms. The goal of >= 2,000/s was met in one process
when about one core was free. The pool needs a second free core: it ran 3,755/s (CPU/wall 1.92) on
two free cores, but only ~1 core was free during these runs, so the pool had no spare core and its
overhead made it slower than one process.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the pool supplies the cores
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


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the pool's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen3-8B", help="offline tokenizer folder name (build_tokenizers.NAMES)")
    p.add_argument("--n", type=int, default=10_000, help="number of synthetic conversations")
    p.add_argument("--train-on", default="last-assistant", choices=("last-assistant", "all-assistant"))
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the four modes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import tinker_sft
    from assets import build_tokenizers

    t0 = time.perf_counter()
    folder = build_tokenizers.build(args.model)
    tok = tinker_sft.load_tokenizer(str(folder))
    fmt = tinker_sft.chat_format(tok, name=args.model)
    setup_s = time.perf_counter() - t0

    rng = random.Random(args.seed)
    examples = [tinker_sft.validate_example(conversation(rng), i + 1) for i in range(args.n)]
    cores = os.cpu_count() or 1
    modes = {"before_1_process": (False, 1), "after_1_process": (True, 1),
             "before_pool": (False, cores), "after_pool": (True, cores)}
    rates = {m: [] for m in modes}
    cpu_ms = {m: [] for m in modes}  # CPU time per conversation (this process + pool workers): load-independent
    outputs = {}
    load_before = os.getloadavg()
    for r in range(args.repeats):
        for mode, (fast, workers) in modes.items():
            c0, t0 = cpu_seconds(), time.perf_counter()
            out = tinker_sft.render_all(examples, tok, fmt, args.train_on, workers=workers, fast=fast)
            rates[mode].append(args.n / (time.perf_counter() - t0))
            cpu_ms[mode].append(1000 * (cpu_seconds() - c0) / args.n)
            outputs.setdefault(fast, out)
            print(f"round {r + 1}/{args.repeats} {mode:<17} {rates[mode][-1]:>8.0f} conversations/s, "
                  f"{cpu_ms[mode][-1]:.2f} CPU ms each (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    if outputs[True] != outputs[False]:
        bad = next(i for i, (a, b) in enumerate(zip(outputs[True], outputs[False])) if a != b)
        print(f"render_throughput: the batch renderer differs from render_example at datum {bad}", file=sys.stderr)
        return 1

    datums = [r for _, r in outputs[True]]
    stops = set(fmt["stop"])
    assert all(r.tokens[-1] in stops and r.weights[-1] == 1.0 and r.weights[0] == 0.0 for r in datums)
    med = {m: statistics.median(v) for m, v in rates.items()}
    result = {
        "model": args.model, "train_on": args.train_on, "conversations": args.n, "datums": len(datums),
        "tokens": sum(len(r.tokens) for r in datums), "trained_tokens": int(sum(sum(r.weights) for r in datums)),
        "conversations_per_s": {m: {"median": round(med[m]), "min": round(min(v)), "max": round(max(v)),
                                    "runs": [round(x) for x in v]} for m, v in rates.items()},
        "cpu_ms_per_conversation": {m: round(statistics.median(v), 3) for m, v in cpu_ms.items()},
        "ratio_after_over_before": {"1_process": round(med["after_1_process"] / med["before_1_process"], 2),
                                    "pool": round(med["after_pool"] / med["before_pool"], 2)},
        "identical_datums": True, "goal": ">= 2000 conversations/s on this 2-core machine", "repeats": args.repeats,
        "setup_seconds": round(setup_s, 2), "cores": cores,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(f"\n{'mode':<18} {'median':>8} {'min-max':>14} {'CPU ms':>7}   conversations/s, {args.n} x {args.model}, "
          f"{args.train_on}, {args.repeats} interleaved rounds", file=sys.stderr)
    for m, v in rates.items():
        print(f"{m:<18} {med[m]:>8.0f} {min(v):>6.0f}-{max(v):<7.0f} {statistics.median(cpu_ms[m]):>7.2f}",
              file=sys.stderr)
    print(f"after / before: {result['ratio_after_over_before']['1_process']:.2f}x in 1 process, "
          f"{result['ratio_after_over_before']['pool']:.2f}x in the pool of {cores}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
