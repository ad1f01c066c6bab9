"""Fixture `local_tinker`: one local Tinker-compatible backend for the whole test session.

Owned by the local-backend work (issue 3); see DEVELOPING.md for the interface.

    def test_sft_runs(local_tinker):
        subprocess.run([...], env=local_tinker.env, check=True)   # a script in a subprocess

    def test_in_process(local_tinker, monkeypatch):
        local_tinker.apply(monkeypatch)                          # os.environ for the SDK here
        tc = tinker.ServiceClient().create_lora_training_client(local_tinker.model, rank=8).result()

Set TINKER_TEST_BASE_URL=http://127.0.0.1:PORT to reuse a server started with
`python scripts/tinker_local.py serve` instead of starting one per pytest run.

A ServiceClient created during a test that uses `local_tinker` (directly, or inside a script's
main() run in-process) is closed when that test ends; one made by a module-scoped fixture, when its module
ends. In one long pytest process an unclosed client keeps heartbeating, so its LoRA adapter slot (13 per
server: MAX_LORA_ADAPTERS = 14, slot 0 is the base model; sampled sampler_weights/ checkpoints borrow up to
SAMPLER_SLOTS = 3 and are unloaded first) would never come back: CI on 5 December 2026 ended with 8 such
sessions alive and test_rl_e2e's off-policy test refused ("Maximum number of LoRA adapters (14) reached").
Clients are held strongly until closed: a script's main() drops its client when it returns, and a weak
reference then lost the client while the SDK's background heartbeat kept its session alive.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import tinker_local

__all__ = ["LocalTinker", "local_backend_install", "real_engines", "local_tinker", "local_real_tinker",
           "local_real_sft_run", "local_sft_run", "local_rl_run", "local_dpo_rehearsal",
           "close_service_clients_made_by_the_test", "close_service_clients_made_by_the_module"]
ROOT = Path(__file__).resolve().parent.parent
# The last lines of a `python -c` program that uses the SDK: end through common/errors.exit_process, as the
# scripts do, which skips interpreter teardown where a pyqwest thread delivering a late response aborts
# CPython < 3.14 (exit -6 after the work is done; pyqwest issue 164, references/troubleshooting.md).
def common_module(name: str):
    """common/NAME.py, the shared source the scripts' generated regions are copied from, loaded by its path."""
    spec = importlib.util.spec_from_file_location(f"bundle_common_{name}", ROOT / "common" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "common"))  # its `from other import name  # splice: drop` lines
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "common"))
    return module


EXIT_WITHOUT_TEARDOWN = (f"\nimport sys as _sys\n_sys.path.insert(0, {str(ROOT / 'common')!r})\n"
                         "from errors import exit_process as _exit_process\n_exit_process(0)\n")


def sigint_default() -> None:
    """preexec_fn: SIGINT at its default in the child, so Python turns it into KeyboardInterrupt. A suite started
    in the background by a non-interactive shell (`cmd &`) inherits SIGINT ignored, and Python keeps it so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

_service_clients: list = []  # every tinker.ServiceClient made in this process and not yet closed


def _track_service_clients():
    import tinker
    original = tinker.ServiceClient.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _service_clients.append(self)

    tinker.ServiceClient.__init__ = init
    return lambda: setattr(tinker.ServiceClient, "__init__", original)


def close_service_clients_since(before: set[int]) -> int:
    """Close every tracked ServiceClient whose id() is not in `before`; their adapter slots are freed at once."""
    closed = 0
    for client in [c for c in _service_clients if id(c) not in before]:
        with contextlib.suppress(Exception):
            client.close("success").result(timeout=30)
            closed += 1
        _service_clients.remove(client)
    return closed


@dataclass
class LocalTinker:
    base_url: str
    model: str
    tokenizer_dir: Path
    env: dict = field(repr=False)      # os.environ plus the client variables, for subprocesses
    client_env: dict = field(repr=False)  # only the variables the server adds
    server: tinker_local.Server | None = None  # None when reusing TINKER_TEST_BASE_URL

    def apply(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point the in-process SDK at the local server for one test."""
        for key, value in self.client_env.items():
            monkeypatch.setenv(key, value)


def _make(base_url: str, home: Path, server=None, real: bool = False) -> LocalTinker:
    added = tinker_local.client_env(base_url, home, real)
    return LocalTinker(base_url=base_url, model=tinker_local.DEFAULT_MODEL,
                       tokenizer_dir=tinker_local.real_model_dir() if real else tinker_local.tiny_model_dir(home),
                       env={**os.environ, **added}, client_env=added, server=server)


@pytest.fixture(scope="session")
def local_backend_install(tmp_path_factory):
    """(venv, home) of the installed local backend; runs the idempotent `setup` once. Then an engine zygote
    (tinker_local.EngineZygote) serves every server this test process starts with the session's environment:
    each engine is forked from a process that imported JAX, SkyRL, transformers and torch once (~7 s of CPU less
    per server start; TINKER_TEST_ENGINE_ZYGOTE=0 turns it off). Tests of the launcher's processes take it away
    (`real_engines`)."""
    venv, home = tinker_local.resolve_venv(), tinker_local.resolve_home()
    try:
        tinker_local.setup(venv, home, python=sys.executable if sys.version_info[:2] == (3, 11) else None)
    except tinker_local.LocalError as exc:
        pytest.fail(f"local Tinker backend setup: {exc}", pytrace=False)
    zygote = None
    if os.environ.get("TINKER_TEST_ENGINE_ZYGOTE", "1") != "0":
        try:
            zygote = tinker_local.EngineZygote(venv, home, folder=tmp_path_factory.mktemp("engine-zygote"))
        except tinker_local.LocalError as exc:
            pytest.fail(f"local Tinker backend: {exc}", pytrace=False)
    yield venv, home
    if zygote is not None:
        zygote.close()


@pytest.fixture
def real_engines(monkeypatch):
    """Servers started in this test run their engine as a process of their own (no engine zygote): for tests of
    which processes a server leaves behind."""
    monkeypatch.delenv(tinker_local.ENGINE_ZYGOTE_ENV, raising=False)


@pytest.fixture(autouse=True)
def close_service_clients_made_by_the_test(request):
    if "local_tinker" not in request.fixturenames and "local_real_tinker" not in request.fixturenames:
        yield
        return
    before = {id(c) for c in _service_clients}
    yield
    close_service_clients_since(before)


@pytest.fixture(autouse=True, scope="module")
def close_service_clients_made_by_the_module():
    """Module-scoped fixtures' clients (left alone by the per-test closer) are closed when the module ends."""
    before = {id(c) for c in _service_clients}
    yield
    close_service_clients_since(before)


@pytest.fixture(scope="session")
def local_tinker(request):
    untrack = _track_service_clients()
    request.addfinalizer(untrack)
    reuse = os.environ.get("TINKER_TEST_BASE_URL")
    if reuse:
        home = tinker_local.resolve_home()
        if not tinker_local.tiny_model_dir(home).exists():
            pytest.fail(f"TINKER_TEST_BASE_URL is set but {home} has no tiny model; "
                        "run `python scripts/tinker_local.py setup` (same TINKER_LOCAL_HOME)")
        yield _make(reuse.rstrip("/"), home)
        return
    venv, home = request.getfixturevalue("local_backend_install")
    try:
        server = tinker_local.start_server(tinker_local.DEFAULT_MODEL, venv=venv, home=home)
    except tinker_local.LocalError as exc:
        pytest.fail(f"local Tinker backend: {exc}", pytrace=False)
    try:
        print(f"\nlocal tinker ready in {server.ready_seconds:.1f} s at {server.base_url} "
              f"(log {server.log})", file=sys.stderr)
        yield _make(server.base_url, home, server)
    finally:
        server.stop()


# Adapter slots of the session's real server, not the default 14: a real-model slot costs ~90 MB (idle engine 3.4 GB
# at 4 slots, 4.3 GB at 14), its engine peaks near 9 GB while it trains, and the real tests run one script at a time
# (in a pytest of their own, tests/conftest.py).
REAL_SESSION_ADAPTERS = 8


@pytest.fixture(scope="session")
def local_real_tinker(request):
    """One server of the real model (SmolLM2-135M-Instruct, `tinker_local.py setup --real`, run once here: it is
    idempotent) for the session's real-model tests: `model` is still Qwen/Qwen3-8B (the name it answers to),
    `tokenizer_dir` the real model's folder, `env` carries its HF cache and TINKER_LOCAL_STAND_IN."""
    untrack = _track_service_clients()
    request.addfinalizer(untrack)
    venv, home = request.getfixturevalue("local_backend_install")
    try:
        tinker_local.setup(venv, home, python=sys.executable if sys.version_info[:2] == (3, 11) else None, real=True)
        server = tinker_local.start_server(tinker_local.DEFAULT_MODEL, venv=venv, home=home, real=True,
                                           max_lora_adapters=REAL_SESSION_ADAPTERS)
    except tinker_local.LocalError as exc:
        pytest.fail(f"local Tinker backend (real model): {exc}", pytrace=False)
    try:
        print(f"\nlocal tinker (real model) ready in {server.ready_seconds:.1f} s at {server.base_url} "
              f"(log {server.log})", file=sys.stderr)
        yield _make(server.base_url, home, server, real=True)
    finally:
        server.stop()


@dataclass
class RealSftRun:
    log: Path        # the run folder (never write into it: copy it first)
    report: dict     # the JSON the script printed
    stderr: str
    returncode: int


@pytest.fixture(scope="session")
def local_real_sft_run(local_real_tinker, tmp_path_factory) -> RealSftRun:
    """The SFT rehearsal on the user's own data on the real model, run once per session and shared by the tests that
    judge it (tests/test_sft_real_e2e.py):
    `tinker_sft.py --rehearse --data templates/sft_example.jsonl` (the real-model preset: 48 steps, lr 2e-3 linear,
    rank 32, batch 4, held-out NLL every 8 steps)."""
    log = tmp_path_factory.mktemp("local_real_sft_run") / "runs" / "sft-real"
    log.parent.mkdir(parents=True)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "tinker_sft.py"), "--rehearse", "--data",
                          str(ROOT / "templates" / "sft_example.jsonl"), "--log-path", str(log)],
                         capture_output=True, text=True, env=local_real_tinker.env, cwd=log.parent, timeout=1500)
    lines = out.stdout.strip().splitlines()
    return RealSftRun(log, json.loads(lines[-1]) if lines else {}, out.stderr, out.returncode)


def record_output(log: Path, out) -> None:
    """Keep what a shared run printed beside its folder (not in it), for tests of what it printed (the next
    commands: tests/test_printed_commands.py, fixture_output)."""
    (log.parent.parent / f"{log.name}.output.json").write_text(json.dumps({"stdout": out.stdout, "stderr": out.stderr}))


def fixture_output(log: Path) -> dict:
    """{"stdout", "stderr"} of the run that made a shared run folder (local_sft_run, local_rl_run); it ran with
    its working directory the folder above runs/, outside the bundle."""
    return json.loads((log.parent.parent / f"{log.name}.output.json").read_text())


@pytest.fixture(scope="session")
def local_sft_run(local_tinker, tmp_path_factory) -> Path:
    """A finished SFT run folder, trained once per session on the local backend and shared by the tests
    that only read one: tinker_sft.py on templates/sft_example.jsonl, batch 4, LoRA rank 8, lr 1e-2,
    4 steps, eval and save every 2 steps, one probe of 8 tokens. Never write into it (a report, a
    resume): copy it first, `shutil.copytree(local_sft_run, tmp_path / "sft")`."""
    log = tmp_path_factory.mktemp("local_sft_run") / "runs" / "sft"
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tinker_sft.py"), "--data", str(ROOT / "templates" / "sft_example.jsonl"),
         "--tokenizer", str(local_tinker.tokenizer_dir), "--model-name", local_tinker.model, "--batch-size", "4",
         "--max-steps", "4", "--save-every", "2", "--eval-every", "2", "--learning-rate", "1e-2",
         "--lora-rank", "8", "--num-probes", "1", "--max-tokens", "8", "--log-path", str(log)],
        capture_output=True, text=True, env={**os.environ, **local_tinker.env}, timeout=900, cwd=log.parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    record_output(log, out)
    return log


LOCAL_RL_RUN = """
import sys
sys.path.insert(0, {scripts!r})
import tinker_rl

# --rehearse off: these tasks, not the script's rehearsal task
tinker_rl.TASKS = [{{"id": i}} for i in range(4)]
tinker_rl.EVAL_TASKS = [{{"id": i}} for i in range(4, 6)]  # held out, same shape
tinker_rl.render_prompt = lambda task: [{{"role": "user", "content": f"Say something {{task['id']}}."}}]
# always differs between random samples: no group ties, so iteration 0 trains
tinker_rl.reward = lambda task, text: sum(c.isascii() and c.isalpha() for c in text) / max(1, len(text))
tinker_rl.exit_process(tinker_rl.run_cli(tinker_rl.main, sys.argv[1:]))
"""


@pytest.fixture(scope="session")
def local_rl_run(local_tinker, tmp_path_factory) -> Path:
    """A finished RL run folder, trained once per session on the local backend and shared by the tests
    that only read one: tinker_rl.py (the code in LOCAL_RL_RUN: 4 tasks, reward = the share of ASCII
    letters) with batch 2, group 4, 8 new tokens, 3 iterations, a checkpoint every iteration, LoRA rank 8,
    lr 0.003, seed 0. Never write into it: copy it first, as for `local_sft_run`."""
    log = tmp_path_factory.mktemp("local_rl_run") / "runs" / "rl"
    out = subprocess.run(
        [sys.executable, "-c", LOCAL_RL_RUN.format(scripts=str(ROOT / "scripts")), "--tokenizer",
         str(local_tinker.tokenizer_dir), "--rehearse", "off", "--model-name", local_tinker.model, "--lora-rank", "8",
         "--batch-size", "2", "--group-size", "4", "--max-tokens", "8", "--iterations", "3", "--save-every", "1",
         "--learning-rate", "0.003", "--seed", "0", "--log-path", str(log)],
        capture_output=True, text=True, env={**os.environ, **local_tinker.env}, timeout=900, cwd=log.parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    record_output(log, out)
    return log


@pytest.fixture(scope="session")
def local_dpo_rehearsal(local_tinker, tmp_path_factory) -> Path:
    """A finished DPO rehearsal folder (`tinker_dpo.py --rehearse`, the preset: the built-in pairs, 10 full-batch
    steps), run once per session from the folder above runs/ (runs/dpo-rehearsal, as the preset names it) and
    shared by the tests of what it learnt and of what it printed (fixture_output). Never write into it."""
    cwd = tmp_path_factory.mktemp("local_dpo_rehearsal")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "tinker_dpo.py"), "--rehearse", "--tokenizer",
                          str(local_tinker.tokenizer_dir), "--model-name", local_tinker.model], capture_output=True,
                         text=True, env={**os.environ, **local_tinker.env}, cwd=cwd, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    log = cwd / "runs" / "dpo-rehearsal"
    record_output(log, out)
    return log
