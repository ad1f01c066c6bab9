"""tinker_sft.py without a server: rendering and masking on the real Qwen3 tokenizer, the datum shift,
data validation, the dry-run audit, the LR schedule and resume bookkeeping."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tinker_sft as sft

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "tinker_sft.py"
EXAMPLE = ROOT / "templates" / "sft_example.jsonl"
PC_EXAMPLE = ROOT / "templates" / "sft_prompt_completion_example.jsonl"


@pytest.fixture(scope="module")
def qwen3_path(offline_tokenizer):
    """The real Qwen3 tokenizer and hybrid chat template (tests/fixtures_tokenizers.py)."""
    return offline_tokenizer("Qwen3-8B")


@pytest.fixture(scope="module")
def qwen3(qwen3_path):
    tok = sft.load_tokenizer(qwen3_path)
    return tok, sft.chat_format(tok, name="Qwen/Qwen3-8B")


def trained_text(tok, r):
    return tok.decode([t for t, w in zip(r.tokens, r.weights) if w])


def conv(*turns, system="Be terse."):
    msgs = [{"role": "system", "content": system}] if system else []
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return sft.validate_example({"messages": msgs}, 1)


# ---- masking on the real Qwen3 template ------------------------------------------------------


def test_single_turn_trains_exactly_the_answer_and_end_of_turn(qwen3):
    tok, fmt = qwen3
    [r] = sft.render_example(conv("What is 2+2?", "4"), tok, fmt)
    assert trained_text(tok, r) == "4<|im_end|>"
    # what precedes the weighted tokens is exactly what the sampler is given
    n_prompt = r.weights.index(1.0)
    prompt = sft.generation_prompt(conv("What is 2+2?", "4")["messages"][:-1], tok, fmt)
    assert r.tokens[:n_prompt] == prompt
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the template's trailing "\n" after <|im_end|> is neither trained nor present
    assert r.tokens[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert len(r.tokens) == len(r.weights)


def test_multi_turn_last_assistant_trains_only_the_last_answer(qwen3):
    tok, fmt = qwen3
    [r] = sft.render_example(conv("2+2?", "4", "3+3?", "6"), tok, fmt, "last-assistant")
    assert trained_text(tok, r) == "6<|im_end|>"
    assert "4<|im_end|>" in tok.decode(r.tokens)  # the earlier answer is context, not trained


def test_multi_turn_all_assistant_trains_every_answer_in_the_context_the_model_sees(qwen3):
    tok, fmt = qwen3
    out = sft.render_example(conv("2+2?", "4", "3+3?", "6", "5+5?", "10"), tok, fmt, "all-assistant")
    # Qwen3 drops the empty think block from earlier turns, so no turn extends the previous one
    assert [trained_text(tok, r) for r in out] == ["4<|im_end|>", "6<|im_end|>", "10<|im_end|>"]
    for r in out:
        assert sum(1 for w in r.weights if w) == len(tok.encode(trained_text(tok, r)))
        assert tok.decode(r.tokens[:r.weights.index(1.0)]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_content_renders_with_thinking_and_is_trained(qwen3):
    tok, fmt = qwen3
    ex = sft.validate_example({"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two plus two"}]}, 1)
    [r] = sft.render_example(ex, tok, fmt)
    assert trained_text(tok, r) == "<think>\ntwo plus two\n</think>\n\n4<|im_end|>"
    assert tok.decode(r.tokens[:r.weights.index(1.0)]).endswith("<|im_start|>assistant\n")


def test_weighted_tokens_match_message_contents_on_the_bundled_example(qwen3):
    tok, fmt = qwen3
    for line, obj in sft.read_jsonl(EXAMPLE):
        ex = sft.validate_example(obj, line)
        answers = [m for m in ex["messages"] if m["role"] == "assistant"]
        rendered = sft.render_example(ex, tok, fmt, "all-assistant")
        assert len(rendered) == len(answers)
        for r, m in zip(rendered, answers):
            expect = m["content"] + "<|im_end|>"
            if m.get("reasoning_content"):
                expect = f"<think>\n{m['reasoning_content']}\n</think>\n\n" + expect
            assert sft.weighted_spans(tok, r) == [expect]


def test_stop_tokens_are_the_trained_end_of_turn(qwen3):
    tok, fmt = qwen3
    assert fmt["stop"] == [tok.convert_tokens_to_ids("<|im_end|>")] == [151645]
    assert sft.stop_tokens(tok, sft.raw_format(tok, name="q")) == [tok.eos_token_id]


def test_format_record_is_json_and_freezes_the_date(qwen3):
    tok, fmt = qwen3
    assert json.loads(json.dumps(fmt)) == fmt
    assert fmt["kind"] == "chat" and len(fmt["template_sha256"]) == 64
    assert fmt["template_kwargs"]["strftime_now"] == "2024-07-26"
    assert fmt["template_kwargs"]["date_string"] == "26 Jul 2024"


def test_a_template_printing_today_renders_the_frozen_date(qwen3_path):
    dated = sft.load_tokenizer(qwen3_path)
    dated.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ strftime_now('%Y-%m-%d') }} {{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fmt = sft.chat_format(dated, name="dated")
    [r] = sft.render_example(conv("hi", "hello", system=None), dated, fmt)
    assert "2024-07-26 hi" in dated.decode(r.tokens)


def test_raw_format_trains_completion_and_explicit_eos(qwen3):
    tok, _ = qwen3
    fmt = sft.raw_format(tok, name="q")
    ex = sft.validate_example({"prompt": "Title: X\nSummary:", "completion": " A summary."}, 3)
    [r] = sft.render_example(ex, tok, fmt)
    assert r.tokens == tok.encode("Title: X\nSummary:") + tok.encode(" A summary.") + [tok.eos_token_id]
    assert trained_text(tok, r) == " A summary." + tok.eos_token
    [c] = sft.render_example(conv("2+2?", "4"), tok, fmt)
    assert tok.decode(c.tokens) == "System: Be terse.\n\nUser: 2+2?\n\nAssistant: 4" + tok.eos_token
    assert trained_text(tok, c) == " 4" + tok.eos_token


def test_datum_is_shifted_by_one_position_by_position(qwen3):
    tok, fmt = qwen3
    [r] = sft.render_example(conv("2+2?", "4"), tok, fmt)
    d = sft.to_datum(r)
    inputs = d.model_input.to_ints()
    targets = d.loss_fn_inputs["target_tokens"].tolist()
    weights = d.loss_fn_inputs["weights"].tolist()
    assert len(inputs) == len(targets) == len(weights) == len(r.tokens) - 1
    for i in range(len(inputs)):
        assert inputs[i] == r.tokens[i]
        assert targets[i] == r.tokens[i + 1]
        assert weights[i] == r.weights[i + 1]
    # the first weighted target is the answer's first token, predicted from the last prompt token
    first = weights.index(1.0)
    assert tok.decode([targets[first]]) == "4" and tok.decode([inputs[first]]) == "\n\n"
    assert targets[-1] == 151645 and weights[-1] == 1.0


def test_training_datums_weight_each_datum_to_one(qwen3):
    tok, fmt = qwen3
    rendered = sft.render_example(conv("a", "one two three", "b", "four"), tok, fmt, "all-assistant")
    for d in sft.training_datums(rendered):
        assert sum(d.loss_fn_inputs["weights"].tolist()) == pytest.approx(1.0)


def test_merge_joins_turns_when_the_template_extends():
    first = sft.Rendered([1, 2, 3], [0, 0, 1])
    second = sft.Rendered([1, 2, 3, 4, 5], [0, 0, 0, 0, 1])
    other = sft.Rendered([9, 4], [0, 1])
    assert sft._merge_extensions([first, second]) == [sft.Rendered([1, 2, 3, 4, 5], [0, 0, 1, 0, 1])]
    assert sft._merge_extensions([first, other]) == [first, other]


def test_template_without_prompt_prefix_is_a_clear_error(qwen3_path):
    tok = sft.load_tokenizer(qwen3_path)
    tok.chat_template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}[bot]{% endif %}")
    fmt = {"kind": "chat", "template_sha256": "ab" * 32, "template_kwargs": {}, "stop": [], "tokenizer": "odd"}
    with pytest.raises(sft.RenderError, match="message 1 .*not a prefix"):
        sft.render_example(conv("hi", "hello", system=None), tok, fmt)


# ---- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("obj, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}, "empty content"),
    ({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}, "roles out of order"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                   {"role": "assistant", "content": "c"}]}, "roles out of order"),
    ({"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]}, "must be a string"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown role"),
    ({"prompt": "p", "completion": ""}, "empty completion"),
    ({"text": "x"}, "expected a 'messages' list"),
])
def test_bad_examples_are_rejected_with_their_line(obj, message):
    with pytest.raises(sft.DataError, match=f"line 7: .*{message}"):
        sft.validate_example(obj, 7)


def test_malformed_json_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a", \n')
    with pytest.raises(sft.DataError, match=r"line 3: malformed JSON"):
        sft.read_jsonl(path)


def test_weights_and_sampler_paths_are_not_interchangeable():
    assert sft.check_tinker_path("tinker://r:train:0/weights/final", "weights")
    with pytest.raises(sft.DataError, match="sampler_weights/ checkpoint: it cannot seed a training client"):
        sft.check_tinker_path("tinker://r:train:0/sampler_weights/final", "weights")
    with pytest.raises(sft.DataError, match="weights/ checkpoint: a sampler needs a sampler_weights/ path"):
        sft.check_tinker_path("tinker://r:train:0/weights/final", "sampler_weights")
    with pytest.raises(sft.DataError, match="not a checkpoint path"):
        sft.check_tinker_path("runs/sft/final", "weights")


# ---- schedule, learning rate, batch order ------------------------------------------------------


def test_lr_schedules_follow_the_cookbook_with_warmup():
    assert [sft.lr_multiplier(s, 4, "linear") for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert [sft.lr_multiplier(s, 4, "constant") for s in range(4)] == [1.0] * 4
    assert sft.lr_multiplier(0, 4, "cosine") == 1.0
    assert sft.lr_multiplier(2, 4, "cosine") == pytest.approx(0.5)
    assert [sft.lr_multiplier(s, 6, "linear", warmup_steps=2) for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]


def test_recommended_learning_rate_matches_the_cookbook_table():
    assert sft.recommended_learning_rate("Qwen/Qwen3-8B") == pytest.approx(4.73e-4, rel=2e-3)
    assert sft.recommended_learning_rate("meta-llama/Llama-3.1-8B-Instruct") == pytest.approx(2.86e-4, rel=2e-3)
    assert sft.recommended_learning_rate("Qwen/Qwen3-30B-A3B") == pytest.approx(4.99e-4, rel=2e-3)
    assert sft.recommended_learning_rate("openai/gpt-oss-20b") is None


def test_batch_order_is_fixed_per_epoch_and_covers_each_datum_once():
    per_epoch, total = sft.plan_steps(10, 3, 2, None)
    assert (per_epoch, total) == (3, 6)
    order = sft.BatchOrder(10, 3, per_epoch, seed=1)
    epoch0 = [i for s in range(3) for i in order(s)]
    epoch1 = [i for s in range(3, 6) for i in order(s)]
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9 and epoch0 != epoch1
    assert order(4) == sft.BatchOrder(10, 3, per_epoch, seed=1)(4)
    assert sft.plan_steps(10, 3, 2, 4) == (3, 4)
    assert sft.plan_steps(2, 8, 3, None) == (1, 3)


def test_length_limit_errors_drops_or_truncates():
    short, long_ = sft.Rendered([1] * 4, [0, 0, 1, 1]), sft.Rendered([1] * 9, [0] * 5 + [1] * 4)
    pairs = [(1, short), (2, long_)]
    with pytest.raises(sft.DataError, match=r"1 datum\(s\) exceed the 6-token limit: line 2 \(9 tokens\)"):
        sft.apply_length_limit(pairs, 6, "error")
    assert sft.apply_length_limit(pairs, 6, "drop") == ([(1, short)], [2])
    kept, dropped = sft.apply_length_limit(pairs, 7, "truncate")
    assert dropped == [] and kept[1][1] == sft.Rendered([1] * 7, [0] * 5 + [1] * 2)
    assert sft.apply_length_limit(pairs, 5, "truncate") == ([(1, short)], [2])  # nothing left to train


# ---- the script as a user runs it (no server) --------------------------------------------------


def run(*args, env=None, cwd=None):
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0", **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=300)


def test_dry_run_audits_without_tinker_and_writes_datums(tmp_path, qwen3_path):
    log = tmp_path / "run"
    out = run("--data", str(EXAMPLE), "--tokenizer", qwen3_path, "--dry-run", "--log-path", str(log),
              "--batch-size", "8", "--epochs", "2", env={"TINKER_API_KEY": "", "TINKER_BASE_URL": "http://127.0.0.1:9"})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["status"] == "dry_run"
    assert report["examples"] == {"train": 31, "test": 3, "dropped": 0}
    assert report["steps"] == 6 and report["batches_per_epoch"] == 3
    assert report["format"]["kind"] == "chat" and report["format"]["stop"] == [151645]
    assert report["longest"]["tokens"] <= 128
    rows = [json.loads(line) for line in (log / "datums.jsonl").read_text().splitlines()]
    assert len(rows) == 34 and {r["split"] for r in rows} == {"train", "test"}
    assert all(r["trained_text"][0].endswith("<|im_end|>") for r in rows)
    assert sum(len(r["tokens"]) - 1 for r in rows if r["split"] == "train") == report["tokens"]["per_epoch"]
    assert not (log / "metrics.jsonl").exists() and not (log / "config.json").exists()
    assert "step " not in out.stderr


def test_dry_run_raw_format_on_prompt_completion_pairs(tmp_path, qwen3_path):
    out = run("--data", str(PC_EXAMPLE), "--tokenizer", qwen3_path, "--format", "raw", "--dry-run",
              "--log-path", str(tmp_path / "r"), "--test-fraction", "0")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["format"]["kind"] == "raw" and report["datums"] == {"train": 8, "test": 0}
    first = json.loads((tmp_path / "r" / "datums.jsonl").read_text().splitlines()[0])
    assert first["trained_text"] == [" From 1 November the last Gull Island sailing moves to 10:40 pm and "
                                     "weekend ferries run every hour.<|im_end|>"]


@pytest.mark.parametrize("content, code, message", [
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', 2, "line 1: conversation has no assistant turn"),
    ('{"prompt": "a", "completion": "b"}\n{oops\n', 2, "line 2: malformed JSON"),
])
def test_bad_data_exits_2_with_one_line_and_writes_nothing(tmp_path, content, code, message, qwen3_path):
    data = tmp_path / "d.jsonl"
    data.write_text(content)
    out = run("--data", str(data), "--tokenizer", qwen3_path, "--log-path", str(tmp_path / "log"))
    assert out.returncode == code
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert not (tmp_path / "log").exists()


def test_context_overflow_lists_lines_and_exits_2(tmp_path, qwen3_path):
    out = run("--data", str(EXAMPLE), "--tokenizer", qwen3_path, "--dry-run", "--max-length", "70",
              "--log-path", str(tmp_path / "log"))
    assert out.returncode == 2
    assert "exceed the 70-token limit: line" in out.stderr and "--drop-long or --truncate" in out.stderr
    dropped = run("--data", str(EXAMPLE), "--tokenizer", qwen3_path, "--dry-run", "--max-length", "70",
                  "--drop-long", "--log-path", str(tmp_path / "log"))
    assert dropped.returncode == 0, dropped.stderr
    report = json.loads(dropped.stdout)
    assert report["examples"]["dropped"] > 0 and report["longest"]["tokens"] <= 70


def test_missing_api_key_exits_4_naming_dry_run_and_local_backend(tmp_path, qwen3_path):
    env = {"TINKER_API_KEY": "", "HOME": str(tmp_path), "TINKER_CREDENTIAL_CMD": ""}
    out = run("--data", str(EXAMPLE), "--tokenizer", qwen3_path, "--log-path", str(tmp_path / "log"), env=env)
    assert out.returncode == 4, out.stderr
    assert "TINKER_API_KEY" in out.stderr and "--dry-run" in out.stderr and "tinker_local.py" in out.stderr
    assert not (tmp_path / "log").exists()


def test_max_usd_below_the_estimate_exits_3(tmp_path, qwen3_path):
    out = run("--data", str(EXAMPLE), "--tokenizer", qwen3_path, "--dry-run", "--max-usd", "0.0000001",
              "--log-path", str(tmp_path / "log"))
    assert out.returncode == 3, out.stderr
    assert "--max-usd" in out.stderr and out.stdout == ""


def test_existing_run_is_refused_without_resume_or_overwrite(tmp_path, qwen3_path):
    log = tmp_path / "log"
    log.mkdir()
    (log / "metrics.jsonl").write_text('{"step": 1}\n')
    out = run("--data", str(EXAMPLE), "--tokenizer", qwen3_path, "--log-path", str(log))
    assert out.returncode == 2 and "--resume" in out.stderr and "--overwrite" in out.stderr
    resumed = run("--data", str(EXAMPLE), "--tokenizer", qwen3_path, "--log-path", str(log), "--resume")
    assert resumed.returncode == 2 and "no checkpoint" in resumed.stderr


def test_the_script_copied_alone_runs_and_says_no_dollar_estimate(tmp_path, qwen3_path):
    import shutil

    alone = tmp_path / "project"
    alone.mkdir()
    shutil.copy(SCRIPT, alone / "tinker_sft.py")
    shutil.copy(PC_EXAMPLE, alone / "data.jsonl")
    out = subprocess.run([sys.executable, "tinker_sft.py", "--data", "data.jsonl", "--tokenizer", qwen3_path,
                          "--dry-run", "--format", "raw"], capture_output=True, text=True, cwd=alone, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    assert "no dollar estimate: tinker_pricing.py is not beside this script" in out.stderr
    report = json.loads(out.stdout)
    assert report["cost"] is None and report["log_path"] == "runs/sft"
    assert (alone / "runs" / "sft" / "datums.jsonl").exists()


def test_a_sampler_path_given_to_init_from_exits_2_before_any_work(tmp_path):
    out = run("--data", str(EXAMPLE), "--init-from", "tinker://r:train:0/sampler_weights/final",
              "--log-path", str(tmp_path / "log"))
    assert out.returncode == 2 and out.stdout == ""
    assert "cannot seed a training client; give the weights/ path" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_resume_reads_the_last_saved_row_and_ignores_a_torn_line(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    rows = [{"name": "000002", "step": 2, "next_batch": 2, "state_path": "tinker://a/weights/000002"},
            {"name": "000004", "step": 4, "next_batch": 4, "state_path": "tinker://a/weights/000004"}]
    (log / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"name": "0000')
    args = sft.parse_args(["--log-path", str(log), "--resume"])
    assert sft.Run(log).resume_point(resume=args.resume, overwrite=args.overwrite)["next_batch"] == 4


# ---- tokenizer: recorded so it loads from anywhere, and no long wait when the hub is out of reach ----


def closed_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_relative_tokenizer_folder_is_recorded_absolute(tmp_path, qwen3_path):
    folder = Path(qwen3_path)
    out = run("--data", str(EXAMPLE), "--tokenizer", os.path.join(".", folder.name), "--dry-run",
              "--log-path", str(tmp_path / "run"), cwd=folder.parent)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["format"]["tokenizer"] == os.path.join(os.path.realpath(folder.parent), folder.name)
    assert sft.tokenizer_record("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # a hub name as given


def test_resume_accepts_a_run_that_recorded_the_same_folder_relative(tmp_path, qwen3_path, monkeypatch):
    folder = Path(qwen3_path)
    monkeypatch.chdir(folder.parent)
    fmt = {"kind": "chat", "tokenizer": os.path.join(os.getcwd(), folder.name), "stop": [151645]}
    (tmp_path / "config.json").write_text(json.dumps({"format": {**fmt, "tokenizer": folder.name}}))
    sft.Run(tmp_path).check_resume({"format": fmt}, sft.RESUME_KEYS)  # no DataError
    with pytest.raises(sft.DataError, match="format"):
        sft.Run(tmp_path).check_resume({"format": {**fmt, "stop": [1]}}, sft.RESUME_KEYS)


def test_an_unreachable_hub_fails_in_seconds_naming_both_ways_to_run_offline(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TINKER_"))}
    env.update(HF_HOME=str(tmp_path / "empty-hf"), HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}",
               TINKER_TELEMETRY="0")
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(SCRIPT), "--data", str(EXAMPLE), "--dry-run"], capture_output=True,
                         text=True, env=env, timeout=300)
    elapsed = time.monotonic() - started
    assert out.returncode == 2 and out.stdout == ""
    assert elapsed < 20, f"took {elapsed:.1f} s"  # huggingface_hub's retries took ~50 s
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("error: cannot load the tokenizer for 'Qwen/Qwen3-8B'")
    assert "hub is unreachable" in error and "--tokenizer" in error and "HF_HUB_OFFLINE=1" in error
    assert "Retrying" not in out.stderr


def test_hf_hub_offline_without_a_cached_tokenizer_names_the_fix_without_a_connection(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TINKER_"))}
    env.update(HF_HOME=str(tmp_path / "empty-hf"), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    out = subprocess.run([sys.executable, str(SCRIPT), "--data", str(EXAMPLE), "--dry-run",
                          "--model-name", "meta-llama/Llama-3.1-8B-Instruct"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: cannot load the tokenizer for 'meta-llama/Llama-3.1-8B-Instruct': "
        "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer is not in the Hugging Face cache and "
        "HF_HUB_OFFLINE=1 forbids the hub; pass --tokenizer PATH (a folder with tokenizer.json), or download it "
        "once and run with HF_HUB_OFFLINE=1")
    # A name the local backend can serve as it is: the message also names that rehearsal, as a command
    out = subprocess.run([sys.executable, str(SCRIPT), "--data", str(EXAMPLE), "--dry-run"], capture_output=True,
                         text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].endswith(
        "; or, for a rehearsal, run it under the local backend, which serves Qwen/Qwen3-8B offline: "
        f"{sys.executable} {ROOT / 'scripts' / 'tinker_local.py'} run --model Qwen/Qwen3-8B -- {sys.executable} {SCRIPT} --data {EXAMPLE} "
        "--dry-run")


@pytest.mark.e2e
def test_a_resumed_run_prices_only_the_steps_left(tmp_path, qwen3_path, local_tinker):
    """The server is asked only for the context window: --max-usd stops the run before any training."""
    log = tmp_path / "run"
    log.mkdir()
    (log / "checkpoints.jsonl").write_text(json.dumps(
        {"name": "000004", "step": 4, "next_batch": 4, "state_path": "tinker://r:train:0/weights/000004"}) + "\n")
    common = ("--data", str(EXAMPLE), "--tokenizer", qwen3_path, "--batch-size", "8", "--epochs", "2",
              "--max-usd", "0.000001", "--log-path", str(log))
    env = local_tinker.env
    whole = run(*common, "--overwrite", "--dry-run", env=env)
    resumed = run(*common, "--resume", env=env)
    assert resumed.returncode == 3, resumed.stderr  # over budget: stops before any Tinker call
    [line] = [x for x in resumed.stderr.splitlines() if x.startswith("cost estimate")]
    assert line.startswith("cost estimate (sft, remaining 2 of 6 steps after --resume: Qwen/Qwen3-8B")
    report = json.loads(whole.stdout) if whole.returncode == 0 else None
    [whole_line] = [x for x in whole.stderr.splitlines() if x.startswith("cost estimate (sft: ")]
    usd = lambda text: float(text.split("): $")[1].split(" ")[0])  # noqa: E731
    assert 0 < usd(line) < usd(whole_line) / 2, (line, whole_line, report)


# ---- planning is linear in the data and keeps the batches of earlier versions --------------------


def test_batch_order_gives_the_batches_of_the_old_per_step_shuffle():
    """Runs recorded before BatchOrder resume identically: same seed, same batches at every step."""
    import random

    def old_batch_indices(step, n_train, batch_size, per_epoch, seed):  # tinker_sft.py before the shared code
        epoch, index = divmod(step, per_epoch)
        order = list(range(n_train))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        size = min(batch_size, n_train)
        return order[index * size:(index + 1) * size]

    for n, batch, epochs, seed in [(10, 3, 3, 1), (37, 8, 2, 0), (5, 8, 4, 7), (1000, 32, 2, 42)]:
        per_epoch, total = sft.plan_steps(n, batch, epochs, None)
        order = sft.BatchOrder(n, batch, per_epoch, seed)
        assert [order(s) for s in range(total)] == [old_batch_indices(s, n, batch, per_epoch, seed)
                                                   for s in range(total)]
        # a resumed process starts mid-epoch with a fresh BatchOrder: same batches
        assert sft.BatchOrder(n, batch, per_epoch, seed)(total - 1) == order(total - 1)


# ---- numeric flags: one check for the dry run and the real run (issue 13) ------------------------


@pytest.mark.parametrize("flag, value, expected", [
    ("--learning-rate", "nan", "expected a finite number"),
    ("--learning-rate", "0", "expected a value in (0, inf]"),
    ("--learning-rate", "-1e-4", "expected a value in (0, inf]"),
    ("--learning-rate", "inf", "expected a finite number"),
    ("--max-steps", "0", "expected a value in [1, inf]"),
    ("--max-steps", "-3", "expected a value in [1, inf]"),
    ("--max-usd", "nan", "expected a finite number"),
    ("--max-usd", "-1", "expected a value in [0, inf]"),
    ("--batch-size", "0", "expected a value in [1, inf]"),
    ("--epochs", "0", "expected a value in [1, inf]"),
    ("--lora-rank", "0", "expected a value in [1, inf]"),
    ("--test-fraction", "1", "expected a value in [0, 1)"),
    ("--warmup-steps", "-1", "expected a value in [0, inf]"),
    ("--max-tokens", "0", "expected a value in [1, inf]"),
])
@pytest.mark.parametrize("mode", ["--dry-run", "real"])
def test_bad_numbers_exit_2_in_dry_run_and_real_run_alike(tmp_path, flag, value, expected, mode):
    log = tmp_path / "log"
    extra = [mode] if mode == "--dry-run" else []
    out = run("--data", str(EXAMPLE), "--log-path", str(log), f"{flag}={value}", *extra,
              env={"TINKER_API_KEY": "", "TINKER_BASE_URL": "http://127.0.0.1:9"})
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"error: {flag} ") and out.stderr.strip().endswith(expected)
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""
    assert not log.exists()


# ---- the script copied alone into an empty folder (issue 12) --------------------------------------


def test_copied_alone_help_and_dry_run_work_with_nothing_beside_it(tmp_path, qwen3_path):
    import shutil

    alone = tmp_path / "empty"
    alone.mkdir()
    shutil.copy(SCRIPT, alone / "tinker_sft.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "TINKER_API_KEY": ""}
    helped = subprocess.run([sys.executable, "tinker_sft.py", "--help"], capture_output=True, text=True,
                            cwd=alone, env=env, timeout=120)
    assert helped.returncode == 0 and "--rehearse" in helped.stdout and "--eval-every" in helped.stdout
    dry = subprocess.run([sys.executable, "tinker_sft.py", "--dry-run", "--tokenizer", qwen3_path],
                         capture_output=True, text=True, cwd=alone, env=env, timeout=300)
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["status"] == "dry_run" and report["examples"]["train"] == len(sft.REHEARSAL_TRAIN)
    assert report["cost"] is None and "built-in rehearsal set" in dry.stderr
    assert sorted(p.name for p in alone.iterdir()) == ["runs", "tinker_sft.py"]
    assert [p.name for p in (alone / "runs" / "sft").iterdir()] == ["datums.jsonl"]


def test_a_real_run_without_data_names_the_flag_instead_of_training_the_toy_set(tmp_path):
    out = run("--log-path", str(tmp_path / "log"), env={"TINKER_API_KEY": ""})
    assert out.returncode == 2 and "no training data: pass --data" in out.stderr and "--rehearse" in out.stderr


# ---------------------------------------------------------------- sizing (issue 27)


def write_pairs(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                             {"role": "assistant", "content": f"Answer {i}."}]}) + "\n")
    return path


def dry_run(tmp_path, capsys, qwen3_path, *flags):
    code = sft.main(["--tokenizer", qwen3_path, "--dry-run", "--log-path", str(tmp_path / "audit"), *flags])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def test_a_plan_under_100_steps_prints_batch_and_epochs_that_reach_them_with_the_scaled_rate(tmp_path, capsys,
                                                                                             qwen3_path):
    data = write_pairs(tmp_path / "small.jsonl", 24)  # 22 train after the 10% split: one step at batch 32
    code, plan, err = dry_run(tmp_path, capsys, qwen3_path, "--data", str(data))
    assert code == 0 and plan["steps"] == 1
    assert plan["sizing"] == {"steps": 1, "min_steps": 100, "suggested": {
        "batch_size": 2, "epochs": 10, "steps": 110, "learning_rate": float(f"{plan['learning_rate'] * (2 / 22) ** 0.5:.3g}")}}
    assert "make 1 step(s); fewer than about 100 rarely train. --batch-size 2 --epochs 10 makes 110" in err
    code, plan, err = dry_run(tmp_path, capsys, qwen3_path, "--data", str(data), "--batch-size", "2", "--epochs", "10")
    assert code == 0 and plan["steps"] == 110 and "sizing" not in plan and "rarely train" not in err


def test_the_default_held_out_split_stops_at_500_and_the_plan_shows_its_size_and_cost(tmp_path, capsys, qwen3_path):
    data = write_pairs(tmp_path / "large.jsonl", 6000)
    code, plan, err = dry_run(tmp_path, capsys, qwen3_path, "--data", str(data))
    assert code == 0 and plan["examples"]["test"] == sft.MAX_HELD_OUT == 500 and plan["examples"]["train"] == 5500
    assert plan["held_out"]["datums"] == 500 and plan["held_out"]["evals"] == 2 and plan["held_out"]["usd"] > 0
    assert "held-out split: 500 of 6000 examples" in err and "500 datums" in err
    code, plan, _ = dry_run(tmp_path, capsys, qwen3_path, "--data", str(data), "--test-fraction", "0.1")
    assert code == 0 and plan["examples"]["test"] == 600  # an explicit fraction is taken as given
