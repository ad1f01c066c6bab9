#!/usr/bin/env python3
"""Rollout wall time of tinker_rl.py with a slow environment: env calls overlapped vs synchronous.

Run (offline; the sampler is a stand-in that answers after --sample-ms, so only the environment differs):
    python benchmarks/rl_env_overlap.py --tokenizer PATH/TO/Qwen3-tokenizer
    python benchmarks/rl_env_overlap.py --tokenizer PATH --env-ms 200 --repeats 3 --env-workers 16

What it measures: 8 groups x 4 samples x 3 turns of the calculator example's episode shape, whose
env_step sleeps --env-ms (a sandbox, a search call, a judge: 0.2-5 s in real agent RL) and asks for
another turn until the third. Two modes, the same tinker_rl.Rollouts code:
    overlapped:  plain env_step in the --env-workers thread pool (the default)
    synchronous: --env-workers 0, env_step called on the event loop one at a time (the old behaviour)
Runs alternate A B A B (--repeats each) after one untimed warm-up of each; prints a table with the
median and spread (min-max) on stderr and one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import tinker_rl  # noqa: E402


class StandInSampler:
    """Answers every sample request after sample_ms with a short text and the end-of-turn token."""

    def __init__(self, tokens, sample_ms):
        self.tokens, self.delay = tokens, sample_ms / 1000

    async def sample(self, prompt, num_samples, sampling_params):
        await asyncio.sleep(self.delay)
        return SimpleNamespace(sequences=[SimpleNamespace(tokens=list(self.tokens), logprobs=[-0.5] * len(self.tokens),
                                                          stop_reason="stop") for _ in range(num_samples)])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="a Qwen3 tokenizer folder (tests' offline_tokenizer)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--env-ms", type=float, default=200.0)
    p.add_argument("--sample-ms", type=float, default=20.0)
    p.add_argument("--env-workers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    def env_step(task, conversation, model_turn, rng):
        time.sleep(args.env_ms / 1000)  # blocking, as real environment code usually is
        turn = sum(m["role"] == "assistant" for m in conversation) + 1
        if turn >= args.turns:
            return None, float(rng.random()), True
        return {"role": "tool", "content": "42"}, 0.0, False

    tokenizer = tinker_rl.load_tokenizer(args.tokenizer)
    fmt = tinker_rl.chat_format(tokenizer, name=args.tokenizer)
    env = dict(tinker_rl.load_env("calculator"), env_step=env_step, tools=None)
    tasks = env["tasks"][: args.groups]
    prompts = [tinker_rl.generation_prompt(env["render_prompt"](t), tokenizer, fmt) for t in tasks]
    job = tinker_rl.Job(env, tasks, tokenizer, fmt, prompts, None, "benchmark")
    sampler = StandInSampler(tokenizer.encode("The answer is 42.") + fmt["stop"][:1], args.sample_ms)

    def timed(workers):
        settings = tinker_rl.parse_args(["--rehearse", "off", "--group-size", str(args.group_size), "--max-turns",
                                         str(args.turns), "--max-tokens", "16", "--env-workers", str(workers)])
        ro = tinker_rl.Rollouts(job, settings, None)
        with ro.pools():
            t0 = time.perf_counter()
            groups = asyncio.run(ro.batch(sampler, list(range(len(tasks))), list(range(len(tasks)))))
            seconds = time.perf_counter() - t0
        turns = [len(e.turns) for g in groups for e in g.episodes]
        assert turns == [args.turns] * (args.groups * args.group_size), turns
        return seconds

    modes = {"overlapped": args.env_workers, "synchronous": 0}
    for workers in modes.values():
        timed(workers)  # warm-up: thread start, tokenizer caches
    runs = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode, workers in modes.items():
            runs[mode].append(timed(workers))
    med = {mode: statistics.median(v) for mode, v in runs.items()}
    ratio = med["synchronous"] / med["overlapped"]
    calls = args.groups * args.group_size * args.turns
    print(f"\n{args.groups} groups x {args.group_size} samples x {args.turns} turns, env_step {args.env_ms:g} ms "
          f"({calls} calls), sample {args.sample_ms:g} ms, {args.repeats} runs each ABAB", file=sys.stderr)
    print(f"{'mode':<34}{'median s':>10}{'min-max s':>16}", file=sys.stderr)
    for mode, label in (("overlapped", f"overlapped (--env-workers {args.env_workers})"),
                        ("synchronous", "synchronous (--env-workers 0)")):
        print(f"{label:<34}{med[mode]:>10.2f}{min(runs[mode]):>8.2f}-{max(runs[mode]):.2f}", file=sys.stderr)
    print(f"synchronous / overlapped = {ratio:.1f}x (goal >= 4x)", file=sys.stderr)
    print(json.dumps({"groups": args.groups, "group_size": args.group_size, "turns": args.turns, "env_ms": args.env_ms,
                      "sample_ms": args.sample_ms, "env_workers": args.env_workers, "repeats": args.repeats,
                      "seconds": runs, "median": med,
                      "spread": {m: [min(v), max(v)] for m, v in runs.items()},
                      "ratio_synchronous_over_overlapped": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
