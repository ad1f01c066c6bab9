#!/usr/bin/env python3
"""Local backend: start-up with and without the persistent JAX compile cache, side by side,
and the steady cost of a training step and a sampling call.

Run (needs `python scripts/tinker_local.py setup` first; starts its own servers):
    python benchmarks/local_backend_timings.py
    python benchmarks/local_backend_timings.py --warm-starts 5 --steps 8

Cold = an empty JAX compile cache (TINKER_LOCAL_JAX_CACHE pointed at a new folder) and a cache
folder whose tiny model and HF cache are linked from the real one, so nothing else differs; warm =
the shared compile cache (tinker_local.jax_cache_dir()) and the real cache folder. For each it records
the time until the engine is ready and the first training step (fb + optim_step on 8 sequences
of 128 tokens: the first step compiles). On the warm server it then times steady steps (median
of --steps after 2 untimed) and a sampling call (8 samples of 128 new tokens, median of 3 after
one untimed). Prints a table on stderr and one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import tinker_local  # noqa: E402

SEQS, TOKENS = 8, 128


def batch():
    from tinker import types
    out = []
    for i in range(SEQS):
        ids = [(1000 + 37 * i + 11 * j) % 150000 for j in range(TOKENS + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * TOKENS}))
    return out


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def start_and_first_step(home: Path, model: str) -> tuple[object, float, float]:
    import tinker
    from tinker import types
    server = tinker_local.start_server(model, home=home)
    os.environ.update(server.env)
    service = tinker.ServiceClient(base_url=server.base_url, api_key=server.env["TINKER_API_KEY"])
    training = service.create_lora_training_client(model, rank=32, seed=0).result()
    data = batch()

    def step():
        fb = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result(), opt.result()

    first = timed(step)
    return (server, service, training, step), server.ready_seconds, first


def cold_home(real: Path, tmp: Path) -> Path:
    """A cache folder like `real` but with an empty JAX compile cache."""
    home = tmp / "cold-home"
    home.mkdir()
    for name in ("models", "hf"):
        (home / name).symlink_to(real / name)
    return home


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=tinker_local.DEFAULT_MODEL)
    p.add_argument("--warm-starts", type=int, default=3, help="warm starts to time (median)")
    p.add_argument("--steps", type=int, default=5, help="steady training steps to time (median)")
    args = p.parse_args(argv)
    real = tinker_local.resolve_home()
    if not tinker_local.is_set_up(tinker_local.resolve_venv(), real):
        print("the local backend is not set up: run `python scripts/tinker_local.py setup`", file=sys.stderr)
        return 1
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TINKER_LOCAL_JAX_CACHE"] = str(Path(tmp) / "jax-cache")  # empty: the cold start compiles
        try:
            (server, service, _, _), cold_ready, cold_first = start_and_first_step(cold_home(real, Path(tmp)),
                                                                                   args.model)
        finally:
            del os.environ["TINKER_LOCAL_JAX_CACHE"]
        service.close("success").result()
        server.stop()
    warm = []
    for i in range(args.warm_starts):
        handles, ready, first = start_and_first_step(real, args.model)
        warm.append((ready, first))
        if i < args.warm_starts - 1:
            handles[1].close("success").result()
            handles[0].stop()
    server, service, training, step = handles
    try:
        from tinker import types
        for _ in range(2):
            step()
        steady = statistics.median(timed(step) for _ in range(args.steps))
        sampler = training.save_weights_and_get_sampling_client("timings")
        sampler = sampler.result() if hasattr(sampler, "result") else sampler
        prompt = types.ModelInput.from_ints(list(range(2000, 2032)))
        params = types.SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=0)

        def sample():
            sampler.sample(prompt, num_samples=SEQS, sampling_params=params).result()

        sample()
        sampled = statistics.median(timed(sample) for _ in range(3))
    finally:
        service.close("success").result()
        server.stop()
    warm_ready = statistics.median(r for r, _ in warm)
    warm_first = statistics.median(f for _, f in warm)
    result = {
        "load_average_1m": round(load, 2),
        "ready_cold_s": round(cold_ready, 1), "ready_warm_s": round(warm_ready, 1),
        "ready_warm_all_s": [round(r, 1) for r, _ in warm],
        "ready_ratio_cold_over_warm": round(cold_ready / warm_ready, 2),
        "first_step_cold_s": round(cold_first, 2), "first_step_warm_s": round(warm_first, 2),
        "first_step_ratio_cold_over_warm": round(cold_first / warm_first, 2),
        "steady_step_s": round(steady, 2), "sample_s": round(sampled, 2),
        "shape": f"{SEQS} sequences x {TOKENS} tokens, LoRA rank 32",
    }
    rows = [("ready (s)", cold_ready, warm_ready), ("first train step (s)", cold_first, warm_first)]
    print(f"{'':24}{'cold cache':>12}{'warm cache':>12}{'ratio':>8}", file=sys.stderr)
    for name, cold, hot in rows:
        print(f"{name:24}{cold:12.2f}{hot:12.2f}{cold / hot:8.2f}", file=sys.stderr)
    print(f"steady train step {steady:.2f} s; sample {SEQS}x{TOKENS} tokens {sampled:.2f} s "
          f"(load average {load:.2f})", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
