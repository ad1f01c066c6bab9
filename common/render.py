"""Tokenizer loading, the run record's "format", and rendering through the model's own chat template.

The masking rule: a datum's weights are 1 exactly on what the model must produce after the generation
prompt (the assistant's tokens, end-of-turn token included) and 0 on everything else. Rendering is
deterministic: the date a template prints is frozen, so a resumed run renders the same datums.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import itertools
import json
import multiprocessing
import os
import re
from pathlib import Path

from errors import DataError, RenderError, local_launcher, python_command, say, this_command  # splice: drop
from flags import check_free_space  # splice: drop
from rehearsal import real_stand_in  # splice: drop

FROZEN_DATE = "2024-07-26"  # every datum renders the same on every day, so resume is exact
FROZEN_DATE_STRING = "26 Jul 2024"  # Llama 3.x templates print this when given


def has_reasoning(message):
    return bool((message.get("reasoning_content") or "").strip()) or "<think>" in message.get("content", "")


def tokenizer_record(name_or_path: str) -> str:
    """An existing folder as an absolute path, so tinker_infer.py --run finds it from any directory;
    a hub name unchanged."""
    return os.path.abspath(name_or_path) if os.path.isdir(name_or_path) else name_or_path


def load_tokenizer(name_or_path: str, flag: str = "--tokenizer"):
    """A local folder loads as is; a Tinker model id follows the SDK's get_tokenizer name rules. `flag` is
    the option the user passes a tokenizer with (tinker_distill.py's teacher: --teacher-tokenizer).

    The Hugging Face cache is tried first with no network; then the hub once, only if one short connection
    to it succeeds: without that probe an offline machine spends ~50 s in huggingface_hub's retries."""
    # The install leaves torch out on purpose (tokenizers need none), so transformers' import-time advice
    # "PyTorch was not found. Models won't be available..." is noise; transformers' own switch for its advisory
    # warnings (logger.warning_advice) silences it, unless the user set it.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    if os.path.isdir(name_or_path):
        return AutoTokenizer.from_pretrained(name_or_path)
    if name_or_path.startswith((".", "/", "~")):  # a folder, not a hub name: no cache or hub to try
        raise DataError(f"tokenizer folder {name_or_path} does not exist; pass {flag} PATH (a folder with "
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
    next_step = (f"; pass {flag} PATH (a folder with tokenizer.json), or download it once and run with "
                 "HF_HUB_OFFLINE=1")
    launcher, command = local_launcher(), this_command()
    # The local backend resolves the name it serves offline (not a name the SDK maps to another repository).
    if launcher and not command.startswith("<") and name == name_or_path.split(":", 1)[0]:
        next_step += (f"; or, for a rehearsal, run it under the local backend, which serves {name} offline: "
                      f"{python_command(launcher, 'run', '--model', name, '--')} {command}")
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


def rendering_differences(student_tok, student_fmt, teacher_tok, teacher_fmt) -> list[str]:
    """What differs between how the student and the teacher read token ids (empty when nothing does)."""
    reasons = []
    student_vocab, teacher_vocab = vocab_digest(student_tok), vocab_digest(teacher_tok)
    if student_vocab != teacher_vocab:
        s_n, t_n = len(student_tok), len(teacher_tok)
        reasons.append(f"vocabularies differ ({s_n} vs {t_n} tokens)" if s_n != t_n
                       else f"vocabularies of {s_n} tokens map some ids to different tokens")
    if student_fmt.get("kind") != teacher_fmt.get("kind"):
        reasons.append(f"the student renders {student_fmt.get('kind')}, the teacher {teacher_fmt.get('kind')}")
    elif student_fmt.get("kind") == "chat" and student_fmt.get("template_sha256") != teacher_fmt.get("template_sha256"):
        reasons.append(f"chat templates differ (sha256 {student_fmt.get('template_sha256', '')[:12]} vs "
                       f"{(teacher_fmt.get('template_sha256') or '')[:12]})")
    if list(student_fmt.get("stop") or []) != list(teacher_fmt.get("stop") or []):
        reasons.append(f"stop tokens differ ({student_fmt.get('stop')} vs {teacher_fmt.get('stop')})")
    return reasons


def vocab_digest(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def resolve_format(kind, model_name, tokenizer, tokenizer_name, thinking=False) -> dict:
    """--format auto|chat|raw: auto is raw for *-Base models or tokenizers without a template, else chat."""
    if kind == "auto":
        base = model_name.split(":", 1)[0].endswith("-Base")
        kind = "raw" if base or not tokenizer.chat_template else "chat"
    if kind == "chat":
        return chat_format(tokenizer, name=tokenizer_name, thinking=thinking)
    return raw_format(tokenizer, name=tokenizer_name)


POOL_MIN_EXAMPLES = 2000  # below this a process pool costs more than it saves
CACHE_MIN_EXAMPLES = 1000  # below this rendering takes about a second: not worth a file
_POOL_JOB = None  # (tokenizer, fmt, train_on, renderer), inherited by forked render workers


def _without_reasoning_on_the_real_stand_in(examples):
    """The local real model's ChatML template has no place for reasoning_content (rendering would stop with
    "drops the reasoning_content"): on that stand-in the answers are trained alone, with a warning. The tiny model
    keeps the named model's template, so a rehearsal there renders the reasoning exactly as Tinker will."""
    if not real_stand_in():
        return examples
    dropped = 0
    out = []
    for ex in examples:
        msgs = ex.get("messages") if isinstance(ex, dict) else None
        if msgs and any(m.get("reasoning_content") for m in msgs):
            dropped += 1
            ex = {**ex, "messages": [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]}
        out.append(ex)
    if dropped:
        say(f"warning: {dropped} example(s) carry reasoning_content, which the local real model's ChatML template "
            "cannot render: trained on their answers alone here; rehearse on the tiny model (tinker_local.py run "
            "without --real) to check how the named model's template renders the reasoning")
    return out


def example_where(example) -> str:
    """How a message names an example: "line 3", or "line 3 of heldout.jsonl" for one with a source."""
    return f"line {example['line']}" + (f" of {example['source']}" if example.get("source") else "")


def render_all(examples, tokenizer, fmt, train_on, *, workers=None, cache_dir=None, fast=True) -> list:
    """[(line, Rendered)] for every validated example, equal to render_example's; a RenderError names the
    example's line.

    Chat conversations render through BatchRenderer (the template run once per conversation shape, the
    tokenizer over the pieces; checked against render_example, see there); fast=False renders each one
    with render_example. Large sets render in a process pool over every core (forked, so each worker
    inherits the tokenizer; the per-datum checks run unchanged in the workers). With cache_dir, the
    result is kept in a file keyed by (examples, tokenizer, format, train_on, rendering code), so a
    --resume or a real run after a dry run reads it back instead of rendering again."""
    examples = _without_reasoning_on_the_real_stand_in(examples)
    path = None
    if cache_dir is not None and len(examples) >= CACHE_MIN_EXAMPLES:
        path = Path(cache_dir) / f"{render_cache_key(examples, tokenizer, fmt, train_on)}.json"
        cached = _read_render_cache(path)
        if cached is not None:
            return cached
        check_free_space(cache_dir, render_cache_bytes(examples), "the render cache (--render-cache)",
                         f"free some space, or pass --render-cache DIR on a disk with room, or --render-cache off "
                         "(a --resume then renders again)")
    workers = workers or os.cpu_count() or 1
    pooled = workers > 1 and len(examples) >= POOL_MIN_EXAMPLES and "fork" in multiprocessing.get_all_start_methods()
    # One renderer per call (inherited by forked workers): its caches never carry one call's work into another.
    renderer = BatchRenderer(tokenizer, fmt) if fast and fmt["kind"] == "chat" else None
    try:
        out = (_render_in_pool(examples, tokenizer, fmt, train_on, workers, renderer) if pooled
               else _unpack(_render_serial(examples, tokenizer, fmt, train_on, renderer)))
    except _FastPathMismatch:  # the template is not what BatchRenderer assumes: render it the slow, exact way
        out = (_render_in_pool(examples, tokenizer, fmt, train_on, workers, None) if pooled
               else _unpack(_render_serial(examples, tokenizer, fmt, train_on, None)))
    if path is not None:
        _write_render_cache(path, out)
    return out


def _render_serial(examples, tokenizer, fmt, train_on, renderer=None) -> list:
    """[(line, tokens, weight runs)]: the compact form the pool and the cache pass around. With a
    BatchRenderer, through it; else render_example per example."""
    if renderer is not None:
        return renderer.render(examples, train_on)
    out = []
    for ex in examples:
        try:
            out.extend((ex["line"], r.tokens, _runs(r.weights)) for r in render_example(ex, tokenizer, fmt, train_on))
        except RenderError as e:
            raise RenderError(f"{example_where(ex)}: {e}") from None
    return out


def _runs(weights) -> list[int]:
    """Weights (0/1) as run lengths, starting with a run of zeros: [0, 0, 1, 1, 1, 0] -> [2, 3, 1]."""
    runs = [len(list(group)) for _, group in itertools.groupby(weights)]
    return [0, *runs] if weights and weights[0] else runs


def _weights(runs) -> list[float]:
    out = []
    for k, n in enumerate(runs):
        out += [float(k % 2)] * n
    return out


def _unpack(rows) -> list:
    return [(line, Rendered(tokens, _weights(runs))) for line, tokens, runs in rows]


def _render_chunk(chunk):
    tokenizer, fmt, train_on, renderer = _POOL_JOB
    return _render_serial(chunk, tokenizer, fmt, train_on, renderer)


def _render_in_pool(examples, tokenizer, fmt, train_on, workers, renderer=None) -> list:
    global _POOL_JOB
    import concurrent.futures
    import gc
    from concurrent.futures.process import BrokenProcessPool

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the Rust pool must not be shared over fork
    size = min(max(len(examples) // (workers * 8), 200), 5000)
    chunks = [examples[i:i + size] for i in range(0, len(examples), size)]
    _POOL_JOB = (tokenizer, fmt, train_on, renderer)
    gc.freeze()  # the workers' garbage collector then leaves the inherited objects (and their pages) alone
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                                    initializer=_pool_worker_start) as pool:
            try:  # in order, each chunk unpacked here while the workers render the next ones
                return [row for part in pool.map(_render_chunk, chunks) for row in _unpack(part)]
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    except BrokenProcessPool:  # a worker was killed (out of memory?): a plain pool would wait forever
        say("render: a worker process died (out of memory?); rendering in this process instead")
        return _unpack(_render_serial(examples, tokenizer, fmt, train_on, renderer))
    finally:
        gc.unfreeze()
        _POOL_JOB = None


def _pool_worker_start():
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the script's handler would wait for Python code to run
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


class _FastPathMismatch(Exception):
    """BatchRenderer and render_example disagreed on a conversation: render_all renders again without it."""


_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001|\ue002(\\d+)\ue003")  # private-use marks: message k's content / reasoning
_MESSAGE_KEYS = {"role", "content", "reasoning_content"}


class BatchRenderer:
    """render_example for many chat conversations at once, equal to it token for token.

    Why it is fast: the chat template (Jinja, about 1 ms a call) runs once per conversation *shape* (roles,
    which messages carry reasoning, the trained turn, thinking on or off) with marker strings in place of
    the contents; each conversation's text is that skeleton with its contents filled in. The text is cut
    at the tokenizer's added tokens (<|im_start|>, <think>, ...), which the fast tokenizer matches before
    anything else, so each piece between them tokenizes on its own exactly as inside the whole text; the
    pieces of a whole chunk go to the Rust tokenizer in one batch and repeated pieces (system prompts,
    headers) are tokenized once. The per-datum checks of _render_chat_turn (prompt is a prefix, trailing
    whitespace after the end-of-turn token untrained, ends on a special token, reasoning kept) run on
    every datum.

    When it applies: a message's content (and reasoning_content) is "inert": non-empty, no leading or
    trailing whitespace, no '<' or '>', no added token's text, and the message has no keys beyond role,
    content and reasoning_content; the example has no tools. Templates branch on content only through
    such things (Qwen3 looks for '</think>' and '<tool_response>', strips newlines; Llama trims), so an
    inert content renders as its marker did. Everything else goes through render_example. The assumption
    is checked, not trusted: the skeleton must come out the same with markers of another length, the
    first conversations of every shape and every VERIFY_EVERY-th one are also rendered by render_example
    and compared, and any difference raises _FastPathMismatch (render_all then renders the whole set
    with render_example)."""

    VERIFY_FIRST = 2  # conversations of each new shape also rendered the slow way
    VERIFY_EVERY = 64  # and every 64th fast-rendered conversation
    SEGMENT_CACHE_MAX = 200_000

    def __init__(self, tokenizer, fmt):
        self.tokenizer, self.fmt = tokenizer, fmt
        self.special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        added = {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.odd_added = [c for c in added if "<" not in c and ">" not in c]
        # Cutting at added tokens is exact when they match plain text (no stripping of neighbours,
        # no normalisation first); otherwise each whole text is tokenized.
        plain = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized)
                    for t in getattr(tokenizer, "added_tokens_decoder", {}).values())
        self.split_re = (re.compile("(" + "|".join(re.escape(c) for c in sorted(added, key=len, reverse=True)) + ")")
                         if plain and added and self.backend is not None else None)
        self.added = added
        self.skeletons, self.shape_seen = {}, {}
        self.segments, self.blank = {}, {}
        self.count = 0

    def render(self, examples, train_on) -> list:
        """[(line, tokens, weight runs)] of every example, in order."""
        jobs, texts = [], []
        for ex in examples:
            plan = self._plan(ex, train_on)
            jobs.append((ex, plan))
            if plan is not None:
                texts.extend(t for _, prompt, full in plan for t in (prompt, full))
        ids = self._tokenize(texts)
        out, k = [], 0
        for ex, plan in jobs:
            rendered = None
            if plan is not None:
                turns = []
                for (shape, _), _, _ in plan:
                    turns.append(self._turn(ex["messages"][len(shape) - 1], ids[k], ids[k + 1]))
                    k += 2
                if all(t is not None for t in turns):
                    rendered = _merge_extensions(turns)
                    self._verify(ex, train_on, plan, rendered)
            if rendered is None:  # the slow path, which also words any error
                try:
                    rendered = render_example(ex, self.tokenizer, self.fmt, train_on)
                except RenderError as e:
                    raise RenderError(f"{example_where(ex)}: {e}") from None
            out.extend((ex["line"], r.tokens, _runs(r.weights)) for r in rendered)
        return out

    def _inert(self, text):
        return (isinstance(text, str) and text and text == text.strip() and "<" not in text and ">" not in text
                and not any(c in text for c in self.odd_added))

    def _plan(self, ex, train_on):
        """[(shape, prompt text, full text)] per trained turn, or None: render_example renders it."""
        messages = ex.get("messages")
        if not messages or ex.get("tools"):
            return None
        values, shape = [], []
        for k, m in enumerate(messages):
            if not m.keys() <= _MESSAGE_KEYS or not self._inert(m["content"]):
                return None
            reasoning = m.get("reasoning_content")
            if reasoning is not None and not self._inert(reasoning):
                return None
            values.append((m["content"], reasoning))
            shape.append((m["role"], reasoning is not None))
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if train_on == "last-assistant":
            turns = turns[-1:]
        plan = []
        thinking_on = self.fmt["template_kwargs"].get("enable_thinking", False)
        for i in turns:
            key = (tuple(shape[: i + 1]), thinking_on or values[i][1] is not None)
            skeleton = self.skeletons.get(key)
            if skeleton is None:
                skeleton = self.skeletons[key] = self._skeleton(key)
            if skeleton is False:
                return None
            plan.append((key, _fill(skeleton[0], values), _fill(skeleton[1], values)))
        return plan

    def _skeleton(self, key):
        """(prompt parts, full parts) of a shape, or False when the template cannot be compiled this way."""
        shape, thinking = key

        def text(offset, n, generation):
            msgs = []
            for k, (role, has_reasoning) in enumerate(shape[:n]):
                m = {"role": role, "content": f"\ue000{k + offset}\ue001"}
                if has_reasoning:
                    m["reasoning_content"] = f"\ue002{k + offset}\ue003"
                msgs.append(m)
            return _template_text(self.tokenizer, msgs, self.fmt, add_generation_prompt=generation, thinking=thinking)

        try:
            n = len(shape)
            parts = [_parts(text(0, n - 1, True), 0), _parts(text(0, n, False), 0)]
            again = [_parts(text(1000, n - 1, True), 1000), _parts(text(1000, n, False), 1000)]
        except Exception:  # the slow path renders it and words the error
            return False
        return tuple(parts) if parts == again else False

    def _tokenize(self, texts) -> list[list[int]]:
        if self.split_re is None:
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)] if self.backend \
                else [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        if len(self.segments) > self.SEGMENT_CACHE_MAX:
            self.segments.clear()
        if not self.segments:
            self.segments[""] = []
            self.segments.update({c: [i] for c, i in self.added.items()})
        segments = self.segments
        pieces = [self.split_re.split(t) for t in texts]
        new = list({p for ps in pieces for p in ps if p not in segments})  # added tokens are always known
        if new:
            for p, e in zip(new, self.backend.encode_batch(new, add_special_tokens=False)):
                segments[p] = e.ids
        out = []
        for ps in pieces:
            ids = []
            for p in ps:
                ids += segments[p]
            out.append(ids)
        return out

    def _is_blank(self, tok):
        blank = self.blank.get(tok)
        if blank is None:
            blank = self.blank[tok] = not self.tokenizer.decode([tok]).strip()
        return blank

    def _turn(self, message, prompt, full):
        """_render_chat_turn's datum and checks from token ids; None when a check fails (the slow path
        then raises the error with its wording)."""
        if full[: len(prompt)] != prompt:
            return None
        completion = full[len(prompt):]
        while completion and completion[-1] not in self.special and self._is_blank(completion[-1]):
            completion.pop()
        if not completion or completion[-1] not in self.special:
            return None
        reasoning = (message.get("reasoning_content") or "").strip()
        if reasoning and reasoning not in self.tokenizer.decode(completion):
            return None
        return Rendered(prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion))

    def _verify(self, ex, train_on, plan, rendered):
        self.count += 1
        seen = self.shape_seen[plan[-1][0]] = self.shape_seen.get(plan[-1][0], 0) + 1
        if seen <= self.VERIFY_FIRST or self.count % self.VERIFY_EVERY == 0:
            try:
                slow = render_example(ex, self.tokenizer, self.fmt, train_on)
            except RenderError:
                slow = None
            if slow != rendered:
                raise _FastPathMismatch(f"line {ex['line']}")


def _template_text(tokenizer, messages, fmt, *, add_generation_prompt, thinking):
    """The chat template's text for messages, with _apply_template's settings (untokenized)."""
    kwargs = dict(fmt["template_kwargs"])
    frozen = kwargs.pop("strftime_now", None)
    kwargs["enable_thinking"] = kwargs["thinking"] = thinking
    with _frozen_clock(frozen):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **kwargs)


def _parts(text, offset):
    """A rendered skeleton as [literal, (field, k), literal, ...]: field 0 content, 1 reasoning_content."""
    out, last = [], 0
    for m in _SENTINEL_RE.finditer(text):
        out.append(text[last:m.start()])
        out.append((0, int(m.group(1)) - offset) if m.group(1) else (1, int(m.group(2)) - offset))
        last = m.end()
    out.append(text[last:])
    return out


def _fill(parts, values) -> str:
    return "".join([p if p.__class__ is str else values[p[1]][p[0]] for p in parts])


def render_cache_bytes(examples) -> int:
    """An upper estimate of the cache file of `examples` in bytes: 5 per character of their JSON, plus 1 MiB.
    Measured with the Qwen3 tokenizer: 1.23 bytes per character for English chat (templates/sft_example.jsonl),
    3.46 for Japanese, 4.12 for emoji and math symbols (each a token or more)."""
    return 5 * sum(len(json.dumps(ex, ensure_ascii=False)) for ex in examples) + 2**20


def render_cache_key(examples, tokenizer, fmt, train_on) -> str:
    """sha256 of everything a rendered datum depends on: the examples, the tokenizer's vocabulary and
    special tokens, the format record (template hash, kwargs, stop), train_on and the rendering code."""
    h = hashlib.sha256()
    h.update(json.dumps([examples, fmt, train_on], sort_keys=True, default=str).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    with contextlib.suppress(OSError, TypeError):  # the code that renders and masks, as it runs now
        h.update("".join(inspect.getsource(f) for f in (render_example, _render_chat_turn, _apply_template,
                                                         generation_prompt, _merge_extensions, BatchRenderer,
                                                         _template_text, _write_render_cache)).encode())
    return h.hexdigest()[:32]


def _read_render_cache(path):
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        return _unpack(rows)
    except (OSError, ValueError, TypeError):
        return None


def _write_render_cache(path, rendered) -> None:
    """Atomic, and never fatal: a read-only or full disk only costs the next run a render. Rows are
    [line, tokens, weight runs] (the runs keep a 200k-conversation set at a third of its size)."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps([[line, r.tokens, _runs(r.weights)] for line, r in rendered]), encoding="utf-8")
        os.replace(tmp, path)


def apply_length_limit(rendered, limit, mode):
    """(kept, dropped lines) of [(line, Rendered)]. mode: 'error' | 'drop' | 'truncate'."""
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
