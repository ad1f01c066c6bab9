#!/usr/bin/env python3
"""Steps per second of tinker_sft.py's pipelined loop against a naive loop, on the local backend.

Run:
    python benchmarks/sft_pipelining.py                 # starts a local backend (tinker_local.py serve)
    python benchmarks/sft_pipelining.py --steps 20 --latency-ms 50

What it measures: the same forward_backward + optim_step steps (cross_entropy, fixed batch of
--batch-size datums of --seq-len tokens, rank 8), driven two ways:
    naive      submit forward_backward, wait; submit optim_step, wait; next step
    pipelined  tinker_sft.pipelined(): forward_backward and optim_step submitted back to back and the
               next step queued before the current one is awaited (the script's own loop driver)
Each runs twice: directly against the server, and through a loopback TCP proxy that delays every
byte by --latency-ms in each direction (a WAN round trip). On a local CPU server the server's compute
dominates, so the direct loops tie; the proxy shows what pipelining buys against the real service,
where every call pays a network round trip.

Outputs: a table on stderr and one JSON object on stdout with steps/s per mode and the ratios.
Requires: the local backend set up (python scripts/tinker_local.py setup), or TINKER_BASE_URL and
TINKER_API_KEY of a running server. Exit codes: 0 ok, 1 failure, 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import tinker_sft as sft  # noqa: E402  (the loop under test)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per loop")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (JIT compiles)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--latency-ms", type=float, default=50.0, help="added delay each way through the proxy")
    p.add_argument("--repeats", type=int, default=2, help="runs of each loop; the best is reported")
    return p.parse_args()


# ---- a loopback proxy that delays every byte ---------------------------------------------------


def _pump(src, dst, delay):
    """Forward src -> dst, each chunk released `delay` seconds after it arrived (bandwidth unlimited)."""
    line = queue.Queue()

    def reader():
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            line.put((time.monotonic() + delay, data))
            if not data:
                return

    threading.Thread(target=reader, daemon=True).start()
    while True:
        due, data = line.get()
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        if not data:
            break
        try:
            dst.sendall(data)
        except OSError:
            break
    for s in (dst, src):
        try:
            s.shutdown(socket.SHUT_WR if s is dst else socket.SHUT_RD)
        except OSError:
            pass


def start_proxy(target_port, delay):
    """127.0.0.1:<returned port> -> 127.0.0.1:target_port with `delay` s added each way."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def serve():
        while True:
            client, _ = listener.accept()
            upstream = socket.create_connection(("127.0.0.1", target_port))
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_pump, args=(client, upstream, delay), daemon=True).start()
            threading.Thread(target=_pump, args=(upstream, client, delay), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


# ---- the two loops ------------------------------------------------------------------------------


def make_batch(batch_size, seq_len, seed=0):
    rng = random.Random(seed)
    rendered = []
    for _ in range(batch_size):
        tokens = [rng.randrange(1000, 100000) for _ in range(seq_len)]
        weights = [0.0] * (seq_len // 2) + [1.0] * (seq_len - seq_len // 2)
        rendered.append(sft.Rendered(tokens, weights))
    return sft.training_datums(rendered)


def naive_loop(tc, datums, steps, adam):
    for _ in range(steps):
        tc.forward_backward(datums, "cross_entropy").result()
        tc.optim_step(adam).result()


def pipelined_loop(tc, datums, steps, adam):
    def submit(step):
        return tc.forward_backward(datums, "cross_entropy"), tc.optim_step(adam)

    def finish(handle):
        handle[0].result()
        handle[1].result()

    sft.pipelined(0, steps, submit, finish)


def measure(base_url, api_key, args, label):
    import tinker

    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    tc = service.create_lora_training_client(os.environ.get("TINKER_BENCH_MODEL", sft.DEFAULT_MODEL),
                                             rank=8, seed=0).result()
    datums = make_batch(args.batch_size, args.seq_len)
    adam = tinker.AdamParams(learning_rate=1e-4, **sft.ADAM)
    naive_loop(tc, datums, args.warmup_steps, adam)  # compile this shape before timing
    rates = {"naive": [], "pipelined": []}
    for _ in range(args.repeats):
        for name, loop in (("naive", naive_loop), ("pipelined", pipelined_loop)):
            t0 = time.perf_counter()
            loop(tc, datums, args.steps, adam)
            rates[name].append(args.steps / (time.perf_counter() - t0))
            print(f"{label:>9} {name:>9}: {rates[name][-1]:.3f} steps/s", file=sys.stderr)
    try:
        service.close("success").result()
    except Exception:
        pass
    best = {k: max(v) for k, v in rates.items()}
    return {"naive_steps_per_s": round(best["naive"], 3), "pipelined_steps_per_s": round(best["pipelined"], 3),
            "ratio": round(best["pipelined"] / best["naive"], 3), "runs": {k: [round(x, 3) for x in v] for k, v in rates.items()}}


def start_local_backend():
    """(process, base_url, env) of a `tinker_local.py serve --json` started here."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "tinker_local.py"), "serve", "--json"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"error: the local backend did not start (exit {proc.wait()}); "
                         "run python scripts/tinker_local.py setup first")
    info = json.loads(line)
    return proc, info["base_url"], info["env"]


def main():
    args = parse_args()
    proc = None
    if os.environ.get("TINKER_BASE_URL"):
        base_url, env = os.environ["TINKER_BASE_URL"], {}
    else:
        proc, base_url, env = start_local_backend()
        os.environ.update(env)
    api_key = os.environ.get("TINKER_API_KEY", "tml-local")
    try:
        port = int(base_url.rsplit(":", 1)[1].split("/")[0])
        proxy_port = start_proxy(port, args.latency_ms / 1000)
        results = {
            "direct": measure(base_url, api_key, args, "direct"),
            f"latency_{args.latency_ms:g}ms": measure(f"http://127.0.0.1:{proxy_port}", api_key, args,
                                                      f"+{args.latency_ms:g}ms"),
        }
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    print(f"\n{'':>14} {'naive':>10} {'pipelined':>10} {'ratio':>7}   (steps/s, batch {args.batch_size}x"
          f"{args.seq_len}, {args.steps} steps, best of {args.repeats})", file=sys.stderr)
    for mode, r in results.items():
        print(f"{mode:>14} {r['naive_steps_per_s']:>10.3f} {r['pipelined_steps_per_s']:>10.3f} {r['ratio']:>7.2f}x",
              file=sys.stderr)
    print(json.dumps({"settings": vars(args), "results": results}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
