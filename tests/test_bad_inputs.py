"""Bad inputs and faults over every script, as a new user meets them (issue 13).

Each case runs a script as a subprocess in its own empty workspace (cwd), with no TINKER_* variable unless
the case sets one, HF_HUB_OFFLINE=1, HOME inside the workspace, and asserts:
  - the documented exit code;
  - exactly one error line on stderr (`error: ...` or argparse's `prog: error: ...`) holding the
    expected text, and no traceback;
  - no file in the workspace changed, appeared or vanished (a refused run touches nothing), except
    inside the case's run folder when it has one;
  - nothing new is half-written: every new or changed .json parses, every .jsonl line parses, no
    *.partial* / staging leftovers;
  - the API key (a unique value per session) appears in no output and no file.
Cases run concurrently (3 at a time) the first time any of them is needed; each test then checks one.
The interrupted-run cases (SIGINT, SIGTERM) and the key-in-no-file check need the local backend (e2e).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fixtures_local import sigint_default

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
KEY = f"tml-badinputs-{secrets.token_hex(8)}"  # never a real key; grepped for everywhere
DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once
UNRESOLVABLE = "http://no-such-host.invalid:8000"  # .invalid never resolves (RFC 2606)
# A dead endpoint must fail well before the SDK's >300 s of retries. The bound is loose because importing
# tinker + transformers alone takes 15-70 s on this shared 2-core machine under load (0.7 s for infer idle).
FAST_S = 150.0
WORKERS = 3
CASE_TIMEOUT_S = 180.0  # a case still running then is a hang (the old dead-endpoint cases ran > 300 s)

GOOD_ROW = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}


def write_workspace(ws: Path) -> None:
    """The inputs every case may point at (relative to the workspace)."""
    good = "".join(json.dumps(GOOD_ROW) + "\n" for _ in range(4))
    files = {
        "good.jsonl": good.encode(),
        "prompts.jsonl": b'{"prompt": "hi"}\n{"prompt": "there"}\n',
        "prefs.jsonl": b'{"prompt": "2+2?", "chosen": "4", "rejected": "5"}\n' * 4,
        "latin1.jsonl": json.dumps(GOOD_ROW).encode() + b'\n{"prompt": "caf\xe9"}\n',
        "malformed.jsonl": json.dumps(GOOD_ROW).encode() + b'\n{"messages": [\n',
        "empty.jsonl": b"",
        "blank.jsonl": b"\n\n  \n",
        "array.jsonl": b'[1, 2, 3]\n',
        "no_assistant.jsonl": b'{"messages": [{"role": "user", "content": "hi"}]}\n',
        "out_of_order.jsonl": b'{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}\n',
        "bad_role.jsonl": b'{"messages": [{"role": "wizard", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
        "non_string_content.jsonl": b'{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "b"}]}\n',
        "afile.txt": b"a file, not a folder\n",
        "full/keep.txt": b"mine\n",
        "notadapter/adapter_config.json": b"{not json",
        "notadapter/adapter_model.safetensors": b"\0" * 16,
        "base/config.json": b"{}",
        "torn_run/checkpoints.jsonl": b'{"name": "0000',
        "proj/TINKER_PRICING.md": b"# my own notes\n",
        "prev_run/config.json": b'{"model_name": "Qwen/Qwen3-8B"}\n',
        "prev_run/metrics.jsonl": b'{"step": 0, "loss": 1.0}\n',
    }
    for name, data in files.items():
        path = ws / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (ws / "adir").mkdir()
    (ws / "empty_run").mkdir()
    (ws / "home").mkdir()


@dataclasses.dataclass
class Case:
    id: str
    script: str
    args: list
    code: int
    says: str  # text the one error line must contain
    env: dict = dataclasses.field(default_factory=dict)
    run_dir: str | None = None  # the only folder allowed to change
    fast: bool = False  # must end within FAST_S


def C(id, script, args, code, says, **kw):
    return Case(id, script, args if isinstance(args, list) else args.split(), code, says, **kw)


SFT_DRY = "--dry-run --data good.jsonl --tokenizer {tok}"
RL_DRY = "--dry-run --tokenizer {tok}"
WITH_KEY = {"TINKER_API_KEY": KEY}

CASES = [
    # ---- data ----
    C("sft-data-missing", "sft", "--dry-run --data nope.jsonl --tokenizer {tok}", 2, "nope.jsonl"),
    C("sft-data-folder", "sft", "--dry-run --data adir --tokenizer {tok}", 2, "adir"),
    C("sft-data-not-utf8", "sft", "--dry-run --data latin1.jsonl --tokenizer {tok}", 2, "line 2"),
    C("sft-data-malformed-json", "sft", "--dry-run --data malformed.jsonl --tokenizer {tok}", 2, "line 2"),
    C("sft-data-empty", "sft", "--dry-run --data empty.jsonl --tokenizer {tok}", 2, "empty.jsonl"),
    C("sft-data-blank-lines-only", "sft", "--dry-run --data blank.jsonl --tokenizer {tok}", 2, "blank.jsonl"),
    C("sft-data-array-row", "sft", "--dry-run --data array.jsonl --tokenizer {tok}", 2, "line 1"),
    C("sft-data-no-assistant", "sft", "--dry-run --data no_assistant.jsonl --tokenizer {tok}", 2, "assistant"),
    C("sft-data-roles-out-of-order", "sft", "--dry-run --data out_of_order.jsonl --tokenizer {tok}", 2, "order"),
    C("sft-data-unknown-role", "sft", "--dry-run --data bad_role.jsonl --tokenizer {tok}", 2, "wizard"),
    C("sft-data-non-string-content", "sft", "--dry-run --data non_string_content.jsonl --tokenizer {tok}", 2,
      "string"),
    C("infer-input-not-utf8", "infer", "--input latin1.jsonl", 2, "latin1.jsonl line 2"),
    C("infer-input-malformed-json", "infer", "--input malformed.jsonl", 2, "malformed.jsonl line 2"),
    C("infer-input-missing", "infer", "--input nope.jsonl", 2, "nope.jsonl"),
    C("infer-input-folder", "infer", "--input adir", 2, "folder"),
    C("infer-input-empty", "infer", "--input empty.jsonl", 2, "empty.jsonl"),
    C("infer-input-array-row", "infer", "--input array.jsonl", 2, "array.jsonl:1"),
    C("infer-messages-not-a-list", "infer", ["--messages", '{"role": "user"}'], 2, "--messages"),
    C("infer-messages-not-json", "infer", ["--messages", "[{"], 2, "--messages is not JSON"),
    C("infer-run-without-record", "infer", "--run empty_run --prompt hi", 2, "checkpoints.jsonl not found"),
    C("infer-run-torn-record-only", "infer", "--run torn_run --prompt hi", 2, "no checkpoint yet"),
    C("infer-old-checkpoints-command", "infer", "checkpoints list --run r", 2,
      "is now tinker_checkpoints.py; next: "),
    C("pricing-sft-data-missing", "pricing", "estimate-sft --data nope.jsonl --tokenizer {tok} --json", 2,
      "nope.jsonl"),
    C("pricing-sft-data-not-utf8", "pricing", "estimate-sft --data latin1.jsonl --tokenizer {tok} --json", 2,
      "latin1.jsonl"),
    # ---- flags: nan, inf, 0, negative, not a number ----
    C("sft-lr-nan", "sft", SFT_DRY + " --learning-rate nan", 2, "--learning-rate"),
    C("sft-lr-inf", "sft", SFT_DRY + " --learning-rate inf", 2, "--learning-rate"),
    C("sft-lr-zero", "sft", SFT_DRY + " --learning-rate 0", 2, "--learning-rate"),
    C("sft-lr-negative", "sft", SFT_DRY + " --learning-rate -1e-4", 2, "--learning-rate"),
    C("sft-max-steps-negative", "sft", SFT_DRY + " --max-steps -3", 2, "--max-steps"),
    C("sft-max-steps-zero", "sft", SFT_DRY + " --max-steps 0", 2, "--max-steps"),
    C("sft-batch-size-zero", "sft", SFT_DRY + " --batch-size 0", 2, "--batch-size"),
    C("sft-epochs-nan", "sft", SFT_DRY + " --epochs nan", 2, "--epochs"),
    C("sft-max-usd-nan", "sft", SFT_DRY + " --max-usd nan", 2, "--max-usd"),
    C("sft-max-usd-negative", "sft", SFT_DRY + " --max-usd -1", 2, "--max-usd"),
    C("sft-lora-rank-zero", "sft", SFT_DRY + " --lora-rank 0", 2, "--lora-rank"),
    C("sft-test-fraction-above-1", "sft", SFT_DRY + " --test-fraction 1.5", 2, "--test-fraction"),
    C("sft-batch-size-not-a-number", "sft", SFT_DRY + " --batch-size abc", 2, "--batch-size"),
    C("rl-lr-nan", "rl", RL_DRY + " --learning-rate nan", 2, "--learning-rate"),
    C("rl-lr-zero", "rl", RL_DRY + " --learning-rate 0", 2, "--learning-rate"),
    C("rl-iterations-negative", "rl", RL_DRY + " --iterations -1", 2, "--iterations"),
    C("rl-group-size-one", "rl", RL_DRY + " --group-size 1", 2, "--group-size"),
    C("rl-max-usd-nan", "rl", RL_DRY + " --max-usd nan", 2, "--max-usd"),
    C("rl-temperature-inf", "rl", RL_DRY + " --temperature inf", 2, "--temperature"),
    C("rl-batch-size-zero", "rl", RL_DRY + " --batch-size 0", 2, "--batch-size"),
    C("rl-max-tokens-zero", "rl", RL_DRY + " --max-tokens 0", 2, "--max-tokens"),
    C("infer-temperature-nan", "infer", "--prompt hi --temperature nan", 2, "--temperature nan"),
    C("infer-temperature-negative", "infer", "--prompt hi --temperature -1", 2, "--temperature"),
    C("infer-top-p-above-1", "infer", "--prompt hi --top-p 1.5", 2, "--top-p"),
    C("infer-max-tokens-zero", "infer", "--prompt hi --max-tokens 0", 2, "--max-tokens"),
    C("infer-n-negative", "infer", "--prompt hi --n -1", 2, "--n"),
    C("infer-timeout-zero", "infer", "--http --prompt hi --timeout 0", 2, "--timeout"),
    C("infer-max-tokens-not-a-number", "infer", "--prompt hi --max-tokens abc", 2, "--max-tokens"),
    C("checkpoints-list-limit-negative", "checkpoints", "list --limit -1", 2, "--limit"),
    C("pricing-rl-absurd-sizes", "pricing", "estimate-rl --iterations 10000000000 --tasks-per-iter "
      "1000000000000 --group-size 100000000000 --avg-prompt 1e300 --avg-completion 1e300 --json", 2, "overflows"),
    C("pricing-rl-huge-ints", "pricing", ["estimate-rl", "--iterations", str(10 ** 200), "--tasks-per-iter",
                                          str(10 ** 200), "--group-size", "2", "--avg-prompt", "1",
                                          "--avg-completion", "1", "--json"], 2, "overflows"),
    C("pricing-train-tokens-negative", "pricing", "estimate --train-tokens -5 --json", 2, "-5"),
    C("pricing-group-size-nan", "pricing", "estimate-rl --iterations 1 --tasks-per-iter 1 --group-size nan "
      "--avg-prompt 1 --avg-completion 1 --json", 2, "nan"),
    C("pricing-max-usd-inf", "pricing", "estimate --train-tokens 5 --max-usd inf --json", 2, "inf"),
    C("pricing-unknown-model", "pricing", "show Qwen/Qwen9-1T --json", 2, "Qwen9"),
    C("local-run-without-command", "local", "run", 2, "needs a command"),
    C("local-port-not-a-number", "local", "serve --port abc", 2, "--port"),
    C("local-unknown-subcommand", "local", "launch", 2, "invalid choice"),
    # ---- paths ----
    C("sft-log-path-is-a-file", "sft", SFT_DRY + " --log-path afile.txt", 2, "afile.txt"),
    C("sft-log-path-unwritable", "sft", SFT_DRY + " --log-path /dev/null/run", 2, "/dev/null"),
    C("sft-log-path-holds-a-run", "sft", "--data good.jsonl --tokenizer {tok} --log-path prev_run", 2,
      "already holds a run", env=WITH_KEY),
    C("sft-tokenizer-folder-missing", "sft", "--dry-run --data good.jsonl --tokenizer ./no-tokenizer", 2,
      "no-tokenizer"),
    C("rl-log-path-is-a-file", "rl", RL_DRY + " --log-path afile.txt", 2, "afile.txt"),
    C("rl-log-path-unwritable", "rl", RL_DRY + " --log-path /dev/null/run", 2, "/dev/null"),
    C("infer-out-is-a-folder", "infer", "--prompt hi --out adir", 2, "adir"),
    C("infer-out-unwritable", "infer", "--prompt hi --out /dev/null/x/out.jsonl", 2, "/dev/null"),
    C("checkpoints-export-out-is-a-file", "checkpoints", "export tinker://r/sampler_weights/f --out afile.txt",
      2, "afile.txt", env=WITH_KEY),
    C("checkpoints-export-out-not-empty", "checkpoints", "export tinker://r/sampler_weights/f --out full", 2,
      "--overwrite", env=WITH_KEY),
    C("checkpoints-merge-not-an-adapter", "checkpoints", "merge adir --base adir --out merged", 2,
      "not a PEFT adapter"),
    C("checkpoints-merge-adapter-config-not-json", "checkpoints", "merge notadapter --base base --out m",
      2, "adapter_config.json is not JSON"),
    C("pricing-init-out-is-a-file", "pricing", "init --out afile.txt --json", 2, "afile.txt"),
    C("pricing-init-keeps-an-existing-file", "pricing", "init --out proj --json", 2, "--force"),
    # ---- credentials ----
    C("sft-no-key", "sft", "--data good.jsonl --tokenizer {tok} --log-path r", 4, "TINKER_API_KEY"),
    C("rl-no-key", "rl", "--tokenizer {tok} --log-path r", 4, "TINKER_API_KEY"),
    C("infer-no-key", "infer", "--model tinker://r/sampler_weights/f --prompt hi", 4, "TINKER_API_KEY"),
    C("infer-key-without-tml-prefix", "infer", "--model tinker://r/sampler_weights/f --prompt hi", 4, "tml-",
      env={"TINKER_API_KEY": "sk-" + KEY[4:]}),
    C("checkpoints-list-no-key", "checkpoints", "list --json", 4, "TINKER_API_KEY"),
    C("infer-http-no-key", "infer", "--http --prompt hi", 4, "TINKER_API_KEY"),
    # ---- endpoints: fail fast with exit 4, naming the URL ----
    C("infer-dead-base-url", "infer", "--model tinker://r/sampler_weights/f --prompt hi", 4, DEAD,
      env={**WITH_KEY, "TINKER_BASE_URL": DEAD}, fast=True),
    C("infer-unresolvable-base-url", "infer", "--model tinker://r/sampler_weights/f --prompt hi", 4,
      "does not resolve", env={**WITH_KEY, "TINKER_BASE_URL": UNRESOLVABLE}, fast=True),
    C("infer-base-url-not-http", "infer", "--model tinker://r/sampler_weights/f --prompt hi", 4, "http(s)",
      env={**WITH_KEY, "TINKER_BASE_URL": "ftp://127.0.0.1:21"}, fast=True),
    C("infer-http-dead-base-url", "infer", f"--http --base-url {DEAD}/oai/api/v1 --prompt hi", 4, "--base-url",
      env=WITH_KEY, fast=True),
    C("checkpoints-list-dead-base-url", "checkpoints", "list --json", 4, DEAD,
      env={**WITH_KEY, "TINKER_BASE_URL": DEAD}, fast=True),
    C("checkpoints-export-dead-base-url", "checkpoints", "export tinker://r/sampler_weights/f --out o", 4, DEAD,
      env={**WITH_KEY, "TINKER_BASE_URL": DEAD}, fast=True),
    C("sft-dead-base-url", "sft", "--data good.jsonl --tokenizer {tok} --log-path r", 4, DEAD,
      env={**WITH_KEY, "TINKER_BASE_URL": DEAD}, fast=True),
    C("rl-dead-base-url", "rl", "--tokenizer {tok} --log-path r", 4, DEAD,
      env={**WITH_KEY, "TINKER_BASE_URL": DEAD}, fast=True),
    C("pricing-refresh-dead-url", "pricing", f"refresh --url {DEAD}/models.json --timeout 2 --json", 4,
      "kept the current prices", fast=True),
    # ---- archives and downloads from a server that misbehaves (the fake REST server below) ----
    C("checkpoints-export-unsafe-archive", "checkpoints", "export tinker://run-x/sampler_weights/evil --out o",
      1, "leaves the target folder", env={**WITH_KEY, "TINKER_BASE_URL": "{fake}"}),
    C("checkpoints-export-download-host-unresolvable", "checkpoints",
      "export tinker://run-x/external_weights/final --out o", 4, "no-such-host.invalid",
      env={**WITH_KEY, "TINKER_BASE_URL": "{fake}"}),
    C("checkpoints-export-truncated-download", "checkpoints", "export tinker://run-x/sampler_weights/short --out o",
      1, "stopped at", env={**WITH_KEY, "TINKER_BASE_URL": "{fake}"}),
]
# Scripts that exist only on some branches get cases only when present.
if (SCRIPTS / "tinker_dpo.py").exists():
    CASES += [
        C("dpo-data-missing", "dpo", "--dry-run --data nope.jsonl --tokenizer {tok}", 2, "nope.jsonl"),
        C("dpo-data-not-preference-pairs", "dpo", "--dry-run --data good.jsonl --tokenizer {tok}", 2, "chosen"),
        C("dpo-lr-nan", "dpo", "--dry-run --data prefs.jsonl --tokenizer {tok} --learning-rate nan", 2,
          "--learning-rate"),
        C("dpo-no-key", "dpo", "--data prefs.jsonl --tokenizer {tok} --log-path r", 4, "TINKER_API_KEY"),
    ]
if (SCRIPTS / "tinker_distill.py").exists():
    TEACHER = "--teacher Qwen/Qwen3-32B --teacher-tokenizer {tok} --tokenizer {tok}"
    CASES += [
        C("distill-no-teacher", "distill", "--dry-run --prompts prompts.jsonl --tokenizer {tok}", 2, "--teacher"),
        C("distill-prompts-missing", "distill", "--dry-run --prompts nope.jsonl " + TEACHER, 2, "nope.jsonl"),
        C("distill-prompts-not-utf8", "distill", "--dry-run --prompts latin1.jsonl " + TEACHER, 2, "line 2"),
        C("distill-lr-nan", "distill", "--dry-run --prompts prompts.jsonl --learning-rate nan " + TEACHER, 2,
          "--learning-rate"),
        C("distill-no-key", "distill", "--prompts prompts.jsonl --log-path r " + TEACHER, 4, "TINKER_API_KEY"),
    ]

ERROR_LINE = re.compile(r"^(?:[\w.\- ]+: )?error\b", re.I)  # `error: ...` or argparse's `prog [sub]: error: ...`


# ---- a REST server that misbehaves: unsafe archive, truncated download, signed URLs to nowhere ----
def tar_bytes(entries) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def fake_tinker():
    evil = tar_bytes([("adapter_config.json", b"{}"), ("../../escaped.txt", b"x")])

    class Handler(BaseHTTPRequestHandler):
        def send(self, status, data, headers=()):
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = {"use_pyqwest_transport": False} if self.path.endswith("/client/config") else {}
            self.send(200, json.dumps(body).encode(), [("Content-Type", "application/json")])

        def do_GET(self):
            if self.path.endswith("/external_weights_urls"):
                body = {"urls": {"adapter_model.safetensors": "http://no-such-host.invalid/adapter"},
                        "expires": "2099-01-01T00:00:00Z"}
                self.send(200, json.dumps(body).encode(), [("Content-Type", "application/json")])
            elif self.path.endswith("/checkpoints/evil/archive"):
                self.send(200, evil, [("Content-Length", str(len(evil)))])
            elif self.path.endswith("/checkpoints/short/archive"):
                self.send(200, evil[:10], [("Content-Length", str(len(evil)))])  # the connection ends early
            else:
                self.send(404, b'{"detail": "Not Found"}', [("Content-Type", "application/json")])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# ---- running a case ----
def snapshot(ws: Path) -> dict[str, str]:
    """relative path -> sha256 (files) or 'dir'; the home folder (caches) is not the user's project."""
    out = {}
    for p in sorted(ws.rglob("*")):
        rel = p.relative_to(ws).as_posix()
        if rel == "home" or rel.startswith("home/"):
            continue
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def base_env(ws: Path) -> dict:
    keep = ("PATH", "LANG", "LC_ALL", "TMPDIR", "TINKER_TEST_ASSETS", "TINKER_LOCAL_HOME", "TINKER_LOCAL_VENV")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(HOME=str(ws / "home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TINKER_TELEMETRY="0",
               PYTHONPATH="", PYTHONDONTWRITEBYTECODE="1")
    return env


def run_case(case: Case, ws: Path, tok: str, fake: str) -> dict:
    write_workspace(ws)
    before = snapshot(ws)
    args = [a.replace("{tok}", tok) for a in case.args]
    env = base_env(ws)
    env.update({k: v.replace("{fake}", fake) for k, v in case.env.items()})
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(SCRIPTS / f"tinker_{case.script}.py"), *args], cwd=ws, env=env,
                              capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = f"hung for {CASE_TIMEOUT_S:g} s", e.stdout or "", e.stderr or ""
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x for x in (out, err))
    return {"code": code, "stdout": out, "stderr": err, "seconds": time.monotonic() - started,
            "before": before, "after": snapshot(ws), "ws": ws}


@pytest.fixture(scope="module")
def results(request, tmp_path_factory, offline_tokenizer, fake_tinker):
    """Runs every selected case once, WORKERS at a time; {case id: result}."""
    selected = {item.callspec.params["case"].id for item in request.session.items
                if getattr(item, "callspec", None) and isinstance(item.callspec.params.get("case"), Case)}
    tok = offline_tokenizer("Qwen3-8B")
    root = tmp_path_factory.mktemp("bad-inputs")
    todo = [c for c in CASES if c.id in selected]
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        futures = {c.id: pool.submit(run_case, c, root / c.id, tok, fake_tinker) for c in todo}
        return {cid: f.result() for cid, f in futures.items()}


def half_written(ws: Path, rel: str) -> str | None:
    """Why a new or changed file looks half-written, or None."""
    path = ws / rel
    if ".partial" in rel or "/.tmp" in f"/{rel}":
        return "a staging leftover"
    if path.is_dir():
        return None
    text = path.read_bytes()
    try:
        if rel.endswith(".json"):
            json.loads(text)
        elif rel.endswith(".jsonl"):
            if text and not text.endswith(b"\n"):
                return "its last line has no newline"
            for line in text.splitlines():
                if line.strip():
                    json.loads(line)
    except ValueError as e:
        return f"does not parse ({e})"
    return None


@pytest.mark.timeout(3600)  # the first test waits for every case (the module fixture runs them all)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_or_fault_ends_cleanly(case, results):
    r = results[case.id]
    where = f"tinker_{case.script}.py exit {r['code']}; stderr:\n{r['stderr'][-2000:]}"
    assert r["code"] == case.code, where
    assert "Traceback" not in r["stderr"], where
    errors = [line for line in r["stderr"].splitlines() if ERROR_LINE.match(line.strip())]
    assert len(errors) == 1, f"expected one error line, got {len(errors)}: {where}"
    assert case.says in errors[0], where
    if case.fast:
        assert r["seconds"] < FAST_S, f"took {r['seconds']:.0f} s: {where}"
    before, after = r["before"], r["after"]
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    allowed = case.run_dir
    outside = [p for p in changed if not (allowed and (p == allowed or p.startswith(allowed + "/")))]
    assert outside == [], f"files changed outside the run folder: {outside}"
    bad = {p: why for p in changed if p in after and (why := half_written(r["ws"], p))}
    assert bad == {}, bad
    assert KEY not in r["stdout"] + r["stderr"], "the API key was printed"
    assert not [p for p in after if after[p] != "dir" and KEY.encode() in (r["ws"] / p).read_bytes()]


def test_the_table_covers_every_script_and_fault_kind():
    scripts = {c.script for c in CASES}
    assert {"sft", "rl", "infer", "checkpoints", "pricing", "local"} <= scripts
    assert len(CASES) >= 60
    assert {c.code for c in CASES} >= {1, 2, 4}


# ---- interrupted local rehearsals (e2e) ----
def live_pids_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(proc.name) != os.getpid():
                pids.append(int(proc.name))
    return pids


def wait_for_checkpoint(run: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = run / "checkpoints.jsonl"
        if rows.exists() and rows.read_text().count("\n") >= 1:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before its first checkpoint: "
                        f"{proc.stderr.read()[-2000:]}")
        time.sleep(1)
    proc.kill()
    pytest.fail(f"no checkpoint row within {timeout_s:.0f} s")


def assert_run_record_whole(run: Path) -> list[dict]:
    for f in run.iterdir():
        why = half_written(run, f.name)
        assert why is None, f"{f.name}: {why}"
    assert json.loads((run / "config.json").read_text())
    return [json.loads(line) for line in (run / "checkpoints.jsonl").read_text().splitlines()]


def sft_rehearsal(tokenizer_dir, log_path, *extra):
    """A 6-step SFT run on the local backend saving every step (not --rehearse: its learning checks need
    its full 60 steps and probes, and this test is about interruption)."""
    data = Path(log_path).parent / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(GOOD_ROW) + "\n" for _ in range(24)))  # 6 batches of 4: one epoch
    return [sys.executable, str(SCRIPTS / "tinker_sft.py"), "--data", str(data), "--tokenizer", str(tokenizer_dir),
            "--log-path", str(log_path), "--learning-rate", "1e-2", "--batch-size", "4", "--max-steps", "6",
            "--save-every", "1", "--num-probes", "0", *extra]


@pytest.fixture(scope="module")
def interrupted_sft(local_tinker, tmp_path_factory):
    """An SFT rehearsal on the local backend, SIGINT after its first checkpoint, then resumed; run with a
    unique API key so the key check below can grep everything it wrote."""
    ws = tmp_path_factory.mktemp("sigint")
    run = ws / "run"
    env = {**local_tinker.env, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    # 10 epochs (50 steps, a checkpoint each): the run is still going, tens of seconds of steps away from its
    # end, when the signal sent after the first checkpoint row lands, however fast a step is
    cmd = sft_rehearsal(local_tinker.tokenizer_dir, run, "--epochs", "10", "--max-steps", "50")
    proc = subprocess.Popen(cmd, cwd=ws, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)
    wait_for_checkpoint(run, proc, 900)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    rows = assert_run_record_whole(run)
    resumed = subprocess.run(cmd + ["--resume"], cwd=ws, env=env, capture_output=True, text=True, timeout=1800)
    return {"code": proc.returncode, "stdout": out, "stderr": err, "rows": rows, "resumed": resumed, "ws": ws,
            "run": run, "env": env}


@pytest.mark.e2e
def test_sigint_during_a_rehearsal_is_recorded_and_resumable(interrupted_sft):
    r = interrupted_sft
    assert r["code"] == 130, r["stderr"][-2000:]
    assert "Traceback" not in r["stderr"]
    assert [line for line in r["stderr"].splitlines() if line.startswith("interrupted:")], r["stderr"][-500:]
    assert r["rows"] and all(row.get("state_path") for row in r["rows"])
    resumed = r["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final = assert_run_record_whole(r["run"])
    assert final[: len(r["rows"])] == r["rows"]  # resume appends; it never rewrites what was recorded
    assert max(row.get("step", 0) for row in final) == 50  # 10 epochs of 5 steps, each once


@pytest.mark.e2e
def test_sigterm_to_the_local_launcher_records_the_run_and_leaves_no_server(local_tinker, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    for k in ("TINKER_API_KEY", "TINKER_BASE_URL"):
        env.pop(k, None)
    server_dir = tmp_path / "server"
    cmd = [sys.executable, str(SCRIPTS / "tinker_local.py"), "run", "--run-dir", str(server_dir), "--",
           *sft_rehearsal(local_tinker.tokenizer_dir, run)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(run, proc, 900)
    assert live_pids_mentioning(str(server_dir)), "no server process found while the run was going"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode in (143, 130, -signal.SIGTERM), err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    rows = assert_run_record_whole(run)
    assert rows and all(row.get("state_path") for row in rows)
    deadline = time.monotonic() + 30
    while live_pids_mentioning(str(server_dir)) and time.monotonic() < deadline:
        time.sleep(1)
    assert live_pids_mentioning(str(server_dir)) == [], "a server process outlived the launcher"
    # Resumable: the record passes the resume checks (a dry run reads it and leaves the record as it was;
    # it writes only its datums.jsonl audit file).
    record = ("config.json", "metrics.jsonl", "checkpoints.jsonl")
    before = {k: v for k, v in snapshot(run).items() if k in record}
    check = subprocess.run([*sft_rehearsal(local_tinker.tokenizer_dir, run), "--resume", "--dry-run"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-2000:]
    assert {k: v for k, v in snapshot(run).items() if k in record} == before


@pytest.mark.e2e
def test_the_api_key_is_in_no_file_any_script_or_the_local_backend_writes(interrupted_sft, local_tinker):
    r = interrupted_sft
    ws, env = r["ws"], r["env"]
    answers = ws / "answers.jsonl"
    sampled = subprocess.run([sys.executable, str(SCRIPTS / "tinker_infer.py"), "--run", str(r["run"]), "--prompt",
                              "hi", "--max-tokens", "4", "--out", str(answers), "--json"], cwd=ws, env=env,
                             capture_output=True, text=True, timeout=600)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    priced = subprocess.run([sys.executable, str(SCRIPTS / "tinker_pricing.py"), "init", "--out", str(ws / "proj")],
                            cwd=ws, env=env, capture_output=True, text=True, timeout=300)
    assert priced.returncode == 0, priced.stderr[-2000:]
    written = [p for p in ws.rglob("*") if p.is_file()]
    assert answers in written and ws / "proj" / "TINKER_PRICING.md" in written and r["run"] / "config.json" in written
    if local_tinker.server is not None:  # the server's run folder: server.log, database, checkpoints
        written += [p for p in Path(local_tinker.server.run_dir).rglob("*") if p.is_file()]
        assert Path(local_tinker.server.log) in written
    leaks = [str(p) for p in written if KEY.encode() in p.read_bytes()]
    assert leaks == [], f"the API key is written in {leaks}"
    for out in (r["stdout"], r["stderr"], r["resumed"].stdout, r["resumed"].stderr, sampled.stdout, sampled.stderr):
        assert KEY not in out


# ---- the documented exit codes agree with the table ----
def documented_exit_codes(text: str) -> set[int]:
    """The codes in the paragraph that starts at 'Exit codes' (docstring or SKILL.md)."""
    start = re.search(r"exit codes", text, re.I)
    assert start, "no 'Exit codes' paragraph"
    paragraph = re.split(r"\n\s*\n", text[start.start():], maxsplit=1)[0]
    return {int(n) for n in re.findall(r"(?<![\w.-])(0|1|2|3|4|130|143)(?![\w.])", paragraph)}


def script_docstring(name: str) -> str:
    import ast
    return ast.get_docstring(ast.parse((SCRIPTS / f"tinker_{name}.py").read_text())) or ""


@pytest.mark.parametrize("name", sorted({c.script for c in CASES}))
def test_every_exit_code_the_table_expects_is_in_the_scripts_docstring(name):
    expected = {c.code for c in CASES if c.script == name} | {0}
    text = (SCRIPTS / f"tinker_{name}.py").read_text()
    if re.search(r"^# ==== SHARED CODE \(generated from common/: [a-z_, ]*\berrors\b", text, re.M):
        expected |= {130, 143}  # common/errors.run_cli: Ctrl-C and SIGTERM
    assert expected <= documented_exit_codes(script_docstring(name)), name


def test_skill_md_lists_every_exit_code_the_scripts_use():
    skill = (ROOT / "SKILL.md").read_text()
    assert documented_exit_codes(skill) >= {0, 1, 2, 3, 4, 130, 143}


EXIT_PROBE = """
import atexit, sys, threading
sys.path.insert(0, sys.argv[1])
{pyqwest}
from errors import exit_process
atexit.register(lambda: open(sys.argv[2], "w").write("ran"))
# a non-daemon thread that never ends: a normal exit (threading._shutdown) would wait for it forever
threading.Thread(target=threading.Event().wait, daemon=False).start() if {block} else None
sys.stdout.write('{{"status": "ok"}}')  # no newline, stdout is a pipe: still in the buffer
exit_process({code})
"""


@pytest.mark.parametrize("transport,code,expected", [("pyqwest", 3, 3), ("pyqwest", None, 0), ("none", 3, 3)])
def test_exit_process_keeps_the_code_the_output_and_the_atexit_handlers(transport, code, expected, tmp_path):
    """The scripts end through common/errors.exit_process. With the SDK's transport loaded on CPython < 3.14 it skips
    interpreter teardown (where a pyqwest thread can abort the process, pyqwest issue 164): what the caller sees
    must not change: the exit code, the buffered stdout, the atexit handlers. The never-ending non-daemon thread
    shows teardown is skipped (a sys.exit would wait for it; the timeout would fail the test)."""
    skipped = transport == "pyqwest" and sys.version_info < (3, 14)
    program = EXIT_PROBE.format(pyqwest="import pyqwest" if transport == "pyqwest" else "", block=skipped, code=code)
    marker = tmp_path / "atexit"
    proc = subprocess.run([sys.executable, "-c", program, str(ROOT / "common"), str(marker)],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (expected, '{"status": "ok"}', "")
    assert marker.read_text() == "ran"
