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
            if role == "assistant" and not content.strip() and not (reasoning or "").strip():
                raise DataError(f"{where}: message {i} (assistant) has empty content; nothing to train on")
            clean.append(dict(m))
        _check_role_order(clean, where)
        return {"messages": clean, "line": line_no}
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


def load_tokenizer(name_or_path: str):
    """A local folder loads as is; a Tinker model id follows the SDK's get_tokenizer name rules."""
    from transformers import AutoTokenizer

    if os.path.isdir(name_or_path):
        return AutoTokenizer.from_pretrained(name_or_path)
    name = name_or_path.split(":", 1)[0]  # drop ':peft:131072'-style suffixes
    kwargs = {}
    if name.startswith("meta-llama/Llama-3"):
        name = "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"  # ungated copy the SDK uses
    elif name.count("/") == 2:
        name = name.rsplit("/", 1)[0]  # org/model/variant -> org/model
    if name.startswith("moonshotai/Kimi-K"):
        kwargs["trust_remote_code"] = True
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except Exception as e:  # offline, gated, misspelt: all end the same way for the user
        raise DataError(
            f"cannot load the tokenizer for {name_or_path!r} ({type(e).__name__}); "
            "pass --tokenizer PATH (a folder with tokenizer.json) to run offline"
        ) from None


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


def _apply_template(tokenizer, messages, fmt, *, add_generation_prompt, thinking=None):
    kwargs = dict(fmt["template_kwargs"])
    frozen = kwargs.pop("strftime_now", None)
    if thinking is not None:
        kwargs["enable_thinking"] = kwargs["thinking"] = thinking
    with _frozen_clock(frozen):
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kwargs
        )
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


def generation_prompt(messages, tokenizer, fmt, *, thinking=None) -> list[int]:
    """Token ids the sampler is given: messages (or a bare prompt string in raw format) + the
    assistant header."""
    if fmt["kind"] == "chat":
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return _apply_template(tokenizer, messages, fmt, add_generation_prompt=True, thinking=thinking)
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


def _render_chat_turn(messages, i, tokenizer, fmt):
    """Rendered for assistant message i: weights 1 exactly on what the model must produce after the
    generation prompt, end-of-turn token included."""
    thinking = fmt["template_kwargs"].get("enable_thinking", False) or has_reasoning(messages[i])
    prompt = _apply_template(tokenizer, messages[:i], fmt, add_generation_prompt=True, thinking=thinking)
    full = _apply_template(tokenizer, messages[: i + 1], fmt, add_generation_prompt=False, thinking=thinking)
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
        rendered = [_render_chat_turn(messages, i, tokenizer, fmt) for i in turns]
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
