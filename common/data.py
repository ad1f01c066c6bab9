"""Reading and validating conversation data (JSONL of {"messages"} or {"prompt", "completion"})."""
from __future__ import annotations

import json
import random
from pathlib import Path

from errors import DataError  # splice: drop
from run_files import jsonl_lines  # splice: drop


def read_jsonl(path, what: str = "--data") -> list[tuple[int, object]]:
    """(line number, object) for each non-blank line; bad bytes or bad JSON is a DataError naming the line."""
    if not path:
        raise DataError(f"no data: pass {what} FILE.jsonl (or edit the EDIT ME loader)")
    try:
        raw = Path(path).read_bytes()
    except IsADirectoryError:
        raise DataError(f"{what} {path} is a folder; expected a JSONL file") from None
    except OSError as e:
        raise DataError(f"cannot read {what} {path}: {e.strerror}; expected a JSONL file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path} line {line} (byte {e.start}): not UTF-8 ({e.reason}); re-save the file as "
                        "UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    rows = []
    for n, line in jsonl_lines(text):  # a byte-order mark and CRLF endings are fine
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {n}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not rows:
        raise DataError(f"{path} has no examples; expected one JSON object per line")
    return rows


ROLES = {"system", "developer", "user", "assistant", "tool"}


def validate_messages(msgs, where: str, *, need_assistant: bool = True) -> list[dict]:
    """A checked copy of a conversation, or DataError naming the message and what is wrong."""
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
    check_role_order(clean, where, need_assistant=need_assistant)
    return clean


def validate_example(obj, line_no) -> dict:
    """A checked copy of one example ({"messages"} or {"prompt", "completion"}) plus "line"; else DataError."""
    where = f"line {line_no}"
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with 'messages' or 'prompt'/'completion', "
                        f"got {type(obj).__name__}")
    if "messages" in obj:
        clean = validate_messages(obj["messages"], where)
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


def check_role_order(msgs, where, *, need_assistant=True):
    roles = [m["role"] for m in msgs]
    if need_assistant and "assistant" not in roles:
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


def normalise_items(items, source=None, validate=validate_example) -> list[dict]:
    """Validated examples from load_dataset()'s items: dicts or (where, dict) pairs. With a `source` (a
    --test-data file, a built-in set) an example's "line" stays its line number (an int, as in datums.jsonl and
    eval.jsonl) and "source" names the file for messages (render.example_where)."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2:
            where, obj = item
        else:
            where, obj = i + 1, item
        example = validate(obj, where if source is None else f"{where} of {source}")
        if source is not None and isinstance(where, int):
            example.update(line=where, source=str(source))
        out.append(example)
    return out


def reference_answer(example):
    """The answer a held-out example expects: its last assistant message, or its "completion"."""
    if "messages" in example:
        return [m for m in example["messages"] if m["role"] == "assistant"][-1]["content"]
    return example["completion"]


def split_examples(train, test, fraction, seed):
    """(train, held-out): `test` when given, else a seeded `fraction` of the training examples."""
    if test is not None or fraction == 0 or len(train) < 2:
        return train, test or []
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    held = set(order[:max(1, round(fraction * len(train)))])
    return [e for i, e in enumerate(train) if i not in held], [train[i] for i in sorted(held)]
