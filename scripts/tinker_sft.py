#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "tinker>=0.38,<0.39",
#     "transformers",
#     "jinja2>=3.1.6",  # transformers renders chat templates with jinja2 but does not declare it
#     "rich",
# ]
# ///
"""Supervised LoRA fine-tuning on Tinker: rendered by the model's own chat template, audited, resumable.

Run:
    # audit for free (no Tinker call): renders, masks, counts tokens, estimates the cost
    uv run tinker_sft.py --data sft_example.jsonl --tokenizer PATH/TO/TOKENIZER --dry-run
    # train
    uv run tinker_sft.py --data my_data.jsonl --model-name Qwen/Qwen3-8B --log-path runs/sft1 --max-usd 5

Edit:
    load_dataset(path) -> list of examples, each {"messages": [{"role", "content"}, ...]} or
    {"prompt": str, "completion": str} (a (line, example) pair is also accepted so errors name the
    line). The default reads JSONL in either shape. Nothing else needs editing for the common case.

Outputs:
    LOG/config.json       every setting (never the API key) and the "format" used to render
    LOG/metrics.jsonl     one row per step: loss (NLL per trained token), learning_rate, tokens, seconds
    LOG/checkpoints.jsonl one row per save: step, next_batch, epoch, state_path, sampler_path, format
    LOG/eval.jsonl        held-out NLL before/after (and every --eval-every steps), probe samples
    LOG/datums.jsonl      (--dry-run) per datum: token ids, weights, decoded text of each weighted span
    stdout                one JSON object: status, log_path, steps, state_path, sampler_path,
                          eval {nll_before, nll_after, probes}, tokens, format, sampling

Requires:
    TINKER_API_KEY (not for --dry-run); TINKER_BASE_URL to point at a local rehearsal backend
    (scripts/tinker_local.py). --tokenizer PATH, or HF_HUB_OFFLINE=1 with a warm cache, to run offline.

Exit codes: 0 ok, 1 Tinker or runtime failure, 2 bad input or usage (data, flags, unknown model,
context overflow, no checkpoint to resume), 3 cost estimate above --max-usd, 4 no credentials or
Tinker unreachable, 130 interrupted (resume with --resume).

Loss: every datum's weights are 1/(its trained tokens), so the summed loss is the mean over datums of
each datum's mean NLL (the cookbook default since its issue 271: long answers do not dominate a batch).
The logged "loss" is the plain NLL per trained token of the batch, comparable across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import json
import math
import os
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

SCRIPT_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = "Qwen/Qwen3-8B"
FROZEN_DATE = "2024-07-26"  # Every datum renders the same on every day, so resume is exact.
FROZEN_DATE_STRING = "26 Jul 2024"  # Llama 3.x templates print this when given.
ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}  # the cookbook's values; the SDK default eps is 1e-12
PERIODIC_TTL_SECONDS = 7 * 24 * 3600


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Supervised LoRA fine-tuning on Tinker (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # data
    p.add_argument("--data", help="training JSONL: {'messages': [...]} or {'prompt', 'completion'} per line")
    p.add_argument("--test-data", help="held-out JSONL; default: a --test-fraction split of --data")
    p.add_argument("--test-fraction", type=float, default=0.1, help="held-out share when no --test-data")
    p.add_argument("--train-on", choices=["last-assistant", "all-assistant"], default="last-assistant")
    p.add_argument("--format", choices=["auto", "chat", "raw"], default="auto",
                   help="chat: the tokenizer's chat template; raw: text + explicit EOS (base models); "
                        "auto: raw for *-Base models or tokenizers without a template, else chat")
    p.add_argument("--thinking", action="store_true",
                   help="render prompts with thinking on (Qwen3 enable_thinking, DeepSeek thinking); "
                        "messages with reasoning_content always render with it on")
    p.add_argument("--max-length", type=int, help="token limit per datum (default: the model's context window)")
    p.add_argument("--drop-long", action="store_true", help="drop datums over the limit instead of failing")
    p.add_argument("--truncate", action="store_true", help="cut datums over the limit instead of failing")
    # model
    p.add_argument("--model-name", default=DEFAULT_MODEL, help="Tinker base model id")
    p.add_argument("--tokenizer", help="tokenizer folder or hub name (default: from --model-name)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--init-from", help="start from a tinker://.../weights/NAME state (fresh optimizer)")
    # optimisation
    p.add_argument("--learning-rate", type=float, help="default: the cookbook LoRA formula for the family")
    p.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default="linear")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="datums per step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, help="stop after this many steps in total")
    p.add_argument("--seed", type=int, default=0, help="data order, test split and LoRA init")
    # evaluation and checkpoints
    p.add_argument("--eval-every", type=int, default=0, help="held-out NLL every N steps (0: before/after only)")
    p.add_argument("--num-probes", type=int, default=3, help="greedy probe samples before and after")
    p.add_argument("--max-tokens", type=int, default=64, help="max tokens per probe sample")
    p.add_argument("--save-every", type=int, default=20, help="save_state every N steps (0: only at the end)")
    p.add_argument("--log-path", default="runs/sft")
    # run control
    p.add_argument("--max-usd", type=float, help="stop before any paid call if the estimate exceeds this")
    p.add_argument("--dry-run", action="store_true", help="render, check and estimate; no Tinker call")
    p.add_argument("--resume", action="store_true", help="continue from the last row of LOG/checkpoints.jsonl")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run record in --log-path")
    args = p.parse_args(argv)
    if args.drop_long and args.truncate:
        p.error("choose one of --drop-long and --truncate")
    if args.resume and args.overwrite:
        p.error("choose one of --resume and --overwrite")
    for name in ("batch_size", "epochs", "lora_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.test_fraction < 1:
        p.error("--test-fraction must be in [0, 1)")
    return args


# ==== EDIT ME: load_dataset() ====
def load_dataset(path):
    """Return the examples in `path`: a list of dicts, each either

        {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}
            (an assistant message may carry "reasoning_content": str; it is trained too), or
        {"prompt": str, "completion": str}.

    Items may also be (where, example) pairs; `where` (a line number or label) names the example in
    error messages. Replace the body to read from anywhere else (a Hugging Face dataset, a database).
    """
    return read_jsonl(path)


# ---------------------------------------------------------------------------------------------
# Errors: each carries its exit code; main() prints one line and exits with it.


class SFTError(Exception):
    exit_code = 1


class DataError(SFTError):
    """Bad input or usage: data, flags, unknown model, context overflow."""

    exit_code = 2


class RenderError(DataError):
    """The chat template cannot produce a faithful datum for this example."""


class BudgetError(SFTError):
    exit_code = 3


class AccessError(SFTError):
    exit_code = 4


# ---------------------------------------------------------------------------------------------
# Data: reading and validation


def read_jsonl(path):
    """(line number, object) for each non-blank line; malformed JSON is a DataError naming the line."""
    if not path:
        raise DataError("no training data: pass --data FILE.jsonl (or edit load_dataset())")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}; expected a JSONL file") from None
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {n}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not rows:
        raise DataError(f"{path} has no examples; expected one JSON object per line")
    return rows


ROLES = {"system", "developer", "user", "assistant", "tool"}


def validate_example(obj, line_no):
    """A checked copy of one example ({"messages"} or {"prompt", "completion"}) plus "line"; else DataError."""
    where = f"line {line_no}"
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with 'messages' or 'prompt'/'completion', got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m:
                raise DataError(f"{where}: message {i} must be an object with 'role' and 'content'")
            role = m["role"]
            if role not in ROLES:
                raise DataError(f"{where}: message {i} has unknown role {role!r}; expected one of {sorted(ROLES)}")
            content = m.get("content")
            if not isinstance(content, str):
                raise DataError(f"{where}: message {i} ({role}) content must be a string, got {type(content).__name__}")
            reasoning = m.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise DataError(f"{where}: message {i} reasoning_content must be a string")
            calls = m.get("tool_calls")
            if calls is not None and (not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function", {}).get("name"), str) for c in calls)):
                raise DataError(f"{where}: message {i} tool_calls must be a list of "
                                "{'type': 'function', 'function': {'name', 'arguments'}} objects")
            if role == "assistant" and not content.strip() and not (reasoning or "").strip() and not calls:
                raise DataError(f"{where}: message {i} (assistant) has empty content; nothing to train on")
            clean.append(dict(m))
        _check_role_order(clean, where)
        tools = obj.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise DataError(f"{where}: 'tools' must be a list of JSON-schema tool objects")
        return {"messages": clean, "line": line_no, **({"tools": tools} if tools else {})}
    if "prompt" in obj or "completion" in obj:
        prompt, completion = obj.get("prompt"), obj.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataError(f"{where}: 'prompt' and 'completion' must both be strings")
        if not completion.strip():
            raise DataError(f"{where}: empty completion; nothing to train on")
        return {"prompt": prompt, "completion": completion, "line": line_no}
    raise DataError(f"{where}: expected a 'messages' list or 'prompt'/'completion' strings, got keys {sorted(obj)}")


def _check_role_order(msgs, where):
    roles = [m["role"] for m in msgs]
    if "assistant" not in roles:
        raise DataError(f"{where}: conversation has no assistant turn; add a {{'role': 'assistant'}} message to train on")
    prev = None
    for i, role in enumerate(roles):
        bad = None
        if role in ("system", "developer") and any(r not in ("system", "developer") for r in roles[:i]):
            bad = f"a {role} message may only open the conversation"
        elif role == "assistant" and prev not in ("user", "tool"):
            bad = "an assistant message must follow a user (or tool) message"
        elif role == "tool" and prev not in ("assistant", "tool"):
            bad = "a tool message must follow an assistant message"
        elif role == "user" and prev == "user":
            bad = "two user messages in a row"
        if bad:
            raise DataError(f"{where}: roles out of order at message {i} ({' -> '.join(roles)}): {bad}")
        prev = role


def has_reasoning(message):
    return bool((message.get("reasoning_content") or "").strip()) or "<think>" in message.get("content", "")


# ---------------------------------------------------------------------------------------------
# Tokenizer and format


def tokenizer_record(name_or_path: str) -> str:
    """An existing folder as an absolute path, so tinker_infer.py --run finds it from any directory;
    a hub name unchanged."""
    return os.path.abspath(name_or_path) if os.path.isdir(name_or_path) else name_or_path


def load_tokenizer(name_or_path: str):
    """A local folder loads as is; a Tinker model id follows the SDK's get_tokenizer name rules.

    The Hugging Face cache is tried first with no network; then the hub once, only if one short connection
    to it succeeds: without that probe an offline machine spends ~50 s in huggingface_hub's retries."""
    from transformers import AutoTokenizer

    if os.path.isdir(name_or_path):
        return AutoTokenizer.from_pretrained(name_or_path)
    if name_or_path.startswith((".", "/", "~")):  # a folder, not a hub name: no cache or hub to try
        raise DataError(f"tokenizer folder {name_or_path} does not exist; pass --tokenizer PATH (a folder with "
                        "tokenizer.json) or a hub name")
    name = name_or_path.split(":", 1)[0]  # drop ':peft:131072'-style suffixes
    kwargs = {}
    if name.startswith("meta-llama/Llama-3"):
        name = "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"  # ungated copy the SDK uses
    elif name.count("/") == 2:
        name = name.rsplit("/", 1)[0]  # org/model/variant -> org/model
    if name.startswith("moonshotai/Kimi-K"):
        kwargs["trust_remote_code"] = True
    with contextlib.suppress(Exception):
        return AutoTokenizer.from_pretrained(name, local_files_only=True, **kwargs)
    failed = f"cannot load the tokenizer for {name_or_path!r}: {name} is not in the Hugging Face cache and "
    next_step = ("; pass --tokenizer PATH (a folder with tokenizer.json), or download it once and run with "
                 "HF_HUB_OFFLINE=1")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise DataError(failed + "HF_HUB_OFFLINE=1 forbids the hub" + next_step)
    unreachable = hub_unreachable()
    if unreachable:
        raise DataError(failed + f"the hub is unreachable ({unreachable})" + next_step)
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except Exception as e:  # gated, misspelt, network lost: all end the same way for the user
        raise DataError(f"cannot load the tokenizer for {name_or_path!r} from the hub ({type(e).__name__})"
                        + next_step) from None


def hub_unreachable(timeout_s: float = 5.0) -> str | None:
    """Why one TCP connection to the hub (HF_ENDPOINT, or the proxy for it) fails, or None if it opens."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(url.hostname):
        url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        return f"{url.hostname}:{port}: {e.strerror or type(e).__name__}"
    return None


def chat_format(tokenizer, *, name: str, thinking: bool = False) -> dict:
    """The run record's "format" for chat-template rendering (see DEVELOPING.md)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # some tokenizers ship named templates
        template = template.get("default") or next(iter(template.values()))
    if not template:
        raise DataError(f"tokenizer {name!r} has no chat template; use --format raw")
    fmt = {
        "kind": "chat",
        "template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "template_kwargs": {
            "enable_thinking": thinking,  # Qwen3
            "thinking": thinking,  # DeepSeek V3.1
            "date_string": FROZEN_DATE_STRING,  # Llama 3.x
            "strftime_now": FROZEN_DATE,  # gpt-oss prints strftime_now("%Y-%m-%d"); frozen while rendering
        },
        "stop": [],
        "tokenizer": name,
    }
    fmt["stop"] = stop_tokens(tokenizer, fmt)
    return fmt


def raw_format(tokenizer, *, name: str) -> dict:
    """The run record's "format" for plain text + explicit EOS (base models)."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {name!r} has no EOS token; raw format needs one to learn to stop")
    return {
        "kind": "raw",
        "stop": [tokenizer.eos_token_id],
        "bos": tokenizer.bos_token_id is not None,
        "conversation": "role-colon: 'User: ...\\n\\nAssistant: ...'",
        "tokenizer": name,
    }


@contextlib.contextmanager
def _frozen_clock(date_iso):
    # transformers builds strftime_now() on datetime.now() and rebuilds any callable kwarg into a
    # string, so the only way to freeze the date a template prints is its module's clock.
    mod = importlib.import_module("transformers.utils.chat_template_utils")
    real = getattr(mod, "datetime", None)
    if real is None or not date_iso:
        yield
        return

    class FrozenDatetime(real):
        @classmethod
        def now(cls, tz=None):
            return real.fromisoformat(date_iso)

    mod.datetime = FrozenDatetime
    try:
        yield
    finally:
        mod.datetime = real


def _tool_call_arguments(messages, as_text):
    """Copies of messages whose tool-call arguments are dicts (the transformers convention, which
    Qwen3, Qwen3.5, gpt-oss and Kimi templates expect) or JSON text (DeepSeek V3.1 concatenates)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[dict(c, function=_arguments(c["function"], as_text)) for c in m["tool_calls"]])
        out.append(m)
    return out


def _arguments(function, as_text):
    args = function.get("arguments", {})
    if as_text and not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    elif not as_text and isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise RenderError(f"tool call {function.get('name')!r} has arguments that are not JSON: {args[:80]!r}") from None
    return dict(function, arguments=args)


def _apply_template(tokenizer, messages, fmt, *, add_generation_prompt, thinking=None, tools=None):
    kwargs = dict(fmt["template_kwargs"])
    frozen = kwargs.pop("strftime_now", None)
    if thinking is not None:
        kwargs["enable_thinking"] = kwargs["thinking"] = thinking
    if tools:
        kwargs["tools"] = tools

    def render(msgs):
        with _frozen_clock(frozen):
            return tokenizer.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kwargs
            )

    try:
        try:
            ids = render(_tool_call_arguments(messages, as_text=False))
        except TypeError:  # a template that concatenates arguments as text (DeepSeek V3.1)
            ids = render(_tool_call_arguments(messages, as_text=True))
    except RenderError:
        raise
    except Exception as e:  # jinja errors: one line naming the template, never a traceback
        raise RenderError(
            f"chat template of {fmt.get('tokenizer')} failed on this conversation: {type(e).__name__}: {e}"
        ) from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older transformers ignore return_dict=False
        ids = ids["input_ids"]
    return list(ids)


def _role_colon_text(messages):
    """Raw-format rendering of a conversation: the prompt text ending in 'Assistant:'."""
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(parts + ["Assistant:"])


def _raw_assistant_text(message):
    reasoning = (message.get("reasoning_content") or "").strip()
    return f"<think>\n{reasoning}\n</think>\n\n{message['content']}" if reasoning else message["content"]


def generation_prompt(messages, tokenizer, fmt, *, thinking=None, tools=None) -> list[int]:
    """Token ids the sampler is given: messages (or a bare prompt string in raw format) + the
    assistant header."""
    if fmt["kind"] == "chat":
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return _apply_template(tokenizer, messages, fmt, add_generation_prompt=True, thinking=thinking, tools=tools)
    text = messages if isinstance(messages, str) else _role_colon_text(messages)
    bos = [tokenizer.bos_token_id] if fmt.get("bos") and tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(text, add_special_tokens=False)


@dataclasses.dataclass
class Rendered:
    """One datum before the shift: token ids and per-token loss weights (same length, unshifted)."""

    tokens: list[int]
    weights: list[float]


def _is_special(tokenizer, tok):
    return tok in tokenizer.all_special_ids or tok in getattr(tokenizer, "added_tokens_decoder", {})


def _render_chat_turn(messages, i, tokenizer, fmt, tools=None):
    """Rendered for assistant message i: weights 1 exactly on what the model must produce after the
    generation prompt, end-of-turn token included."""
    thinking = fmt["template_kwargs"].get("enable_thinking", False) or has_reasoning(messages[i])
    prompt = _apply_template(tokenizer, messages[:i], fmt, add_generation_prompt=True, thinking=thinking, tools=tools)
    full = _apply_template(tokenizer, messages[: i + 1], fmt, add_generation_prompt=False, thinking=thinking,
                           tools=tools)
    template_id = f"{fmt.get('tokenizer')} (template sha256 {fmt['template_sha256'][:12]})"
    if full[: len(prompt)] != prompt:
        raise RenderError(
            f"chat template of {template_id} renders message {i} so that the generation prompt is not a "
            "prefix of the conversation; training on it would not match sampling (try --format raw)"
        )
    completion = full[len(prompt):]
    # The template may append whitespace after the end-of-turn token (Qwen3: "<|im_end|>\n"): the
    # sampler stops at the end-of-turn token and never produces it, so it is not trained.
    while completion and not _is_special(tokenizer, completion[-1]) and not tokenizer.decode([completion[-1]]).strip():
        completion.pop()
    if not completion:
        raise RenderError(f"chat template of {template_id} renders assistant message {i} as nothing")
    if not _is_special(tokenizer, completion[-1]):
        raise RenderError(
            f"chat template of {template_id} ends assistant message {i} with "
            f"{tokenizer.decode(completion[-1:])!r}, not an end-of-turn special token; the model would never learn to stop"
        )
    reasoning = (messages[i].get("reasoning_content") or "").strip()
    if reasoning and reasoning not in tokenizer.decode(completion):
        raise RenderError(
            f"chat template of {template_id} drops the reasoning_content of assistant message {i} "
            "(Kimi K2 keeps it only before a tool call; DeepSeek V3.1 never renders it); "
            "remove reasoning_content to train the answer alone"
        )
    return Rendered(prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion))


def render_example(example, tokenizer, fmt, train_on="last-assistant") -> list[Rendered]:
    """The datums of one validated example.

    chat, last-assistant: one datum training the last assistant message.
    chat, all-assistant: every assistant message is trained; consecutive turns share one datum when
        the earlier datum's tokens are a prefix of the later one (the template has the extension
        property). Otherwise each turn is its own datum, rendered in the context the model really
        sees at that turn (Qwen3 drops earlier turns' <think> blocks, so its turns are separate).
    Reasoning: a message with reasoning_content (or <think> in its content) renders with thinking on
        and its reasoning is trained; other messages render with the format's thinking switch.
    raw: [bos] + prompt + completion + [eos], weights on completion + eos; a conversation becomes
        role-colon text ('User: ...\\n\\nAssistant:') with the assistant content as completion.
    """
    if fmt["kind"] == "chat":
        messages = example.get("messages") or [
            {"role": "user", "content": example["prompt"]},
            {"role": "assistant", "content": example["completion"]},
        ]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if train_on == "last-assistant":
            turns = turns[-1:]
        rendered = [_render_chat_turn(messages, i, tokenizer, fmt, example.get("tools")) for i in turns]
        return _merge_extensions(rendered)

    eos = tokenizer.eos_token_id
    if "messages" in example:
        messages = example["messages"]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if train_on == "last-assistant":
            turns = turns[-1:]
        pairs = [(messages[:i], " " + _raw_assistant_text(messages[i])) for i in turns]
    else:
        pairs = [(example["prompt"], example["completion"])]
    out = []
    for prompt_part, completion_text in pairs:
        prompt = generation_prompt(prompt_part, tokenizer, fmt)
        completion = tokenizer.encode(completion_text, add_special_tokens=False) + [eos]
        out.append(Rendered(prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion)))
    return _merge_extensions(out)


def _merge_extensions(rendered):
    merged = []
    for r in rendered:
        last = merged[-1] if merged else None
        if last is not None and r.tokens[: len(last.tokens)] == last.tokens:
            merged[-1] = Rendered(r.tokens, last.weights + r.weights[len(last.tokens):])
        else:
            merged.append(r)
    return merged


def stop_tokens(tokenizer, fmt) -> list[int]:
    """Token ids that end a sampled turn: the end-of-turn token the renderer trains (found by rendering
    a probe conversation), plus Harmony's <|call|> when the end-of-turn is <|return|>; raw: [eos]."""
    if fmt["kind"] != "chat":
        return [tokenizer.eos_token_id]
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    end = _render_chat_turn(probe, 1, tokenizer, fmt).tokens[-1]
    stops = [end]
    if tokenizer.convert_ids_to_tokens(end) == "<|return|>":
        call = tokenizer.convert_tokens_to_ids("<|call|>")
        if isinstance(call, int) and call != tokenizer.unk_token_id:
            stops.append(call)
    return stops


def to_datum(r: Rendered):
    """The shift by one: model_input = tokens[:-1], target_tokens = tokens[1:], weights = weights[1:]."""
    import tinker

    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(r.tokens[:-1]),
        loss_fn_inputs={"target_tokens": list(r.tokens[1:]), "weights": [float(w) for w in r.weights[1:]]},
    )


def weighted_spans(tokenizer, r: Rendered) -> list[str]:
    """Decoded text of each run of consecutive weighted tokens (what the audit shows a human)."""
    spans, current = [], []
    for tok, w in zip(r.tokens, r.weights):
        if w:
            current.append(tok)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tokenizer.decode(s) for s in spans]


# ---------------------------------------------------------------------------------------------
# Settings that depend on the model


# Hidden sizes of the lineup models the cookbook's LR formula is calibrated for (hyperparam_utils).
HIDDEN_SIZES = {
    "meta-llama/Llama-3.2-1B": 2048, "meta-llama/Llama-3.2-3B": 3072, "meta-llama/Llama-3.1-8B": 4096,
    "meta-llama/Llama-3.1-8B-Instruct": 4096, "meta-llama/Llama-3.1-70B": 8192,
    "meta-llama/Llama-3.3-70B-Instruct": 8192,
    "Qwen/Qwen3-8B": 4096, "Qwen/Qwen3-8B-Base": 4096, "Qwen/Qwen3-32B": 5120,
    "Qwen/Qwen3-30B-A3B": 2048, "Qwen/Qwen3-30B-A3B-Base": 2048, "Qwen/Qwen3-30B-A3B-Instruct-2507": 2048,
    "Qwen/Qwen3-4B-Instruct-2507": 2560, "Qwen/Qwen3-235B-A22B-Instruct-2507": 4096,
    "Qwen/Qwen3.5-4B": 2560, "Qwen/Qwen3.5-9B": 4096, "Qwen/Qwen3.5-9B-Base": 4096,
    "Qwen/Qwen3.5-27B": 5120, "Qwen/Qwen3.5-35B-A3B": 2048, "Qwen/Qwen3.5-35B-A3B-Base": 2048,
}


def recommended_learning_rate(model_name):
    """The cookbook's LoRA LR: 5e-5 * 10 * (2000 / hidden) ** P, P = 0.781 (Llama) or 0.0775 (Qwen).
    None when the family is not calibrated or the hidden size is unknown."""
    name = model_name.split(":", 1)[0]
    hidden = HIDDEN_SIZES.get(name)
    lowered = name.lower()
    power = 0.781 if "llama" in lowered else 0.0775 if "qwen" in lowered else None
    if hidden is None or power is None:
        return None
    return 5e-5 * 10 * (2000 / hidden) ** power


def lr_multiplier(step, total_steps, schedule, warmup_steps=0):
    """Multiplier for the 0-based step: linear warmup over warmup_steps, then the cookbook schedules
    (linear 1 - p, cosine 0.5 (1 + cos pi p), constant 1) over the remaining steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = (step - warmup_steps) / span
    if schedule == "linear":
        return 1 - progress
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def resolve_format(args, tokenizer, tokenizer_name):
    kind = args.format
    if kind == "auto":
        base = args.model_name.split(":", 1)[0].endswith("-Base")
        kind = "raw" if base or not tokenizer.chat_template else "chat"
    if kind == "chat":
        return chat_format(tokenizer, name=tokenizer_name, thinking=args.thinking)
    return raw_format(tokenizer, name=tokenizer_name)


def check_tinker_path(path, need):
    """A tinker:// checkpoint path of the kind `need` ("weights" or "sampler_weights"); DataError otherwise."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights", "external_weights"):
        raise DataError(f"{path!r} is not a checkpoint path; expected tinker://RUN_ID/{need}/NAME")
    if parts[1] != need:
        if need == "weights":
            raise DataError(
                f"{path} is a {parts[1]}/ checkpoint: it cannot seed a training client; give the weights/ "
                "path saved by save_state (state_path in checkpoints.jsonl)")
        raise DataError(
            f"{path} is a {parts[1]}/ checkpoint: a sampler needs a sampler_weights/ path saved by "
            "save_weights_for_sampler (sampler_path in checkpoints.jsonl)")
    return path


# ---------------------------------------------------------------------------------------------
# Data preparation: split, render, length limits, batch order


def normalise_items(items, source):
    out = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2:
            where, obj = item
        else:
            where, obj = i + 1, item
        out.append(validate_example(obj, where if source is None else f"{where} of {source}"))
    return out


def split_examples(train, test, args):
    """Held-out set: --test-data, else a seeded --test-fraction split of the training examples."""
    if test is not None or args.test_fraction == 0 or len(train) < 2:
        return train, test or []
    order = list(range(len(train)))
    random.Random(args.seed).shuffle(order)
    n_test = max(1, round(args.test_fraction * len(train)))
    held = set(order[:n_test])
    return [e for i, e in enumerate(train) if i not in held], [train[i] for i in sorted(held)]


def render_all(examples, tokenizer, fmt, train_on):
    """[(line, Rendered)] for every example; a RenderError names the example's line."""
    out = []
    for ex in examples:
        try:
            out.extend((ex["line"], r) for r in render_example(ex, tokenizer, fmt, train_on))
        except RenderError as e:
            raise RenderError(f"line {ex['line']}: {e}") from None
    return out


def apply_length_limit(rendered, limit, mode):
    """(kept, dropped lines). mode: 'error' | 'drop' | 'truncate'."""
    if not limit:
        return rendered, []
    long = [(line, r) for line, r in rendered if len(r.tokens) > limit]
    if not long:
        return rendered, []
    if mode == "error":
        shown = ", ".join(f"line {line} ({len(r.tokens)} tokens)" for line, r in long[:10])
        more = f" and {len(long) - 10} more" if len(long) > 10 else ""
        raise DataError(
            f"{len(long)} datum(s) exceed the {limit}-token limit: {shown}{more}; shorten them, "
            "or pass --drop-long or --truncate")
    kept, dropped = [], []
    for line, r in rendered:
        if len(r.tokens) <= limit:
            kept.append((line, r))
        elif mode == "truncate" and sum(r.weights[1:limit]) > 0:
            kept.append((line, Rendered(r.tokens[:limit], r.weights[:limit])))
        else:  # dropped, or truncation would leave nothing to train
            dropped.append(line)
    return kept, dropped


def plan_steps(n_train, batch_size, epochs, max_steps):
    """(batches per epoch, total steps). A final partial batch is dropped so every step has the
    same size; a data set smaller than one batch is one batch."""
    per_epoch = max(n_train // batch_size, 1)
    total = per_epoch * epochs
    return per_epoch, min(total, max_steps) if max_steps else total


def batch_indices(step, n_train, batch_size, per_epoch, seed):
    """Datum indices of global batch `step`: a fixed order per epoch from --seed, so a resumed run
    trains exactly the batches an uninterrupted one would."""
    epoch, index = divmod(step, per_epoch)
    order = list(range(n_train))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    size = min(batch_size, n_train)
    return order[index * size:(index + 1) * size]


def training_datums(rendered):
    """Datums with weights 1/(trained tokens): each datum contributes its mean NLL to the loss."""
    datums = []
    for r in rendered:
        n = sum(1 for w in r.weights[1:] if w) or 1
        datums.append(to_datum(Rendered(r.tokens, [w / n for w in r.weights])))
    return datums


def trained_mask(r):
    return [1.0 if w else 0.0 for w in r.weights[1:]]


# ---------------------------------------------------------------------------------------------
# Run record


RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints.jsonl", "eval.jsonl", "datums.jsonl")
# Settings that must match for --resume to continue the same run exactly.
RESUME_KEYS = ("model_name", "data", "test_data", "test_fraction", "train_on", "batch_size", "epochs",
               "max_steps", "seed", "learning_rate", "lr_schedule", "warmup_steps", "lora_rank",
               "max_length", "drop_long", "truncate", "init_from")


def read_rows(path):
    """Rows of a JSONL record; a torn last line (a kill mid-write) is ignored."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def append_row(path, row):
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def check_log_dir(log, args):
    """Refuse to mix two runs in one folder; with --resume, the last checkpoint row to continue from."""
    has_run = any((log / name).exists() for name in ("metrics.jsonl", "checkpoints.jsonl"))
    if args.resume:
        rows = [r for r in read_rows(log / "checkpoints.jsonl") if r.get("state_path")]
        if not rows:
            raise DataError(
                f"--resume: no checkpoint in {log / 'checkpoints.jsonl'}; start a new run without --resume "
                "(add --overwrite to replace what is there)")
        return rows[-1]
    if has_run and not args.overwrite and not args.dry_run:
        raise DataError(
            f"{log} already holds a run; pass --resume to continue it or --overwrite to replace it "
            "(or choose another --log-path)")
    return None


def settings_record(args, fmt, lr, lr_source, max_length):
    config = {k: v for k, v in vars(args).items() if k not in ("resume", "overwrite", "dry_run")}
    config.update(learning_rate=lr, learning_rate_source=lr_source, max_length=max_length, format=fmt,
                  adam=ADAM, loss="cross_entropy; weights 1/(trained tokens) per datum")
    return config


def check_resume_config(log, config):
    saved = json.loads((log / "config.json").read_text()) if (log / "config.json").exists() else {}
    diffs = [f"--{k.replace('_', '-')} {saved.get(k)!r} -> {config.get(k)!r}"
             for k in RESUME_KEYS if k in saved and saved.get(k) != config.get(k)]
    if saved.get("format", {}).get("tokenizer"):  # runs recorded before folders were made absolute
        saved["format"]["tokenizer"] = tokenizer_record(saved["format"]["tokenizer"])
    if saved.get("format") and saved["format"] != config["format"]:
        diffs.append("format (tokenizer, template or --format/--thinking)")
    if diffs:
        raise DataError(f"--resume with different settings than the saved run: {'; '.join(diffs)}; "
                        "resume with the original flags")


# ---------------------------------------------------------------------------------------------
# Cost


def load_pricing():
    """tinker_pricing from beside this script, or None (then no dollar estimate)."""
    if str(SCRIPT_DIR) not in sys.path:
        sys.path.insert(0, str(SCRIPT_DIR))
    try:
        return importlib.import_module("tinker_pricing")
    except ImportError:
        return None


def estimate(args, tokens, context=None, label="sft"):
    """The pricing estimate dict, or None; BudgetError when --max-usd is exceeded or unprovable."""
    pricing = load_pricing()
    if pricing is None:
        note = "no dollar estimate: tinker_pricing.py is not beside this script"
        if args.max_usd is not None:
            raise BudgetError(f"cannot check --max-usd: {note}; copy it here or drop --max-usd")
        print(note, file=sys.stderr)
        return None
    try:
        return pricing.preflight(args.model_name, tokens, args.max_usd, label=label, context=context)
    except pricing.BudgetExceeded as e:
        raise BudgetError(str(e)) from None
    except (pricing.UnknownModelError, ValueError) as e:
        if args.max_usd is not None:
            raise BudgetError(f"cannot check --max-usd: {e}") from None
        print(f"no dollar estimate: {e}", file=sys.stderr)
        return None


def catalogue_context(model_name):
    pricing = load_pricing()
    try:
        return pricing.resolve_model(model_name).get("context") if pricing else None
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# Tinker calls


def connect(args):
    """ServiceClient and the model's context window, or AccessError / DataError before any paid call."""
    import tinker

    if not tinker.auth.tinker_has_credentials():
        raise AccessError(
            "no Tinker credentials: set TINKER_API_KEY (tml-...), or audit for free with --dry-run, "
            "or rehearse offline against the local backend (scripts/tinker_local.py)")
    try:
        caps = tinker.RestClient().get_server_capabilities().result()
    except (tinker.AuthenticationError, tinker.PermissionDeniedError) as e:
        raise AccessError(f"Tinker refused the credentials ({e.__class__.__name__}); check TINKER_API_KEY") from None
    except (tinker.APIConnectionError, tinker.APITimeoutError, OSError) as e:
        url = os.environ.get("TINKER_BASE_URL") or "the Tinker service"
        raise AccessError(f"cannot reach {url} ({e.__class__.__name__}); check the network or TINKER_BASE_URL") from None
    models = {m.model_name: m for m in caps.supported_models if m.model_name}
    model = models.get(args.model_name)
    if model is None:
        shown = ", ".join(sorted(models)[:12])
        raise DataError(f"unknown model {args.model_name!r}: this Tinker serves {shown}; pass one with --model-name")
    if model.trainable is False:
        raise DataError(f"{args.model_name} is not trainable on this Tinker; pick another --model-name")
    return tinker.ServiceClient(), model.max_context_length


def submit_held_out(tc, test_rendered):
    """Queue a forward pass over the held-out datums (weights = the loss mask); None if there are none."""
    if not test_rendered:
        return None
    data = [to_datum(Rendered(r.tokens, [1.0 if w else 0.0 for w in r.weights])) for r in test_rendered]
    return tc.forward(data, "cross_entropy")


def batch_nll(result, masks):
    """NLL per trained token of a forward_backward batch, from the per-datum target logprobs."""
    total = count = 0.0
    for out, mask in zip(result.loss_fn_outputs, masks):
        logprobs = out["logprobs"].tolist()
        total -= sum(lp * m for lp, m in zip(logprobs, mask))
        count += sum(mask)
    return total / max(count, 1.0)


def probe_prompts(examples, tokenizer, fmt, n):
    probes = []
    for ex in examples[:n]:
        if "messages" in ex:
            msgs = ex["messages"]
            last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            tokens = generation_prompt(msgs[:last], tokenizer, fmt, tools=ex.get("tools"))
            expected = msgs[last]["content"]
            text = msgs[last - 1]["content"]
        else:
            tokens = generation_prompt(ex["prompt"], tokenizer, fmt)
            expected, text = ex["completion"], ex["prompt"]
        probes.append({"line": ex["line"], "prompt": text, "expected": expected, "tokens": tokens})
    return probes


def greedy_samples(sampler, probes, fmt, tokenizer, max_tokens):
    import tinker

    params = tinker.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=fmt["stop"])
    futures = [sampler.sample(tinker.ModelInput.from_ints(p["tokens"]), 1, params) for p in probes]
    outs = []
    for f in futures:
        seq = f.result().sequences[0]
        toks = [t for t in seq.tokens if t not in fmt["stop"]]
        outs.append((tokenizer.decode(toks, skip_special_tokens=False), len(seq.tokens)))
    return outs


def evaluate(forward, sampler, test_rendered, probes, fmt, tokenizer, args, step, log, when, sampled_from=None):
    """Held-out NLL (from a queued forward) and greedy probes; one row in LOG/eval.jsonl."""
    nll = batch_nll(forward.result(), [trained_mask(r) for r in test_rendered]) if forward else None
    row = {"step": step, "when": when, "nll": nll,
           "test_tokens": int(sum(sum(trained_mask(r)) for r in test_rendered))}
    if sampler is not None and probes:
        for p, (text, n) in zip(probes, greedy_samples(sampler, probes, fmt, tokenizer, args.max_tokens)):
            p[when], p[f"{when}_sampled_tokens"] = text, n
        row["sampled_from"] = sampled_from
        row["probes"] = [{k: v for k, v in p.items() if k != "tokens"} for p in probes]
    append_row(log / "eval.jsonl", row)
    nll_text = "n/a" if nll is None else f"{nll:.4f}"
    print(f"eval {when} (step {step}) | held-out nll {nll_text} per token", file=sys.stderr)
    return nll


def save_checkpoint(tc, log, name, step, per_epoch, fmt, sampler=False, ttl=None):
    """save_state (+ save_weights_for_sampler) and the checkpoints.jsonl row once the paths are known."""
    state = tc.save_state(name, ttl_seconds=ttl)
    samp = tc.save_weights_for_sampler(name, ttl_seconds=ttl) if sampler else None
    row = {"name": name, "step": step, "next_batch": step, "epoch": step // per_epoch,
           "state_path": state.result().path, "sampler_path": samp.result().path if samp else None,
           "format": fmt, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    append_row(log / "checkpoints.jsonl", row)
    return row


def pipelined(start, total, submit, finish):
    """Run steps start..total-1. submit(step) queues a step on the server and returns a handle without
    waiting; finish(handle) waits for it. Step N+1 is built and queued before step N is awaited, so the
    server always has the next forward_backward + optim_step in hand and never idles on a round trip."""
    pending = submit(start) if start < total else None
    step = start
    while pending is not None:
        upcoming = submit(step + 1) if step + 1 < total else None
        finish(pending)
        pending, step = upcoming, step + 1


def train(args, tokenizer, fmt, train_rendered, test_rendered, probes, lr, per_epoch, total_steps,
          resume_row, log, service):
    import tinker

    start = 0
    if resume_row is not None:
        start = resume_row["next_batch"]
        tc = service.create_training_client_from_state_with_optimizer(resume_row["state_path"]).result()
        print(f"resumed from {resume_row['state_path']} at batch {start}", file=sys.stderr)
    elif args.init_from:
        tc = service.create_training_client_from_state(args.init_from).result()
    else:
        tc = service.create_lora_training_client(args.model_name, rank=args.lora_rank, seed=args.seed).result()

    evals = read_rows(log / "eval.jsonl")
    nll_before = next((r["nll"] for r in evals if r.get("when") == "before"), None)
    if resume_row is None:
        # Probes before training sample the base model (a fresh LoRA is the identity).
        base = service.create_sampling_client(base_model=args.model_name).result() if probes else None
        nll_before = evaluate(submit_held_out(tc, test_rendered), base, test_rendered, probes, fmt, tokenizer,
                              args, 0, log, "before", sampled_from=args.model_name)

    def submit(step):
        """Queue one step (and its save) on the server; nothing here waits."""
        rows = [train_rendered[i] for i in batch_indices(step, len(train_rendered), args.batch_size, per_epoch, args.seed)]
        rate = lr * lr_multiplier(step, total_steps, args.lr_schedule, args.warmup_steps)
        held_out = None
        if args.eval_every and step > start and step % args.eval_every == 0:
            held_out = submit_held_out(tc, test_rendered)  # queued first: it sees the weights after `step` steps
        fb = tc.forward_backward(training_datums(rows), "cross_entropy")
        opt = tc.optim_step(tinker.AdamParams(learning_rate=rate, **ADAM))
        done = step + 1
        save = None
        if args.save_every and done % args.save_every == 0 and done < total_steps:
            save = tc.save_state(f"{done:06d}", ttl_seconds=PERIODIC_TTL_SECONDS)
        return {"step": step, "rows": rows, "lr": rate, "fb": fb, "opt": opt, "save": save, "held_out": held_out}

    last_time = time.time()

    def finish(pending):
        """Wait for one step, log it, and record its checkpoint once the path is known."""
        nonlocal last_time
        step = pending["step"]
        if pending["held_out"] is not None:
            evaluate(pending["held_out"], None, test_rendered, [], fmt, tokenizer, args, step, log, "during")
        result = pending["fb"].result()
        pending["opt"].result()
        masks = [trained_mask(r) for r in pending["rows"]]
        now = time.time()
        row = {"step": step + 1, "epoch": step // per_epoch, "loss": batch_nll(result, masks),
               "loss_per_datum": result.metrics.get("loss:sum", float("nan")) / len(pending["rows"]),
               "learning_rate": pending["lr"], "tokens": sum(len(r.tokens) - 1 for r in pending["rows"]),
               "trained_tokens": int(sum(sum(m) for m in masks)), "seconds": round(now - last_time, 3)}
        last_time = now
        append_row(log / "metrics.jsonl", row)
        print(f"step {row['step']}/{total_steps} | loss {row['loss']:.4f} | lr {row['learning_rate']:.1e} | "
              f"{row['tokens']} tok | {row['seconds']:.1f}s", file=sys.stderr)
        if pending["save"] is not None:
            done = step + 1
            append_row(log / "checkpoints.jsonl", {
                "name": f"{done:06d}", "step": done, "next_batch": done, "epoch": done // per_epoch,
                "state_path": pending["save"].result().path, "sampler_path": None, "format": fmt,
                "time": datetime.now(timezone.utc).isoformat(timespec="seconds")})

    pipelined(start, total_steps, submit, finish)
    final = save_checkpoint(tc, log, "final", total_steps, per_epoch, fmt, sampler=True)
    sampler = service.create_sampling_client(model_path=final["sampler_path"]).result() if probes else None
    nll_after = evaluate(submit_held_out(tc, test_rendered), sampler, test_rendered, probes, fmt, tokenizer,
                         args, total_steps, log, "after", sampled_from=final["sampler_path"])
    return final, nll_before, nll_after


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    log = Path(args.log_path)
    resume_row = check_log_dir(log, args)
    if args.init_from:
        check_tinker_path(args.init_from, "weights")

    tokenizer_name = tokenizer_record(args.tokenizer or args.model_name)
    tokenizer = load_tokenizer(tokenizer_name)
    fmt = resolve_format(args, tokenizer, tokenizer_name)

    train_examples = normalise_items(load_dataset(args.data), None)
    test_examples = normalise_items(load_dataset(args.test_data), args.test_data) if args.test_data else None
    train_examples, test_examples = split_examples(train_examples, test_examples, args)
    train_pairs = render_all(train_examples, tokenizer, fmt, args.train_on)
    test_pairs = render_all(test_examples, tokenizer, fmt, args.train_on)

    service, context = (None, None) if args.dry_run else connect(args)
    if args.dry_run:
        context = catalogue_context(args.model_name)
    limit = min(x for x in (args.max_length, context) if x) if (args.max_length or context) else None
    mode = "drop" if args.drop_long else "truncate" if args.truncate else "error"
    train_pairs, dropped = apply_length_limit(train_pairs, limit, mode)
    test_pairs, dropped_test = apply_length_limit(test_pairs, limit, mode)
    if dropped or dropped_test:
        print(f"dropped {len(dropped) + len(dropped_test)} datum(s) over {limit} tokens: lines "
              f"{', '.join(map(str, (dropped + dropped_test)[:20]))}", file=sys.stderr)
    if not train_pairs:
        raise DataError("no training datum left after the length limit; raise --max-length or shorten the data")

    lr, lr_source = args.learning_rate, "--learning-rate"
    if lr is None:
        lr, lr_source = recommended_learning_rate(args.model_name), "cookbook LoRA formula"
        if lr is None:
            lr, lr_source = 1e-4, "fallback (family not calibrated: pass --learning-rate)"
        print(f"learning rate {lr:.3e} ({lr_source}, {args.model_name})", file=sys.stderr)

    train_rendered = [r for _, r in train_pairs]
    test_rendered = [r for _, r in test_pairs]
    per_epoch, total_steps = plan_steps(len(train_rendered), args.batch_size, args.epochs, args.max_steps)
    if len(train_rendered) < args.batch_size:
        print(f"warning: {len(train_rendered)} training datums < --batch-size {args.batch_size}; "
              f"one batch of {len(train_rendered)} per epoch", file=sys.stderr)
    size = min(args.batch_size, len(train_rendered))
    step_tokens = [sum(len(train_rendered[i].tokens) - 1
                       for i in batch_indices(s, len(train_rendered), args.batch_size, per_epoch, args.seed))
                   for s in range(total_steps)]
    run_tokens = sum(step_tokens)
    trained_tokens = sum(sum(trained_mask(train_rendered[i])) for s in range(total_steps)
                         for i in batch_indices(s, len(train_rendered), args.batch_size, per_epoch, args.seed))
    n_evals = 2 + (total_steps - 1) // args.eval_every if args.eval_every else 2
    held_out_tokens = sum(len(r.tokens) - 1 for r in test_rendered)  # one eval's forward pass
    eval_tokens = n_evals * held_out_tokens
    probes = probe_prompts(test_examples or train_examples, tokenizer, fmt, args.num_probes)
    # A --resume pays only for what is left: its steps, its evals, and no "before" eval or probes.
    start = min(resume_row["next_batch"], total_steps) if resume_row is not None else 0
    evals_left = (start == 0) + 1 + ((total_steps - 1) // args.eval_every - start // args.eval_every
                                     if args.eval_every else 0)
    probe_rounds = 2 if start == 0 else 1
    cost_tokens = {"train": sum(step_tokens[start:]) + evals_left * held_out_tokens,
                   "prefill": probe_rounds * sum(len(p["tokens"]) for p in probes),
                   "sample": probe_rounds * len(probes) * args.max_tokens}
    longest_line, longest = max(train_pairs + test_pairs, key=lambda p: len(p[1].tokens))
    summary = {
        "examples": {"train": len(train_examples), "test": len(test_examples),
                     "dropped": len(dropped) + len(dropped_test)},
        "datums": {"train": len(train_rendered), "test": len(test_rendered)},
        "steps": total_steps, "batch_size": size, "batches_per_epoch": per_epoch,
        "tokens": {"model_input": run_tokens, "trained": int(trained_tokens), "eval_forward": eval_tokens,
                   "per_epoch": sum(len(r.tokens) - 1 for r in train_rendered)},
        "longest": {"line": longest_line, "tokens": len(longest.tokens)},
        "max_length": limit, "learning_rate": lr,
    }
    print_summary(summary, fmt, args)
    cost = estimate(args, cost_tokens, context=None,
                    label="sft" if not start else f"sft, remaining {total_steps - start} of {total_steps} steps "
                                                  "after --resume")

    config = settings_record(args, fmt, lr, lr_source, limit)
    if args.dry_run:
        log.mkdir(parents=True, exist_ok=True)
        with open(log / "datums.jsonl", "w") as f:
            for split, pairs in (("train", train_pairs), ("test", test_pairs)):
                for line, r in pairs:
                    f.write(json.dumps({"split": split, "line": line, "tokens": r.tokens, "weights": r.weights,
                                        "trained_text": weighted_spans(tokenizer, r)}) + "\n")
        emit({"status": "dry_run", "log_path": str(log), **summary, "cost": cost, "format": fmt})
        return 0

    if resume_row is not None:
        check_resume_config(log, config)
        if resume_row["next_batch"] >= total_steps and resume_row.get("name") == "final":
            evals = read_rows(log / "eval.jsonl")
            emit(result_record("complete", log, total_steps, resume_row, evals, run_tokens, trained_tokens, fmt))
            return 0
        # Rows past the checkpoint were trained by the killed process and will be trained again.
        keep = [r for r in read_rows(log / "metrics.jsonl") if r["step"] <= resume_row["next_batch"]]
        (log / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in keep))
        evals = [r for r in read_rows(log / "eval.jsonl") if r["step"] <= resume_row["next_batch"] and r["when"] != "after"]
        (log / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    else:
        log.mkdir(parents=True, exist_ok=True)
        for name in RUN_FILES:
            if name != "datums.jsonl":
                (log / name).unlink(missing_ok=True)
        (log / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    final, nll_before, nll_after = train(args, tokenizer, fmt, train_rendered, test_rendered, probes, lr,
                                         per_epoch, total_steps, resume_row, log, service)
    evals = read_rows(log / "eval.jsonl")
    with contextlib.suppress(Exception):  # the run is saved; a failed session close changes nothing
        service.close("success").result()
    record = result_record("ok", log, total_steps, final, evals, run_tokens, trained_tokens, fmt)
    template = f"chat template {fmt['template_sha256'][:12]}" if fmt["kind"] == "chat" else "raw text + EOS"
    print(f"sample it in the format it was trained in ({template}, stop {fmt['stop']}): "
          f"{record['sampling']['hint']}; sampler path {final['sampler_path']}", file=sys.stderr)
    emit(record)
    return 0


def print_summary(summary, fmt, args):
    """The audit as a table on stderr: what will be trained, on what, at which rate."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tinker_sft plan", show_header=False, title_justify="left")
    fmt_text = (f"chat template {fmt['template_sha256'][:12]}, kwargs {fmt['template_kwargs']}"
                if fmt["kind"] == "chat" else "raw text + EOS")
    for key, value in [
        ("model", args.model_name), ("format", f"{fmt_text}, stop {fmt['stop']}"),
        ("datums", f"{summary['datums']['train']} train / {summary['datums']['test']} held-out "
                   f"({summary['examples']['dropped']} dropped over the limit)"),
        ("steps", f"{summary['steps']} of {summary['batch_size']} datums ({summary['batches_per_epoch']} per epoch)"),
        ("tokens", f"{summary['tokens']['model_input']} model-input, {summary['tokens']['trained']} trained, "
                   f"{summary['tokens']['eval_forward']} held-out forward"),
        ("longest", f"{summary['longest']['tokens']} tokens (line {summary['longest']['line']}), "
                    f"limit {summary['max_length'] or 'unknown'}"),
        ("learning rate", f"{summary['learning_rate']:.3e}, {args.lr_schedule}, warmup {args.warmup_steps}"),
    ]:
        table.add_row(key, str(value))
    Console(stderr=True, highlight=False, soft_wrap=True).print(table)


def result_record(status, log, steps, final, evals, run_tokens, trained_tokens, fmt):
    before = next((r for r in evals if r.get("when") == "before"), {})
    after = next((r for r in reversed(evals) if r.get("when") == "after"), {})
    probes = after.get("probes") or before.get("probes") or []
    sampler = final.get("sampler_path")
    return {
        "status": status, "log_path": str(log), "steps": steps,
        "state_path": final.get("state_path"), "sampler_path": sampler,
        "eval": {"nll_before": before.get("nll"), "nll_after": after.get("nll"), "probes": probes},
        "tokens": {"model_input": run_tokens, "trained": int(trained_tokens)},
        "format": fmt,
        "sampling": {"model_path": sampler, "stop": fmt["stop"],
                     "hint": f"python tinker_infer.py --run {log} (renders prompts in this run's format)"},
    }


def emit(obj):
    print(json.dumps(obj))


def cli():
    try:
        return main()
    except SFTError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted: continue with the same command plus --resume", file=sys.stderr)
        return 130
    except Exception as e:  # Tinker or runtime failure: one line, the details are in the SDK's log
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
