#!/usr/bin/env python3
"""Tool time per RL iteration at --env-workers 16 (the old default) vs the new default (the episodes in flight).

Run (offline; the sampler is a stand-in that answers after --sample-ms, so only the environment differs):
    python benchmarks/rl_env_workers.py --tokenizer PATH/TO/Qwen3-tokenizer
    python benchmarks/rl_env_workers.py --tokenizer PATH --batch-size 16 --group-size 8 --turns 3 --env-ms 300

What it measures: one iteration of --batch-size groups x --group-size samples x --turns turns through the
same tinker_rl.Rollouts code, whose plain-function env_step sleeps --env-ms (a tool: a sandbox, a lookup, a
judge) and asks for another turn until the last. Three settings, alternated A B C after one untimed warm-up:
    no tool:      env_step 0 ms, default workers (the baseline: sampling and tokenizer work only)
    old default:  --env-workers 16
    new default:  --env-workers unset (= batch x group, at most tinker_rl.MAX_ENV_WORKERS)
Tool time per iteration = the setting's wall time - the no-tool wall time. Prints a table (median, min-max)
and the load average on stderr, one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tinker_rl  # noqa: E402
from rl_env_overlap import StandInSampler  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="a Qwen3 tokenizer folder (tests' offline_tokenizer)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--env-ms", type=float, default=300.0)
    p.add_argument("--sample-ms", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    def env_step_after(ms):
        def env_step(task, conversation, model_turn, rng):
            time.sleep(ms / 1000)  # blocking, as real tool code usually is
            turn = sum(m["role"] == "assistant" for m in conversation) + 1
            if turn >= args.turns:
                return None, float(rng.random()), True
            return {"role": "tool", "content": "42"}, 0.0, False
        return env_step

    tokenizer = tinker_rl.load_tokenizer(args.tokenizer)
    fmt = tinker_rl.chat_format(tokenizer, name=args.tokenizer)
    base = dict(tinker_rl.load_env("calculator"), tools=None)
    tasks = base["tasks"][: args.batch_size]
    prompts = [tinker_rl.generation_prompt(base["render_prompt"](t), tokenizer, fmt) for t in tasks]
    sampler = StandInSampler(tokenizer.encode("The answer is 42.") + fmt["stop"][:1], args.sample_ms)
    settings = {"no tool": (0.0, None), "old default (--env-workers 16)": (args.env_ms, 16),
                "new default (--env-workers unset)": (args.env_ms, None)}

    def timed(env_ms, workers):
        flags = ["--rehearse", "off", "--batch-size", str(args.batch_size), "--group-size", str(args.group_size),
                 "--max-turns", str(args.turns), "--max-tokens", "16"]
        cli = tinker_rl.parse_args(flags + ([] if workers is None else ["--env-workers", str(workers)]))
        job = tinker_rl.Job(dict(base, env_step=env_step_after(env_ms)), tasks, tokenizer, fmt, prompts, None, "bench")
        ro = tinker_rl.Rollouts(job, cli, None)
        with ro.pools():
            t0 = time.perf_counter()
            groups = asyncio.run(ro.batch(sampler, list(range(len(tasks))), list(range(len(tasks)))))
            seconds = time.perf_counter() - t0
        turns = [len(e.turns) for g in groups for e in g.episodes]
        assert turns == [args.turns] * (args.batch_size * args.group_size), turns
        return seconds, tinker_rl.env_workers(cli)

    for env_ms, workers in settings.values():
        timed(env_ms, workers)  # warm-up: threads, tokenizer caches
    runs, workers_used = {name: [] for name in settings}, {}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for name, (env_ms, workers) in settings.items():
            seconds, workers_used[name] = timed(env_ms, workers)
            runs[name].append(seconds)
    load.append(os.getloadavg()[0])
    med = {name: statistics.median(v) for name, v in runs.items()}
    tool = {name: med[name] - med["no tool"] for name in settings if name != "no tool"}
    old, new = tool["old default (--env-workers 16)"], tool["new default (--env-workers unset)"]
    episodes = args.batch_size * args.group_size
    print(f"\none iteration: {args.batch_size} groups x {args.group_size} samples x {args.turns} turns "
          f"({episodes} episodes, {episodes * args.turns} env_step calls of {args.env_ms:g} ms), sample "
          f"{args.sample_ms:g} ms, {args.repeats} runs each ABC; load average {load[0]:.2f} -> {load[1]:.2f}",
          file=sys.stderr)
    print(f"{'setting':<38}{'workers':>8}{'median s':>10}{'min-max s':>14}{'tool s':>9}", file=sys.stderr)
    for name in settings:
        print(f"{name:<38}{workers_used[name]:>8}{med[name]:>10.2f}{min(runs[name]):>7.2f}-{max(runs[name]):<6.2f}"
              f"{tool.get(name, 0.0):>9.2f}", file=sys.stderr)
    print(f"tool time per iteration: old default / new default = {old / max(new, 1e-9):.1f}x", file=sys.stderr)
    print(json.dumps({"batch_size": args.batch_size, "group_size": args.group_size, "turns": args.turns,
                      "env_ms": args.env_ms, "sample_ms": args.sample_ms, "repeats": args.repeats,
                      "workers": workers_used, "seconds": runs, "median": med, "tool_seconds": tool,
                      "ratio_old_over_new": old / max(new, 1e-9), "loadavg_1min": load}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
