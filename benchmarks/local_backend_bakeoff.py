#!/usr/bin/env python3
"""Bake-off: the local backend's server (SkyRL 0.4.0, JAX) against another installable
Tinker-compatible server (axolotl's hatchery-core 0.3.0, PyTorch/PEFT), same tiny Qwen3, same
machine, the tinker SDK 0.38 as the client.

Run (needs `python scripts/tinker_local.py setup` first, for the tiny model; one server at a time):
    .venv/bin/python benchmarks/local_backend_bakeoff.py                      # fresh setups, 3 rounds
    .venv/bin/python benchmarks/local_backend_bakeoff.py --reuse-setup --rounds 1 --no-parity

Per candidate:
  setup   each install command into a fresh venv under <repo>/.cache/bakeoff/<name>/ (seconds, exit
          code, last error line). SkyRL: `tinker_local.py setup --venv --home`. hatchery-core:
          Python 3.11 (the only local CPU torch wheel is cp311), `pip install torch==2.13.0`, then the
          package without its torch==2.10 pin (the documented `pip install hatchery-core` is tried
          first and its refusal recorded).
  start   seconds from launch until the server takes requests (SkyRL: engine ready; hatchery: the
          tiny model loaded by its worker on the CPU and /api/v1/healthz answering).
  step    warm forward_backward + optim_step, 8 sequences of 32 tokens, LoRA rank 8 (2 untimed).
  sample  warm sample, 4 samples of 16 new tokens (1 untimed).
  parity  tests/test_local_backend.py's probe list (every SDK 0.38 call and loss the bundle uses).
  native  hatchery only: the same step and sample through its own JSON client (`hatchery-client`),
          for a speed figure where SDK 0.38 cannot train or sample on it.
The probe stops the SDK from retrying 5xx answers (it would retry each for minutes); the error
class recorded is the one the SDK raises. The decision rule: adopt the other server only if it
serves more of the parity list and is at most 1.5x slower; results are in benchmarks/README.md.
Rounds interleave the candidates (A B, then B A, ...), one server at a time, each started afresh.
Times are pooled over rounds: median, min, max and each round's median.

Outputs: a table on stderr, one JSON object on stdout. Internal roles (re-entered by this file):
`probe` (the SDK client, in this venv), `hatchery-serve` and `native-probe` (in hatchery's venv).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
import tinker_local  # noqa: E402

BAKEOFF = ROOT / ".cache" / "bakeoff"
API_KEY = "tml-local"
SEQS, TOKENS, RANK = 8, 32, 8
SAMPLES, NEW_TOKENS = 4, 16
HATCHERY_DEPS = ["tinker==0.38.0", "fastapi>=0.110", "uvicorn[standard]>=0.27", "pydantic>=2.6", "msgpack>=1.0",
                 "aiosqlite>=0.19", "structlog>=24.1", "httpx>=0.27", "transformers==5.16.1", "peft==0.18.1"]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def wait_for_memory(need_gb: float = 7.0, timeout: float = 900) -> float:
    """Block until MemAvailable >= need_gb (the shared machine's rule for starting a server)."""
    deadline = time.monotonic() + timeout
    while True:
        avail = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable")) / 2**20
        if avail >= need_gb or time.monotonic() > deadline:
            return round(avail, 1)
        say(f"waiting for memory: {avail:.1f} GB available, need {need_gb}")
        time.sleep(20)


def run_cmd(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 1800) -> dict:
    t0 = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    lines = [l for l in log.read_text().splitlines() if l.strip()]
    errors = [l for l in lines if "ERROR" in l or "Error" in l]
    return {"cmd": " ".join(str(c).replace(str(ROOT) + "/", "") for c in cmd), "rc": done.returncode,
            "seconds": round(time.perf_counter() - t0, 1),
            "last_error": (errors[-1] if errors else lines[-1] if lines else "")[:300] if done.returncode else None}


# ---------------------------------------------------------------- setup


def setup_skyrl(fresh: bool) -> dict:
    venv, home = (BAKEOFF / "skyrl" / "venv", BAKEOFF / "skyrl" / "home") if fresh else (
        tinker_local.resolve_venv(), tinker_local.resolve_home())
    steps = []
    if fresh:
        shutil.rmtree(BAKEOFF / "skyrl", ignore_errors=True)
        (BAKEOFF / "skyrl").mkdir(parents=True)
        steps.append(run_cmd([sys.executable, str(ROOT / "scripts" / "tinker_local.py"), "setup",
                              "--venv", str(venv), "--home", str(home)], BAKEOFF / "skyrl" / "setup.log"))
    ok = all(s["rc"] == 0 for s in steps) and tinker_local.is_set_up(venv, home)
    return {"fresh": fresh, "ok": ok, "seconds": round(sum(s["seconds"] for s in steps), 1) if fresh else None,
            "steps": steps, "venv": venv, "home": home}


def setup_hatchery(fresh: bool) -> dict:
    base = BAKEOFF / "hatchery"
    venv = base / "venv"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    steps = []
    if fresh or not (venv / "bin" / "python").exists():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        log = base / "setup.log"
        python311 = tinker_local._find_python311()
        steps.append(run_cmd([python311, "-m", "venv", str(venv)], log))
        # The documented install: refused on Python 3.11 (hatchery-core declares >=3.12 and pins
        # torch==2.10, which for Linux on PyPI is the multi-GB CUDA build). Recorded, then bypassed.
        steps.append({**run_cmd([*pip, "hatchery-core==0.3.0"], log), "expected_to_fail": True})
        steps.append(run_cmd([*pip, "torch==2.13.0"], log))
        steps.append(run_cmd([*pip, "--no-deps", "--ignore-requires-python", "hatchery-core==0.3.0",
                              "hatchery-client==0.2.0"], log))
        steps.append(run_cmd([*pip, *HATCHERY_DEPS], log))
        steps.append(run_cmd([str(venv / "bin" / "python"), "-c",
                              "import torch, hatchery.core.worker, hatchery.core.tinker_compat; "
                              "assert torch.__version__.startswith('2.13.0')"], log))
    needed = [s for s in steps if not s.get("expected_to_fail")]
    ok = all(s["rc"] == 0 for s in needed) and (venv / "bin" / "python").exists()
    return {"fresh": bool(steps), "ok": ok, "seconds": round(sum(s["seconds"] for s in steps), 1) if steps else None,
            "steps": steps, "venv": venv}


# ---------------------------------------------------------------- servers


class Running:
    def __init__(self, base_url: str, model: str, env: dict, stop, log: Path | None):
        self.base_url, self.model, self.env, self.stop, self.log = base_url, model, env, stop, log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_skyrl(setup: dict) -> Running:
    server = tinker_local.start_server(tinker_local.DEFAULT_MODEL, venv=setup["venv"], home=setup["home"])
    return Running(server.base_url, tinker_local.DEFAULT_MODEL, server.env, server.stop, server.run_dir / "server.log")


def start_hatchery(setup: dict, model_dir: Path, timeout: float = 600) -> Running:
    port = free_port()
    log = BAKEOFF / "hatchery" / f"server-{port}.log"
    proc = subprocess.Popen([str(setup["venv"] / "bin" / "python"), __file__, "hatchery-serve", "--port", str(port),
                             "--model", str(model_dir)], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
                            start_new_session=True)

    def stop():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while "READY" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            raise RuntimeError(f"hatchery server did not start (see {log}): {log.read_text()[-800:]}")
        time.sleep(0.2)
    env = {"TINKER_BASE_URL": base_url, "TINKER_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0",
           "HF_HOME": os.environ.get("HF_HOME", str(BAKEOFF / "hf-home"))}
    return Running(base_url, str(model_dir), env, stop, log)


def hatchery_serve(port: int, model: str) -> int:
    """Runs in hatchery's venv: its gateway and its real (torch/PEFT) worker in one process, on the
    CPU. hatchery's own `hatchery-local-dev` starts a scripted stub worker whenever CUDA is absent,
    so this wires the same pieces with the real worker and device "cpu", float32."""
    import asyncio
    import uuid

    import torch
    import uvicorn
    from hatchery.core import local_dev
    from hatchery.core.gateway import create_app, set_config
    from hatchery.core.worker import GPUWorker

    async def serve() -> None:
        config = local_dev._build_config(API_KEY)
        set_config(config)
        app = create_app(config=config)
        await config.metadata.initialize()
        await config.queue.initialize()
        worker_id = f"bakeoff-{uuid.uuid4().hex[:6]}"
        worker = GPUWorker(worker_id=worker_id, base_model_name=model, config=config, device="cpu",
                           dtype=torch.float32)
        await worker.register()

        async def work() -> None:
            while True:
                job = await config.queue.dequeue(worker_id=worker_id, model_filter=model, visibility_timeout=300)
                if job is None:
                    await asyncio.sleep(0.02)
                    continue
                await worker._process_one(job)

        worker_task = asyncio.create_task(work())
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        serve_task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        print("READY", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.should_exit = True
        await serve_task
        worker_task.cancel()

    asyncio.run(serve())
    return 0


def native_probe(base_url: str, model: str, steps: int, samples: int) -> dict:
    """Runs in hatchery's venv: the same step and sample through hatchery's own client
    (`hatchery-client`, JSON bodies), which it serves, to compare speed where SDK 0.38 cannot."""
    from hatchery.client import HatcheryClient

    out: dict = {"step_seconds": [], "sample_seconds": [], "errors": {}}
    client = HatcheryClient(base_url=base_url, token=API_KEY)
    data = []
    for i in range(SEQS):
        ids = [(1000 + 37 * i + 11 * j) % 150000 for j in range(TOKENS + 1)]
        data.append({"model_input": {"chunks": [{"type": "encoded_text", "tokens": ids[:-1]}]},
                     "loss_fn_inputs": {"target_tokens": {"data": ids[1:], "dtype": "int64", "shape": [TOKENS]},
                                        "weights": {"data": [1.0] * TOKENS, "dtype": "float32", "shape": [TOKENS]}}})
    try:
        training = client.create_lora_training_client(model, rank=RANK)

        def step():
            fb = training.forward_backward(data, "cross_entropy")
            opt = training.optim_step(learning_rate=1e-3)
            result = fb.result()
            opt.result()
            return result

        first = step()
        out["first_metrics"] = {k: v for k, v in (first.get("metrics") or {}).items()} if isinstance(first, dict) else None
        step()
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            out["step_seconds"].append(time.perf_counter() - t0)
        for i in range(samples + 1):
            t0 = time.perf_counter()
            training.sample([1000 + j for j in range(8)], max_tokens=NEW_TOKENS, n=SAMPLES, seed=i).result()
            if i:
                out["sample_seconds"].append(time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001
        out["errors"]["native"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


# ---------------------------------------------------------------- the SDK client (probe role)


def probe(base_url: str, model: str, tokenizer_dir: str, steps: int, samples: int, parity: bool, env: dict) -> dict:
    import tinker
    import transformers
    from tinker import types

    from tinker._base_client import BaseClient
    from tinker.lib.internal_client_holder import InternalClientHolder

    # The SDK retries a 5xx answer (10 HTTP retries, then up to 5 minutes) before raising it. A
    # server that answers 500 to every SDK 0.38 protobuf body would make the probe list take hours;
    # stop retrying 5xx so the same error class arrives at once (both candidates alike).
    InternalClientHolder._is_retryable_status_code = staticmethod(lambda code: code in (408, 409, 429))
    should_retry = BaseClient._should_retry
    BaseClient._should_retry = lambda self, response: response.status_code < 500 and should_retry(self, response)
    os.environ.update(env)
    out: dict = {"step_seconds": [], "sample_seconds": [], "errors": {}}
    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    data = []
    for i in range(SEQS):
        ids = [(1000 + 37 * i + 11 * j) % 150000 for j in range(TOKENS + 1)]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * TOKENS}))

    def step(training):
        fb = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=1e-3))
        loss = fb.result(timeout=600).metrics["loss:sum"]
        opt.result(timeout=600)
        return loss

    try:
        training = service.create_lora_training_client(model, rank=RANK, seed=0).result(timeout=600)
        out["first_loss_per_token"] = step(training) / (SEQS * TOKENS)
        step(training)
        for _ in range(steps):
            t0 = time.perf_counter()
            step(training)
            out["step_seconds"].append(time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - the bake-off records what the SDK user gets
        out["errors"]["train"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    try:
        sampler = service.create_sampling_client(base_model=model).result(timeout=600)
        prompt = types.ModelInput.from_ints([1000 + j for j in range(8)])
        for i in range(samples + 1):
            params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=i)
            t0 = time.perf_counter()
            result = sampler.sample(prompt, SAMPLES, params).result(timeout=600)
            assert len(result.sequences) == SAMPLES
            if i:
                out["sample_seconds"].append(time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001
        out["errors"]["sample"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    if parity:
        import test_local_backend

        class Target:  # what parity_rows reads from the local_tinker fixture
            pass

        target = Target()
        target.model, target.env, target.base_url = model, {**os.environ, **env}, base_url
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        try:
            out["parity"] = test_local_backend.parity_rows(target, tokenizer)
        except Exception as exc:  # noqa: BLE001 - a probe list that cannot finish is a result too
            out["errors"]["parity"] = f"{type(exc).__name__}: {exc}"[:400]
            out["parity_traceback"] = traceback.format_exc()[-1500:]
    with __import__("contextlib").suppress(Exception):
        service.close("success").result(timeout=30)
    return out


def run_probe(server: Running, tokenizer_dir: Path, args, parity: bool) -> dict:
    result_file = BAKEOFF / f"probe-{os.getpid()}.json"
    cmd = [sys.executable, __file__, "probe", "--base-url", server.base_url, "--model", server.model,
           "--tokenizer", str(tokenizer_dir), "--steps", str(args.steps), "--samples", str(args.samples),
           "--out", str(result_file), "--env", json.dumps(server.env)] + (["--parity"] if parity else [])
    try:
        done = subprocess.run(cmd, env={**os.environ, **server.env}, capture_output=True, text=True,
                              timeout=args.probe_timeout, cwd=BAKEOFF)
        if done.returncode != 0 or not result_file.exists():
            return {"step_seconds": [], "sample_seconds": [], "errors": {"probe": done.stderr.strip()[-600:]}}
        return json.loads(result_file.read_text())
    except subprocess.TimeoutExpired:
        return {"step_seconds": [], "sample_seconds": [],
                "errors": {"probe": f"client did not finish within {args.probe_timeout} s"}}
    finally:
        result_file.unlink(missing_ok=True)


def run_native_probe(server: Running, setup: dict, args) -> dict:
    result_file = BAKEOFF / f"native-{os.getpid()}.json"
    cmd = [str(setup["venv"] / "bin" / "python"), __file__, "native-probe", "--base-url", server.base_url,
           "--model", server.model, "--steps", str(args.steps), "--samples", str(args.samples), "--out", str(result_file)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.probe_timeout, cwd=BAKEOFF)
        if done.returncode != 0 or not result_file.exists():
            return {"step_seconds": [], "sample_seconds": [], "errors": {"native": done.stderr.strip()[-600:]}}
        return json.loads(result_file.read_text())
    except subprocess.TimeoutExpired:
        return {"step_seconds": [], "sample_seconds": [], "errors": {"native": f"no result in {args.probe_timeout} s"}}
    finally:
        result_file.unlink(missing_ok=True)


# ---------------------------------------------------------------- orchestration


def spread(values: list[float], per_round: list[list[float]]) -> dict | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "n": len(values),
            "round_medians": [round(statistics.median(r), 4) for r in per_round if r]}


def main(argv: list[str]) -> int:
    if argv and argv[0] == "hatchery-serve":
        p = argparse.ArgumentParser()
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--model", required=True)
        a = p.parse_args(argv[1:])
        return hatchery_serve(a.port, a.model)
    if argv and argv[0] == "native-probe":
        p = argparse.ArgumentParser()
        for flag in ("--base-url", "--model", "--out"):
            p.add_argument(flag, required=True)
        p.add_argument("--steps", type=int, default=5)
        p.add_argument("--samples", type=int, default=3)
        a = p.parse_args(argv[1:])
        Path(a.out).write_text(json.dumps(native_probe(a.base_url, a.model, a.steps, a.samples)))
        return 0
    if argv and argv[0] == "probe":
        p = argparse.ArgumentParser()
        for flag in ("--base-url", "--model", "--tokenizer", "--out", "--env"):
            p.add_argument(flag, required=True)
        p.add_argument("--steps", type=int, default=5)
        p.add_argument("--samples", type=int, default=3)
        p.add_argument("--parity", action="store_true")
        a = p.parse_args(argv[1:])
        result = probe(a.base_url, a.model, a.tokenizer, a.steps, a.samples, a.parity, json.loads(a.env))
        Path(a.out).write_text(json.dumps(result))
        return 0

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each starts every server afresh)")
    p.add_argument("--steps", type=int, default=5, help="timed warm training steps per round")
    p.add_argument("--samples", type=int, default=3, help="timed warm sampling calls per round")
    p.add_argument("--reuse-setup", action="store_true",
                   help="use the installed server venv and an existing .cache/bakeoff/hatchery venv (no setup timing)")
    p.add_argument("--no-parity", action="store_true", help="skip the parity probe list")
    p.add_argument("--probe-timeout", type=float, default=1500)
    args = p.parse_args(argv)

    home = tinker_local.resolve_home()
    model_dir = tinker_local.tiny_model_dir(home)
    if not (model_dir / "config.json").exists():
        say("error: the tiny model is missing; run `python scripts/tinker_local.py setup` first")
        return 1
    BAKEOFF.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": {"cores": os.cpu_count()}, "model": {"dir": str(model_dir.relative_to(ROOT)),
                    **json.loads((model_dir / "tinker-local-model.json").read_text())},
                    "shapes": {"train": f"{SEQS}x{TOKENS} tokens, rank {RANK}", "sample": f"{SAMPLES}x{NEW_TOKENS} new tokens"},
                    "candidates": {}}
    setups = {}
    for name, fn in (("skyrl", setup_skyrl), ("hatchery", setup_hatchery)):
        say(f"setup {name} ({'fresh' if not args.reuse_setup else 'reuse'}) ...")
        setups[name] = fn(not args.reuse_setup)
        say(f"  ok={setups[name]['ok']} seconds={setups[name]['seconds']}")
    starters = {"skyrl": lambda: start_skyrl(setups["skyrl"]),
                "hatchery": lambda: start_hatchery(setups["hatchery"], model_dir)}
    runs: dict[str, list] = {name: [] for name in starters}
    for r in range(args.rounds):
        order = list(starters) if r % 2 == 0 else list(reversed(starters))
        for name in order:
            if not setups[name]["ok"]:
                continue
            avail = wait_for_memory()
            say(f"round {r + 1}: {name} (memory available {avail} GB)")
            t0 = time.perf_counter()
            try:
                server = starters[name]()
            except Exception as exc:  # noqa: BLE001
                runs[name].append({"start_error": f"{type(exc).__name__}: {str(exc)[:600]}"})
                continue
            start_s = time.perf_counter() - t0
            try:
                res = run_probe(server, model_dir, args, parity=(r < 2 and not args.no_parity
                                                                 and not any("parity" in x for x in runs[name])))
                if name == "hatchery":
                    res["native"] = run_native_probe(server, setups[name], args)
            finally:
                server.stop()
            runs[name].append({"start_seconds": start_s, **res})
            say(f"  start {start_s:.1f}s  step {res['step_seconds']}  sample {res['sample_seconds']}  "
                f"errors {res['errors']}")

    for name, rounds in runs.items():
        setup = setups[name]
        parity = next((x["parity"] for x in rounds if "parity" in x), None)
        steps = [x.get("step_seconds", []) for x in rounds]
        samples = [x.get("sample_seconds", []) for x in rounds]
        result["candidates"][name] = {
            "setup": {k: v for k, v in setup.items() if k not in ("venv", "home")},
            "start_seconds": spread([x["start_seconds"] for x in rounds if "start_seconds" in x],
                                    [[x["start_seconds"]] for x in rounds if "start_seconds" in x]),
            "step_seconds": spread(sum(steps, []), steps),
            "sample_seconds": spread(sum(samples, []), samples),
            "first_loss_per_token": next((x["first_loss_per_token"] for x in rounds if "first_loss_per_token" in x), None),
            "errors": [x.get("errors") or x.get("start_error") for x in rounds if x.get("errors") or x.get("start_error")],
            "native_client": None if name != "hatchery" else {
                "what": "the same step and sample through hatchery-client (JSON), which SDK 0.38 cannot use",
                "step_seconds": spread(sum((x.get("native", {}).get("step_seconds", []) for x in rounds), []),
                                       [x.get("native", {}).get("step_seconds", []) for x in rounds]),
                "sample_seconds": spread(sum((x.get("native", {}).get("sample_seconds", []) for x in rounds), []),
                                         [x.get("native", {}).get("sample_seconds", []) for x in rounds]),
                "first_metrics": next((x["native"].get("first_metrics") for x in rounds if x.get("native")), None),
                "errors": [x["native"]["errors"] for x in rounds if x.get("native", {}).get("errors")]},
            "parity": None if parity is None else {
                "served": sum(1 for _, o in parity if o == "served"), "probed": len(parity),
                "rows": {n: o for n, o in parity}},
        }
    sky, hat = result["candidates"]["skyrl"], result["candidates"]["hatchery"]

    def ratio(key):
        return (round(hat[key]["median"] / sky[key]["median"], 2)
                if sky.get(key) and hat.get(key) else None)

    result["hatchery_over_skyrl"] = {k: ratio(k) for k in ("start_seconds", "step_seconds", "sample_seconds")}
    native = hat.get("native_client") or {}
    result["hatchery_native_client_over_skyrl_sdk"] = {
        k: (round(native[k]["median"] / sky[k]["median"], 2) if native.get(k) and sky.get(k) else None)
        for k in ("step_seconds", "sample_seconds")}
    sky_served = (sky["parity"] or {}).get("served", 0)
    hat_served = (hat["parity"] or {}).get("served", 0)
    slower = max([v for group in ("hatchery_over_skyrl", "hatchery_native_client_over_skyrl_sdk")
                  for v in result[group].values() if v is not None], default=None)
    adopt = hat_served > sky_served and slower is not None and slower <= 1.5
    result["decision"] = {
        "adopt": "hatchery-core" if adopt else "skyrl (keep)",
        "rule": "adopt the other server only if it serves more of the parity list and is at most 1.5x slower",
        "parity_served": {"skyrl": sky_served, "hatchery": hat_served},
        "slowest_ratio": slower,
    }
    say(f"\n{'':12}{'setup s':>10}{'start s':>10}{'step s':>10}{'sample s':>10}{'parity':>10}")
    for name, c in result["candidates"].items():
        cells = [c["setup"]["seconds"], *((c[k] or {}).get("median") for k in ("start_seconds", "step_seconds", "sample_seconds"))]
        par = c["parity"]
        say(f"{name:12}" + "".join(f"{'-' if v is None else round(v, 2):>10}" for v in cells)
            + f"{(str(par['served']) + '/' + str(par['probed'])) if par else '-':>10}")
    say(f"decision: {result['decision']['adopt']}")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
