"""Tool calls through the real chat templates: rendered, masked (the call is learned, the result is
not) and parsed back from sampled tokens, as multi-turn RL needs (issue 7, item 4).

parse_qwen3_tool_calls, parse_xml_tool_calls (Qwen3.5/3.6, Nemotron 3) and parse_harmony_tool_calls
(gpt-oss) are small and standalone on purpose: RL code copies the one its model needs
(scripts/tinker_rl.py's multi-turn example parses Qwen3's <tool_call>{json}</tool_call>).
Each is checked against Thinking Machines' own parser (tml-renderers) on the same tokens.
"""
from __future__ import annotations

import json
import re

import pytest

import tinker_sft as sft
from test_chat_templates import one, unweighted_text, weighted_text

_QWEN3_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_qwen3_tool_calls(text: str) -> list[dict]:
    """Tool calls in a decoded Qwen3 completion, [{"name": str, "arguments": dict}, ...].

    Qwen3 writes each call as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>; text
    before the first call is the visible reply. Raises ValueError when a call is unclosed, is not
    JSON, or lacks a name: a malformed call is the policy's mistake, not a call to run.
    """
    bodies = _QWEN3_CALL.findall(text)
    if text.count("<tool_call>") != len(bodies):
        raise ValueError("unclosed <tool_call> (completion cut by max_tokens?)")
    calls = []
    for body in bodies:
        obj = json.loads(body)  # ValueError on bad JSON
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError(f"tool call without a name: {body.strip()[:80]!r}")
        args = obj.get("arguments", {})
        calls.append({"name": obj["name"], "arguments": json.loads(args) if isinstance(args, str) else args})
    return calls


_HARMONY_CALL = re.compile(
    r"to=functions\.([^\s<]+)\s*<\|channel\|>commentary[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)<\|call\|>",
    re.S)


def parse_harmony_tool_calls(text: str) -> list[dict]:
    """Tool calls in a decoded gpt-oss (Harmony) completion, [{"name", "arguments"}, ...].

    A call is '... to=functions.NAME<|channel|>commentary json<|message|>{args}<|call|>'
    (the template writes 'json', Harmony writes '<|constrain|>json'; both parse).
    """
    calls = []
    for name, args in _HARMONY_CALL.findall(text):
        calls.append({"name": name, "arguments": json.loads(args)})
    if "<|call|>" in text and not calls:
        raise ValueError("<|call|> without a parsable 'to=functions.NAME ... <|message|>{json}' call")
    return calls


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def parse_xml_tool_calls(text: str) -> list[dict]:
    """Tool calls in a decoded Qwen3.5/3.6 or Nemotron 3 completion, [{"name", "arguments"}, ...].

    Those templates write <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n
    </function>\n</tool_call>. A value that parses as JSON (numbers, objects, lists, true) is
    taken as JSON, anything else as text: the same reading as Tinker's parser (so a string "3"
    comes back as the number 3; the format cannot tell them apart).
    """
    bodies = _QWEN3_CALL.findall(text)
    if text.count("<tool_call>") != len(bodies):
        raise ValueError("unclosed <tool_call> (completion cut by max_tokens?)")
    calls = []
    for body in bodies:
        function = _XML_FUNCTION.search(body)
        if not function:
            raise ValueError(f"<tool_call> without <function=NAME>: {body.strip()[:80]!r}")
        arguments = {}
        for key, value in _XML_PARAMETER.findall(function.group(2)):
            try:
                arguments[key] = json.loads(value)
            except ValueError:
                arguments[key] = value
        calls.append({"name": function.group(1).strip(), "arguments": arguments})
    return calls


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C, sunny"},
    {"role": "assistant", "content": "It is 18C and sunny."},
]
EXPECTED_CALL = [{"name": "get_weather", "arguments": {"city": "Paris"}}]

TRAINED_CALL = {  # the weighted tokens of the tool-call turn
    "Qwen3-8B": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    "gpt-oss-20b": ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
    "Qwen3.5-4B": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                  "</tool_call><|im_end|>",
    # Nemotron's HF template writes "<think></think>\n" before a call; Tinker's renderer has no "\n"
    "Nemotron-3-Nano-30B-A3B": "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                               "</function>\n</tool_call>\n<|im_end|>",
    "DeepSeek-V3.1": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
}
PARSERS = {"Qwen3-8B": parse_qwen3_tool_calls, "gpt-oss-20b": parse_harmony_tool_calls,
           "Qwen3.5-4B": parse_xml_tool_calls, "Nemotron-3-Nano-30B-A3B": parse_xml_tool_calls}
TML_RENDERER = {"Qwen3-8B": "Qwen3", "gpt-oss-20b": "GptOss", "Qwen3.5-4B": "Qwen35",
                "Nemotron-3-Nano-30B-A3B": "Nemotron3"}


def example():
    return sft.validate_example({"messages": CALL, "tools": TOOLS}, 1)


@pytest.mark.parametrize("name", sorted(TRAINED_CALL))
def test_tool_call_is_learned_and_tool_result_is_not(chat_family, name):
    tok, fmt = chat_family(name)
    call_turn = one(sft.render_example({**example(), "messages": CALL[:2]}, tok, fmt))
    assert weighted_text(tok, call_turn) == [TRAINED_CALL[name]]
    # DeepSeek V3.1's template ignores `tools`: declare them in the system message yourself
    declared = "Current weather for a city" in unweighted_text(tok, call_turn)
    assert declared == (name != "DeepSeek-V3.1"), "the declaration is prompt, never trained"
    for r in sft.render_example(example(), tok, fmt, train_on="all-assistant"):
        assert not any("18C, sunny" in s for s in weighted_text(tok, r))
    final = sft.render_example(example(), tok, fmt)[-1]
    assert "18C, sunny" in unweighted_text(tok, final)
    assert weighted_text(tok, final)[-1].startswith(("It is 18C", "<|channel|>final<|message|>It is 18C"))


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_tool_call_parses_back_from_sampled_tokens(chat_family, name):
    tok, fmt = chat_family(name)
    r = one(sft.render_example({**example(), "messages": CALL[:2]}, tok, fmt))
    sampled = [t for t, w in zip(r.tokens, r.weights) if w]  # what a sampler returns after the prompt
    assert r.tokens[: len(r.tokens) - len(sampled)] == sft.generation_prompt(CALL[:1], tok, fmt, tools=TOOLS)
    assert sampled[-1] in fmt["stop"], "sampling stops at the end of the call"
    assert PARSERS[name](tok.decode(sampled)) == EXPECTED_CALL


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_parsers_agree_with_tinker_renderer_parser(chat_family, tml_renderers, name):
    tok, fmt = chat_family(name)
    messages = [CALL[0], dict(CALL[1], tool_calls=[{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 3, "units": {"t": "C"}}}}])]
    r = one(sft.render_example({"messages": messages}, tok, fmt))
    sampled = [t for t, w in zip(r.tokens, r.weights) if w]
    cls = getattr(tml_renderers.renderers, TML_RENDERER[name])
    oracle = cls(current_date=sft.FROZEN_DATE) if name == "gpt-oss-20b" else cls.disable_thinking()
    _, parser = oracle.render_for_completion(tml_renderers.chat.OpenAIMessage.from_oss_messages(CALL[:1]))
    parsed = tml_renderers.chat.MessageList(parser.parse_tokens(sampled)).to_oss_messages()
    tml_calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                 for m in parsed for c in m.get("tool_calls", [])]
    assert tml_calls == PARSERS[name](tok.decode(sampled)) == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "units": {"t": "C"}}}]


def test_qwen3_parser_reads_several_calls_and_rejects_malformed_ones():
    two = ('Checking.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
           '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": 2}"}\n</tool_call><|im_end|>')
    assert parse_qwen3_tool_calls(two) == [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": 2}}]
    assert parse_qwen3_tool_calls("Just text.<|im_end|>") == []
    with pytest.raises(ValueError, match="unclosed"):
        parse_qwen3_tool_calls('<tool_call>\n{"name": "a", "argu')
    with pytest.raises(ValueError):
        parse_qwen3_tool_calls("<tool_call>\nnot json\n</tool_call>")
    with pytest.raises(ValueError, match="without a name"):
        parse_qwen3_tool_calls('<tool_call>\n{"arguments": {}}\n</tool_call>')


def test_xml_parser_reads_several_calls_and_rejects_malformed_ones():
    text = ("<tool_call>\n<function=a>\n<parameter=x>\nline one\nline two\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=b>\n</function>\n</tool_call>")
    assert parse_xml_tool_calls(text) == [{"name": "a", "arguments": {"x": "line one\nline two"}},
                                          {"name": "b", "arguments": {}}]
    with pytest.raises(ValueError, match="unclosed"):
        parse_xml_tool_calls("<tool_call>\n<function=a>\n<parameter=x>\n1")
    with pytest.raises(ValueError, match="without <function=NAME>"):
        parse_xml_tool_calls("<tool_call>\n{\"name\": \"a\"}\n</tool_call>")


def test_harmony_parser_reads_a_call_after_reasoning_and_the_constrain_form():
    text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    assert parse_harmony_tool_calls(text) == EXPECTED_CALL
    assert parse_harmony_tool_calls("<|channel|>final<|message|>Hi<|return|>") == []
    with pytest.raises(ValueError):
        parse_harmony_tool_calls("garbage<|call|>")


def test_tool_call_merges_with_the_answer_only_where_the_template_extends(chat_family):
    tok, fmt = chat_family("Qwen3-8B")
    assert len(sft.render_example(example(), tok, fmt, train_on="all-assistant")) == 2
    tok, fmt = chat_family("DeepSeek-V3.1")
    merged = one(sft.render_example(example(), tok, fmt, train_on="all-assistant"))
    assert weighted_text(tok, merged) == [TRAINED_CALL["DeepSeek-V3.1"], "It is 18C and sunny.<｜end▁of▁sentence｜>"]


def test_kimi_tool_calls_stop_with_a_clear_error(chat_family):
    # Kimi-K2's template appends to a list, which transformers' sandbox refuses; Moonshot's own
    # tokenizer code renders tools differently (TypeScript). The bundle refuses rather than guess.
    tok, fmt = chat_family("Kimi-K2-Thinking")
    with pytest.raises(sft.RenderError, match="Kimi-K2-Thinking.*failed on this conversation"):
        sft.render_example(example(), tok, fmt)


def test_examples_with_tools_are_validated(chat_family):
    with pytest.raises(sft.DataError, match="line 3: 'tools' must be a list"):
        sft.validate_example({"messages": CALL, "tools": {"name": "x"}}, 3)
    with pytest.raises(sft.DataError, match="line 4: message 1 tool_calls"):
        sft.validate_example({"messages": [CALL[0], dict(CALL[1], tool_calls=[{"function": {}}])]}, 4)
    bad_json = [CALL[0], dict(CALL[1], tool_calls=[{"type": "function",
                                                   "function": {"name": "f", "arguments": "{oops"}}])]
    tok, fmt = chat_family("Qwen3-8B")
    with pytest.raises(sft.RenderError, match="not JSON"):
        sft.render_example(sft.validate_example({"messages": bad_json}, 5), tok, fmt)


def test_rl_calculator_reads_a_call_sampled_in_the_qwen3_template(chat_family):
    """tinker_rl.py's multi-turn example parses the call the Qwen3 template teaches."""
    import random

    import tinker_rl

    tok, fmt = chat_family("Qwen3-8B")
    call = [{"role": "user", "content": "What is 2*3?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "calculator", "arguments": {"expression": "2*3"}}}]}]
    r = one(sft.render_example({"messages": call}, tok, fmt))
    sampled = [t for t, w in zip(r.tokens, r.weights) if w]
    turn = tinker_rl.completion_text(tok, fmt, sampled)
    assert parse_qwen3_tool_calls(turn) == [{"name": "calculator", "arguments": {"expression": "2*3"}}]
    observation, reward, done, info = tinker_rl.calculator_env_step({}, call[:1], turn, random.Random(0))
    assert observation == {"role": "tool", "content": "6"} and reward == 0.0 and not done
    assert info == {"tool_calls": 1}
