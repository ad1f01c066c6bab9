#!/usr/bin/env python3
"""A script run as the tests start it: a fresh interpreter against a fork of a warm one (tests/forked_scripts.py).

Run:
    .venv/bin/python benchmarks/forked_script_runs.py                 # starts a local backend of its own
    .venv/bin/python benchmarks/forked_script_runs.py --repeats 8

What it measures: the same command, `tinker_sft.py` for 2 steps on templates/sft_example.jsonl (batch 4, rank 8,
one probe of 4 tokens, a checkpoint every step: the settings of tests/test_faults_e2e.py), started two ways
through subprocess.run's contract:
    real    subprocess.run([sys.executable, "scripts/tinker_sft.py", ...])  (what a user types)
    forked  tests/forked_scripts.run(...): forked from a zygote that imported the SDK, torch and transformers
interleaved (real, forked, real, forked, ...) so a change in machine load hits both. Each run's wall time and
its process's CPU (user + sys of the child, from wait4's rusage; for a forked run, of the forked child) are
reported as median and min-max; ratios are real / forked of the medians. Every run must exit 0 and both ways
must write the same metrics (loss of each step).

Outputs: a table on stderr and one JSON object on stdout. Exit codes: 0 ok, 1 failure.
Requires: the local backend set up (python scripts/tinker_local.py setup).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import forked_scripts  # noqa: E402
import tinker_local  # noqa: E402


def sft_argv(tokenizer: Path, log: Path) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "tinker_sft.py"), "--data", str(ROOT / "templates" / "sft_example.jsonl"),
            "--batch-size", "4", "--max-steps", "2", "--num-probes", "1", "--max-tokens", "4", "--test-fraction", "0",
            "--render-cache", "off", "--tokenizer", str(tokenizer), "--model-name", tinker_local.DEFAULT_MODEL,
            "--lora-rank", "8", "--learning-rate", "1e-2", "--save-every", "1", "--log-path", str(log)]


def child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_real(argv, env) -> tuple[float, float]:
    cpu, started = child_cpu(), time.perf_counter()
    done = forked_scripts.ORIGINAL_RUN(argv, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"real run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return wall, child_cpu() - cpu


def timed_forked(argv, env) -> tuple[float, float]:
    # the child's own CPU: it reports its rusage at exit through a file (the zygote, not us, reaps it)
    with tempfile.NamedTemporaryFile(suffix=".cpu") as f:
        code = (f"import atexit, resource, runpy, sys\n"
                f"def _cpu():\n    u = resource.getrusage(resource.RUSAGE_SELF)\n"
                f"    open({f.name!r}, 'w').write(str(u.ru_utime + u.ru_stime))\n"
                f"atexit.register(_cpu)\nsys.argv = sys.argv[1:]\n"
                f"import os\nsys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))\n"
                f"_exit = os._exit\nos._exit = lambda c: (_cpu(), _exit(c))\n"
                f"runpy.run_path(sys.argv[0], run_name='__main__')\n")
        started = time.perf_counter()
        done = forked_scripts.run([sys.executable, "-c", code, *argv[1:]], start_zygote=True, env=env,
                                  capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - started
        if done.returncode != 0 or not getattr(done, "forked", False):
            raise SystemExit(f"forked run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        return wall, float(Path(f.name).read_text())


def losses(log: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (log / "metrics.jsonl").read_text().splitlines()]


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=6, help="runs each way, interleaved")
    args = parser.parse_args(argv)
    venv, home = tinker_local.resolve_venv(), tinker_local.resolve_home()
    server = tinker_local.start_server(tinker_local.DEFAULT_MODEL, venv=venv, home=home)
    print(f"local server ready in {server.ready_seconds:.1f} s", file=sys.stderr)
    env = {**os.environ, **server.env}
    tokenizer = tinker_local.tiny_model_dir(home)
    times = {"real": [], "forked": []}
    cpus = {"real": [], "forked": []}
    seen = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            timed_real(sft_argv(tokenizer, Path(tmp) / "warm"), env)  # compiles the shapes once
            for i in range(args.repeats):
                for way, run in (("real", timed_real), ("forked", timed_forked)):
                    log = Path(tmp) / f"{way}-{i}"
                    wall, cpu = run(sft_argv(tokenizer, log), env)
                    times[way].append(wall)
                    cpus[way].append(cpu)
                    seen.setdefault(way, losses(log))
                    print(f"{way:7s} run {i + 1}: {wall:.2f} s wall, {cpu:.2f} s CPU", file=sys.stderr)
    finally:
        server.stop()
        forked_scripts.close_all()
    if seen["real"] != seen["forked"]:
        print(f"the two ways trained differently: {seen}", file=sys.stderr)
        return 1
    result = {"repeats": args.repeats, "load_average": os.getloadavg(),
              "wall_s": {k: summary(v) for k, v in times.items()}, "cpu_s": {k: summary(v) for k, v in cpus.items()},
              "wall_ratio": round(statistics.median(times["real"]) / statistics.median(times["forked"]), 2),
              "cpu_ratio": round(statistics.median(cpus["real"]) / statistics.median(cpus["forked"]), 2),
              "losses": seen["real"]}
    print(f"{'':8s}{'wall median (min-max)':>26s}{'CPU median (min-max)':>26s}", file=sys.stderr)
    for way in ("real", "forked"):
        w, c = result["wall_s"][way], result["cpu_s"][way]
        print(f"{way:8s}{w['median']:>10.2f} s ({w['min']:.2f}-{w['max']:.2f}){c['median']:>10.2f} s "
              f"({c['min']:.2f}-{c['max']:.2f})", file=sys.stderr)
    print(f"real / forked: wall {result['wall_ratio']}x, CPU {result['cpu_ratio']}x", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
