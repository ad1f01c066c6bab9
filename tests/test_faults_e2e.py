"""Faults a hosted service gives, injected between the SDK and the local backend; kills at any point.

Every case of tests/fault_cases.py (the table in references/troubleshooting.md) runs one training script
(tinker_sft.py, tinker_rl.py, tinker_dpo.py, tinker_distill.py; 2 steps or iterations, tiny batches)
through tests/fault_proxy.py and checks, against an uninterrupted run of the same script on the same server:

- the run finishes (exit 0), or exits with its documented code (4 lost service, 1 runtime failure) and the
  command its last error line names continues it to the end;
- metrics.jsonl holds exactly one whole row per step (no gap, no duplicate, no torn line) with the
  uninterrupted run's values, within TOLERANCE;
- the final weights' logprobs on PROBE equal the uninterrupted run's within TOLERANCE;
- the cost rows add up (each cumulative = the previous + this step) to the uninterrupted run's total;
- no traceback on stderr, and the API key in no file the run wrote.

Two local servers of the module's own: the death and restart cases kill one and start it again on the same
--run-dir, a case at a time; the other cases share the other, never killed, two at a time. Cases run ahead of
their tests (`Ahead`), so one case's waits (SDK timeouts, back-offs, restarts) overlap another's work. Waits
are for events (a request seen by the proxy, a process ending), never for wall-clock time.
"""
from __future__ import annotations

import concurrent.futures
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tinker_local
import tinker_sft
from fault_cases import CASES, REQUESTS, Case
from fault_proxy import FaultProxy

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
API_KEY = "tml-fault-harness-4b9e2d"  # distinctive: it must appear in no file a run writes
# Logprobs of the final weights on these tokens (a short Qwen3 chat turn) compare two runs' weights.
PROBE = [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198, 59604]
# Runs on one CPU backend are bit-for-bit repeatable (measured: every value equal); the tolerance leaves
# room for a backend that reorders a reduction, far below what one training step changes (> 0.1 nats).
TOLERANCE = 1e-4
COMPARED = {"sft": ("loss", "loss_per_datum", "tokens"), "dpo": ("loss", "margin", "tokens"),
            "rl": ("reward_mean", "loss_sum", "tokens_sampled"), "distill": ("reverse_kl", "loss_sum", "tokens_sampled")}
STEP_KEY = {"sft": ("step", 1), "dpo": ("step", 1), "rl": ("iteration", 0), "distill": ("iteration", 0)}
STEPS = 2
TIMINGS: dict[str, float] = {}
DIFFS: dict[str, float] = {}
SPANS: dict[str, tuple] = {}  # case folder -> (start, end) seconds since the module's servers were up
T0 = time.monotonic()  # largest |logprob difference| on PROBE from the uninterrupted run, per checked run


def settings(script, tokenizer, model):
    common = ["--tokenizer", str(tokenizer), "--model-name", model, "--lora-rank", "8", "--learning-rate", "1e-2",
              "--save-every", "1"]
    if script == "sft":
        return ["tinker_sft.py", "--data", str(ROOT / "templates" / "sft_example.jsonl"), "--batch-size", "4",
                "--max-steps", str(STEPS), "--num-probes", "1", "--max-tokens", "4", "--test-fraction", "0",
                "--render-cache", "off", *common]
    if script == "dpo":
        return ["tinker_dpo.py", "--data", str(ROOT / "templates" / "dpo_example.jsonl"), "--batch-size", "4",
                "--max-steps", str(STEPS), "--lr-schedule", "constant", *common]
    if script == "rl":
        return ["tinker_rl.py", "--iterations", str(STEPS), "--batch-size", "2", "--group-size", "2",
                "--max-tokens", "4", *common]
    return ["tinker_distill.py", "--teacher", model, "--teacher-tokenizer", str(tokenizer), "--iterations",
            str(STEPS), "--batch-size", "2", "--group-size", "2", "--max-tokens", "4", *common]


class ModuleServer:
    """A local backend of the module's own (the mortal one is killed and started again on the same --run-dir)."""

    def __init__(self, run_dir: Path, venv: Path, home: Path):
        self.venv, self.home = venv, home
        self.run_dir, self.server = run_dir, None
        self.tokenizer = tinker_local.tiny_model_dir(self.home)
        self.model = tinker_local.DEFAULT_MODEL
        self.starts = 0

    @property
    def url(self) -> str:
        return self.server.base_url

    def start(self) -> str:
        self.server = tinker_local.start_server(self.model, venv=self.venv, home=self.home, run_dir=self.run_dir)
        self.starts += 1
        return self.server.base_url

    def kill(self) -> None:
        tinker_local.stop_group(self.server.proc, grace_sec=0)  # SIGKILL to the group: no shutdown path

    def ensure(self) -> None:
        if self.server is None or self.server.proc.poll() is not None:
            self.start()

    def log_tail(self, lines=40) -> str:
        """The server log's last lines (rich's box drawing dropped), for a failure message."""
        try:
            text = self.server.log.read_text(errors="replace").splitlines()
        except (OSError, AttributeError):
            return "(no server log)"
        kept = [x for x in text if x.strip() and not x.lstrip().startswith(("│", "╭", "╰"))]
        return "server log ends:\n" + "\n".join(kept[-lines:])

    def env(self, url, **extra) -> dict:
        env = {**os.environ, **tinker_local.client_env(url, self.home), "TINKER_API_KEY": API_KEY,
               "TINKER_UNREACHABLE_S": "600"}
        env.pop("TINKER_TEST_BASE_URL", None)
        return {**env, **extra}


def start_all(*servers) -> None:
    """Start the servers side by side (each start is mostly one process importing and building the model)."""
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        starts = [pool.submit(server.start) for server in servers]
    failed = [f.exception() for f in starts if f.exception() is not None]
    if failed:
        for server in servers:
            if server.server is not None:
                server.server.stop()
        if isinstance(failed[0], tinker_local.LocalError):
            pytest.fail(f"local Tinker backend: {failed[0]}", pytrace=False)
        raise failed[0]


class Ahead:
    """Runs each case's test body before pytest reaches the test, on two streams, so the cases' waits overlap:
    the SDK's 45-61 s timeouts (delay), Retry-After back-offs (429), TINKER_UNREACHABLE_S and server restarts.

    - steady: the absorbed, delay and SIGKILL-of-the-script cases, WIDTH at a time, on a server that is never
      killed (a run's requests go through a proxy of its own, which counts them); each script's baseline is
      made there by the first case that needs it;
    - mortal: the death and restart cases, MORTALS at a time, each on a server of its own that it kills and
      starts again.

    A test waits for its case and re-raises whatever the body raised (its assertion, with its traceback), so
    every case still passes or fails as its own test. Cases are submitted in the module's test order, at most
    LOOKAHEAD not yet taken by a test: tests another xdist worker takes over cost that worker a rerun, never a
    skipped check. Concurrent runs stay equal to the uninterrupted one: sampling is seeded per request and
    the comparisons allow 1e-4 (a step changes a loss by > 0.1)."""

    # Measured, the module alone: WIDTH 2, MORTALS 1: 316 s of wall, 289 s of CPU; 3 and 2: 289 s, 361 s. The
    # suite is CPU-bound (2 cores): fewer concurrent runs cost less CPU.
    WIDTH = 2
    MORTALS = 1
    LOOKAHEAD = 8

    def __init__(self, bodies: list):
        self.bodies = bodies  # [(case, stream, body)] in the module's test order
        self.pools = {"steady": concurrent.futures.ThreadPoolExecutor(self.WIDTH, thread_name_prefix="steady"),
                      "mortal": concurrent.futures.ThreadPoolExecutor(self.MORTALS, thread_name_prefix="mortal")}
        self.futures: dict = {}
        self.taken: set = set()
        self.lock = threading.Lock()

    def submit(self, stream: str, key, fn, *args):
        with self.lock:
            if key not in self.futures:
                self.futures[key] = self.pools[stream].submit(fn, *args)
            return self.futures[key]

    def result(self, case: Case):
        """Wait for `case` (submitting it and the next LOOKAHEAD of each stream first) and return what its body
        returned, or raise what it raised."""
        with self.lock:
            self.taken.add(case)
        at = next(i for i, b in enumerate(self.bodies) if b[0] == case)
        for stream in self.pools:
            mine = [b for b in self.bodies[at:at + 1] if b[1] == stream]
            later = [b for b in self.bodies[at + 1:] if b[1] == stream and b[0] not in self.taken]
            for c, _, body in mine + later[:self.LOOKAHEAD]:
                self.submit(stream, c, body, c)
        return self.futures[case].result()

    def close(self) -> None:
        for future in self.futures.values():
            future.cancel()
        for pool in self.pools.values():
            pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, local_backend_install):
    """(steady, mortals): local backends of the module's own; each of the Ahead.MORTALS mortal ones is killed and
    restarted by one case at a time (taken from and put back in the `mortals` queue). Their engines are forked by
    the session's engine zygote (`local_backend_install`)."""
    venv, home = local_backend_install
    steady = ModuleServer(tmp_path_factory.mktemp("steady-server"), venv, home)
    mortal = [ModuleServer(tmp_path_factory.mktemp("fault-server"), venv, home) for _ in range(Ahead.MORTALS)]
    start_all(steady, *mortal)
    global T0
    T0 = time.monotonic()
    mortals = queue.Queue()
    for server in mortal:
        mortals.put(server)
    yield steady, mortals
    for server in (steady, *mortal):
        if server.server is not None:
            server.server.stop()
    if TIMINGS:  # beside the module's temporary folders: script seconds per run, probe differences
        summary = {"runs": len(TIMINGS), "script_seconds": round(sum(TIMINGS.values()), 1),
                   "load_average": os.getloadavg(), "server_starts": sum(x.starts for x in (steady, *mortal)),
                   "max_probe_difference": max(DIFFS.values(), default=None), "seconds": TIMINGS, "probe": DIFFS,
                   "cases": SPANS}
        (tmp_path_factory.getbasetemp() / "fault-summary.json").write_text(json.dumps(summary, indent=1))


def run(server, script, log, url, *extra, env_extra=None, timeout=300):
    argv = settings(script, server.tokenizer, server.model)
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, str(SCRIPTS / argv[0]), *argv[1:], "--log-path", str(log), *extra],
                             capture_output=True, text=True, env=server.env(url, **(env_extra or {})), timeout=timeout)
    except subprocess.TimeoutExpired as e:  # a hang is a failure: say where it stood
        pytest.fail(f"{script} {' '.join(extra)} still running after {timeout} s; its stderr ends:\n"
                    f"{(e.stderr or b'')[-3000:].decode(errors='replace')}\n{server.log_tail()}", pytrace=False)
    TIMINGS[f"{log.parent.name}:{' '.join(extra)}"] = time.monotonic() - started
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out


def probe_logprobs(server, sampler_path) -> list[float]:
    import tinker

    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    try:
        sampler = service.create_sampling_client(model_path=sampler_path).result()
        return [x for x in sampler.compute_logprobs(tinker.ModelInput.from_ints(PROBE)).result() if x is not None]
    finally:
        service.close("success").result()


def metrics_rows(log: Path) -> list[dict]:
    """Every line of metrics.jsonl, each a whole JSON object (a torn line fails here)."""
    raw = (log / "metrics.jsonl").read_bytes()
    assert raw.endswith(b"\n"), "torn last line"
    return [json.loads(line) for line in raw.decode().splitlines()]


def record(server, script, log) -> dict:
    rows = metrics_rows(log)
    final = [r for r in (json.loads(x) for x in (log / "checkpoints.jsonl").read_text().splitlines())
             if r["name"] == "final"]
    assert len(final) == 1, "exactly one final checkpoint"
    return {"rows": rows, "probe": probe_logprobs(server, final[0]["sampler_path"])}


@pytest.fixture(scope="module")
def baseline(servers, tmp_path_factory):
    """baseline(script): the uninterrupted run's record on the steady server, made once per script by its first
    caller (other callers wait), through a fault-free proxy that also counts each operation's requests: the
    points the cases name must exist."""
    steady = servers[0]
    made, locks = {}, {script: threading.Lock() for script in REQUESTS}

    def get(script):
        with locks[script]:
            if script not in made:
                log = tmp_path_factory.mktemp("baseline") / script
                with FaultProxy(steady.url) as proxy:
                    out = run(steady, script, log, proxy.base_url)
                    assert out.returncode == 0, out.stderr[-3000:]
                    counts = {op: proxy.count(op) for op in REQUESTS[script]}
                assert counts == REQUESTS[script], \
                    f"fault_cases.REQUESTS[{script!r}] no longer matches the run: {counts}"
                made[script] = record(steady, script, log)
        return made[script]

    return get


def assert_same_run(server, script, log, base):
    """One whole row per step with the uninterrupted run's values, the cost summed once, equal final weights,
    no API key in any file written."""
    got = record(server, script, log)
    key, first = STEP_KEY[script]
    assert [r[key] for r in got["rows"]] == list(range(first, first + STEPS)), "one row per step, no gap or duplicate"
    for mine, theirs in zip(got["rows"], base["rows"]):
        for name in COMPARED[script]:
            a, b = mine.get(name), theirs.get(name)
            assert (a is None and b is None) or math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=TOLERANCE), (name, a, b)
    cumulative = 0.0
    for row in got["rows"]:
        if "cost/step_usd" in row:
            cumulative += row["cost/step_usd"]
            assert math.isclose(row["cost/cumulative_usd"], cumulative, rel_tol=1e-9, abs_tol=1e-12), row
    base_total = base["rows"][-1].get("cost/cumulative_usd")
    assert base_total is not None and math.isclose(cumulative, base_total, rel_tol=1e-9), (cumulative, base_total)
    assert len(got["probe"]) == len(base["probe"]) == len(PROBE) - 1
    DIFFS[str(log)] = max(abs(a - b) for a, b in zip(got["probe"], base["probe"]))
    assert DIFFS[str(log)] <= TOLERANCE
    for path in log.rglob("*"):
        if path.is_file():
            assert API_KEY.encode() not in path.read_bytes(), f"the API key is written in {path}"


def next_flag(stderr: str) -> str:
    """The flag the script's last error line says continues the run."""
    last = [x for x in stderr.splitlines() if x.startswith("error:")][-1]
    if "plus --resume" in last:
        return "--resume"
    assert "again with --overwrite" in last, last
    return "--overwrite"


def case_id(case: Case) -> str:
    return f"{case.id}-{'-'.join(f'{f.op}{f.nth}' for f in case.faults)}"


def absorbed(case, steady, baseline, folder):
    base = baseline(case.script)
    log = folder / case.script
    with FaultProxy(steady.url, case.faults) as proxy:
        out = run(steady, case.script, log, proxy.base_url)
        fired = sorted(str(f) for f in proxy.fired)
    assert out.returncode == 0, out.stderr[-3000:]
    assert fired == sorted(str(f) for f in case.faults), "every scheduled fault was injected"
    assert_same_run(steady, case.script, log, base)


def death(case, mortal, baseline, folder):
    base = baseline(case.script)
    mortal.ensure()
    log = folder / case.script
    with FaultProxy(mortal.url, case.faults, on_death=mortal.kill) as proxy:
        out = run(mortal, case.script, log, proxy.base_url, env_extra={"TINKER_UNREACHABLE_S": "3"})
        assert [str(f) for f in proxy.fired] == [str(f) for f in case.faults]
    assert out.returncode == 4, out.stderr[-3000:]
    assert "lost Tinker at" in out.stderr
    flag = next_flag(out.stderr)
    mortal.start()
    with FaultProxy(mortal.url) as proxy:
        resumed = run(mortal, case.script, log, proxy.base_url, flag)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(mortal, case.script, log, base)


def restart(case, mortal, baseline, folder):
    base = baseline(case.script)
    mortal.ensure()
    log = folder / case.script
    with FaultProxy(mortal.url, case.faults, on_death=mortal.kill, on_restart=mortal.start) as proxy:
        out = run(mortal, case.script, log, proxy.base_url)
        assert [str(f) for f in proxy.fired] == [str(f) for f in case.faults]
        assert out.returncode == 1, out.stderr[-3000:]
        resumed = run(mortal, case.script, log, proxy.base_url, next_flag(out.stderr))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(mortal, case.script, log, base)


def sigkill(case, steady, baseline, folder):
    base = baseline(case.script)
    log = folder / case.script
    argv = settings(case.script, steady.tokenizer, steady.model)
    holder = {}

    def kill():
        os.kill(holder["proc"].pid, signal.SIGKILL)  # the python process itself, never a wrapper shell

    with FaultProxy(steady.url, case.faults, on_kill=kill) as proxy:
        started = time.monotonic()
        holder["proc"] = subprocess.Popen([sys.executable, str(SCRIPTS / argv[0]), *argv[1:], "--log-path", str(log)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          env=steady.env(proxy.base_url))
        try:
            code = holder["proc"].wait(timeout=300)
        except subprocess.TimeoutExpired:
            holder["proc"].kill()
            pytest.fail(f"the kill moment {case.faults[0]} never came; the proxy saw: "
                        f"{[(e.op, e.n, e.fault, e.status) for e in proxy.events][-30:]}\n{steady.log_tail()}",
                        pytrace=False)
        TIMINGS[f"{log.parent.name}:killed"] = time.monotonic() - started
        assert [str(f) for f in proxy.fired] == [str(f) for f in case.faults]
    assert code == -signal.SIGKILL
    saved = bool(tinker_sft.Run(log).checkpoints())  # what --resume would continue from
    with FaultProxy(steady.url) as proxy:
        resumed = run(steady, case.script, log, proxy.base_url, "--resume" if saved else "--overwrite")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if saved:
        assert "resumed from tinker://" in resumed.stderr
    assert_same_run(steady, case.script, log, base)


# The delay cases first: mostly a wait past the SDK's timeout, it overlaps the most work started after it.
ABSORBED_CASES = sorted((c for c in CASES if c.outcome in ("absorbed", "delay")), key=lambda c: c.outcome != "delay")
DEATH_CASES = [c for c in CASES if c.outcome == "death"]
RESTART_CASES = [c for c in CASES if c.outcome == "restart"]
SIGKILL_CASES = [c for c in CASES if c.outcome == "sigkill"]
# (cases, stream, body) in the order pytest runs the tests below
BODIES = [(ABSORBED_CASES, "steady", absorbed), (DEATH_CASES, "mortal", death), (RESTART_CASES, "mortal", restart),
          (SIGKILL_CASES, "steady", sigkill)]


@pytest.fixture(scope="module")
def ahead(servers, baseline, tmp_path_factory, request):
    """The module's Ahead, over the cases whose tests this session selected (`-k` runs only those)."""
    steady, mortals = servers
    selected = {item.callspec.params["case"] for item in request.session.items
                if item.path == request.path and hasattr(item, "callspec")}

    def bind(body, stream):
        def go(case):
            folder, began = tmp_path_factory.mktemp(case.id), time.monotonic()
            server = steady if stream == "steady" else mortals.get()
            try:
                return body(case, server, baseline, folder)
            finally:
                SPANS[folder.name] = (round(began - T0, 1), round(time.monotonic() - T0, 1))
                if server is not steady:
                    mortals.put(server)
        return go

    runner = Ahead([(c, stream, bind(body, stream)) for cases, stream, body in BODIES for c in cases
                    if c in selected])
    yield runner
    runner.close()


@pytest.mark.parametrize("case", ABSORBED_CASES, ids=case_id)
def test_an_absorbed_fault_leaves_the_run_as_if_nothing_happened(case, ahead):
    ahead.result(case)


@pytest.mark.parametrize("case", DEATH_CASES, ids=case_id)
def test_a_dead_service_ends_the_run_with_exit_4_and_the_printed_command_finishes_it(case, ahead):
    ahead.result(case)


@pytest.mark.parametrize("case", RESTART_CASES, ids=case_id)
def test_a_restarted_service_fails_the_step_and_the_printed_command_finishes_it(case, ahead):
    ahead.result(case)


@pytest.mark.parametrize("case", SIGKILL_CASES, ids=case_id)
def test_sigkill_at_any_request_then_resume_repeats_the_uninterrupted_run(case, ahead):
    ahead.result(case)
