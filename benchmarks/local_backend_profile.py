#!/usr/bin/env python3
"""Local backend: where a training step's and a sampling call's time goes, before and after the speed
shims (tinker_local_server.py section F), side by side in one run.

Run (needs `python scripts/tinker_local.py setup` first; starts two servers of its own, ~4 minutes):
    .venv/bin/python benchmarks/local_backend_profile.py
    .venv/bin/python benchmarks/local_backend_profile.py --rounds 30 --no-jax

What it does:
  1. Starts two local servers with the profile probes on: "before" (TINKER_LOCAL_SPEED=0: skyrl's own
     engine loop and poller, all-slot training, padded loss chunks, an fsync per commit) and "after"
     (the speed shims). One LoRA (rank 8, seed 0) on each, the same data on each.
  2. Interleaves, alternating the server that goes first each round (A B, B A, ...): a warm
     forward_backward + optim_step of 4 sequences x 32 tokens, submitted back to back as the scripts
     do, and a sample of 4 x 8 new tokens from an 8-token prompt of a sampler checkpoint.
     Prints median, min-max and the ratio; the first loss on both servers (must be equal).
  3. The breakdown of each call's critical path, from the probes both server processes write
     (TINKER_LOCAL_PROFILE) and the client's clock: SDK request building and sending, the HTTP
     handler (parse, insert, commit), waiting for the engine loop, the engine's DB queries, JAX,
     result commits, the API's future poller, the response, the SDK's decoding; and, off that path,
     the sessions' heartbeat POSTs and the engine's stale-session sweeps. SDK 0.38 long-polls
     retrieve_future (one request per future, 45 s timeout), so the client adds no polling interval.
  4. In the server venv, without HTTP, database or engine loop, and without the persistent compile
     cache (first calls compile as on a fresh clone; `--no-jax` skips it): create/delete a model,
     forward_backward (wall, CPU, and the jitted call alone), optim_step (the LoRA update), a new
     length bucket's first call (its compile) and warm, a sample from the backend alone.
  Also: the server processes' CPU seconds per round and each server's start-up time.

Outputs: tables on stderr, one JSON object on stdout (all figures, the load average before and after).
Internal role (re-entered by this file in the server venv): `jax-only SPEED`.
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

SEQS, TOKENS, RANK = 4, 32, 8
SAMPLES, NEW_TOKENS, PROMPT = 4, 8, 8

STEP_PATH = [  # (label of the gap that ends at this milestone, milestone)
    ("SDK: build + send forward_backward", "fb.http.t0"),
    ("API: forward_backward POST (parse, insert, commit)", "fb.http.t"),
    ("queue: until the engine loop wakes", "fb.found.tick"),
    ("engine: find work (DB queries)", "fb.found.t"),
    ("engine: batch preparation", "fb.compute.t0"),
    ("JAX: forward_backward (incl. host-side arrays)", "fb.compute.t"),
    ("engine: commit forward_backward result", "fb.commit.t"),
    ("engine: until optim_step starts", "optim.compute.t0"),
    ("JAX: optim_step (the LoRA update)", "optim.compute.t"),
    ("engine: commit optim_step result", "optim.commit.t"),
    ("API: future poller notices", "optim.resolved.t"),
    ("API: serialize + respond", "optim.retrieve.t"),
    ("SDK: receive + decode", "done"),
]
SAMPLE_PATH = [
    ("SDK: build + send sample", "s.http.t0"),
    ("API: asample POST (parse, insert, commit)", "s.http.t"),
    ("queue: until the engine loop wakes", "s.found.tick"),
    ("engine: find work (DB queries)", "s.found.t"),
    ("engine: checkpoint slot + weights", "s.compute.t0"),
    ("JAX: sample (prefill + decode)", "s.compute.t"),
    ("engine: commit sample result", "s.commit.t"),
    ("API: future poller notices", "s.resolved.t"),
    ("API: serialize + respond", "s.retrieve.t"),
    ("SDK: receive + decode", "done"),
]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def batch():
    from tinker import types
    out = []
    for i in range(SEQS):
        ids = [(1000 + 37 * i + 11 * j) % 150000 for j in range(TOKENS + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * TOKENS}))
    return out


def group_cpu_seconds(pgid: int) -> float:
    """utime + stime of every live process in the server's process group (API process + engine)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


class Side:
    """One server (before or after) with its training client, sampler and probe file."""

    def __init__(self, name: str, speed: bool, home: Path, probe_dir: Path):
        import tinker
        from tinker import types
        self.name, self.probe = name, probe_dir / f"{name}.jsonl"
        os.environ["TINKER_LOCAL_SPEED"] = "1" if speed else "0"
        os.environ["TINKER_LOCAL_PROFILE"] = str(self.probe)
        try:
            self.server = tinker_local.start_server(tinker_local.DEFAULT_MODEL, home=home)
        finally:
            del os.environ["TINKER_LOCAL_SPEED"], os.environ["TINKER_LOCAL_PROFILE"]
        self.service = tinker.ServiceClient(base_url=self.server.base_url, api_key=tinker_local.API_KEY)
        self.training = self.service.create_lora_training_client(tinker_local.DEFAULT_MODEL, rank=RANK, seed=0).result()
        self.data, self.adam = batch(), types.AdamParams(learning_rate=1e-4)
        self.first_loss = self.step()[1]
        self.sampler = self.training.save_weights_and_get_sampling_client("profile").result()
        self.prompt = types.ModelInput.from_ints(list(range(2000, 2000 + PROMPT)))
        self.params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=0)
        self.steps: list[dict] = []
        self.samples: list[dict] = []

    def step(self) -> tuple[dict, float]:
        t0 = time.time()
        fb = self.training.forward_backward(self.data, "cross_entropy")
        opt = self.training.optim_step(self.adam)
        loss = fb.result().metrics["loss:sum"]
        opt.result()
        return {"t0": t0, "done": time.time()}, loss

    def sample(self) -> dict:
        t0 = time.time()
        self.sampler.sample(self.prompt, num_samples=SAMPLES, sampling_params=self.params).result()
        return {"t0": t0, "done": time.time()}

    def cpu(self) -> float:
        return group_cpu_seconds(self.server.proc.pid)

    def close(self) -> None:
        try:
            self.service.close("success").result(timeout=30)
        finally:
            self.server.stop()


# ---------------------------------------------------------------- joining probes to calls


def load_probes(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def milestones_for(call: dict, probes: list[dict], kinds: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Milestone times of one client call: for each prefix, the POST it made (path suffix) inside
    the call's window, and then the engine and API events that carry that request id."""
    t0, done = call["t0"], call["done"]
    out = {"t0": t0, "done": done}
    for prefix, (post, compute_kind) in kinds.items():
        posts = [p for p in probes if p["ev"] == "http" and p["path"].endswith(post) and t0 <= p["t0"] <= done]
        if not posts or posts[0].get("rid") is None:
            continue
        rid = posts[0]["rid"]
        out[f"{prefix}.http.t0"], out[f"{prefix}.http.t"] = posts[0]["t0"], posts[0]["t"]
        for p in probes:
            rids = p.get("rids") or ([p["rid"]] if "rid" in p else [])
            if rid not in rids:
                continue
            if p["ev"] == "found":
                out.setdefault(f"{prefix}.found.tick", p["tick"])
                out.setdefault(f"{prefix}.found.t", p["t"])
            elif p["ev"] == "compute" and (compute_kind is None or p["kind"] == compute_kind):
                out[f"{prefix}.compute.t0"], out[f"{prefix}.compute.t"] = p["t0"], p["t"]
            elif p["ev"] == "commit":
                out[f"{prefix}.commit.t"] = p["t"]
            elif p["ev"] == "resolved":
                out[f"{prefix}.resolved.t"] = p["t"]
            elif p["ev"] == "http" and p["path"].endswith("/retrieve_future"):
                out[f"{prefix}.retrieve.t"] = p["t"]
    return out


def breakdown(points: dict[str, float], path: list[tuple[str, str]]) -> dict[str, float] | None:
    """Gaps between consecutive milestones along the critical path (they sum to the call's time);
    a milestone earlier than its predecessor (work that overlapped) counts as zero."""
    if any(m not in points for _, m in path):
        return None
    gaps, last = {}, points["t0"]
    for label, milestone in path:
        at = max(points[milestone], last)
        gaps[label] = at - last
        last = at
    return gaps


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# ---------------------------------------------------------------- JAX alone (server venv)


def jax_only(speed: bool) -> dict:
    """Runs in the server venv: the backend without HTTP, DB or engine loop."""
    os.environ["TINKER_LOCAL_SPEED"] = "1" if speed else "0"
    import tinker_local_server as server
    server.shim_typing()
    server.apply_engine_shims()
    from skyrl.backends.jax import JaxBackendConfig, JaxBackendImpl
    from skyrl.tinker import engine, types

    import jax
    home = tinker_local.resolve_home()
    backend = JaxBackendImpl(str(tinker_local.tiny_model_dir(home)), JaxBackendConfig(
        max_lora_adapters=tinker_local.MAX_LORA_ADAPTERS, max_lora_rank=tinker_local.MAX_LORA_RANK), 0)
    creates = []
    for i in range(3):  # the first also builds what every later model shares (and compiles, if the cache is cold)
        t0 = time.perf_counter()
        backend.create_model("m" if i == 0 else f"m{i}", types.LoraConfig(rank=RANK, alpha=32, seed=i))
        creates.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    backend.delete_model("m2")
    delete_s = time.perf_counter() - t0
    jitted: list[float] = []  # the jitted forward_backward alone (blocked until its results are ready)

    def timed(fn):
        def run(*args):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            jitted.append(time.perf_counter() - t0)
            return out
        return run

    def data(tokens: int):
        rows = []
        for i in range(SEQS):
            ids = [(1000 + 37 * i + 11 * j) % 150000 for j in range(tokens + 1)]
            rows.append({"model_input": {"chunks": [{"type": "encoded_text", "tokens": ids[:-1]}]},
                         "loss_fn_inputs": {"target_tokens": {"data": ids[1:], "dtype": "int64"},
                                            "weights": {"data": [1.0] * tokens, "dtype": "float32"},
                                            "advantages": {"data": []}, "logprobs": {"data": []}}})
        return {"r": ("m", types.ForwardBackwardInput.model_validate({"data": rows, "loss_fn": "cross_entropy"}))}

    adam = types.OptimStepInput.model_validate({"adam_params": {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95,
                                                                "eps": 1e-12, "weight_decay": 0.0}})
    requests = data(TOKENS)
    calls: dict[str, list[float]] = {"prepare": [], "forward_backward": [], "forward_backward_cpu": [],
                                     "optim_step": [], "optim_step_cpu": []}
    first = None
    out = backend.forward_backward(engine.prepare_model_pass_batch(requests))  # builds the slot kit (after)
    if speed:
        backend._speed_kit.forward_backward = timed(backend._speed_kit.forward_backward)
    else:
        backend._forward_backward_and_accumulate = timed(backend._forward_backward_and_accumulate)
    for i in range(8):
        t0 = time.perf_counter()
        prepared = engine.prepare_model_pass_batch(requests)
        t1, c1 = time.perf_counter(), time.process_time()
        out = backend.forward_backward(prepared)
        t2, c2 = time.perf_counter(), time.process_time()
        backend.optim_step("m", adam)
        t3, c3 = time.perf_counter(), time.process_time()
        first = first if first is not None else out["r"].metrics["loss:sum"]  # no optim_step yet: the first loss
        if i >= 2:
            for key, value in (("prepare", t1 - t0), ("forward_backward", t2 - t1), ("forward_backward_cpu", c2 - c1),
                               ("optim_step", t3 - t2), ("optim_step_cpu", c3 - c2)):
                calls[key].append(value)
    t0 = time.perf_counter()
    backend.forward_backward(engine.prepare_model_pass_batch(data(TOKENS + 24)))  # a new bucket: 56 -> 64
    new_shape_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.forward_backward(engine.prepare_model_pass_batch(data(TOKENS + 24)))
    new_shape_warm_s = time.perf_counter() - t0
    backend.optim_step("m", adam)
    sample_input = types.SampleInput.model_validate({
        "base_model": "", "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(range(2000, 2000 + PROMPT))}]},
        "sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 1.0, "seed": 0}, "num_samples": SAMPLES,
        "checkpoint_id": "", "prompt_logprobs": False})
    sample_calls = []
    for i in range(6):
        t0 = time.perf_counter()
        backend.sample(engine.prepare_sample_batch({"s": ("", sample_input)}))
        if i >= 1:
            sample_calls.append(time.perf_counter() - t0)
    floors = vocab_floors(backend) if speed else {}
    return {"speed": speed, "first_loss": first, **floors, "create_model_first_s": creates[0],
            "create_model_s": statistics.median(creates[1:]), "delete_model_s": delete_s,
            "jitted_forward_backward_s": statistics.median(jitted[2:]),
            **{f"{k}_s": statistics.median(v) for k, v in calls.items()},
            "new_bucket_first_fb_s": new_shape_s, "new_bucket_warm_fb_s": new_shape_warm_s,
            "sample_s": statistics.median(sample_calls)}


def vocab_floors(backend) -> dict:
    """What the tied LM head (151,936 x 64) costs by itself, on the served weights, jitted, CPU time per
    call: what remains of a step and of a sample once nothing else is left."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    embedding = backend.non_lora_params["model"]["embed_tokens"]["embedding"].get_value()
    rng = np.random.RandomState(0)
    hidden = jnp.asarray(rng.randn(SEQS * TOKENS, embedding.shape[1]).astype(np.float32))
    targets = jnp.asarray(rng.randint(0, embedding.shape[0], SEQS * TOKENS))
    rows = jnp.asarray(rng.randn(SAMPLES, embedding.shape[1]).astype(np.float32))
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(SAMPLES))

    def nll(h):
        logits = h @ embedding.T
        return -jnp.sum(jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, -1))

    logits = rows @ embedding.T
    calls = {
        "floor_lm_head_fwd_bwd_128_tokens_cpu_s": (jax.jit(jax.value_and_grad(nll)), (hidden,)),
        "floor_decode_lm_head_4_rows_cpu_s": (jax.jit(lambda r: r @ embedding.T), (rows,)),
        "floor_decode_gumbel_draw_4_rows_cpu_s": (jax.jit(jax.vmap(lambda k, l: jax.random.categorical(k, l))),
                                                  (keys, logits)),
        "floor_decode_argmax_and_logsumexp_4_rows_cpu_s": (
            jax.jit(lambda l: (jnp.argmax(l, -1), jax.nn.logsumexp(l, -1))), (logits,)),
    }
    out = {}
    for name, (fn, args) in calls.items():
        jax.block_until_ready(fn(*args))
        c0 = time.process_time()
        for _ in range(20):
            jax.block_until_ready(fn(*args))
        out[name] = (time.process_time() - c0) / 20
    return out


def run_jax_only(speed: bool) -> dict:
    venv = tinker_local.resolve_venv()
    # no persistent compile cache here: first calls compile as on a fresh clone, before and after alike
    env = {**tinker_local._server_env(tinker_local.resolve_home()), "TINKER_LOCAL_SPEED": "1" if speed else "0",
           "JAX_ENABLE_COMPILATION_CACHE": "false"}
    done = subprocess.run([str(tinker_local.venv_python(venv)), __file__, "jax-only", "1" if speed else "0"],
                          capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"jax-only run failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- main


def table(title: str, rows: list[tuple[str, float, float]]) -> None:
    say(f"\n{title}")
    say(f"{'':56}{'before':>10}{'after':>10}")
    for label, before, after in rows:
        say(f"{label:56}{before * 1000:9.1f}ms{after * 1000:8.1f}ms")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["jax-only"]:
        sys.path.insert(0, str(ROOT / "scripts"))
        print(json.dumps(jax_only(argv[1] == "1")))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds (each: one step and one sample per server)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--no-jax", action="store_true", help="skip the JAX-only part")
    args = p.parse_args(argv)
    home = tinker_local.resolve_home()
    if not tinker_local.is_set_up(tinker_local.resolve_venv(), home):
        say("the local backend is not set up: run `python scripts/tinker_local.py setup`")
        return 1
    load_before = os.getloadavg()
    result: dict = {"load_average_before": [round(x, 2) for x in load_before],
                    "shape": {"step": f"forward_backward + optim_step, {SEQS} x {TOKENS} tokens, LoRA rank {RANK}",
                              "sample": f"{SAMPLES} samples x {NEW_TOKENS} new tokens, {PROMPT}-token prompt"}}
    with tempfile.TemporaryDirectory() as tmp:
        say("starting the 'before' and 'after' servers ...")
        sides = {"before": Side("before", False, home, Path(tmp)), "after": Side("after", True, home, Path(tmp))}
        try:
            cpu0 = {name: side.cpu() for name, side in sides.items()}
            for r in range(args.warmup + args.rounds):
                order = list(sides.values()) if r % 2 == 0 else list(sides.values())[::-1]
                for side in order:
                    call, _ = side.step()
                    if r >= args.warmup:
                        side.steps.append(call)
                for side in order:
                    call = side.sample()
                    if r >= args.warmup:
                        side.samples.append(call)
                if r == args.warmup - 1:
                    cpu0 = {name: side.cpu() for name, side in sides.items()}
            cpu = {name: (side.cpu() - cpu0[name]) / args.rounds for name, side in sides.items()}
            first = {name: side.first_loss for name, side in sides.items()}
        finally:
            for side in sides.values():
                side.close()
        probes = {name: load_probes(side.probe) for name, side in sides.items()}
    result["first_loss"] = first
    result["ready_s"] = {name: round(side.server.ready_seconds, 1) for name, side in sides.items()}
    result["server_cpu_s_per_round"] = {k: round(v, 3) for k, v in cpu.items()}
    for what, calls_of, kinds, path in (
            ("step", lambda s: s.steps, {"fb": ("/forward_backward", "process_forward_backward"),
                                         "optim": ("/optim_step", "optim_step")}, STEP_PATH),
            ("sample", lambda s: s.samples, {"s": ("/asample", "sample")}, SAMPLE_PATH)):
        result[what] = {}
        for name, side in sides.items():
            calls = calls_of(side)
            times = [c["done"] - c["t0"] for c in calls]
            gaps = [g for g in (breakdown(milestones_for(c, probes[name], kinds), path) for c in calls) if g]
            result[what][name] = {**{k: round(v, 4) for k, v in summarise(times).items()},
                                  "breakdown_median_s": {label: round(statistics.median(g[label] for g in gaps), 4)
                                                         for label, _ in path} if gaps else None,
                                  "breakdown_calls": len(gaps)}
        b, a = result[what]["before"]["median"], result[what]["after"]["median"]
        result[what]["ratio_before_over_after"] = round(b / a, 2)
        say(f"\n{what}: before {b * 1000:.0f} ms (min {result[what]['before']['min'] * 1000:.0f}, max "
            f"{result[what]['before']['max'] * 1000:.0f}), after {a * 1000:.0f} ms (min "
            f"{result[what]['after']['min'] * 1000:.0f}, max {result[what]['after']['max'] * 1000:.0f}), "
            f"{b / a:.2f}x; medians of {args.rounds} interleaved calls")
        if result[what]["before"]["breakdown_median_s"] and result[what]["after"]["breakdown_median_s"]:
            table(f"{what}: critical path, median of each segment (they need not sum to the median)",
                  [(label, result[what]["before"]["breakdown_median_s"][label],
                    result[what]["after"]["breakdown_median_s"][label]) for label, _ in path])
    result["sessions"] = {}
    for name in sides:  # off the critical path, but they share the loop and the database
        beats = [p["t"] - p["t0"] for p in probes[name] if p["ev"] == "http" and p["path"].endswith("/session_heartbeat")]
        sweeps = [p["t"] - p["t0"] for p in probes[name] if p["ev"] == "sweep"]
        result["sessions"][name] = {"heartbeats": len(beats), "heartbeat_median_s": statistics.median(beats) if beats else None,
                                    "sweeps": len(sweeps), "sweep_median_s": statistics.median(sweeps) if sweeps else None}
    say("\nsessions (off the critical path): " + "; ".join(
        f"{name}: {v['heartbeats']} heartbeat POSTs (SDK, every 10 s) of "
        f"{(v['heartbeat_median_s'] or 0) * 1000:.1f} ms, {v['sweeps']} stale-session sweeps (engine, every 5 s) of "
        f"{(v['sweep_median_s'] or 0) * 1000:.1f} ms" for name, v in result["sessions"].items()))
    say(f"\nfirst loss (same data, seed 0): before {first['before']!r}, after {first['after']!r}"
        f"{'' if first['before'] == first['after'] else '  <-- DIFFERENT'}")
    say(f"server CPU per round (one step + one sample): before {cpu['before']:.3f} s, after {cpu['after']:.3f} s")
    say(f"server ready after start: before {result['ready_s']['before']} s, after {result['ready_s']['after']} s")
    if not args.no_jax:
        say("\nJAX alone, in the server venv (no HTTP, no database, no engine loop) ...")
        jax_runs = {"before": run_jax_only(False), "after": run_jax_only(True)}
        result["jax_only"] = jax_runs
        rows = [("create_model, first (builds shared parts)", "create_model_first_s"),
                ("create_model, later ones", "create_model_s"), ("delete_model", "delete_model_s"),
                ("engine: prepare_model_pass_batch", "prepare_s"),
                ("forward_backward (wall)", "forward_backward_s"), ("forward_backward (CPU)", "forward_backward_cpu_s"),
                ("  of which the jitted call, until ready", "jitted_forward_backward_s"),
                ("optim_step: the LoRA update (wall)", "optim_step_s"), ("optim_step (CPU)", "optim_step_cpu_s"),
                ("forward_backward, new length bucket: first call", "new_bucket_first_fb_s"),
                ("forward_backward, that bucket warm", "new_bucket_warm_fb_s"),
                ("sample 4 x 8 from the base model (backend only)", "sample_s")]
        table("JAX alone (medians)", [(label, jax_runs["before"][key], jax_runs["after"][key]) for label, key in rows])
        say(f"first loss, JAX alone: before {jax_runs['before']['first_loss']!r}, after {jax_runs['after']['first_loss']!r}")
        a = jax_runs["after"]
        say(f"\nwhat remains: the tied LM head (151,936 x 64), CPU per call, jitted alone:"
            f"\n  forward + backward over {SEQS * TOKENS} tokens (a step's logprobs): "
            f"{a['floor_lm_head_fwd_bwd_128_tokens_cpu_s'] * 1000:.1f} ms of the step's "
            f"{a['forward_backward_cpu_s'] * 1000:.1f} ms forward_backward CPU"
            f"\n  per decode step of {SAMPLES} rows: LM head {a['floor_decode_lm_head_4_rows_cpu_s'] * 1000:.1f} ms, "
            f"Gumbel draw over the vocabulary (jax.random.categorical) {a['floor_decode_gumbel_draw_4_rows_cpu_s'] * 1000:.1f} ms, "
            f"argmax + log-sum-exp {a['floor_decode_argmax_and_logsumexp_4_rows_cpu_s'] * 1000:.1f} ms; "
            f"x {NEW_TOKENS} steps per sample call")
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    say(f"\nload average before {result['load_average_before']}, after {result['load_average_after']} "
        f"({os.cpu_count()} CPUs)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
