"""The batch renderer (issue 14) gives render_example's datums token for token on every chat family,
takes the fast path where it claims to, and falls back to render_example where it must: contents it
cannot prove inert, tools, and a template whose output its skeleton would get wrong."""
from __future__ import annotations

import random

import pytest

import tinker_sft as sft
from test_chat_templates import CHAT_FAMILIES

WORDS = "the ferry leaves at 9 and returns at 17 while tickets cost 4.50 euros per adult Tokyo café".split()


def sentence(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def varied(n, seed=0, awkward=True, reasoning=True):
    """n validated conversations: system or not, 1-3 turns, reasoning on some; with awkward=True also
    contents the fast path must refuse (leading newline, tags, trailing space, tool calls, tools)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": sentence(rng, 3, 8)}] if i % 2 else []
        for _ in range(rng.randint(1, 3)):
            msgs += [{"role": "user", "content": sentence(rng, 2, 12)},
                     {"role": "assistant", "content": sentence(rng, 2, 20)}]
        if reasoning and i % 5 == 0:
            msgs[-1]["reasoning_content"] = sentence(rng, 3, 10)
        example = {"messages": msgs}
        if awkward and i % 7 == 3:
            kind = (i // 7) % 5
            if kind == 0:
                msgs[-1]["content"] = "\n" + msgs[-1]["content"]
            elif kind == 1:
                msgs[-1]["content"] = "<think>\nhmm\n</think>\n\n" + msgs[-1]["content"]
            elif kind == 2:
                msgs[-2]["content"] += "  "
            elif kind == 3:
                msgs[-1]["tool_calls"] = [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]
            else:
                example["tools"] = [{"type": "function", "function": {"name": "lookup", "description": "Look up.",
                                                                      "parameters": {"type": "object", "properties": {}}}}]
        out.append(sft.validate_example(example, i + 1))
    return out


def slow(examples, tok, fmt, train_on):
    out = []
    for ex in examples:
        try:
            out.extend((ex["line"], r) for r in sft.render_example(ex, tok, fmt, train_on))
        except sft.RenderError as e:
            out.append((ex["line"], f"error: {e}"))
    return out


@pytest.mark.parametrize("name", CHAT_FAMILIES)
@pytest.mark.parametrize("train_on", ["last-assistant", "all-assistant"])
def test_batch_renderer_equals_render_example_on_every_family(chat_family, name, train_on):
    tok, fmt = chat_family(name)
    examples = varied(120)
    expected = slow(examples, tok, fmt, train_on)
    renderable = [ex for ex in examples if not any(line == ex["line"] and isinstance(r, str) for line, r in expected)]
    renderer = sft.BatchRenderer(tok, fmt)
    got = sft._unpack(renderer.render(renderable, train_on))
    assert got == [(line, r) for line, r in expected if not isinstance(r, str)]
    assert any(s is not False for s in renderer.skeletons.values()), "the fast path was never taken"


@pytest.mark.parametrize("name", ["Qwen3-8B", "Llama-3.1-8B-Instruct"])
def test_render_all_is_exact_with_and_without_the_fast_path_in_the_pool(chat_family, name):
    tok, fmt = chat_family(name)
    examples = varied(sft.POOL_MIN_EXAMPLES + 300, seed=1, awkward=False, reasoning=name.startswith("Qwen3"))
    fast = sft.render_all(examples, tok, fmt, "all-assistant", workers=2)
    assert fast == sft.render_all(examples, tok, fmt, "all-assistant", workers=1, fast=False)


def test_inert_contents_take_the_fast_path_and_the_others_do_not(chat_family):
    tok, fmt = chat_family("Qwen3-8B")
    renderer = sft.BatchRenderer(tok, fmt)
    plain = varied(1, awkward=False)[0]
    assert renderer._plan(plain, "last-assistant") is not None
    for content in ("\nleading newline", "trailing space ", "a <b>tag</b>", "", "x</think>y"):
        edited = {**plain, "messages": [*plain["messages"][:-1], {"role": "assistant", "content": content}]}
        assert renderer._plan(edited, "last-assistant") is None, content
    with_tools = {**plain, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert renderer._plan(with_tools, "last-assistant") is None


def test_a_template_the_skeleton_gets_wrong_falls_back_to_render_example(chat_family, monkeypatch):
    """A template that branches on a content's length renders markers and real contents differently;
    the spot checks catch it and render_all renders everything the slow way."""
    tok, fmt = chat_family("Qwen3-8B")
    examples = varied(200, seed=2, awkward=False)
    expected = sft.render_all(examples, tok, fmt, "last-assistant", workers=1, fast=False)
    real_fill = sft._fill
    monkeypatch.setattr(sft, "_fill", lambda parts, values: real_fill(parts, values).replace(" at ", " @ "))
    with pytest.raises(sft._FastPathMismatch):
        sft.BatchRenderer(tok, fmt).render(examples, "last-assistant")
    assert sft.render_all(examples, tok, fmt, "last-assistant", workers=1) == expected


def test_a_render_error_on_the_batch_path_names_its_line(chat_family):
    tok, fmt = chat_family("Qwen3-8B")
    examples = varied(50, awkward=False)
    examples[20] = sft.validate_example({"messages": [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                              "function": {"name": "f", "arguments": "{oops"}}]}]},
        21)
    with pytest.raises(sft.RenderError, match=r"^line 21: tool call 'f' has arguments that are not JSON"):
        sft.render_all(examples, tok, fmt, "last-assistant", workers=1)


def test_weight_runs_round_trip():
    for weights in ([], [0.0], [1.0], [0.0, 0.0, 1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0]):
        assert sft._weights(sft._runs(weights)) == weights


def _dies_on_line_1500(chunk):
    """A pool worker killed mid-chunk (as the kernel's out-of-memory killer does)."""
    import os

    if any(ex["line"] == 1500 for ex in chunk):
        os._exit(9)
    return _REAL_CHUNK[0](chunk)


_REAL_CHUNK = []


def test_a_killed_pool_worker_costs_a_serial_render_not_a_hang(chat_family, monkeypatch, capsys):
    tok, fmt = chat_family("Qwen3-8B")
    examples = varied(sft.POOL_MIN_EXAMPLES + 100, seed=3, awkward=False)
    expected = sft.render_all(examples, tok, fmt, "last-assistant", workers=1)
    _REAL_CHUNK[:] = [sft._render_chunk]
    monkeypatch.setattr(sft, "_render_chunk", _dies_on_line_1500)
    assert sft.render_all(examples, tok, fmt, "last-assistant", workers=2) == expected
    assert "a worker process died" in capsys.readouterr().err
