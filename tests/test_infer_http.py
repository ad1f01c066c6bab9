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
    code, result, _ = run_err(capsys, *argv)
    return code, result


def run_err(capsys, *argv):
    """(exit code, the JSON on stdout, stderr)."""
    code = tinker_infer.main(list(argv))
    captured = capsys.readouterr()
    return code, json.loads(captured.out.strip().splitlines()[-1]), captured.err


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


# ---------------------------------------------------------------- --run over --http: as trained (issue 44)


def qwen3_run(tmp_path, offline_tokenizer, system=None):
    """A run record of a Qwen3-8B chat run (thinking off, as tinker_sft.py trains) with the real tokenizer;
    (log dir, tokenizer, format)."""
    folder = offline_tokenizer("Qwen3-8B")
    tokenizer = tinker_infer.load_tokenizer(folder)
    fmt = json.loads(json.dumps(tinker_infer.chat_format(tokenizer, name=folder)))
    log = tmp_path / "log"
    log.mkdir()
    (log / "checkpoints.jsonl").write_text(json.dumps(
        {"name": "final", "step": 4, "next_batch": 4, "epoch": 0, "state_path": "tinker://run-abc:train:0/weights/final",
         "sampler_path": SAMPLER, "format": fmt, "time": "2026-12-01T10:00:00Z"}) + "\n")
    config = {"model_name": "Qwen/Qwen3-8B", "system_prompts": "shared" if system else "none", "system_prompt": system}
    (log / "config.json").write_text(json.dumps(config))
    return log, tokenizer, fmt


def test_a_run_over_http_is_rendered_as_trained_and_sent_to_completions(oai_server, tmp_path, capsys,
                                                                        offline_tokenizer):
    """Before: /chat/completions with the bare messages, so the server's template rendered Qwen3 with thinking on
    (47 tokens where training rendered 51), and nothing said so. Now the prompt is the SDK route's tokens, as text."""
    log, tokenizer, fmt = qwen3_run(tmp_path, offline_tokenizer, system="Be terse.")
    assert fmt["template_kwargs"]["enable_thinking"] is False
    code, result, err = run_err(capsys, "--http", "--base-url", oai_server.base_url, "--run", str(log),
                                "--prompt", "2+2?", "--max-tokens", "5", "--stop", "END")
    assert code == 0, result
    [(path, _, body)] = oai_server.requests
    expected = tinker_infer.generation_prompt([{"role": "system", "content": "Be terse."},
                                               {"role": "user", "content": "2+2?"}], tokenizer, fmt)
    assert path == "/oai/api/v1/completions" and "messages" not in body
    assert body["prompt"] == tokenizer.decode(expected, skip_special_tokens=False)
    assert body["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off, as trained
    assert tokenizer.encode(body["prompt"], add_special_tokens=False) == expected
    assert body["stop"] == ["END", "<|im_end|>"]  # --stop, then the format's end-of-turn token
    assert body["temperature"] == 0.0  # the run's probes sampled greedily
    assert result["prompt_tokens_as_trained"] == [len(expected)]
    assert result["format"]["template_kwargs"] == fmt["template_kwargs"]
    # the test server counts 7 prompt tokens, not the rendered count: said, not silent
    assert f"counted 7 prompt tokens for prompt 0, not the {len(expected)} rendered here" in err


def test_a_run_over_http_is_priced_as_its_base_model(oai_server, tmp_path, capsys, offline_tokenizer):
    """Before: "no dollar estimate (tinker_pricing.py not beside this script ...)" with the file beside it, because
    the --http route never knew the sampler path's base model; the run record names it."""
    import tinker_pricing
    log, _, _ = qwen3_run(tmp_path, offline_tokenizer)
    code, result, err = run_err(capsys, "--http", "--base-url", oai_server.base_url, "--run", str(log),
                                "--prompt", "hi", "--max-tokens", "5")
    assert code == 0, result
    assert result["base_model"] == "Qwen/Qwen3-8B"
    assert result["usd"] == pytest.approx(tinker_pricing.estimate_cost("Qwen/Qwen3-8B", prefill=7, sample=5)["usd"]["total"])
    assert "no dollar estimate" not in err and "| est. cost $" in err
    # a bare sampler path: the reason named is the real one
    code, result, err = run_err(capsys, "--http", "--base-url", oai_server.base_url, "--model", SAMPLER,
                                "--prompt", "hi")
    assert code == 0 and result["usd"] is None
    assert f"no dollar estimate (the --http route does not learn the base model of {SAMPLER}; pass --run" in err
    assert "not beside this script" not in err


def test_several_choices_over_http_are_priced_from_the_servers_usage(oai_server, capsys):
    """usage counts the n choices together: the total is priced from it (before: 0 completion tokens were priced)."""
    import tinker_pricing
    code, result = run(capsys, "--http", "--base-url", oai_server.base_url, "--model", "Qwen/Qwen3-8B",
                       "--prompt", "hi", "--n", "3", "--max-tokens", "5")
    assert code == 0, result
    assert result["usage"] == {"prompt_tokens": 7, "completion_tokens": 15}
    assert result["usd"] == pytest.approx(tinker_pricing.estimate_cost("Qwen/Qwen3-8B", prefill=7, sample=15)["usd"]["total"])
    assert [s["usd"] for s in result["samples"]] == [None] * 3  # per choice unknown, not a guess


def test_a_dry_run_of_a_run_over_http_estimates_what_it_would_cost(tmp_path, capsys, offline_tokenizer, monkeypatch):
    """Before: "estimate_usd": null for a known model; the prompts are rendered here, so they are counted."""
    import tinker_pricing
    monkeypatch.delenv("TINKER_API_KEY")
    log, tokenizer, fmt = qwen3_run(tmp_path, offline_tokenizer)
    code, result = run(capsys, "--http", "--base-url", "http://127.0.0.1:9/oai/api/v1", "--run", str(log),
                       "--prompt", "2+2?", "--n", "2", "--max-tokens", "16", "--dry-run")
    assert code == 0, result
    n_prompt = len(tinker_infer.generation_prompt("2+2?", tokenizer, fmt))
    assert result["endpoint"] == "http://127.0.0.1:9/oai/api/v1/completions" and result["prompt_tokens"] == [n_prompt]
    expected = tinker_pricing.estimate_cost("Qwen/Qwen3-8B", prefill=n_prompt, cached_prefill=n_prompt,
                                            sample=2 * 16)["usd"]["total"]
    assert result["estimate_usd"] == pytest.approx(expected) and expected > 0


def test_a_prompt_whose_text_does_not_tokenize_back_is_refused_over_http(oai_server, tmp_path, capsys,
                                                                         offline_tokenizer, monkeypatch):
    log, tokenizer, _ = qwen3_run(tmp_path, offline_tokenizer)
    # a rendering the text cannot carry: "hi" split into two tokens that re-tokenize as one
    monkeypatch.setattr(tinker_infer, "render_prompt", lambda row, fmt, tok: tok.encode("h") + tok.encode("i"))
    code, result = run(capsys, "--http", "--base-url", oai_server.base_url, "--run", str(log), "--prompt", "hi")
    assert code == 2 and oai_server.requests == []
    assert "cannot send prompt 0 exactly as" in result["error"] and "without --http" in result["error"]


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


@pytest.mark.e2e
def test_http_route_renders_a_run_as_the_sdk_route_does(local_tinker, local_sft_run):
    """Issue 44: `--run RUN --http` sent the bare messages to /chat/completions, whose template rendered
    Qwen3 with thinking on: 47 prompt tokens where the run trained (and the SDK route samples) 51. Now both
    routes send the same prompt, so the server counts the same tokens and greedy sampling gives the same text."""
    args = ["--run", str(local_sft_run), "--prompt", "Where is my invoice?", "--max-tokens", "8"]
    code, sdk = infer_cli(local_tinker, *args)
    assert code == 0, sdk
    code, http = infer_cli(local_tinker, "--http", *args)
    assert code == 0, http
    assert http["endpoint"] == local_tinker.base_url + "/oai/api/v1/completions"
    assert http["samples"][0]["prompt_tokens"] == sdk["samples"][0]["prompt_tokens"]
    assert http["prompt_tokens_as_trained"] == [sdk["samples"][0]["prompt_tokens"]]
    assert [s["text"] for s in http["samples"]] == [s["text"] for s in sdk["samples"]]  # greedy, as the probes
    # what the old request (the server's own template and defaults) counts instead: not the trained prompt
    code, chat = infer_cli(local_tinker, "--http", "--model", sdk["model"], "--system", "", "--prompt",
                           "Where is my invoice?", "--max-tokens", "8", "--temperature", "0")
    code_bare, bare = infer_cli(local_tinker, "--run", str(local_sft_run), "--system", "", "--prompt",
                                "Where is my invoice?", "--max-tokens", "8")
    assert code == 0 and code_bare == 0, (chat, bare)
    assert chat["samples"][0]["prompt_tokens"] != bare["samples"][0]["prompt_tokens"], (chat, bare)
