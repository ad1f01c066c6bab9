#!/usr/bin/env python3
"""Local backend: server memory for a large training batch, with and without micro-batching
(tinker_local_server.py shim group G), and how the engine's memory grows as new shapes arrive.

Run (needs `python scripts/tinker_local.py setup` first; starts one server per --micro-batch-tokens value):
    .venv/bin/python benchmarks/local_backend_memory.py                       # 128 x 1024, G on (default budget)
    .venv/bin/python benchmarks/local_backend_memory.py --micro-batch-tokens 0 --shapes 16x256
    .venv/bin/python benchmarks/local_backend_memory.py --micro-batch-tokens 0,1024 --shapes 8x256,16x256
    .venv/bin/python benchmarks/local_backend_memory.py --shapes 4x32 --also-serve Qwen/Qwen3-32B   # a teacher's cost

What it does, per budget (TINKER_LOCAL_MICRO_BATCH_TOKENS; 0 = skyrl's one batch):
  starts a server, creates one LoRA (rank 8, seed 0), and for each shape SEQSxTOKENS sends one
  forward_backward (cross_entropy, every token weighted) and one forward of random token ids, then
  reads every server process's peak (VmHWM) and current (VmRSS) resident memory from /proc. A call
  that fails is reported with its error's first line (the "before" of a batch that does not fit).
  The first losses of each budget are printed side by side: micro-batching must not change them.

Outputs: a table on stderr, one JSON object on stdout (figures and the load average before and after).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import tinker_local  # noqa: E402


def server_memory(pgid: int) -> dict:
    """{pid: {"role", "hwm_mb", "rss_mb"}} for every process of the server's group."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            status = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        role = "engine" if b"engine" in cmd else "api" if b"api" in cmd else "other"
        found[int(entry.name)] = {"role": role, "hwm_mb": int(status["VmHWM"].split()[0]) // 1024,
                                  "rss_mb": int(status["VmRSS"].split()[0]) // 1024}
    return found


def batch(types, seqs: int, tokens: int, seed: int) -> list:
    rng = random.Random(seed)
    data = []
    for _ in range(seqs):
        ids = [rng.randrange(1000, 150000) for _ in range(tokens + 1)]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
            "target_tokens": types.TensorData(data=ids[1:], dtype="int64", shape=[tokens]),
            "weights": types.TensorData(data=[1.0] * tokens, dtype="float32", shape=[tokens])}))
    return data


def run_budget(budget: int, shapes: list[tuple[int, int]], also_serve: list[str] = ()) -> dict:
    import tinker
    from tinker import types
    os.environ["TINKER_LOCAL_MICRO_BATCH_TOKENS"] = str(budget)
    out = {"micro_batch_tokens": budget, "also_serve": list(also_serve), "shapes": []}
    with tinker_local.start_server(also_serve=also_serve) as server:
        os.environ.update(server.env)
        out["at_start"] = server_memory(server.proc.pid)
        client = tinker.ServiceClient().create_lora_training_client(base_model=server.model, rank=8, seed=0).result()
        for seqs, tokens in shapes:
            row = {"shape": f"{seqs}x{tokens}"}
            for kind in ("forward_backward", "forward"):
                t0 = time.monotonic()
                try:
                    result = getattr(client, kind)(batch(types, seqs, tokens, 0), "cross_entropy").result()
                    row[kind] = {"loss_sum": result.metrics["loss:sum"], "seconds": round(time.monotonic() - t0, 2)}
                except Exception as exc:  # noqa: BLE001 - the failure is the measurement
                    row[kind] = {"error": str(exc).splitlines()[0][:300], "seconds": round(time.monotonic() - t0, 2)}
                    client = tinker.ServiceClient().create_lora_training_client(
                        base_model=server.model, rank=8, seed=0).result()  # a failed request poisons its client
            row["memory"] = server_memory(server.proc.pid)
            out["shapes"].append(row)
            engine = [m for m in row["memory"].values() if m["role"] == "engine"]
            print(f"budget {budget:>5} {row['shape']:>9}: fb {row['forward_backward']} fwd {row['forward']} "
                  f"engine peak {engine[0]['hwm_mb'] if engine else '?'} MB, now {engine[0]['rss_mb'] if engine else '?'} MB",
                  file=sys.stderr, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch-tokens", default="1024",
                        help="comma-separated budgets, one server each; 0 = one batch (skyrl's own)")
    parser.add_argument("--shapes", default="128x1024", help="comma-separated SEQSxTOKENS, in order")
    parser.add_argument("--also-serve", action="append", default=[], metavar="NAME",
                        help="also serve NAME (a sampled-only teacher): what a second model costs")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    load0 = os.getloadavg()
    runs = [run_budget(int(b), shapes, args.also_serve) for b in args.micro_batch_tokens.split(",")]
    print(json.dumps({"runs": runs, "load_before": load0, "load_after": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
