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

One local server for the module (its own, since cases kill and restart it on the same --run-dir). Waits
are for events (a request seen by the proxy, a process ending), never for wall-clock time.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
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
DIFFS: dict[str, float] = {}  # largest |logprob difference| on PROBE from the uninterrupted run, per checked run


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


class Mortal:
    """The module's local backend: killed and started again on the same --run-dir by the cases."""

    def __init__(self, run_dir: Path):
        self.venv, self.home = tinker_local.resolve_venv(), tinker_local.resolve_home()
        tinker_local.setup(self.venv, self.home, python=sys.executable if sys.version_info[:2] == (3, 11) else None)
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


@pytest.fixture(scope="module")
def mortal(tmp_path_factory):
    server = Mortal(tmp_path_factory.mktemp("fault-server"))
    try:
        server.start()
    except tinker_local.LocalError as exc:
        pytest.fail(f"local Tinker backend: {exc}", pytrace=False)
    yield server
    if server.server is not None:
        server.server.stop()
    if TIMINGS:  # beside the module's temporary folders: script seconds per run, probe differences
        summary = {"runs": len(TIMINGS), "script_seconds": round(sum(TIMINGS.values()), 1),
                   "load_average": os.getloadavg(), "server_starts": server.starts,
                   "max_probe_difference": max(DIFFS.values(), default=None), "seconds": TIMINGS, "probe": DIFFS}
        (tmp_path_factory.getbasetemp() / "fault-summary.json").write_text(json.dumps(summary, indent=1))


def run(mortal, script, log, url, *extra, env_extra=None, timeout=300):
    argv = settings(script, mortal.tokenizer, mortal.model)
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, str(SCRIPTS / argv[0]), *argv[1:], "--log-path", str(log), *extra],
                             capture_output=True, text=True, env=mortal.env(url, **(env_extra or {})), timeout=timeout)
    except subprocess.TimeoutExpired as e:  # a hang is a failure: say where it stood
        pytest.fail(f"{script} {' '.join(extra)} still running after {timeout} s; its stderr ends:\n"
                    f"{(e.stderr or b'')[-3000:].decode(errors='replace')}\n{mortal.log_tail()}", pytrace=False)
    TIMINGS[f"{script}:{log.name}:{' '.join(extra)}"] = time.monotonic() - started
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out


def probe_logprobs(mortal, sampler_path) -> list[float]:
    import tinker

    service = tinker.ServiceClient(base_url=mortal.url, api_key=API_KEY)
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


def record(mortal, script, log) -> dict:
    rows = metrics_rows(log)
    final = [r for r in (json.loads(x) for x in (log / "checkpoints.jsonl").read_text().splitlines())
             if r["name"] == "final"]
    assert len(final) == 1, "exactly one final checkpoint"
    return {"rows": rows, "probe": probe_logprobs(mortal, final[0]["sampler_path"])}


@pytest.fixture(scope="module")
def baseline(mortal, tmp_path_factory):
    """baseline(script): the uninterrupted run's record (made once per script, through a fault-free proxy
    that also counts each operation's requests: the points the cases name must exist)."""
    made = {}

    def get(script):
        if script not in made:
            mortal.ensure()
            log = tmp_path_factory.mktemp("baseline") / script
            with FaultProxy(mortal.url) as proxy:
                out = run(mortal, script, log, proxy.base_url)
                assert out.returncode == 0, out.stderr[-3000:]
                counts = {op: proxy.count(op) for op in REQUESTS[script]}
            assert counts == REQUESTS[script], f"fault_cases.REQUESTS[{script!r}] no longer matches the run: {counts}"
            made[script] = record(mortal, script, log)
        return made[script]

    return get


def assert_same_run(mortal, script, log, base):
    """One whole row per step with the uninterrupted run's values, the cost summed once, equal final weights,
    no API key in any file written."""
    got = record(mortal, script, log)
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


@pytest.mark.parametrize("case", [c for c in CASES if c.outcome in ("absorbed", "delay")], ids=case_id)
def test_an_absorbed_fault_leaves_the_run_as_if_nothing_happened(case, mortal, baseline, tmp_path):
    base = baseline(case.script)
    mortal.ensure()
    log = tmp_path / case.script
    with FaultProxy(mortal.url, case.faults) as proxy:
        out = run(mortal, case.script, log, proxy.base_url)
        fired = sorted(str(f) for f in proxy.fired)
    assert out.returncode == 0, out.stderr[-3000:]
    assert fired == sorted(str(f) for f in case.faults), "every scheduled fault was injected"
    assert_same_run(mortal, case.script, log, base)


@pytest.mark.parametrize("case", [c for c in CASES if c.outcome == "death"], ids=case_id)
def test_a_dead_service_ends_the_run_with_exit_4_and_the_printed_command_finishes_it(case, mortal, baseline, tmp_path):
    base = baseline(case.script)
    mortal.ensure()
    log = tmp_path / case.script
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


@pytest.mark.parametrize("case", [c for c in CASES if c.outcome == "restart"], ids=case_id)
def test_a_restarted_service_fails_the_step_and_the_printed_command_finishes_it(case, mortal, baseline, tmp_path):
    base = baseline(case.script)
    mortal.ensure()
    log = tmp_path / case.script
    with FaultProxy(mortal.url, case.faults, on_death=mortal.kill, on_restart=mortal.start) as proxy:
        out = run(mortal, case.script, log, proxy.base_url)
        assert [str(f) for f in proxy.fired] == [str(f) for f in case.faults]
        assert out.returncode == 1, out.stderr[-3000:]
        resumed = run(mortal, case.script, log, proxy.base_url, next_flag(out.stderr))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(mortal, case.script, log, base)


@pytest.mark.parametrize("case", [c for c in CASES if c.outcome == "sigkill"], ids=case_id)
def test_sigkill_at_any_request_then_resume_repeats_the_uninterrupted_run(case, mortal, baseline, tmp_path):
    base = baseline(case.script)
    mortal.ensure()
    log = tmp_path / case.script
    argv = settings(case.script, mortal.tokenizer, mortal.model)
    holder = {}

    def kill():
        os.kill(holder["proc"].pid, signal.SIGKILL)  # the python process itself, never a wrapper shell

    with FaultProxy(mortal.url, case.faults, on_kill=kill) as proxy:
        started = time.monotonic()
        holder["proc"] = subprocess.Popen([sys.executable, str(SCRIPTS / argv[0]), *argv[1:], "--log-path", str(log)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          env=mortal.env(proxy.base_url))
        try:
            code = holder["proc"].wait(timeout=300)
        except subprocess.TimeoutExpired:
            holder["proc"].kill()
            pytest.fail(f"the kill moment {case.faults[0]} never came; the proxy saw: "
                        f"{[(e.op, e.n, e.fault, e.status) for e in proxy.events][-30:]}\n{mortal.log_tail()}",
                        pytrace=False)
        TIMINGS[f"{case.script}:{log.name}:killed"] = time.monotonic() - started
        assert [str(f) for f in proxy.fired] == [str(f) for f in case.faults]
    assert code == -signal.SIGKILL
    saved = bool(tinker_sft.Run(log).checkpoints())  # what --resume would continue from
    with FaultProxy(mortal.url) as proxy:
        resumed = run(mortal, case.script, log, proxy.base_url, "--resume" if saved else "--overwrite")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if saved:
        assert "resumed from tinker://" in resumed.stderr
    assert_same_run(mortal, case.script, log, base)
