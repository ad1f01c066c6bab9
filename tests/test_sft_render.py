"""Rendering at scale (issue 14): the process pool gives exactly the serial datums, a render error still
names its line, and the on-disk cache is keyed by everything a datum depends on, so a --resume or a real
run after a dry run reads the datums back instead of rendering again."""
import json

import pytest

import tinker_sft as sft
from test_sft_loop import RecordingService


@pytest.fixture(scope="module")
def qwen3(offline_tokenizer):
    path = offline_tokenizer("Qwen3-8B")
    tok = sft.load_tokenizer(path)
    return path, tok, sft.chat_format(tok, name=sft.tokenizer_record(path))


def synthetic(n, start=0):
    """n short, distinct conversations, some multi-turn, validated as tinker_sft validates them."""
    out = []
    for i in range(start, start + n):
        msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": f"What is {i} + {i % 7}?"},
                {"role": "assistant", "content": str(i + i % 7)}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": str(2 * (i + i % 7))}]
        out.append(sft.validate_example({"messages": msgs}, i + 1))
    return out


def test_the_process_pool_renders_exactly_what_one_process_renders(qwen3):
    _, tok, fmt = qwen3
    examples = synthetic(sft.POOL_MIN_EXAMPLES + 500)
    for train_on in ("last-assistant", "all-assistant"):
        serial = sft.render_all(examples, tok, fmt, train_on, workers=1)
        pooled = sft.render_all(examples, tok, fmt, train_on, workers=2)
        assert pooled == serial
        two_turns = sum(1 for i in range(len(examples)) if i % 3 == 0)  # Qwen3 trains each turn as its own datum
        assert len(serial) == len(examples) + (two_turns if train_on == "all-assistant" else 0)


def test_a_render_error_in_a_pool_worker_names_its_line(qwen3):
    _, tok, fmt = qwen3
    examples = synthetic(sft.POOL_MIN_EXAMPLES + 100)
    examples[1500] = sft.validate_example({"messages": [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                              "function": {"name": "f", "arguments": "{oops"}}]}]},
        "1501")
    with pytest.raises(sft.RenderError, match=r"^line 1501: tool call 'f' has arguments that are not JSON"):
        sft.render_all(examples, tok, fmt, "last-assistant", workers=2)


def test_the_cache_returns_the_same_datums_without_rendering(qwen3, tmp_path, monkeypatch):
    _, tok, fmt = qwen3
    examples = synthetic(sft.CACHE_MIN_EXAMPLES)
    first = sft.render_all(examples, tok, fmt, "last-assistant", workers=1, cache_dir=tmp_path)
    [cached] = list(tmp_path.iterdir())
    assert cached.name == sft.render_cache_key(examples, tok, fmt, "last-assistant") + ".json"

    def no_render(*args, **kwargs):
        raise AssertionError("rendered again")

    monkeypatch.setattr(sft, "_render_serial", no_render)
    monkeypatch.setattr(sft, "_render_in_pool", no_render)
    assert sft.render_all(examples, tok, fmt, "last-assistant", workers=1, cache_dir=tmp_path) == first


def test_the_cache_key_changes_with_data_format_train_on_and_the_renderer(qwen3, monkeypatch):
    _, tok, fmt = qwen3
    examples = synthetic(5)
    key = sft.render_cache_key(examples, tok, fmt, "last-assistant")
    assert key == sft.render_cache_key(synthetic(5), tok, fmt, "last-assistant")
    edited = synthetic(5)
    edited[3]["messages"][-1]["content"] += "!"
    assert sft.render_cache_key(edited, tok, fmt, "last-assistant") != key
    assert sft.render_cache_key(examples, tok, fmt, "all-assistant") != key
    thinking = dict(fmt, template_kwargs={**fmt["template_kwargs"], "enable_thinking": True})
    assert sft.render_cache_key(examples, tok, thinking, "last-assistant") != key
    assert sft.render_cache_key(examples, tok, sft.raw_format(tok, name="q"), "last-assistant") != key
    real = sft.render_example
    monkeypatch.setattr(sft, "render_example", lambda *a, **k: real(*a, **k))  # the rendering code changed
    assert sft.render_cache_key(examples, tok, fmt, "last-assistant") != key


def test_a_real_run_after_a_dry_run_and_its_resume_render_nothing_again(qwen3, tmp_path, monkeypatch, capsys):
    path, _, _ = qwen3
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": ex["messages"]}) + "\n" for ex in synthetic(1200)))
    cache = tmp_path / "cache"
    flags = ["--data", str(data), "--tokenizer", path, "--log-path", str(tmp_path / "log"), "--batch-size", "4",
             "--max-steps", "2", "--save-every", "1", "--num-probes", "0", "--learning-rate", "1e-3",
             "--render-cache", str(cache)]
    assert sft.main([*flags, "--dry-run"]) == 0
    assert len(list(cache.iterdir())) == 1  # the training split; the 120 held-out examples are too few to cache
    rendered = []
    real_serial = sft._render_serial
    monkeypatch.setattr(sft, "_render_serial", lambda ex, *a: rendered.append(len(ex)) or real_serial(ex, *a))
    monkeypatch.setattr(sft, "_render_in_pool", lambda *a: pytest.fail("the training split was rendered again"))
    service = RecordingService()
    monkeypatch.setattr(sft, "connect", lambda model_name, **_: (service, 40960))
    assert sft.main(flags) == 0
    assert rendered == [120]  # only the held-out split, below the cache threshold
    (tmp_path / "log" / "checkpoints.jsonl").write_text(
        (tmp_path / "log" / "checkpoints.jsonl").read_text().splitlines()[0] + "\n")
    assert sft.main([*flags, "--resume"]) == 0
    assert rendered == [120, 120]
