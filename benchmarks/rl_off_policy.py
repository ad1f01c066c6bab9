#!/usr/bin/env python3
"""Iterations per second of tinker_rl.py off-policy (--max-staleness 1) vs on-policy (0) on the local backend,
and the reward curve of each on the learnable rehearsal task.

**Run:**
    .venv/bin/python benchmarks/rl_off_policy.py                       # 3 ABAB pairs of 8 iterations
    .venv/bin/python benchmarks/rl_off_policy.py --pairs 5 --iterations 10 --base-url http://127.0.0.1:PORT
    .venv/bin/python benchmarks/rl_off_policy.py --simulated    # a fake service that samples while it trains

**What it does:** after --warmup untimed runs of each mode, runs `scripts/tinker_rl.py` as a user would (the rehearsal task and settings that
--rehearse picks on the local backend, --save-every 0), alternating on-policy and off-policy runs
(A B A B ...) against one server, so drift in machine load hits both modes alike. A run's rate is its
steady state: (iterations - 1) / the seconds between its first and last progress line (iteration 0 is
on-policy in both modes, and process start, tokenizer and client creation are left out).

Why --simulated: on a 2-core machine the local backend is CPU-bound. Its engine samples beside
training (tinker_local_server.py, shim sampling_waits_for_training), but sampling and training each
keep ~1.6 of the 2 cores busy, so the overlap is capped by the CPU: the benchmark measures the CPU
seconds per iteration of the client and the server it started and prints `cpu_ceiling`, the most any
overlap of the same work could gain there (cpus / cores busy on-policy). Hosted Tinker samples and
trains on separate workers. --simulated runs the same script in-process against a fake service whose
sample call takes --sample-seconds and whose forward_backward takes --train-seconds, independently:
what the loop gains where the service can overlap.

**Outputs:** progress on stderr; one JSON object on stdout: the settings, per mode the rates of every
run, their median and spread (min..max), CPU seconds per iteration and cores busy (server runs only),
the ratio of medians, the CPU ceiling, the reward per iteration of every run and
the mean of the last 3 iterations; the machine's load average before and after.

**Requires:** the local backend set up (`python scripts/tinker_local.py setup`). Starts its own server
unless --base-url is given (stopped at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import tinker_local  # noqa: E402

SCRIPT = ROOT / "scripts" / "tinker_rl.py"
MODES = {"on_policy": 0, "off_policy": 1}


def say(message: str) -> None:
    print(f"rl_off_policy: {message}", file=sys.stderr, flush=True)


def process_tree_cpu(roots: set[int]) -> float:
    """CPU seconds (user + system) used so far by the live processes in the trees under `roots`
    (each process's own threads included; children that already exited are not counted)."""
    stats, parent = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(d.name)] = int(fields[1])
            stats[int(d.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid, cpu in stats.items():
        p, seen = pid, 0
        while p and p not in roots and seen < 64:
            p, seen = parent.get(p, 0), seen + 1
        total += cpu if p in roots else 0.0
    return total


def one_run(staleness: int, iterations: int, log: Path, env: dict, server_pids: set[int]) -> dict:
    """Run tinker_rl.py once; time each progress line as it arrives, and the CPU seconds the client and
    the server (when we started it) used by then."""
    cmd = [sys.executable, str(SCRIPT), "--iterations", str(iterations), "--max-staleness", str(staleness),
           "--save-every", "0", "--trace-every", "0", "--log-path", str(log)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stamps, cpu, tail = [], [], []
    for line in proc.stderr:
        if line.startswith("iter "):
            stamps.append(time.monotonic())
            cpu.append(process_tree_cpu(server_pids | {proc.pid}) if server_pids else None)
        tail = (tail + [line.rstrip()])[-5:]
    proc.wait()
    if proc.returncode != 0 or len(stamps) != iterations:
        raise SystemExit(f"tinker_rl.py --max-staleness {staleness} failed ({proc.returncode}): " + " | ".join(tail))
    metrics = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines() if x.strip()]
    seconds_per_iteration = (stamps[-1] - stamps[0]) / (iterations - 1)
    cpu_per_iteration = (cpu[-1] - cpu[0]) / (iterations - 1) if server_pids else None
    return {"iterations_per_s": 1 / seconds_per_iteration,
            "cpu_seconds_per_iteration": round(cpu_per_iteration, 3) if cpu_per_iteration else None,
            "cores_busy": round(cpu_per_iteration / seconds_per_iteration, 3) if cpu_per_iteration else None,
            "reward": [round(m["reward_mean"], 4) for m in metrics],
            "staleness": [m["staleness_max"] for m in metrics],
            "seconds": {k: round(sum(m[f"seconds_{k}"] for m in metrics), 2)
                        for k in ("sampler_weights", "sampling", "training")}}


class Ready:
    def __init__(self, value, seconds=0.0):
        self.value, self.seconds = value, seconds

    def result(self, timeout=None):
        time.sleep(self.seconds)
        return self.value


class SlowSampler:
    def __init__(self, seconds, eot):
        self.seconds, self.eot = seconds, eot

    async def sample(self, prompt, num_samples, sampling_params):
        import asyncio
        from types import SimpleNamespace

        await asyncio.sleep(self.seconds)
        seqs = [[1040] * (1 + (sampling_params.seed + i) % 3) + [self.eot] for i in range(num_samples)]
        return SimpleNamespace(sequences=[SimpleNamespace(tokens=t, logprobs=[-0.5] * len(t), stop_reason="stop")
                                          for t in seqs])


class SlowTraining:
    def __init__(self, sample_s, train_s, eot):
        self.sample_s, self.train_s, self.eot = sample_s, train_s, eot

    def save_weights_and_get_sampling_client(self):
        return Ready(SlowSampler(self.sample_s, self.eot))

    def forward_backward(self, datums, loss_fn, loss_fn_config):
        from types import SimpleNamespace

        outputs = [{"logprobs": d.loss_fn_inputs["logprobs"].tolist()} for d in datums]
        return Ready(SimpleNamespace(metrics={"loss:sum": 0.0}, loss_fn_outputs=outputs), self.train_s)

    def optim_step(self, params):
        return Ready(None)

    def save_state(self, name, ttl_seconds=None):
        from types import SimpleNamespace
        return Ready(SimpleNamespace(path=f"tinker://simulated/weights/{name}"))

    def save_weights_for_sampler(self, name):
        from types import SimpleNamespace
        return Ready(SimpleNamespace(path=f"tinker://simulated/sampler_weights/{name}"))


def simulated_run(staleness: int, iterations: int, log: Path, args, tokenizer_dir: Path) -> dict:
    """tinker_rl.main in this process against SlowTraining: rate from the first to the last metrics row."""
    import contextlib
    import io

    import tinker_rl

    eot = tinker_rl.load_tokenizer(str(tokenizer_dir)).convert_tokens_to_ids("<|im_end|>")
    training = SlowTraining(args.sample_seconds, args.train_seconds, eot)
    service = type("SlowService", (), {"create_lora_training_client": lambda self, **kw: Ready(training)})()
    tinker_rl.connect = lambda model_name, **kw: (service, 32768)
    tinker_rl.estimate_cost = lambda *a, **kw: None
    tinker_rl.rehearsal_reward = lambda task, completion: float(len(completion))  # samples differ: every group trains
    stamps = []
    append = tinker_rl.Run.append

    def timed_append(run, name, row):
        if name == "metrics.jsonl":
            stamps.append(time.monotonic())
        return append(run, name, row)

    tinker_rl.Run.append = timed_append
    argv = ["--rehearse", "on", "--tokenizer", str(tokenizer_dir), "--iterations", str(iterations),
            "--max-staleness", str(staleness), "--save-every", "0", "--trace-every", "0", "--log-path", str(log)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = tinker_rl.run_cli(tinker_rl.main, argv)
    tinker_rl.Run.append = append
    if code != 0:
        raise SystemExit(f"simulated tinker_rl.py --max-staleness {staleness} failed with exit {code}")
    metrics = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"iterations_per_s": (iterations - 1) / (stamps[-1] - stamps[0]),
            "reward": [round(m["reward_mean"], 4) for m in metrics],
            "staleness": [m["staleness_max"] for m in metrics],
            "seconds": {k: round(sum(m[f"seconds_{k}"] for m in metrics), 2)
                        for k in ("sampler_weights", "sampling", "training")}}


def summary(runs: list[dict]) -> dict:
    rates = [r["iterations_per_s"] for r in runs]
    last3 = [statistics.mean(r["reward"][-3:]) for r in runs]
    return {"iterations_per_s": [round(x, 4) for x in rates], "median": round(statistics.median(rates), 4),
            "spread": [round(min(rates), 4), round(max(rates), 4)],
            "reward_last3_mean": [round(x, 4) for x in last3],
            "reward_last3_median": round(statistics.median(last3), 4),
            "reward_curves": [r["reward"] for r in runs], "staleness": runs[0]["staleness"],
            "seconds": [r["seconds"] for r in runs],
            **({"cores_busy": [r["cores_busy"] for r in runs],
                "cores_busy_median": statistics.median(r["cores_busy"] for r in runs)}
               if runs[0].get("cores_busy") else {})}


def cpu_ceiling(on_policy: dict) -> float | None:
    """The most any overlap can speed up the on-policy loop on this machine if the work stays the same:
    an iteration needs its CPU seconds (client + server) spread over every core, so it takes at least
    cpu_seconds / cpus; the on-policy loop takes cpu_seconds / cores_busy. Spin-waiting thread pools count as
    busy, so this overstates the work a little (and understates the ceiling by as much)."""
    busy = on_policy.get("cores_busy_median")
    return round(os.cpu_count() / busy, 3) if busy else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="ABAB repeats: each pair is one run of each mode")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs of each mode first: the local engine compiles each new batch shape once")
    p.add_argument("--base-url", default=None, help="reuse a running local server")
    p.add_argument("--simulated", action="store_true", help="a fake service that overlaps sampling and training")
    p.add_argument("--sample-seconds", type=float, default=1.0, help="--simulated: one sample call")
    p.add_argument("--train-seconds", type=float, default=1.0, help="--simulated: one forward_backward")
    args = p.parse_args()

    home = tinker_local.resolve_home()
    if args.simulated:
        os.environ.update(HF_HUB_OFFLINE="1", TINKER_API_KEY="tml-simulated")
        runs = {mode: [] for mode in MODES}
        with tempfile.TemporaryDirectory() as tmp:
            for pair in range(args.pairs):
                for mode in MODES:
                    runs[mode].append(simulated_run(MODES[mode], args.iterations, Path(tmp) / f"{mode}-{pair}", args,
                                                    tinker_local.tiny_model_dir(home)))
                    say(f"simulated pair {pair + 1}/{args.pairs} {mode}: {runs[mode][-1]['iterations_per_s']:.3f} it/s")
        result = {mode: summary(r) for mode, r in runs.items()}
        ratio = result["off_policy"]["median"] / result["on_policy"]["median"]
        say(f"simulated: on-policy {result['on_policy']['median']:.3f} it/s, off-policy "
            f"{result['off_policy']['median']:.3f} it/s: x{ratio:.2f}")
        print(json.dumps({"benchmark": "rl_off_policy", "simulated": {"sample_seconds": args.sample_seconds,
                                                                      "train_seconds": args.train_seconds},
                          "pairs": args.pairs, "iterations": args.iterations, **result,
                          "speedup_median": round(ratio, 3), "loadavg": [round(x, 2) for x in os.getloadavg()]}))
        return 0
    server = None
    if args.base_url:
        base_url = args.base_url
    else:
        server = tinker_local.start_server(tinker_local.DEFAULT_MODEL)
        base_url = server.base_url
        say(f"server ready in {server.ready_seconds:.1f} s")
    env = {**os.environ, **tinker_local.client_env(base_url, home)}
    server_pids = {server.proc.pid} if server is not None else set()  # api process; the engine is its child
    load_before = os.getloadavg()
    runs = {mode: [] for mode in MODES}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.warmup):
                for mode in MODES:
                    say(f"warm-up {mode}: {one_run(MODES[mode], args.iterations, Path(tmp) / f'warm-{mode}-{i}', env, server_pids)['iterations_per_s']:.3f} it/s")
            for pair in range(args.pairs):
                for mode in MODES:  # A B, A B, ...
                    run = one_run(MODES[mode], args.iterations, Path(tmp) / f"{mode}-{pair}", env, server_pids)
                    runs[mode].append(run)
                    say(f"pair {pair + 1}/{args.pairs} {mode}: {run['iterations_per_s']:.3f} it/s, "
                        f"reward {run['reward']}")
    finally:
        if server is not None:
            server.stop()
    result = {mode: summary(r) for mode, r in runs.items()}
    ratio = result["off_policy"]["median"] / result["on_policy"]["median"]
    ceiling = cpu_ceiling(result["on_policy"])
    if ceiling:
        say(f"on-policy keeps {result['on_policy']['cores_busy_median']:.2f} of {os.cpu_count()} cores busy: "
            f"no overlap of the same work can run it faster than x{ceiling:.2f} here")
    say(f"on-policy {result['on_policy']['median']:.3f} it/s (spread {result['on_policy']['spread']}), "
        f"off-policy {result['off_policy']['median']:.3f} it/s (spread {result['off_policy']['spread']}): "
        f"x{ratio:.2f}; reward last-3 median {result['on_policy']['reward_last3_median']} vs "
        f"{result['off_policy']['reward_last3_median']}")
    print(json.dumps({"benchmark": "rl_off_policy", "pairs": args.pairs, "iterations": args.iterations,
                      "warmup_runs_per_mode": args.warmup,
                      "settings": "tinker_rl.py rehearsal (--rehearse auto on the local backend), --save-every 0",
                      **result, "speedup_median": round(ratio, 3), "cpu_ceiling": ceiling,
                      "loadavg_before": [round(x, 2) for x in load_before],
                      "loadavg_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
