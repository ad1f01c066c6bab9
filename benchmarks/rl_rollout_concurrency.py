#!/usr/bin/env python3
"""Rollout wall time of tinker_rl.py: every group in flight at once vs one group after another.

Run (against the local backend, or real Tinker with TINKER_API_KEY set):
    python scripts/tinker_local.py run -- python benchmarks/rl_rollout_concurrency.py
    python benchmarks/rl_rollout_concurrency.py --batch-size 8 --group-size 4 --max-tokens 16 --repeats 3

It uses the script's own rollout code (tinker_rl.rollout_batch with concurrent=True/False) on the
single-turn example tasks, one sampling client, the same seeds for both modes. Both modes are
warmed up first (--warmup runs each: the local backend compiles once per batch shape, and timing a
first call measures the compiler), then each mode runs --repeats times, alternating; medians. Prints a side-by-side table on
stderr and one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import tinker_rl  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-name", default="Qwen/Qwen3-8B")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--env", choices=("single", "calculator"), default="single")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=4, help="untimed runs of each mode first (JIT shapes)")
    args = p.parse_args(argv)

    import tinker

    rl_args = tinker_rl.parse_args(["--env", args.env, "--model-name", args.model_name, "--max-tokens",
                                    str(args.max_tokens), "--max-turns", str(args.max_turns)]
                                   + (["--tokenizer", args.tokenizer] if args.tokenizer else []))
    tinker_rl.validate_args(rl_args)
    env, tasks, tokenizer, fmt, rendered = tinker_rl.prepare(rl_args)
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=args.model_name, rank=8).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    ro = tinker_rl.Rollout(tokenizer, fmt, env, tasks, rendered, args.max_tokens, 1.0, args.max_turns,
                           "continue", None)
    task_indices = tinker_rl.batch_tasks(0, len(tasks), args.batch_size, 0)
    seeds = [tinker_rl.group_seed(0, 0, slot) for slot in range(len(task_indices))]

    def timed(concurrent):
        t0 = time.perf_counter()
        groups = asyncio.run(tinker_rl.rollout_batch(sampler, ro, task_indices, seeds, args.group_size, concurrent))
        seconds = time.perf_counter() - t0
        tokens = sum(len(t.action) for g in groups for e in g.episodes for t in e.turns)
        return seconds, tokens

    # The local backend batches whatever requests are queued together, so the in-flight mode meets
    # several new batch shapes and compiles each once: warm until those are all seen.
    warm = {"concurrent": [], "sequential": []}
    for i in range(args.warmup):
        for mode in ("concurrent", "sequential"):
            warm[mode].append(timed(mode == "concurrent")[0])
        print(f"warm-up {i + 1}/{args.warmup}: in flight {warm['concurrent'][-1]:.2f} s, "
              f"sequential {warm['sequential'][-1]:.2f} s", file=sys.stderr)
    runs = {"concurrent": [], "sequential": []}
    tokens = {}
    for _ in range(args.repeats):
        for mode in ("concurrent", "sequential"):
            seconds, tokens[mode] = timed(mode == "concurrent")
            runs[mode].append(seconds)
    med = {mode: statistics.median(v) for mode, v in runs.items()}
    ratio = med["sequential"] / med["concurrent"]
    print(f"\nrollout of {args.batch_size} groups x {args.group_size} samples, max {args.max_tokens} tokens, "
          f"--env {args.env} ({args.repeats} runs each, median)", file=sys.stderr)
    print(f"{'mode':<28}{'median s':>10}{'runs':>26}{'tokens':>8}", file=sys.stderr)
    for mode, label in (("concurrent", "all groups in flight"), ("sequential", "one group after another")):
        print(f"{label:<28}{med[mode]:>10.2f}{' '.join(f'{x:.2f}' for x in runs[mode]):>26}{tokens[mode]:>8}",
              file=sys.stderr)
    print(f"sequential / in flight = {ratio:.2f}x", file=sys.stderr)
    print(json.dumps({"batch_size": args.batch_size, "group_size": args.group_size, "max_tokens": args.max_tokens,
                      "env": args.env, "warmup_seconds": warm, "seconds": runs, "median": med,
                      "ratio_sequential_over_concurrent": ratio}))
    service.close("success").result()
    return 0


if __name__ == "__main__":
    sys.exit(main())
