#!/usr/bin/env python3
"""Local backend: the real model (SmolLM2-135M-Instruct, `run --real`) against the tiny Qwen3, side by side in one
run: server ready time, a training step and a sampling call, and optionally whole SFT rehearsals on each.

Run (needs `python scripts/tinker_local.py setup --real` first; starts two servers of its own, ~2 minutes on 2 cores):
    .venv/bin/python benchmarks/real_model_speed.py
    .venv/bin/python benchmarks/real_model_speed.py --rounds 10 --sft      # + the SFT rehearsals (~4 min more)

What it does:
  1. Starts a tiny-model server and a real-model server with tinker_local.start_server (one after the other, so
     each ready time is its own) and puts one LoRA (rank 32, seed 0, the scripts' default rank) on each.
  2. Runs each shape once untimed (the first call of a shape compiles), then interleaves N rounds, alternating the
     server that goes first: a training step (forward_backward + optim_step of 4 sequences x 64 tokens, submitted
     back to back as the scripts do) and a sample of 4 x 32 new tokens (temperature 1, seed 0, no stop: every
     sample runs to 32) from a 16-token prompt of a sampler of the LoRA.
     Prints per model the median, min and max in seconds and the ratio real/tiny of the medians.
  3. --sft: times the whole SFT rehearsal as a user types it, server start included, on each model:
     `tinker_local.py [--real] run -- python scripts/tinker_sft.py --rehearse --overwrite --log-path TMP`, and on own
     data (--data templates/sft_example.jsonl without its reasoning_content rows, 32 help-desk conversations): wall
     seconds, the rehearsal's verdict and steps.

Token ids are below 49,152 (SmolLM2's vocabulary) so the same batch fits both models. The machine's load average
is printed before and after: on a shared machine the figures move with it.

Outputs: tables on stderr, one JSON object on stdout.
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

SEQS, TOKENS, RANK = 4, 64, 32
SAMPLES, NEW_TOKENS, PROMPT = 4, 32, 16
VOCAB = 49152  # the smaller of the two vocabularies (SmolLM2's)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def batch():
    from tinker import types
    out = []
    for i in range(SEQS):
        ids = [(1000 + 37 * i + 11 * j) % VOCAB for j in range(TOKENS + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * TOKENS}))
    return out


class Side:
    """One server (tiny or real) with its training client and a sampler of its LoRA."""

    def __init__(self, name: str, real: bool):
        import tinker
        from tinker import types
        self.name = name
        self.server = tinker_local.start_server(tinker_local.DEFAULT_MODEL, real=real)
        self.service = tinker.ServiceClient(base_url=self.server.base_url, api_key=tinker_local.API_KEY)
        self.training = self.service.create_lora_training_client(tinker_local.DEFAULT_MODEL, rank=RANK,
                                                                 seed=0).result()
        self.data, self.adam = batch(), types.AdamParams(learning_rate=1e-4)
        self.prompt = types.ModelInput.from_ints([(2000 + 13 * j) % VOCAB for j in range(PROMPT)])
        self.params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=0, stop=[])
        self.sampler = None
        self.steps: list[float] = []
        self.samples: list[float] = []
        self.sampled_tokens: list[int] = []

    def step(self) -> float:
        t0 = time.monotonic()
        fb = self.training.forward_backward(self.data, "cross_entropy")
        opt = self.training.optim_step(self.adam)
        fb.result()
        opt.result()
        return time.monotonic() - t0

    def sample(self) -> float:
        if self.sampler is None:
            self.sampler = self.training.save_weights_and_get_sampling_client("speed").result()
        t0 = time.monotonic()
        reply = self.sampler.sample(self.prompt, num_samples=SAMPLES, sampling_params=self.params).result()
        elapsed = time.monotonic() - t0
        self.sampled_tokens = [len(s.tokens) for s in reply.sequences]
        return elapsed

    def close(self) -> None:
        try:
            self.service.close("success").result(timeout=30)
        finally:
            self.server.stop()


def summarise(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "n": len(values)}


def own_data(folder: Path) -> Path:
    """templates/sft_example.jsonl without its rows that carry reasoning_content (SmolLM2's template has no place
    for it)."""
    rows = [line for line in (ROOT / "templates" / "sft_example.jsonl").read_text().splitlines()
            if line.strip() and not any("reasoning_content" in m for m in json.loads(line)["messages"])]
    path = folder / "sft_help_desk.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def rehearsal(real: bool, data: Path | None, log_path: Path) -> dict:
    """One SFT rehearsal as typed, server start included: wall seconds, exit code, verdict, steps."""
    cmd = [sys.executable, str(ROOT / "scripts" / "tinker_local.py"), "run", *(["--real"] if real else []), "--",
           sys.executable, str(ROOT / "scripts" / "tinker_sft.py"), "--rehearse", "--overwrite",
           "--log-path", str(log_path), *(["--data", str(data)] if data else [])]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    try:
        report = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        report = {}
    ready = [line for line in done.stderr.splitlines() if "tinker_local: ready in" in line]
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (log_path / "metrics.jsonl").exists() else []
    return {"seconds": round(seconds, 1), "exit": done.returncode, "status": report.get("status"),
            "passed": (report.get("rehearsal") or {}).get("passed"), "steps": len(rows),
            "server_ready": ready[0].split("ready in ")[1].split(" s")[0] if ready else None,
            "stderr_tail": done.stderr[-600:] if done.returncode else ""}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (each: one step, one sample per "
                                                         "server; default %(default)s)")
    p.add_argument("--sft", action="store_true", help="also time whole SFT rehearsals (built-in and own data) on "
                                                      "each model")
    args = p.parse_args(argv)
    venv, home = tinker_local.resolve_venv(), tinker_local.resolve_home()
    if not tinker_local.is_set_up(venv, home) or not tinker_local.is_real_set_up():
        say("the local backend or its real model is not set up: run `python scripts/tinker_local.py setup --real`")
        return 1
    result: dict = {"load_average_before": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count(),
                    "shape": {"step": f"forward_backward + optim_step, {SEQS} x {TOKENS} tokens, LoRA rank {RANK}",
                              "sample": f"{SAMPLES} samples x {NEW_TOKENS} new tokens, {PROMPT}-token prompt"}}
    sides: dict[str, Side] = {}
    try:
        for name, real in (("tiny", False), ("real", True)):
            say(f"starting the {name} server ...")
            sides[name] = Side(name, real)
            say(f"  ready in {sides[name].server.ready_seconds:.1f} s")
        for side in sides.values():  # warm: each shape once (its compile)
            t_step, t_sample = side.step(), side.sample()
            say(f"{side.name}: first step {t_step:.2f} s, first sample {t_sample:.2f} s (compiles)")
            result.setdefault("first_calls_s", {})[side.name] = {"step": round(t_step, 2), "sample": round(t_sample, 2)}
        for r in range(args.rounds):
            order = list(sides.values()) if r % 2 == 0 else list(sides.values())[::-1]
            for side in order:
                side.steps.append(side.step())
            for side in order:
                side.samples.append(side.sample())
        result["ready_s"] = {name: round(side.server.ready_seconds, 1) for name, side in sides.items()}
        result["step_s"] = {name: summarise(side.steps) for name, side in sides.items()}
        result["sample_s"] = {name: summarise(side.samples) for name, side in sides.items()}
        result["sampled_tokens"] = {name: side.sampled_tokens for name, side in sides.items()}
    finally:
        for side in sides.values():
            side.close()
    say(f"\n{'':24}{'tiny':>10}{'real':>10}{'real/tiny':>11}")
    for label, key in (("server ready (s)", "ready_s"),):
        t, r = result[key]["tiny"], result[key]["real"]
        say(f"{label:24}{t:>10.1f}{r:>10.1f}{r / t:>10.1f}x")
    for label, key in (("training step (s)", "step_s"), ("sample (s)", "sample_s")):
        t, r = result[key]["tiny"], result[key]["real"]
        result[key]["ratio_real_tiny"] = round(r["median"] / t["median"], 2)
        say(f"{label:24}{t['median']:>10.3f}{r['median']:>10.3f}{r['median'] / t['median']:>10.1f}x"
            f"   (min-max tiny {t['min']}-{t['max']}, real {r['min']}-{r['max']}; medians of {args.rounds})")
    if args.sft:
        with tempfile.TemporaryDirectory() as tmp:
            data = own_data(Path(tmp))
            result["sft_rehearsal"] = {}
            for real in (False, True):
                for kind, source in (("built-in", None), ("own data", data)):
                    name = f"{'real' if real else 'tiny'}, {kind}"
                    say(f"SFT rehearsal ({name}) ...")
                    got = rehearsal(real, source, Path(tmp) / name.replace(", ", "-").replace(" ", "-"))
                    result["sft_rehearsal"][name] = got
                    say(f"  {got['seconds']} s wall (server ready {got['server_ready']} s), exit {got['exit']}, "
                        f"status {got['status']}, {got['steps']} steps{'; ' + got['stderr_tail'] if got['exit'] else ''}")
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    say(f"load average before {result['load_average_before']}, after {result['load_average_after']} "
        f"({result['cores']} cores)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
