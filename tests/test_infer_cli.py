"""tinker_infer.py and tinker_checkpoints.py offline: argument validation, checkpoint-kind errors, run records,
template kwargs, the dry run, and the old `tinker_infer.py checkpoints` spelling."""
import json
import shlex
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import tinker_checkpoints
import tinker_infer

RUN = "run-1"
SAMPLER = f"tinker://{RUN}/sampler_weights/final"
STATE = f"tinker://{RUN}/weights/final"


def run(capsys, *argv, script=tinker_infer):
    code = script.main(list(argv))
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1])


def checkpoints(capsys, *argv):
    return run(capsys, *argv, script=tinker_checkpoints)


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


@pytest.fixture(scope="module")
def rest_base_url():
    """Just enough of Tinker's REST API for RestClient.list_checkpoints (SDK 0.38)."""
    checkpoints = [
        {"checkpoint_id": "weights/final", "checkpoint_type": "training", "time": "2026-12-01T10:00:00Z",
         "tinker_path": STATE, "size_bytes": 1000},
        {"checkpoint_id": "sampler_weights/final", "checkpoint_type": "sampler", "time": "2026-12-01T10:00:01Z",
         "tinker_path": SAMPLER, "size_bytes": 500},
        {"checkpoint_id": "weights/000005", "checkpoint_type": "training", "time": "2026-12-01T09:00:00Z",
         "tinker_path": f"tinker://{RUN}/weights/000005", "size_bytes": 1000},
        {"checkpoint_id": "sampler_weights/000005", "checkpoint_type": "sampler", "time": "2026-12-01T09:00:01Z",
         "tinker_path": f"tinker://{RUN}/sampler_weights/000005", "size_bytes": 500},
    ]

    class Handler(BaseHTTPRequestHandler):
        def reply(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.reply(200, {"use_pyqwest_transport": False} if self.path.endswith("/client/config") else {})

        def do_GET(self):
            if self.path.startswith(f"/api/v1/training_runs/{RUN}/checkpoints"):
                self.reply(200, {"checkpoints": checkpoints})
            else:
                self.reply(404, {"detail": f"Not found: {self.path}"})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def rest_server(rest_base_url, monkeypatch, api_key):
    monkeypatch.setenv("TINKER_BASE_URL", rest_base_url)


def write_run(log_dir, rows):
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return log_dir


CHAT_FORMAT = {"kind": "chat", "template_sha256": "0" * 64, "template_kwargs": {"enable_thinking": False},
               "stop": [151645], "tokenizer": "Qwen/Qwen3-8B"}


def row(name, step, state, sampler, fmt=CHAT_FORMAT):
    return {"name": name, "step": step, "next_batch": step, "epoch": 0, "state_path": state,
            "sampler_path": sampler, "format": fmt, "time": "2026-12-01T10:00:00Z"}


# ---- input validation (exit 2, no request) ----
@pytest.mark.parametrize("argv, expected", [
    ([], "exactly one of --prompt"),
    (["--prompt", "a", "--messages", "[]"], "exactly one of --prompt"),
    (["--messages", "{not json"], "--messages is not JSON"),
    (["--messages", '[{"content": "no role"}]'], "role"),
    (["--prompt", "x", "--n", "0"], "--n 0: expected a value in [1, inf]"),
    (["--prompt", "x", "--top-p", "0"], "--top-p"),
    (["--prompt", "x", "--model", "tinker://run-1/checkpoints/final"], "not a checkpoint path"),
    (["--input", "does-not-exist.jsonl"], "not found"),
])
def test_bad_input_exits_2_with_the_expected_form(capsys, api_key, argv, expected):
    code, result = run(capsys, *argv)
    assert code == 2
    assert expected in result["error"]


def test_input_rows_without_prompt_or_messages_are_refused_with_line_number(tmp_path, capsys, api_key):
    (tmp_path / "in.jsonl").write_text('{"prompt": "ok"}\n{"question": "?"}\n')
    code, result = run(capsys, "--input", str(tmp_path / "in.jsonl"))
    assert code == 2 and "in.jsonl:2" in result["error"]


# ---- checkpoint kinds ----
def test_weights_path_for_sampling_names_the_same_runs_sampler_path(rest_server, capsys, monkeypatch):
    argv = ["--model", STATE, "--prompt", "hi"]
    monkeypatch.setattr(sys, "argv", [tinker_infer.__file__, *argv])  # as typed: the printed command edits it
    code, result = run(capsys, *argv)
    assert code == 2
    assert "resumable training state" in result["error"]
    assert f"tinker_infer.py --model {SAMPLER} --prompt hi" in result["error"]


def test_weights_path_over_http_is_refused_before_any_completion_request(rest_server, capsys):
    code, result = run(capsys, "--http", "--base-url", "http://127.0.0.1:9/none", "--model", STATE, "--prompt", "hi")
    assert code == 2 and SAMPLER in result["error"]


def test_external_weights_path_cannot_be_sampled(rest_server, capsys):
    code, result = run(capsys, "--model", f"tinker://{RUN}/external_weights/x", "--prompt", "hi")
    assert code == 2 and "cannot be sampled" in result["error"]


def test_resolve_from_the_server_picks_the_newest_of_each_kind(rest_server, capsys):
    assert checkpoints(capsys, "resolve", RUN)[1]["path"] == SAMPLER
    assert checkpoints(capsys, "resolve", RUN, "--kind", "state")[1]["path"] == STATE


def test_checkpoint_list_of_a_run_is_newest_first(rest_server, capsys):
    code, result = checkpoints(capsys, "list", "--run", RUN, "--json")
    assert code == 0
    assert [(c["path"], c["type"], c["size_bytes"]) for c in result["checkpoints"]] == [
        (SAMPLER, "sampler", 500), (STATE, "training", 1000),
        (f"tinker://{RUN}/sampler_weights/000005", "sampler", 500), (f"tinker://{RUN}/weights/000005", "training", 1000)]


def test_resolve_from_a_path_gives_the_same_save_of_the_other_kind(rest_server, capsys):
    code, result = checkpoints(capsys, "resolve", f"tinker://{RUN}/weights/000005")
    assert (code, result["path"]) == (0, f"tinker://{RUN}/sampler_weights/000005")
    code, result = checkpoints(capsys, "resolve", f"tinker://{RUN}/sampler_weights/000005", "--kind", "state")
    assert (code, result["path"]) == (0, f"tinker://{RUN}/weights/000005")


def test_missing_key_exits_4(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    code, result = run(capsys, "--model", SAMPLER, "--prompt", "hi")
    assert code == 4 and "TINKER_API_KEY" in result["error"]


def test_key_without_tml_prefix_exits_4(monkeypatch, capsys):
    monkeypatch.setenv("TINKER_API_KEY", "sk-wrong")
    code, result = run(capsys, "--model", SAMPLER, "--prompt", "hi")
    assert code == 4 and "tml-" in result["error"]


# ---- run records ----
def test_resolve_reads_the_latest_path_of_each_kind_from_the_run_record(tmp_path, capsys):
    log_dir = write_run(tmp_path / "log", [
        row("000010", 10, "tinker://r/weights/000010", None),
        row("final", 20, "tinker://r/weights/final", "tinker://r/sampler_weights/final"),
        row("000030", 30, "tinker://r/weights/000030", None),
    ])
    code, result = checkpoints(capsys, "resolve", str(log_dir), "--kind", "state")
    assert (code, result["path"], result["step"]) == (0, "tinker://r/weights/000030", 30)
    code, result = checkpoints(capsys, "resolve", str(log_dir))
    assert (code, result["path"], result["format"]["kind"]) == (0, "tinker://r/sampler_weights/final", "chat")


def test_resolve_sampler_of_a_run_without_one_names_the_other_kind(tmp_path, capsys):
    log_dir = write_run(tmp_path / "log", [row("000010", 10, "tinker://r/weights/000010", None)])
    code, result = checkpoints(capsys, "resolve", str(log_dir))
    assert code == 2 and "--kind state" in result["error"]


def test_run_folder_without_a_record_is_refused(tmp_path, capsys, api_key):
    code, result = run(capsys, "--run", str(tmp_path), "--prompt", "hi")
    assert code == 2 and "checkpoints.jsonl not found" in result["error"]


def test_format_flag_contradicting_the_run_is_refused(tmp_path, capsys, api_key):
    log_dir = write_run(tmp_path / "log", [row("final", 1, None, "tinker://r/sampler_weights/final")])
    code, result = run(capsys, "--run", str(log_dir), "--format", "raw", "--prompt", "hi")
    assert code == 2 and "trained in chat format" in result["error"]


def test_a_recorded_date_renders_exactly_and_only_for_that_render(chat_family):
    """The run's frozen strftime_now is the date the prompt prints (not today's), and the template's
    own clock is back once the render is done (common/render.py freezes it for one render)."""
    import datetime

    tokenizer, fmt = chat_family("gpt-oss-20b")
    fmt = json.loads(json.dumps(fmt))
    fmt["template_kwargs"]["strftime_now"] = "2026-01-02"
    text = tokenizer.decode(tinker_infer.render_prompt({"prompt": "hi"}, fmt, tokenizer))
    assert "Current date: 2026-01-02" in text
    today = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert f"Current date: {datetime.date.today().isoformat()}" in today


# ---- export / merge argument errors ----
def test_export_refuses_a_non_empty_out_folder(tmp_path, capsys, api_key):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, result = checkpoints(capsys, "export", SAMPLER, "--out", str(tmp_path / "out"))
    assert code == 2 and "--overwrite" in result["error"]
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_merge_of_a_folder_that_is_not_an_adapter_says_how_to_get_one(tmp_path, capsys):
    code, result = checkpoints(capsys, "merge", str(tmp_path), "--base", str(tmp_path), "--out",
                       str(tmp_path / "m"))
    assert code == 2 and "tinker_checkpoints.py export tinker://" in result["error"]


def test_adapter_target_modules_are_read_from_the_weight_names():
    keys = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight",
            "base_model.model.model.embed_tokens.lora_embedding_A"]
    assert tinker_checkpoints.adapter_target_modules(keys) == ["down_proj", "embed_tokens", "q_proj"]


def test_raw_format_renders_messages_as_role_colon_text_after_bos():
    class Tok:
        bos_token_id = 1

        def encode(self, text, add_special_tokens):
            assert add_special_tokens is False
            return [ord(c) for c in text]

    messages = [{"role": "user", "content": "2+2?"}]
    ids = tinker_infer.render_prompt({"messages": messages}, {"kind": "raw", "bos": True}, Tok())
    assert ids == [1] + [ord(c) for c in "User: 2+2?\n\nAssistant:"]
    assert tinker_infer.render_prompt({"prompt": "ab"}, {"kind": "raw", "bos": False}, Tok()) == [97, 98]


# ---- the format contract: tinker_infer renders exactly the prompt tinker_sft trained on ----
FAMILIES = ["Qwen3-8B", "Llama-3.1-8B-Instruct", "DeepSeek-V3.1", "gpt-oss-20b", "Kimi-K2-Thinking"]
CONVERSATION = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_prompt_matches_the_sft_scripts_generation_prompt(chat_family, family):
    import tinker_sft

    tokenizer, fmt = chat_family(family)
    fmt = json.loads(json.dumps(fmt))  # exactly what checkpoints.jsonl carries
    expected = tinker_sft.generation_prompt(CONVERSATION, tokenizer, fmt)
    assert tinker_infer.render_prompt({"messages": CONVERSATION}, fmt, tokenizer) == expected
    assert tinker_infer.format_stop_ids(fmt, tokenizer) == sorted(fmt["stop"])


def test_frozen_gpt_oss_date_is_the_recorded_one(chat_family):
    tokenizer, fmt = chat_family("gpt-oss-20b")
    fmt = json.loads(json.dumps(fmt))
    text = tokenizer.decode(tinker_infer.render_prompt({"prompt": "hi"}, fmt, tokenizer))
    assert f"Current date: {fmt['template_kwargs']['strftime_now']}" in text


def test_raw_prompt_matches_the_sft_scripts_generation_prompt(offline_tokenizer):
    import tinker_sft

    tokenizer = tinker_sft.load_tokenizer(offline_tokenizer("Qwen3-8B-Base"))
    fmt = json.loads(json.dumps(tinker_sft.raw_format(tokenizer, name="Qwen3-8B-Base")))
    for row in ({"prompt": "Once upon a time"}, {"messages": CONVERSATION}):
        expected = tinker_sft.generation_prompt(row.get("messages") or row["prompt"], tokenizer, fmt)
        assert tinker_infer.render_prompt(row, fmt, tokenizer) == expected


def test_an_unreachable_hub_fails_in_seconds_naming_both_ways_to_run_offline(tmp_path):
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TINKER_"))}
    env.update(HF_HOME=str(tmp_path / "empty-hf"), HF_ENDPOINT=f"http://127.0.0.1:{closed}",
               PYTHONPATH=os.path.dirname(tinker_infer.__file__))
    # The base model's name comes from the sampling client; no server is needed to reach the tokenizer.
    # The base model's name (as a sampling client reports it) names the tokenizer; no server is needed.
    code = ("import tinker_infer\n"
            "try:\n    tinker_infer.load_sampling_tokenizer('Qwen/Qwen3-8B:peft:131072')\n"
            "except tinker_infer.DataError as e:\n    print(e.exit_code, e)\n")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.monotonic() - started
    assert elapsed < 20, f"took {elapsed:.1f} s"  # the SDK's get_tokenizer() retried for ~50 s
    assert out.stdout.strip() == (
        "2 cannot load the tokenizer for 'Qwen/Qwen3-8B:peft:131072': Qwen/Qwen3-8B is not in the Hugging Face "
        f"cache and the hub is unreachable (127.0.0.1:{closed}: Connection refused); pass --tokenizer PATH (a "
        "folder with tokenizer.json), or download it once and run with HF_HUB_OFFLINE=1"), out.stderr


# ---- --run prompts as training did (issue 27)


@pytest.mark.parametrize("kind, system, said", [
    ("shared", "You are the help desk.", "system prompt: the one every training example of"),
    ("differ", None, "carry different system prompts, so none is added; pass --system TEXT"),
    ("none", None, ""),
])
def test_run_uses_the_shared_system_prompt_and_samples_greedily_by_default(tmp_path, capsys, kind, system, said):
    (tmp_path / "config.json").write_text(json.dumps({
        "system_prompt": system, "system_prompts": kind, "probe_sampling": {"temperature": 0.0, "max_tokens": 16}}))
    assert tinker_infer.run_sampling(str(tmp_path), None, None) == (0.0, system)
    err = capsys.readouterr().err
    assert "sampling at temperature 0, as the run's probes" in err and said in err
    rows = tinker_infer.with_system_prompt([{"prompt": "Where is my invoice?"}], system, "chat")
    expected = [{"role": "user", "content": "Where is my invoice?"}]
    if system:
        assert rows == [{"messages": [{"role": "system", "content": system}, *expected]}]
    else:
        assert rows == [{"prompt": "Where is my invoice?"}]


def test_system_and_temperature_flags_win_and_a_conversation_keeps_its_own_system(tmp_path, capsys,
                                                                                   offline_tokenizer):
    (tmp_path / "config.json").write_text(json.dumps({"system_prompt": "Trained.", "system_prompts": "shared"}))
    assert tinker_infer.run_sampling(str(tmp_path), 0.7, "") == (0.7, None)  # --system '' --temperature 0.7
    # no --run: Tinker's default temperature, no system prompt (through the whole command, as a dry run)
    code, result = run(capsys, "--prompt", "hi", "--dry-run", "--tokenizer", offline_tokenizer("Qwen3-8B"))
    assert code == 0, result
    assert (result["sampling"]["temperature"], result["sampling"]["system"]) == (tinker_infer.DEFAULT_TEMPERATURE, None)
    own = [{"messages": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]}]
    assert tinker_infer.with_system_prompt(own, "Trained.", "chat") == own
    assert tinker_infer.with_system_prompt([{"prompt": "hi"}], "Trained.", "raw") == [{"prompt": "hi"}]
    assert "applies to the chat format only" in capsys.readouterr().err


# ---- the dry run: everything before the first request, offline (no key, no server)


@pytest.fixture
def no_key(monkeypatch, tmp_path):
    for name in ("TINKER_API_KEY", "TINKER_CREDENTIAL_CMD", "TINKER_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_a_dry_run_of_a_run_renders_the_prompt_as_trained_without_a_key(tmp_path, capsys, no_key, offline_tokenizer):
    tok = offline_tokenizer("Qwen3-8B")
    tokenizer = tinker_infer.load_tokenizer(tok)
    fmt = json.loads(json.dumps(tinker_infer.chat_format(tokenizer, name=tok)))
    log_dir = write_run(tmp_path / "log", [row("final", 4, STATE, SAMPLER, fmt)])
    (log_dir / "config.json").write_text(json.dumps({"model_name": "Qwen/Qwen3-8B", "system_prompts": "shared",
                                                     "system_prompt": "Be terse."}))
    code, result = run(capsys, "--run", str(log_dir), "--prompt", "2+2?", "--dry-run")
    assert code == 0, result
    assert (result["status"], result["route"], result["model"]) == ("dry_run", "sdk", SAMPLER)
    expected = tinker_infer.generation_prompt([{"role": "system", "content": "Be terse."},
                                               {"role": "user", "content": "2+2?"}], tokenizer, fmt)
    [prompt] = result["prompts"]
    assert prompt["prompt_tokens"] == len(expected)
    assert prompt["text"] == tokenizer.decode(expected, skip_special_tokens=False)
    assert prompt["text"].startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n2+2?")
    assert result["format"]["stop"] == fmt["stop"] and result["template_matches_run"] is True
    assert (result["sampling"]["temperature"], result["sampling"]["system"]) == (0.0, "Be terse.")


def test_a_dry_run_over_http_shows_the_request_bodies(capsys, no_key):
    code, result = run(capsys, "--http", "--base-url", "http://127.0.0.1:9/oai/api/v1", "--model", SAMPLER,
                       "--prompt", "hi", "--n", "2", "--seed", "3", "--dry-run")
    assert code == 0, result
    assert result["endpoint"] == "http://127.0.0.1:9/oai/api/v1/chat/completions"
    assert result["bodies"] == [{"model": SAMPLER, "max_tokens": tinker_infer.DEFAULT_MAX_TOKENS,
                                 "temperature": tinker_infer.DEFAULT_TEMPERATURE, "top_p": 1.0, "n": 2,
                                 "messages": [{"role": "user", "content": "hi"}], "seed": 3}]


def test_a_dry_run_of_a_bare_checkpoint_path_asks_for_its_tokenizer(capsys, no_key):
    code, result = run(capsys, "--model", SAMPLER, "--prompt", "hi", "--dry-run")
    assert code == 2 and "--tokenizer" in result["error"]


# ---- the old spelling `tinker_infer.py checkpoints ...` (before tinker_checkpoints.py)


@pytest.mark.parametrize("argv, replacement", [
    (["checkpoints", "list", "--run", RUN], f"tinker_checkpoints.py list --run {RUN}"),
    (["checkpoints", "resolve", "logs/my sft", "--kind", "state"], "tinker_checkpoints.py resolve 'logs/my sft' --kind state"),
    (["checkpoints"], "tinker_checkpoints.py --help"),
])
def test_the_old_checkpoints_command_exits_2_naming_the_command_that_replaced_it(capsys, monkeypatch, argv,
                                                                                  replacement):
    monkeypatch.delenv("TINKER_LOCAL_LAUNCHER", raising=False)
    code, result = run(capsys, *argv)
    assert (code, result["status"], result["exit_code"]) == (2, "error", 2)
    assert result["error"].startswith("`tinker_infer.py checkpoints` is now tinker_checkpoints.py; next: "
                                      f"{shlex.quote(sys.executable)} ")
    assert result["error"].endswith(replacement)


def test_out_rows_hold_index_the_prompt_as_given_and_the_samples_without_prompt_index(tmp_path):
    """The --out row schema documented in the docstring and references/inference.md."""
    rows = [{"prompt": "first"}, {"messages": [{"role": "user", "content": "second"}]}]
    sample = {"sample_index": 0, "text": "ok", "tokens": [1, 2], "stop_reason": "stop", "prompt_tokens": 3,
              "completion_tokens": 2, "usd": None}
    samples = [{"prompt_index": 1, **sample}, {"prompt_index": 0, **sample, "sample_index": 0},
               {"prompt_index": 0, **sample, "sample_index": 1}]
    out = tmp_path / "answers.jsonl"
    tinker_infer.write_results(str(out), rows, samples)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [set(r) for r in written] == [{"index", "prompt", "samples"}, {"index", "messages", "samples"}]
    assert [r["index"] for r in written] == [0, 1] and written[1]["messages"] == rows[1]["messages"]
    assert [s["sample_index"] for s in written[0]["samples"]] == [0, 1]
    assert set(written[0]["samples"][0]) == {"sample_index", "text", "tokens", "stop_reason", "prompt_tokens",
                                             "completion_tokens", "usd"}
    assert not (tmp_path / "answers.jsonl.partial").exists()
