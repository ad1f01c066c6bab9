"""tinker_infer.py --http against a real HTTP server on 127.0.0.1 that records every request."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import tinker_infer

KEY = "tml-test-key-123"


class Recorder:
    def __init__(self):
        self.requests = []  # (path, headers, body)
        self.replies = []  # scripted (status, body, headers); empty -> a normal completion
        self.lock = threading.Lock()

    def reply_for(self, path, body):
        with self.lock:
            if self.replies:
                return self.replies.pop(0)
        n = body.get("n", 1)
        if path.endswith("/chat/completions"):
            choices = [{"index": i, "message": {"role": "assistant", "content": f"chat answer {i} to "
                        f"{body['messages'][-1]['content']}"}, "finish_reason": "stop"} for i in range(n)]
        else:
            choices = [{"index": i, "text": f"completion {i} of {body['prompt']}", "finish_reason": "length"}
                       for i in range(n)]
        return 200, {"id": "x", "object": "completion", "choices": choices,
                     "usage": {"prompt_tokens": 7, "completion_tokens": 5 * n, "total_tokens": 7 + 5 * n}}, {}


@pytest.fixture
def oai_server():
    recorder = Recorder()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.loads(raw)
            with recorder.lock:
                recorder.requests.append((self.path, dict(self.headers), body))
            status, payload, headers = recorder.reply_for(self.path, body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    recorder.base_url = f"http://127.0.0.1:{server.server_address[1]}/oai/api/v1"
    yield recorder
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", KEY)


def run(capsys, *argv):
    code = tinker_infer.main(list(argv))
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1])


SAMPLER = "tinker://run-abc:train:0/sampler_weights/final"


def test_chat_request_carries_every_sampling_option_and_the_bearer_key(oai_server, capsys):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]
    code, result = run(capsys, "--http", "--base-url", oai_server.base_url, "--model", SAMPLER,
                       "--messages", json.dumps(messages), "--stop", "\n\n", "--stop", "END", "--seed", "42",
                       "--n", "3", "--max-tokens", "17", "--temperature", "0.3", "--top-p", "0.9", "--top-k", "20")
    assert code == 0
    assert len(oai_server.requests) == 1
    path, headers, body = oai_server.requests[0]
    assert path == "/oai/api/v1/chat/completions"
    assert headers["Authorization"] == f"Bearer {KEY}"
    assert body == {"model": SAMPLER, "messages": messages, "stop": ["\n\n", "END"], "seed": 42, "n": 3,
                    "max_tokens": 17, "temperature": 0.3, "top_p": 0.9, "top_k": 20}
    assert result["route"] == "http"
    assert [s["text"] for s in result["samples"]] == [f"chat answer {i} to 2+2?" for i in range(3)]
    assert {s["stop_reason"] for s in result["samples"]} == {"stop"}
    assert result["samples"][0]["prompt_tokens"] == 7


def test_raw_format_posts_the_prompt_to_completions(oai_server, capsys):
    code, result = run(capsys, "--http", "--base-url", oai_server.base_url, "--model", SAMPLER, "--format", "raw",
                       "--prompt", "Once upon", "--max-tokens", "5", "--seed", "0")
    assert code == 0
    path, _, body = oai_server.requests[0]
    assert path == "/oai/api/v1/completions"
    assert body["prompt"] == "Once upon" and "messages" not in body and body["seed"] == 0
    assert "stop" not in body  # no --stop given: nothing invented
    sample = result["samples"][0]
    assert (sample["text"], sample["stop_reason"], sample["completion_tokens"]) == ("completion 0 of Once upon", "length", 5)


def test_raw_format_sends_messages_as_role_colon_text(oai_server, capsys):
    code, _ = run(capsys, "--http", "--base-url", oai_server.base_url, "--model", SAMPLER, "--format", "raw",
                  "--messages", '[{"role": "user", "content": "2+2?"}]')
    assert code == 0
    assert oai_server.requests[0][2]["prompt"] == "User: 2+2?\n\nAssistant:"


def test_a_429_is_retried_and_then_succeeds(oai_server, capsys):
    oai_server.replies = [(429, {"error": {"message": "rate limited"}}, {"Retry-After": "0"})]
    code, result = run(capsys, "--http", "--base-url", oai_server.base_url, "--model", SAMPLER, "--prompt", "hi")
    assert code == 0
    assert len(oai_server.requests) == 2
    assert oai_server.requests[0][2] == oai_server.requests[1][2]  # the same request, re-sent
    assert result["samples"][0]["text"] == "chat answer 0 to hi"


def test_a_5xx_is_retried_until_the_retry_budget_runs_out(oai_server, capsys):
    oai_server.replies = [(503, {"error": {"message": "overloaded"}}, {"Retry-After": "0"})] * 3
    code, result = run(capsys, "--http", "--base-url", oai_server.base_url, "--model", SAMPLER, "--prompt", "hi",
                       "--retries", "2")
    assert code == 1
    assert len(oai_server.requests) == 3
    assert "overloaded" in result["error"] and "3 tries" in result["error"]


def test_a_400_is_reported_with_the_servers_message_and_not_retried(oai_server, capsys):
    oai_server.replies = [(400, {"error": {"message": "Unknown model: tinker://nope"}}, {})]
    code, result = run(capsys, "--http", "--base-url", oai_server.base_url, "--model", SAMPLER, "--prompt", "hi")
    assert code == 2
    assert len(oai_server.requests) == 1
    assert "400" in result["error"] and "Unknown model: tinker://nope" in result["error"]


def test_a_refused_key_exits_4(oai_server, capsys):
    oai_server.replies = [(401, {"detail": "invalid api key"}, {})]
    code, result = run(capsys, "--http", "--base-url", oai_server.base_url, "--model", SAMPLER, "--prompt", "hi")
    assert code == 4 and "invalid api key" in result["error"]


def test_batch_input_is_sent_concurrently_and_written_in_input_order(oai_server, tmp_path, capsys):
    rows = [{"prompt": f"question {i}"} for i in range(6)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    code, result = run(capsys, "--http", "--base-url", oai_server.base_url, "--model", SAMPLER, "--json",
                       "--input", str(tmp_path / "in.jsonl"), "--out", str(out))
    assert code == 0
    assert sorted(b["messages"][0]["content"] for _, _, b in oai_server.requests) == [r["prompt"] for r in rows]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["index"] for w in written] == list(range(6))
    assert [w["samples"][0]["text"] for w in written] == [f"chat answer 0 to question {i}" for i in range(6)]
    assert [s["prompt_index"] for s in result["samples"]] == list(range(6))


def test_base_url_defaults_to_tinker_base_url_plus_oai_path(oai_server, monkeypatch, capsys):
    monkeypatch.setenv("TINKER_BASE_URL", oai_server.base_url.removesuffix("/oai/api/v1"))
    code, _ = run(capsys, "--http", "--model", SAMPLER, "--prompt", "hi")
    assert code == 0
    assert oai_server.requests[0][0] == "/oai/api/v1/chat/completions"


def test_missing_key_exits_4_before_any_request(oai_server, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("TINKER_API_KEY")
    monkeypatch.setenv("HOME", str(tmp_path))  # no stored `tinker auth login` credential
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD", raising=False)
    code, result = run(capsys, "--http", "--base-url", oai_server.base_url, "--model", SAMPLER, "--prompt", "hi")
    assert code == 4 and "TINKER_API_KEY" in result["error"]
    assert oai_server.requests == []


def test_script_copied_alone_runs_and_prices_only_with_tinker_pricing_beside_it(oai_server, tmp_path):
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    scripts = Path(tinker_infer.__file__).parent
    shutil.copy(scripts / "tinker_infer.py", tmp_path / "tinker_infer.py")
    argv = [sys.executable, str(tmp_path / "tinker_infer.py"), "--http", "--base-url", oai_server.base_url,
            "--model", "Qwen/Qwen3-8B", "--prompt", "hi", "--max-tokens", "5"]
    env = {**os.environ, "TINKER_API_KEY": KEY, "PYTHONPATH": ""}

    alone = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert alone.returncode == 0, alone.stderr
    assert json.loads(alone.stdout)["usd"] is None
    assert "no dollar estimate" in alone.stderr

    shutil.copy(scripts / "tinker_pricing.py", tmp_path / "tinker_pricing.py")
    priced = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    result = json.loads(priced.stdout)
    # 7 prompt + 5 completion tokens from the test server, at the catalogue's Qwen3-8B rates.
    import tinker_pricing
    expected = tinker_pricing.estimate_cost("Qwen/Qwen3-8B", prefill=7, sample=5)["usd"]["total"]
    assert result["usd"] == pytest.approx(expected) and result["usd"] > 0


# ---------------------------------------------------------------- against the local backend


def infer_cli(local_tinker, *argv):
    """tinker_infer.py in a subprocess against the local backend; (exit code, its JSON)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(tinker_infer.__file__).resolve()
    done = subprocess.run([sys.executable, str(script), *argv, "--json"], env=local_tinker.env,
                          capture_output=True, text=True, timeout=900)
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-2000:]
    return done.returncode, json.loads(lines[-1])


@pytest.mark.e2e
def test_http_route_on_the_local_backend_samples_what_the_sdk_route_samples(local_tinker):
    """Same prompt, seed and options: the OpenAI-compatible endpoint (TINKER_BASE_URL + /oai/api/v1)
    and the SDK return the same texts, because both sample the same server's sampler."""
    args = ["--model", local_tinker.model, "--format", "raw", "--prompt", "Once upon a time",
            "--n", "2", "--max-tokens", "8", "--temperature", "1.0", "--seed", "5"]
    code, http = infer_cli(local_tinker, "--http", *args)
    assert code == 0, http
    assert http["endpoint"] == local_tinker.base_url + "/oai/api/v1/completions"
    code, sdk = infer_cli(local_tinker, *args)
    assert code == 0, sdk
    assert [s["text"] for s in http["samples"]] == [s["text"] for s in sdk["samples"]]
    assert [s["prompt_tokens"] for s in http["samples"]] == [sdk["samples"][0]["prompt_tokens"]] * 2
    # a stop string taken from what seed 5 produced cuts that sample there, OpenAI-style (excluded)
    text = http["samples"][0]["text"]
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip()
                 and text[i:i + 2] not in text[:i]), None)
    if stop is not None:
        code, cut = infer_cli(local_tinker, "--http", *args, "--stop", stop)
        assert code == 0, cut
        assert cut["samples"][0]["text"] == text[:text.index(stop)]
        assert cut["samples"][0]["stop_reason"] == "stop"


@pytest.mark.e2e
def test_http_route_on_the_local_backend_samples_a_sampler_checkpoint_in_chat_format(local_tinker, monkeypatch):
    import tinker
    local_tinker.apply(monkeypatch)
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(local_tinker.model, rank=8, seed=0).result()
    path = training.save_weights_for_sampler("http-e2e").result().path
    code, result = infer_cli(local_tinker, "--http", "--model", path, "--prompt", "What colour is the sky?",
                             "--n", "2", "--max-tokens", "8", "--seed", "3")
    assert code == 0, result
    assert result["endpoint"].endswith("/oai/api/v1/chat/completions")
    assert [(s["prompt_index"], s["sample_index"]) for s in result["samples"]] == [(0, 0), (0, 1)]
    assert all(s["stop_reason"] in ("stop", "length") and isinstance(s["text"], str) for s in result["samples"])
    assert result["samples"][0]["prompt_tokens"] > 5
    # the run's checkpoint, not a name the server does not serve: a wrong path is a one-line exit 2
    code, missing = infer_cli(local_tinker, "--http", "--model", path.replace("http-e2e", "no-such"),
                              "--prompt", "hi", "--max-tokens", "4")
    assert code == 2 and "no-such" in missing["error"], missing
