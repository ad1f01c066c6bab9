#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "tinker>=0.38,<0.39",
#     "transformers",
#     "jinja2>=3.1.6",  # transformers renders chat templates with jinja2 but does not declare it
#     "numpy",
# ]
# ///
"""Reinforcement learning on Tinker with group-relative advantages, single-turn or multi-turn tool use.

Run:
    # check for free (no Tinker call): renders every prompt, checks the tasks, estimates the cost
    uv run tinker_rl.py --dry-run --tokenizer PATH/TO/TOKENIZER
    # train: the single-turn example, then the multi-turn calculator tool-use example
    uv run tinker_rl.py --model-name Qwen/Qwen3-8B --log-path runs/rl1 --iterations 20 --max-usd 5
    uv run tinker_rl.py --env calculator --log-path runs/rl-calc --iterations 20 --max-usd 5

Edit:
    The block marked `# ==== EDIT ME ====` below the settings: TASKS, render_prompt(task) (a list of
    chat messages, or a str for a base model), reward(task, completion) -> float. For a multi-turn
    agent, also env_step(task, conversation, model_turn, rng) -> (observation, reward, done): it gets
    the model's turn and returns the next message (a tool result or a user reply), a reward, and
    whether the episode ended. The calculator example (--env calculator) shows all of it.

Outputs:
    LOG/config.json       every setting (never the API key) and the "format" prompts are rendered with
    LOG/metrics.jsonl     one row per iteration: reward mean/std/min/max, fraction of groups tied,
                          fraction truncated, tokens sampled/trained, loss_fn, loss, sampler/learner KL,
                          seconds sampling/training, the per-group seeds
    LOG/checkpoints.jsonl one row per save: name, step, next_iteration, epoch, state_path, sampler_path, format
    stdout                one JSON object: status, log_path, iterations, state_path, sampler_path,
                          reward {first, last}, format

Requires:
    TINKER_API_KEY (not for --dry-run); TINKER_BASE_URL to point at a local rehearsal backend
    (scripts/tinker_local.py). --tokenizer PATH, or HF_HUB_OFFLINE=1 with a warm cache, to run offline.

Exit codes: 0 ok, 1 Tinker or runtime failure, 2 bad input or usage (tasks, reward, flags, unknown
model, prompt over the context window, every group tied on the base policy, a loss the server
rejects), 3 cost estimate above --max-usd, 4 no credentials or Tinker unreachable, 130 interrupted
(resume with --resume).

The recipe: per iteration, snapshot the weights into a sampling client; sample --group-size
completions of every task with every group in flight at once; advantage = reward - group mean
(Dr. GRPO, no std unless --normalize-std); groups whose rewards all tie carry no signal and are
skipped; one datum per episode (turns that extend the previous context merge), advantages zero on
prompt and observation tokens; forward_backward(--loss-fn) and optim_step submitted back to back.
Truncated turns (stop_reason "length", --max-tokens applies per turn): --on-truncation end (default)
ends the episode and scores the cut text as it is; continue closes the turn with the end-of-turn
token and lets the environment answer. Both are counted in frac_truncated.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import dataclasses
import hashlib
import importlib
import json
import math
import operator
import os
import random
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

SCRIPT_DIR = Path(__file__).resolve().parent
LOSS_FNS = ("importance_sampling", "ppo", "cispo", "dro")
# Clip thresholds are absolute bounds on the ratio p_learner / p_sampler (tinker docs, cookbook).
DEFAULT_LOSS_CONFIG = {
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},  # one-sided, as in ScaleRL
    "dro": {"beta": 0.05},
}
# Models that always think before answering: their turns need room (4096 tokens unless --max-tokens).
REASONING_MODELS = ("gpt-oss", "Kimi-K2-Thinking", "GLM-5", "Qwen3.8", "DeepSeek-V4", "Inkling")
FROZEN_DATE = "2024-07-26"  # same rendering on every day (as tinker_sft.py), so resume is exact
FROZEN_DATE_STRING = "26 Jul 2024"
PERIODIC_TTL_SECONDS = 7 * 24 * 3600


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="RL with group-relative advantages on Tinker (single-turn or multi-turn tool use).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--env", choices=("single", "calculator"), default="single",
                   help="which example in the EDIT ME block: single-turn tasks or the multi-turn calculator")
    p.add_argument("--model-name", default="Qwen/Qwen3-8B")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the model's)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=4e-5, help="constant; RL wants 1e-6..1e-4")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="tasks (groups) per iteration")
    p.add_argument("--group-size", type=int, default=4, help="samples per task; advantages compare them")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="per turn; default 256, or 4096 for reasoning models")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-turns", type=int, default=4, help="model turns per episode (multi-turn envs)")
    p.add_argument("--on-truncation", choices=("end", "continue"), default="end",
                   help="a turn cut by --max-tokens: end the episode, or close the turn and continue")
    p.add_argument("--loss-fn", choices=LOSS_FNS, default="importance_sampling")
    p.add_argument("--clip-low-threshold", type=float, default=None, help="ppo/cispo ratio bound")
    p.add_argument("--clip-high-threshold", type=float, default=None, help="ppo/cispo ratio bound")
    p.add_argument("--dro-beta", type=float, default=None)
    p.add_argument("--normalize-std", action="store_true", help="divide advantages by the group's std")
    p.add_argument("--context-window", type=int, default=None,
                   help="override the model's context window (default: asked from Tinker)")
    p.add_argument("--save-every", type=int, default=10, help="iterations between save_state; 0 = only final")
    p.add_argument("--log-path", default=None, help="default runs/rl-<env>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-usd", type=float, default=None, help="stop before training if the estimate is above")
    p.add_argument("--dry-run", action="store_true", help="render and check, no Tinker call")
    p.add_argument("--resume", action="store_true", help="continue from the last row of checkpoints.jsonl")
    p.add_argument("--overwrite", action="store_true", help="start over in an existing --log-path")
    return p.parse_args(argv)


# ==== EDIT ME: TASKS, render_prompt(), reward(), env_step() ====
# Single-turn example (--env single): multiply two numbers in one reply. Qwen3-8B gets some but
# not all right, so groups disagree and there is a gradient (a task every sample passes, or every
# sample fails, teaches nothing: the script stops if the base policy ties every group).

_task_rng = random.Random(1234)
TASKS = [{"a": a, "b": b, "answer": a * b}
         for a, b in ((_task_rng.randint(100, 999), _task_rng.randint(10, 99)) for _ in range(64))]


def render_prompt(task):
    """The prompt of one task: a list of {"role", "content"} messages (rendered with the model's chat
    template), or a str used as raw text (base models)."""
    return [{"role": "user", "content": f"What is {task['a']} * {task['b']}? Reply with only the number."}]


def reward(task, completion):
    """Score one completion (the model's text, end-of-turn token removed) of `task`.

    Contract: return a finite float, higher is better; only differences inside a group matter.
    Must not raise on garbage text: score it low instead. Called once per sample.
    """
    numbers = re.findall(r"-?\d[\d,]*", completion)
    return 1.0 if numbers and numbers[-1].replace(",", "") == str(task["answer"]) else 0.0


# Multi-turn example (--env calculator): the model may call a calculator tool, reads the result,
# then answers. Episodes end on an answer without a tool call, or after --max-turns.

_calc_rng = random.Random(4321)
CALCULATOR_TASKS = [{"a": a, "b": b, "c": c, "answer": a * b - c}
                    for a, b, c in ((_calc_rng.randint(1000, 9999), _calc_rng.randint(100, 999),
                                     _calc_rng.randint(10, 99)) for _ in range(64))]
CALCULATOR_TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]
# A simulated user (another model answering the agent) must behave the same for every sample of a
# group, or its randomness is credited to the policy: sample it at temperature 0, or seeded from `rng`.
SIMULATED_USER_TEMPERATURE = 0.0


def calculator_render_prompt(task):
    """The first prompt of a calculator episode (the tools are passed to the chat template)."""
    return [{"role": "user", "content": (
        f"What is {task['a']} * {task['b']} - {task['c']}? Use the calculator tool, then reply with "
        "only the final number.")}]


def calculator_reward(task, completion):
    """Score the final answer (text without a tool call): 1.0 when its last number is right, else 0.0."""
    return reward(task, completion)


def calculator_env_step(task, conversation, model_turn, rng):
    """One environment step after the model's turn.

    Contract: (task, conversation so far without this turn, this turn's text, a random.Random seeded
    per group) -> (observation, reward, done[, info]). observation is the next message
    ({"role": "tool" | "user", "content": str}) or None when done; reward is a finite float added to
    the episode's total; info (optional) is a dict of numbers summed into metrics as env/<key>.
    Policy for a tool call that does not parse: the tool answers with an error message saying what
    is expected, the step's reward is 0 and the episode goes on (counted as env/tool_parse_errors).
    Everything here must be deterministic given `rng`, so it is the same for the whole group.
    """
    calls = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", model_turn, flags=re.S)
    if not calls:
        return None, calculator_reward(task, model_turn), True, {"answers": 1}
    try:
        call = json.loads(calls[0].strip())
        if call.get("name") != "calculator":
            raise ValueError(f"unknown tool {call.get('name')!r}")
        args = call.get("arguments")
        args = json.loads(args) if isinstance(args, str) else args
        result = _safe_eval(str(args["expression"]))
        return {"role": "tool", "content": str(result)}, 0.0, False, {"tool_calls": 1}
    except Exception as e:  # any malformed call: tell the model, never crash the run
        message = (f"error: could not run the tool call ({type(e).__name__}: {str(e)[:80]}). Expected "
                   '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>')
        return {"role": "tool", "content": message}, 0.0, False, {"tool_parse_errors": 1}


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _safe_eval(expression):
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / ** ( ) are allowed")

    value = ev(ast.parse(expression, mode="eval").body)
    return int(value) if isinstance(value, float) and value.is_integer() else value


def load_env(name):
    """The pieces of one example: tasks, render_prompt, reward, env_step (None = single-turn), tools."""
    if name == "calculator":
        return dict(tasks=CALCULATOR_TASKS, render_prompt=calculator_render_prompt, reward=calculator_reward,
                    env_step=calculator_env_step, tools=CALCULATOR_TOOLS)
    return dict(tasks=TASKS, render_prompt=render_prompt, reward=reward, env_step=None, tools=None)

# ==== END OF EDIT ME ====


class RLError(Exception):
    exit_code = 1


class DataError(RLError):
    """Bad tasks, reward, flags or model: fix the input, rerun."""
    exit_code = 2


class BudgetError(RLError):
    exit_code = 3


class AccessError(RLError):
    exit_code = 4


def validate_args(args):
    if args.group_size < 2:
        raise DataError(f"--group-size {args.group_size}: the advantage compares samples of one task, "
                        "so at least 2 are needed (4 is a good start)")
    for flag in ("iterations", "batch_size", "max_turns", "lora_rank"):
        if getattr(args, flag) < 1:
            raise DataError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise DataError("--max-tokens must be at least 1")
    if args.save_every < 0:
        raise DataError("--save-every must be 0 (final only) or more")
    if not (args.temperature > 0):
        raise DataError("--temperature must be above 0: RL needs different samples inside a group")
    if args.resume and args.overwrite:
        raise DataError("--resume and --overwrite contradict each other; pick one")
    if args.max_tokens is None:
        args.max_tokens = 4096 if any(m.lower() in args.model_name.lower() for m in REASONING_MODELS) else 256
    if args.log_path is None:
        args.log_path = f"runs/rl-{args.env}"


def loss_fn_config(args):
    """The loss_fn_config sent with forward_backward: defaults per loss, overridden by the flags."""
    config = DEFAULT_LOSS_CONFIG[args.loss_fn]
    config = dict(config) if config else None
    if args.loss_fn in ("ppo", "cispo"):
        if args.clip_low_threshold is not None:
            config["clip_low_threshold"] = args.clip_low_threshold
        if args.clip_high_threshold is not None:
            config["clip_high_threshold"] = args.clip_high_threshold
    elif args.clip_low_threshold is not None or args.clip_high_threshold is not None:
        raise DataError(f"--clip-*-threshold applies to --loss-fn ppo or cispo, not {args.loss_fn}")
    if args.dro_beta is not None:
        if args.loss_fn != "dro":
            raise DataError(f"--dro-beta applies to --loss-fn dro, not {args.loss_fn}")
        config["beta"] = args.dro_beta
    return config


# ---------------------------------------------------------------------------------------------
# Format: the same rendering rules as tinker_sft.py, so tinker_infer.py --run LOG works. A copy,
# because each script must run alone.


@contextlib.contextmanager
def _frozen_clock(date_iso):
    # transformers builds strftime_now() on datetime.now(); freezing its module clock is the only way
    # to make a template that prints today's date render the same every day.
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


def render_text(tokenizer, fmt, messages, tools=None, add_generation_prompt=True):
    kwargs = dict(fmt["template_kwargs"])
    frozen = kwargs.pop("strftime_now", None)
    with _frozen_clock(frozen):
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **kwargs)


def render_tokens(tokenizer, fmt, prompt, tools=None):
    """Token ids given to the sampler for a prompt (messages -> chat template; str -> raw text)."""
    if fmt["kind"] == "raw":
        text = prompt if isinstance(prompt, str) else "\n\n".join(
            [f"{m['role'].capitalize()}: {m['content']}" for m in prompt] + ["Assistant:"])
        bos = [tokenizer.bos_token_id] if fmt.get("bos") and tokenizer.bos_token_id is not None else []
        return bos + tokenizer.encode(text, add_special_tokens=False)
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return tokenizer.encode(render_text(tokenizer, fmt, prompt, tools), add_special_tokens=False)


_PROBE = "Zq7PROBEqZ"


def chat_format(tokenizer, name):
    """The run record's "format" (DEVELOPING.md): template hash and kwargs, stop = the end-of-turn
    token found by rendering an assistant turn (plus Harmony's <|call|>)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()))
    fmt = {
        "kind": "chat",
        "template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "template_kwargs": {"enable_thinking": False, "thinking": False,
                            "date_string": FROZEN_DATE_STRING, "strftime_now": FROZEN_DATE},
        "stop": [],
        "tokenizer": name,
    }
    text = render_text(tokenizer, fmt, [{"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": _PROBE}], add_generation_prompt=False)
    after = tokenizer.encode(text[text.index(_PROBE) + len(_PROBE):], add_special_tokens=False)
    specials = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    end = next((t for t in after if t in specials), None)
    if end is None:
        raise DataError(f"the chat template of {name!r} ends an assistant turn with no special token; "
                        "cannot tell when a turn stops")
    fmt["stop"] = [end]
    if tokenizer.convert_ids_to_tokens(end) == "<|return|>":
        call = tokenizer.convert_tokens_to_ids("<|call|>")
        if isinstance(call, int) and call != tokenizer.unk_token_id:
            fmt["stop"].append(call)
    return fmt


def raw_format(tokenizer, name):
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {name!r} has no EOS token; a raw prompt needs one to stop")
    return {"kind": "raw", "stop": [tokenizer.eos_token_id], "bos": tokenizer.bos_token_id is not None,
            "conversation": "role-colon: 'User: ...\\n\\nAssistant: ...'", "tokenizer": name}


def observation_tokens(tokenizer, fmt, message):
    """Tokens that follow a closed model turn: the observation message and the next generation prompt.

    Rendered after a probe assistant turn and cut after its end-of-turn token, so the result appends
    to the tokens actually sampled (the extension property holds by construction and the episode
    stays one datum, whatever the template does to earlier turns)."""
    if isinstance(message, str):
        message = {"role": "user", "content": message}
    text = render_text(tokenizer, fmt, [{"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": _PROBE}, message])
    eot = tokenizer.decode([fmt["stop"][0]])
    start = text.index(_PROBE) + len(_PROBE)
    cut = text.index(eot, start) + len(eot)
    return tokenizer.encode(text[cut:], add_special_tokens=False)


def completion_text(tokenizer, fmt, tokens):
    if tokens and tokens[-1] in fmt["stop"]:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens)


# ---------------------------------------------------------------------------------------------
# Tasks, rewards, advantages, datums


def task_label(tasks, index):
    text = json.dumps(tasks[index], default=str)
    return f"task {index} ({text[:60]}{'...' if len(text) > 60 else ''})"


def checked_reward(value, label, where="reward()"):
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where} returned {value!r} for {label}; expected a finite float. Fix it in the "
                        "EDIT ME block and check with --dry-run")
    return float(value)


def call_user_code(fn, label, *args):
    """reward() / env_step() from the EDIT ME block; an exception there is bad input, named by task."""
    try:
        return fn(*args)
    except RLError:
        raise
    except Exception as e:
        raise DataError(f"{fn.__name__}() raised on {label}: {type(e).__name__}: {str(e)[:120]}") from None


def batch_tasks(iteration, n_tasks, batch_size, seed):
    """Task indices of one iteration: epochs of seeded shuffles, so --resume picks the same tasks."""
    out = []
    for k in range(iteration * batch_size, (iteration + 1) * batch_size):
        epoch, pos = divmod(k, n_tasks)
        order = list(range(n_tasks))
        random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
        out.append(order[pos])
    return out


def group_seed(seed, iteration, slot):
    """The seed of one group: its sampler calls and its environment rng (the same for every sample)."""
    return random.Random(f"{seed}-{iteration}-{slot}").randrange(2**31)


def advantages(rewards, normalize_std=False):
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + 1e-6) for c in centred]


@dataclasses.dataclass
class Turn:
    observation: list[int]  # everything the sampler was given for this turn
    action: list[int]  # the sampled tokens
    logprobs: list[float]  # the sampler's logprob of each sampled token
    stop_reason: str


@dataclasses.dataclass
class Episode:
    turns: list[Turn]
    reward: float
    truncated: bool = False
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Group:
    task_index: int
    seed: int
    episodes: list[Episode]


def episode_sequences(turns, advantage):
    """Unshifted (tokens, sampler logprobs, advantages, mask) per datum of one episode.

    A turn whose observation starts with everything so far extends it: only the new observation
    tokens are appended (logprob, advantage and mask 0), then the action (sampler logprobs, the
    episode's advantage, mask 1). A turn that does not extend starts a new datum."""
    sequences, seq = [], None
    for turn in turns:
        if seq is not None and turn.observation[: len(seq[0])] == seq[0]:
            new = turn.observation[len(seq[0]):]
        else:
            if seq is not None:
                sequences.append(seq)
            seq, new = ([], [], [], []), turn.observation
        if len(turn.logprobs) != len(turn.action):
            raise RLError(f"sampler returned {len(turn.logprobs)} logprobs for {len(turn.action)} tokens")
        tokens, lps, advs, mask = seq
        tokens += new + turn.action
        lps += [0.0] * len(new) + [float(x) for x in turn.logprobs]
        advs += [0.0] * len(new) + [float(advantage)] * len(turn.action)
        mask += [0.0] * len(new) + [1.0] * len(turn.action)
    if seq is not None:
        sequences.append(seq)
    return sequences


def to_datum(tokens, logprobs, advs):
    """Shift by one: position i predicts token i+1. No `mask` key: prompt and observation positions
    are out of the loss because their advantage is 0."""
    import tinker

    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": list(tokens[1:]), "logprobs": list(logprobs[1:]),
                        "advantages": list(advs[1:])},
    )


def build_batch(groups, normalize_std=False):
    """Datums (with their client-side masks) of every group whose rewards do not all tie."""
    datums, masks, tied = [], [], 0
    for group in groups:
        rewards = [e.reward for e in group.episodes]
        if max(rewards) - min(rewards) < 1e-9:
            tied += 1
            continue
        for episode, adv in zip(group.episodes, advantages(rewards, normalize_std)):
            for tokens, lps, advs, mask in episode_sequences(episode.turns, adv):
                if len(tokens) < 2 or not any(mask):
                    continue
                datums.append(to_datum(tokens, lps, advs))
                masks.append(mask[1:])
    return datums, masks, tied


def kl_metrics(datums, masks, outputs):
    """Sampler vs learner on the sampled tokens: v1 = mean(lp_sampler - lp_learner), v2 = half the mean
    square (stable training keeps these below about 0.01), entropy = -mean(lp_sampler)."""
    diffs, sampler_lps = [], []
    for datum, mask, out in zip(datums, masks, outputs):
        learner = out["logprobs"].tolist() if hasattr(out["logprobs"], "tolist") else list(out["logprobs"])
        sampler = datum.loss_fn_inputs["logprobs"].tolist()
        for m, q, p in zip(mask, sampler, learner):
            if m:
                diffs.append(q - p)
                sampler_lps.append(q)
    if not diffs:
        return {}
    n = len(diffs)
    return {"kl_sample_train_v1": sum(diffs) / n, "kl_sample_train_v2": 0.5 * sum(d * d for d in diffs) / n,
            "entropy": -sum(sampler_lps) / n}


# ---------------------------------------------------------------------------------------------
# Rollouts: every group in flight at once


@dataclasses.dataclass
class Rollout:
    """Everything a rollout needs besides the sampling client."""

    tokenizer: object
    fmt: dict
    env: dict
    tasks: list
    prompts: list  # rendered first-prompt tokens, one per task
    max_tokens: int
    temperature: float
    max_turns: int
    on_truncation: str
    context_window: int | None


def _params(ro, prompt_len, seed):
    import tinker

    cap = ro.max_tokens if ro.context_window is None else min(ro.max_tokens, ro.context_window - prompt_len)
    return None if cap <= 0 else tinker.SamplingParams(max_tokens=cap, temperature=ro.temperature,
                                                        stop=list(ro.fmt["stop"]), seed=seed)


async def run_episode(sampler, ro, task_index, seed, index, first):
    """Continue one episode from its first sampled turn until the environment says done."""
    import tinker

    task, env = ro.tasks[task_index], ro.env
    label = task_label(ro.tasks, task_index)
    rng = random.Random(seed)  # the same environment randomness for every sample of the group
    conversation = list(env["render_prompt"](task)) if env["env_step"] else None
    observation, sequence = ro.prompts[task_index], first
    turns, total, truncated, info = [], 0.0, False, {}
    for turn_index in range(ro.max_turns):
        if turn_index > 0:
            params = _params(ro, len(observation), seed + 7919 * index + turn_index)
            if params is None:  # no room left in the context window
                truncated = True
                break
            response = await sampler.sample(prompt=tinker.ModelInput.from_ints(observation), num_samples=1,
                                            sampling_params=params)
            sequence = response.sequences[0]
        action = list(sequence.tokens)
        turns.append(Turn(observation, action, list(sequence.logprobs or []), sequence.stop_reason))
        text = completion_text(ro.tokenizer, ro.fmt, action)
        cut = sequence.stop_reason == "length"
        truncated = truncated or cut
        if env["env_step"] is None:
            total += checked_reward(call_user_code(env["reward"], label, task, text), label)
            break
        result = call_user_code(env["env_step"], label, task, list(conversation), text, rng)
        if not isinstance(result, tuple) or len(result) not in (3, 4):
            raise DataError(f"env_step() returned {type(result).__name__} for {label}; expected "
                            "(observation, reward, done) or (observation, reward, done, info)")
        message, step_reward, done = result[:3]
        for key, value in (result[3] if len(result) == 4 and result[3] else {}).items():
            info[key] = info.get(key, 0) + value
        total += checked_reward(step_reward, label, "env_step()")
        if done or message is None or (cut and ro.on_truncation == "end"):
            break
        conversation += [{"role": "assistant", "content": text},
                         message if isinstance(message, dict) else {"role": "user", "content": str(message)}]
        closed = action if action and action[-1] in ro.fmt["stop"] else action + ro.fmt["stop"][:1]
        observation = observation + closed + observation_tokens(ro.tokenizer, ro.fmt, message)
    return Episode(turns, total, truncated, info)


async def rollout_group(sampler, ro, task_index, seed, group_size):
    """One group: the first turn of all its samples in one call, then each episode on its own."""
    import tinker

    prompt = ro.prompts[task_index]
    response = await sampler.sample(prompt=tinker.ModelInput.from_ints(prompt), num_samples=group_size,
                                    sampling_params=_params(ro, len(prompt), seed))
    episodes = await asyncio.gather(*(run_episode(sampler, ro, task_index, seed, i, seq)
                                      for i, seq in enumerate(response.sequences)))
    return Group(task_index, seed, list(episodes))


async def rollout_batch(sampler, ro, task_indices, seeds, group_size, concurrent=True):
    """All groups of one iteration. concurrent=False samples one group after another (benchmark only)."""
    if concurrent:
        return list(await asyncio.gather(*(rollout_group(sampler, ro, t, s, group_size)
                                           for t, s in zip(task_indices, seeds))))
    return [await rollout_group(sampler, ro, t, s, group_size) for t, s in zip(task_indices, seeds)]


# ---------------------------------------------------------------------------------------------
# Training step, checkpoints, run record


def train_step(training_client, datums, loss_fn, config, learning_rate):
    """forward_backward with the chosen loss and its config, optim_step submitted right behind it."""
    import tinker

    fb = training_client.forward_backward(datums, loss_fn=loss_fn, loss_fn_config=config)
    step = training_client.optim_step(tinker.AdamParams(learning_rate=learning_rate, beta1=0.9, beta2=0.95,
                                                        eps=1e-8))
    result = fb.result()
    step.result()
    return result


def read_rows(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_row(path, row):
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def save_checkpoint(tc, log, name, next_iteration, epoch, fmt, final=False):
    state = tc.save_state(name, ttl_seconds=None if final else PERIODIC_TTL_SECONDS)
    sampler = tc.save_weights_for_sampler(name) if final else None
    row = {"name": name, "step": next_iteration, "next_iteration": next_iteration, "epoch": epoch,
           "state_path": state.result().path, "sampler_path": sampler.result().path if sampler else None,
           "format": fmt, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    append_row(log / "checkpoints.jsonl", row)
    return row


SETTINGS_THAT_MUST_MATCH = ("env", "model_name", "lora_rank", "batch_size", "group_size", "seed")


def prepare_log(args, config):
    """The log folder, and the checkpoint row to resume from (or None)."""
    log = Path(args.log_path)
    ckpt_path, metrics_path = log / "checkpoints.jsonl", log / "metrics.jsonl"
    existing = [p for p in (ckpt_path, metrics_path) if p.exists()]
    if args.resume:
        rows = [r for r in read_rows(ckpt_path) if r.get("state_path")]
        if not rows:
            raise DataError(f"nothing to resume in {log}: no checkpoints.jsonl row with a state_path; "
                            "drop --resume to start")
        old = json.loads((log / "config.json").read_text()) if (log / "config.json").exists() else {}
        changed = [k for k in SETTINGS_THAT_MUST_MATCH if k in old and old[k] != config[k]]
        if changed:
            raise DataError(f"--resume with different {', '.join('--' + k.replace('_', '-') for k in changed)} "
                            f"than the run in {log}; use the same settings or a new --log-path")
        last = rows[-1]
        kept = [r for r in read_rows(metrics_path) if r.get("iteration", 0) < last["next_iteration"]]
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return log, last
    if existing and not args.overwrite:
        raise DataError(f"{log} already holds a run; add --resume to continue it or --overwrite to start over")
    log.mkdir(parents=True, exist_ok=True)
    for p in existing:
        p.unlink()
    return log, None


def load_pricing():
    if str(SCRIPT_DIR) not in sys.path:
        sys.path.insert(0, str(SCRIPT_DIR))
    try:
        return importlib.import_module("tinker_pricing")
    except ImportError:
        return None


def estimate(args, avg_prompt, turns, context=None, start=0):
    """Dollar estimate of iterations start..--iterations, i.e. what a --resume has left to pay for
    (completions counted at --max-tokens: an upper bound)."""
    pricing = load_pricing()
    if pricing is None:
        note = "no dollar estimate: tinker_pricing.py is not beside this script"
        if args.max_usd is not None:
            raise BudgetError(f"cannot check --max-usd: {note}; copy it here or drop --max-usd")
        print(note, file=sys.stderr)
        return None
    remaining = max(0, args.iterations - start)
    tokens = pricing.rl_tokens(remaining, args.batch_size, args.group_size, avg_prompt, args.max_tokens,
                               turns=turns, avg_observation=64 if turns > 1 else 0)
    label = "rl" if not start else f"rl, remaining {remaining} of {args.iterations} iterations after --resume"
    try:
        return pricing.preflight(args.model_name, tokens, args.max_usd, label=label, context=context)
    except pricing.BudgetExceeded as e:
        raise BudgetError(str(e)) from None
    except (pricing.UnknownModelError, ValueError) as e:
        if args.max_usd is not None:
            raise BudgetError(f"cannot check --max-usd: {e}") from None
        print(f"no dollar estimate: {e}", file=sys.stderr)
        return None


def connect(args):
    """ServiceClient and the model's context window, or an AccessError/DataError before any paid call."""
    import tinker

    if not tinker.auth.tinker_has_credentials():
        raise AccessError("no Tinker credentials: set TINKER_API_KEY (tml-...), or check for free with "
                          "--dry-run, or rehearse against the local backend (scripts/tinker_local.py)")
    try:
        caps = tinker.RestClient().get_server_capabilities().result()
    except (tinker.AuthenticationError, tinker.PermissionDeniedError) as e:
        raise AccessError(f"Tinker refused the credentials ({type(e).__name__}); check TINKER_API_KEY") from None
    except (tinker.APIConnectionError, tinker.APITimeoutError, OSError) as e:
        url = os.environ.get("TINKER_BASE_URL") or "the Tinker service"
        raise AccessError(f"cannot reach {url} ({type(e).__name__}); check the network or TINKER_BASE_URL") from None
    models = {m.model_name: m for m in caps.supported_models if m.model_name}
    model = models.get(args.model_name)
    if model is None:
        raise DataError(f"unknown model {args.model_name!r}: this Tinker serves "
                        f"{', '.join(sorted(models)[:12])}; pass one with --model-name")
    if model.trainable is False:
        raise DataError(f"{args.model_name} is not trainable on this Tinker; pick another --model-name")
    return tinker.ServiceClient(), model.max_context_length


def describe_failure(e):
    status = getattr(e, "status_code", None)
    text = str(getattr(e, "message", None) or e).replace("\n", " ")
    return f"{type(e).__name__}{f' {status}' if status else ''}: {text[:200]}"


def is_rejection(e):
    """A request the server refused as invalid (4xx, or a failed request of category user)."""
    status = getattr(e, "status_code", None)
    category = str(getattr(e, "category", "")).lower()
    return (status is not None and 400 <= status < 500) or category.endswith("user")


# ---------------------------------------------------------------------------------------------
# Main


def prepare(args):
    """Tasks, tokenizer, format and rendered prompts; everything checked that can be without Tinker."""
    env = load_env(args.env)
    tasks = list(env["tasks"])
    if not tasks:
        raise DataError(f"the task list of --env {args.env} is empty; fill TASKS in the EDIT ME block")
    # A folder is recorded absolute so tinker_infer.py --run finds it from any directory; hub names as given.
    tokenizer_name = args.tokenizer or args.model_name
    tokenizer_name = os.path.abspath(tokenizer_name) if os.path.isdir(tokenizer_name) else tokenizer_name
    tokenizer = load_tokenizer(tokenizer_name)
    prompts = []
    for i, task in enumerate(tasks):
        try:
            prompts.append(env["render_prompt"](task))
        except Exception as e:
            raise DataError(f"render_prompt() failed on {task_label(tasks, i)}: {type(e).__name__}: {e}") from None
    if all(isinstance(p, str) for p in prompts) and not tokenizer.chat_template:
        fmt = raw_format(tokenizer, tokenizer_name)
    elif all(isinstance(p, list) and p and all(isinstance(m, dict) and "role" in m for m in p) for p in prompts):
        if not tokenizer.chat_template:
            raise DataError(f"tokenizer {tokenizer_name!r} has no chat template; render_prompt() must return "
                            "a str for this model")
        fmt = chat_format(tokenizer, tokenizer_name)
    else:
        bad = next(i for i, p in enumerate(prompts) if not isinstance(p, (list, str)) or isinstance(p, str)
                   != isinstance(prompts[0], str))
        raise DataError(f"render_prompt() returned {type(prompts[bad]).__name__} for {task_label(tasks, bad)}; "
                        "expected a list of {'role', 'content'} messages for every task (or a str for every task "
                        "with a base model)")
    if env["env_step"] is not None and fmt["kind"] != "chat":
        raise DataError("a multi-turn environment needs a chat template to render observations")
    rendered = [render_tokens(tokenizer, fmt, p, env["tools"]) for p in prompts]
    if SIMULATED_USER_TEMPERATURE > 0 and env["env_step"] is not None:
        print(f"warning: SIMULATED_USER_TEMPERATURE is {SIMULATED_USER_TEMPERATURE}: a simulated user that "
              "samples differently inside a group adds noise the advantage credits to the policy; use 0, or "
              "seed it from the rng env_step receives", file=sys.stderr)
    return env, tasks, tokenizer, fmt, rendered


def check_context(args, tasks, rendered, context_window):
    if context_window is None:
        return
    for i, tokens in enumerate(rendered):
        if len(tokens) >= context_window:
            raise DataError(f"the prompt of {task_label(tasks, i)} is {len(tokens)} tokens, not below the "
                            f"context window of {context_window}; shorten it in render_prompt()")
    longest = max(len(t) for t in rendered)
    if longest + args.max_tokens > context_window:
        print(f"note: longest prompt {longest} + --max-tokens {args.max_tokens} exceeds the context window "
              f"{context_window}; turns are capped to the room left", file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    validate_args(args)
    config_loss = loss_fn_config(args)
    env, tasks, tokenizer, fmt, rendered = prepare(args)
    turns = args.max_turns if env["env_step"] else 1
    avg_prompt = sum(map(len, rendered)) / len(rendered)
    print(f"{len(tasks)} tasks (--env {args.env}), prompts {min(map(len, rendered))}-{max(map(len, rendered))} "
          f"tokens, max {args.max_tokens} tokens per turn, up to {turns} turn(s)", file=sys.stderr)

    if args.dry_run:
        check_context(args, tasks, rendered, args.context_window)
        print("first prompt as the sampler sees it:\n" + tokenizer.decode(rendered[0]), file=sys.stderr)
        if env["env_step"] is None:  # the reward must hold its contract before any money is spent
            for i, task in enumerate(tasks):
                checked_reward(call_user_code(env["reward"], task_label(tasks, i), task, ""), task_label(tasks, i))
        est = estimate(args, avg_prompt, turns, args.context_window)
        emit({"status": "dry_run", "tasks": len(tasks), "env": args.env,
              "prompt_tokens": {"min": min(map(len, rendered)), "mean": round(avg_prompt, 1),
                                "max": max(map(len, rendered))},
              "max_tokens": args.max_tokens, "loss_fn": args.loss_fn, "loss_fn_config": config_loss,
              "estimate_usd": (est or {}).get("usd", {}).get("total") if est else None, "format": fmt})
        return 0

    service, context_window = connect(args)
    context_window = args.context_window or context_window
    check_context(args, tasks, rendered, context_window)
    config = {k: v for k, v in vars(args).items()}
    config.update(loss_fn_config=config_loss, context_window=context_window, n_tasks=len(tasks), format=fmt)
    log, resume_row = prepare_log(args, config)
    start = resume_row["next_iteration"] if resume_row else 0
    estimate(args, avg_prompt, turns, context_window, start)
    (log / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    if resume_row:
        tc = service.create_training_client_from_state_with_optimizer(resume_row["state_path"]).result()
        print(f"resumed from {resume_row['state_path']} at iteration {start}", file=sys.stderr)
    else:
        tc = service.create_lora_training_client(base_model=args.model_name, rank=args.lora_rank,
                                                 seed=args.seed).result()
    ro = Rollout(tokenizer, fmt, env, tasks, rendered, args.max_tokens, args.temperature, args.max_turns,
                 args.on_truncation, context_window)
    metrics_path = log / "metrics.jsonl"
    first_reward = next((r["reward_mean"] for r in read_rows(metrics_path)), None)
    last_reward, final = None, None

    for it in range(start, args.iterations):
        t0 = time.time()
        sampler = tc.save_weights_and_get_sampling_client().result()
        t1 = time.time()
        task_indices = batch_tasks(it, len(tasks), args.batch_size, args.seed)
        seeds = [group_seed(args.seed, it, slot) for slot in range(len(task_indices))]
        groups = asyncio.run(rollout_batch(sampler, ro, task_indices, seeds, args.group_size))
        t2 = time.time()
        datums, masks, tied = build_batch(groups, args.normalize_std)
        episodes = [e for g in groups for e in g.episodes]
        rewards = [e.reward for e in episodes]
        if it == 0 and tied == len(groups):
            raise DataError(
                f"the base policy ties every group (all {len(groups)} groups at reward "
                f"{sorted(set(rewards))[:3]}): no advantage, no gradient. Make the tasks easier (reward "
                "floor) or harder (ceiling), give partial credit in reward(), or raise --group-size / "
                "--temperature; nothing was trained")
        fb_metrics, train_seconds = {}, 0.0
        if datums:
            t3 = time.time()
            try:
                result = train_step(tc, datums, args.loss_fn, config_loss, args.learning_rate)
            except Exception as e:
                where = (f"the last checkpoint is {read_rows(log / 'checkpoints.jsonl')[-1]['state_path']}"
                         if (log / "checkpoints.jsonl").exists() else "no checkpoint was saved yet")
                # SDK 0.38 poisons a TrainingClient only when forward_backward_custom fails; a rejected
                # loss (dro, gspo) leaves it usable. The run stops anyway: the same loss would be rejected
                # again, and a failure mid-run is safer resumed from the last checkpoint than trained past.
                if is_rejection(e) and it == start and args.loss_fn != "importance_sampling":
                    others = "|".join(x for x in LOSS_FNS if x != args.loss_fn)
                    raise DataError(f"the server rejected --loss-fn {args.loss_fn} ({describe_failure(e)}); "
                                    f"the run stops here ({where}). Rerun with --loss-fn {others}") from None
                raise RLError(f"forward_backward/optim_step failed at iteration {it} ({describe_failure(e)}); "
                              f"the run stops here ({where}); rerun with --resume") from None
            train_seconds = time.time() - t3
            fb_metrics = {"loss_sum": result.metrics.get("loss:sum"),
                          **kl_metrics(datums, masks, result.loss_fn_outputs)}
        mean = sum(rewards) / len(rewards)
        row = {
            "iteration": it, "reward_mean": mean,
            "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
            "reward_min": min(rewards), "reward_max": max(rewards),
            "groups": len(groups), "groups_tied": tied, "frac_groups_tied": tied / len(groups),
            "episodes": len(episodes), "frac_truncated": sum(e.truncated for e in episodes) / len(episodes),
            "turns_mean": sum(len(e.turns) for e in episodes) / len(episodes),
            "tokens_sampled": sum(len(t.action) for e in episodes for t in e.turns),
            "tokens_trained": sum(d.model_input.length for d in datums), "datums": len(datums),
            "loss_fn": args.loss_fn, "loss_fn_config": config_loss, "learning_rate": args.learning_rate,
            **fb_metrics,
            "seconds_sampler_weights": t1 - t0, "seconds_sampling": t2 - t1, "seconds_training": train_seconds,
            "tasks": task_indices, "group_seeds": seeds,
        }
        for key in sorted({k for e in episodes for k in e.info}):
            row[f"env/{key}"] = sum(e.info.get(key, 0) for e in episodes)
        append_row(metrics_path, row)
        first_reward = mean if first_reward is None else first_reward
        last_reward = mean
        kl = fb_metrics.get("kl_sample_train_v1")
        print(f"iter {it + 1}/{args.iterations} | reward {mean:.3f} ± {row['reward_std']:.3f} | "
              f"tied {row['frac_groups_tied']:.2f} | trunc {row['frac_truncated']:.2f} | "
              f"loss {fb_metrics.get('loss_sum', float('nan')):.4g} | kl {kl if kl is not None else float('nan'):.2e} | "
              f"sample {t2 - t1:.1f}s | train {train_seconds:.1f}s", file=sys.stderr)
        done = it + 1
        epoch = done * args.batch_size // len(tasks)
        if args.save_every and done % args.save_every == 0 and done < args.iterations:
            save_checkpoint(tc, log, f"{done:06d}", done, epoch, fmt)

    if start < args.iterations or not resume_row or resume_row.get("name") != "final":
        final = save_checkpoint(tc, log, "final", args.iterations, args.iterations * args.batch_size // len(tasks),
                                fmt, final=True)
    else:
        final = resume_row
    emit({"status": "ok", "log_path": str(log), "iterations": args.iterations,
          "state_path": final["state_path"], "sampler_path": final["sampler_path"],
          "reward": {"first": first_reward, "last": last_reward}, "loss_fn": args.loss_fn, "format": fmt,
          "sampling": {"model_path": final["sampler_path"], "stop": fmt["stop"],
                       "hint": f"python tinker_infer.py --run {log}"}})
    return 0


def emit(obj):
    print(json.dumps(obj))


def cli(argv=None):
    try:
        return main(argv)
    except RLError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted: continue with the same command plus --resume", file=sys.stderr)
        return 130
    except Exception as e:  # Tinker or runtime failure: one line, the details are in the SDK's log
        print(f"error: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
