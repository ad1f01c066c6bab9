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
    uv run tinker_rl.py --dry-run              # offline: add --tokenizer DIR (a saved tokenizer folder)
    # rehearse for free on the local backend: --rehearse auto trains your reward() when the tiny model's
    # samples vary under it, else a stand-in task it can learn (the script says which)
    python tinker_local.py run -- python tinker_rl.py            # add --env calculator for multi-turn
    # ... your own reward from an SFT rehearsal's checkpoint (its final state_path), as after SFT on Tinker
    python tinker_local.py run -- python tinker_rl.py --init-from tinker://RUN/weights/final --log-path runs/rl
    # train: the single-turn example, then the multi-turn calculator tool-use example
    uv run tinker_rl.py --model-name Qwen/Qwen3-8B --log-path runs/rl1 --iterations 20 --max-usd 5
    uv run tinker_rl.py --env calculator --log-path runs/rl-calc --iterations 20 --max-usd 5

Edit:
    The block marked `# ==== EDIT ME ====` below the settings holds a whole environment: ENV_NAME (--env NAME),
    TASKS, TOOLS (function schemas rendered into the prompt) and SYSTEM_PROMPT, render_prompt(task) (chat
    messages, or a str for a base model), reward(task, completion) -> float and, for a multi-turn agent,
    env_step(task, conversation, model_turn, rng) -> (observation, reward, done[, info]). Each may be a
    plain function (run in a thread pool of --env-workers) or an `async def` (awaited). The calculator
    example (--env calculator, below the training loop) shows a multi-turn tool-use environment.

Outputs:
    LOG/config.json       every setting (never the API key) and the "format" prompts are rendered with
    LOG/metrics.jsonl     one row per iteration: reward stats, groups tied, truncation, tokens, loss, KL,
                          seconds, retries, sampler version/staleness, the tasks and per-group seeds
    LOG/checkpoints.jsonl one row per save: name, step, next_iteration, epoch, state_path, sampler_path, format
    LOG/rollouts.jsonl    one row per rollout (every --trace-every iterations): tokens, sampler logprobs,
                          sampler version and staleness, reward, advantage, trained or not, per-turn
                          observation/action spans
    stdout                one JSON object: status, log_path, iterations, state_path, sampler_path,
                          reward {first, last}, format (+ rehearsal: the real model's verdict, exit 1 if failed)

Requires:
    TINKER_API_KEY (not for --dry-run); TINKER_BASE_URL to point at a local rehearsal backend
    (scripts/tinker_local.py). --tokenizer PATH, or HF_HUB_OFFLINE=1 with a warm cache, to run offline.

Exit codes: 0 ok, 1 Tinker or runtime failure, 2 bad input or usage (tasks, reward, flags, unknown
model, prompt over the context window, every group tied on the base policy, a loss the server
rejects, --resume with other settings), 3 cost estimate above --max-usd (before the run, or during it: the
metered cost plus the next iteration's estimate; saved first, continue with --resume), 4 no credentials or Tinker
unreachable, 130 interrupted / 143 terminated (resume with --resume).

The recipe: per iteration, snapshot the weights into a sampling client; sample --group-size
completions of every task, at most --max-in-flight requests at once; advantage = reward - group mean
(Dr. GRPO, no std unless --normalize-std); groups whose rewards all tie carry no signal and are
skipped; one datum per episode (turns that extend the previous context merge), advantages zero on
prompt and observation tokens; forward_backward(--loss-fn) and optim_step submitted back to back.
--max-staleness K >= 1 (async off-policy): the next K iterations sample with the weights they may use
(at most K steps old, never older than the last save) while this one trains; the loss corrects with the
sampling logprobs as always. The machinery (rollouts, datums, the schedule) is generated code at the end.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import operator
import os
import random
import re
import sys
import time

# ==== SETTINGS ====
LOSS_FNS = ("importance_sampling", "ppo", "cispo", "dro")
# Clip thresholds are absolute bounds on the ratio p_learner / p_sampler (tinker docs, cookbook).
DEFAULT_LOSS_CONFIG = {
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},  # one-sided, as in ScaleRL
    "dro": {"beta": 0.05},
}
# Models whose turns usually start with reasoning (always, or hybrid with thinking on by default, as the price
# catalogue lists them): their turns need room (4096 tokens unless --max-tokens).
REASONING_MODELS = ("gpt-oss", "Kimi-K2", "GLM-5", "Qwen3.8", "DeepSeek-V4", "Inkling")  # Kimi-K2: K2.6 (K2-Thinking retired)
# --rehearse: the settings of RL_REHEARSAL (and RL_REHEARSAL_FROM_CHECKPOINT with --init-from), in the shared
# code below, by the model standing in; any flag given on the command line wins.
# A resumed run must match these settings (and the format); config.json keeps the original ones.
RESUME_KEYS = ("env", "rehearse", "model_name", "lora_rank", "train_unembed", "learning_rate", "loss_fn",
               "loss_fn_config", "batch_size", "group_size", "max_tokens", "temperature", "max_turns", "on_truncation",
               "normalize_std", "seed", "tasks_sha256", "init_from", "reward")


def edit_me(name, default=None):
    """A setting of the EDIT ME block, or `default` when the block does not define it (an older block)."""
    return globals().get(name, default)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="RL with group-relative advantages on Tinker (single-turn or multi-turn tool use).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    name = edit_me("ENV_NAME", "single")
    p.add_argument("--env", choices=tuple(dict.fromkeys((name, "single", "calculator"))), default=name,
                   help=f"{name}: the EDIT ME block's environment (ENV_NAME; 'single' is another name for it); "
                        "calculator: the multi-turn tool-use example")
    p.add_argument("--rehearse", choices=("auto", "on", "off"), default="auto",
                   help="the tiny-model rehearsal task and settings; auto: on when TINKER_BASE_URL is this machine")
    p.add_argument("--model-name", default="Qwen/Qwen3-8B")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the model's)")
    p.add_argument("--lora-rank", type=int, default=32, help="ignored with --init-from (the checkpoint's rank)")
    p.add_argument("--no-train-unembed", dest="train_unembed", action="store_false",
                   help="leave the output head out of the LoRA (the SDK's train_unembed=False; its default "
                        "trains it): an export then has no lm_head LoRA, which some vLLM versions and models "
                        "refuse; ignored with --init-from (the checkpoint's layers)")
    p.add_argument("--init-from", default=None,
                   help="start from a tinker://.../weights/NAME state, weights only, fresh optimizer (e.g. the "
                        "state_path of an SFT run's final checkpoint)")
    p.add_argument("--learning-rate", type=float, default=4e-5, help="constant; RL wants 1e-6..1e-4")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="tasks (groups) per iteration")
    p.add_argument("--group-size", type=int, default=4, help="samples per task; advantages compare them")
    p.add_argument("--max-tokens", type=int, default=None, help="per turn; default 256, 4096 for reasoning models")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-turns", type=int, default=4, help="model turns per episode (multi-turn envs)")
    p.add_argument("--on-truncation", choices=("end", "continue"), default="end",
                   help="a turn cut by --max-tokens: end the episode, or close the turn and continue")
    p.add_argument("--loss-fn", choices=LOSS_FNS, default="importance_sampling")
    p.add_argument("--clip-low-threshold", type=float, default=None, help="ppo/cispo ratio bound")
    p.add_argument("--clip-high-threshold", type=float, default=None, help="ppo/cispo ratio bound")
    p.add_argument("--dro-beta", type=float, default=None)
    p.add_argument("--normalize-std", action="store_true", help="divide advantages by the group's std")
    p.add_argument("--context-window", type=int, default=None, help="override the model's (asked from Tinker)")
    p.add_argument("--env-workers", type=int, default=None,
                   help="threads for plain-function reward()/env_step(); default: the episodes in flight "
                        f"(--batch-size x --group-size, x --max-staleness when above 1; at most {MAX_ENV_WORKERS}); "
                        "0 calls them on the event loop, one at a time")
    p.add_argument("--max-in-flight", type=int, default=64,
                   help="sampling requests at once, the rest queued (64: the cookbook's eval concurrency)")
    p.add_argument("--max-staleness", type=int, default=0,
                   help="0: on-policy; K >= 1: the next K iterations sample with older weights while this one "
                        "trains (rollouts more than K optim steps old are dropped)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="score EVAL_TASKS every N iterations (greedy reward and pass@k); 0 = never")
    p.add_argument("--eval-samples", type=int, default=4, help="k of pass@k: samples per held-out task")
    p.add_argument("--save-every", type=int, default=10, help="iterations between save_state; 0 = only final")
    p.add_argument("--trace-every", type=int, default=1,
                   help="write rollouts.jsonl rows every N iterations; 0 = no trace")
    p.add_argument("--log-path", default=None, help="default runs/rl-<env>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-usd", type=float, default=None,
                   help="stop before training if the estimate is above; during the run, save and stop (exit 3) "
                        "before an iteration whose estimate would take the metered cost above it")
    p.add_argument("--estimate-from", default=None, metavar="RUN_DIR",
                   help="price with the turns, sampled tokens per turn and observation tokens measured in "
                        "RUN_DIR/rollouts.jsonl (e.g. a short run or a rehearsal) instead of the upper bounds")
    p.add_argument("--dry-run", action="store_true", help="render and check, no Tinker call")
    p.add_argument("--resume", action="store_true", help="continue from the last row of checkpoints.jsonl")
    p.add_argument("--overwrite", action="store_true", help="start over in an existing --log-path")
    args = p.parse_args(argv)
    args.rehearse_flag = args.rehearse
    args.rehearse = args.rehearse == "on" or (args.rehearse == "auto" and on_local_backend())
    if args.rehearse:  # the rehearsal's settings, for every flag not given on the command line
        p.set_defaults(**rl_rehearsal_settings(args.init_from, multi_turn=args.env != name or env_step is not None))
        args = p.parse_args(argv)
        args.rehearse_flag, args.rehearse = args.rehearse, True
    if args.env == "single":
        args.env = name  # the EDIT ME block's environment, by its old name
    # Which reward trains: "own" (reward()/env_step() of the EDIT ME block), "stand-in" (the rehearsal's task),
    # or "auto" (a single-turn rehearsal without --init-from: own if it tells the first samples apart).
    if not args.rehearse:
        args.reward = "own"
    elif args.env == name and edit_me("REHEARSAL_TURNS") is not None:
        args.reward = "own"  # a scripted rehearsal: your env_step()/reward() on scripted and sampled episodes
    elif (args.env != name or env_step is not None) and args.init_from and real_stand_in():
        args.reward = "own"  # the real model after a tool-call warm-up (SFT) calls the tool: your env_step() trains
    elif args.env != name or env_step is not None:
        args.reward = "stand-in"  # multi-turn: the rehearsal scores the shipped environment's answers
    else:  # "auto" samples before the budget check: only where sampling is free (the local backend)
        args.reward = "own" if args.init_from else "auto" if on_local_backend() else "stand-in"
    return args


# ==== EDIT ME: TASKS, render_prompt(), reward(), env_step(), ENV_NAME, TOOLS, SYSTEM_PROMPT, REHEARSAL_TURNS ====
# Everything an environment is lives here; nothing outside this block needs an edit for a new one. os, sys,
# json, math, random, re are imported above. ENV_NAME, TOOLS, SYSTEM_PROMPT, REHEARSAL_TURNS may be left out.
# Single-turn example: multiply two numbers in one reply. Qwen3-8B gets some but not all right, so
# groups disagree and there is a gradient (a task every sample passes, or every sample fails, teaches
# nothing: the script stops if the base policy ties every group).
#
# Contracts. reward() and env_step() may be plain functions or `async def`:
#   - plain: run in a thread pool of --env-workers threads, so a slow one (a sandbox, a judge model,
#     a web call) does not hold up the other episodes; it must be thread-safe (or use --env-workers 0:
#     one call at a time on the event loop, which blocks every other episode while it runs).
#   - async def: awaited on the event loop; it must not block (await your I/O).
# Either way: never raise on garbage text (score it low instead), return finite floats, and be
# deterministic given `rng` so every sample of a group meets the same environment.

_task_rng = random.Random(1234)
_ALL_TASKS = [{"a": a, "b": b, "answer": a * b}
              for a, b in ((_task_rng.randint(100, 999), _task_rng.randint(10, 99)) for _ in range(72))]
TASKS, EVAL_TASKS = _ALL_TASKS[:64], _ALL_TASKS[64:]  # EVAL_TASKS: held out, scored by --eval-every
PASS_REWARD = 1.0  # pass@k counts a held-out task passed when one of k samples scores at least this
ENV_NAME = "multiply"  # --env NAME runs this block (the default); it names the run folder runs/rl-NAME
# Tools the model may call: OpenAI-style function schemas, rendered into every prompt by the chat template
# (tools=), e.g. [{"type": "function", "function": {"name": "lookup", "description": "...", "parameters":
# {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}]. None: no tools.
TOOLS = None
SYSTEM_PROMPT = None  # a str: sent as the first (system) message of every episode, before render_prompt()'s


def render_prompt(task):
    """The prompt of one task: a list of {"role", "content"} messages (rendered with the model's chat
    template), or a str used as raw text (base models)."""
    return [{"role": "user", "content": f"What is {task['a']} * {task['b']}? Reply with only the number."}]


def reward(task, completion):
    """Score one completion (the model's text, end-of-turn token removed) of `task`: a finite float,
    higher is better; only differences inside a group matter. Called once per single-turn sample."""
    numbers = re.findall(r"-?\d[\d,]*", completion)
    return 1.0 if numbers and numbers[-1].replace(",", "") == str(task["answer"]) else 0.0


# Multi-turn: env_step(task, conversation, model_turn, rng) -> (observation, reward, done[, info]).
# conversation: the messages so far without this turn; model_turn: this turn's text; rng: a
# random.Random seeded per group. observation: the next message ({"role": "tool"|"user", "content"}) or
# None when done; reward is added to the episode's total; info (optional): numbers summed into metrics
# as env/<key>. None here means single-turn: reward() scores the one reply. See calculator_env_step().
env_step = None

# The rehearsal on the local backend (--rehearse) plays these assistant turns (a list of texts, or a function of
# the task returning one) in half of each group: a tool call your env_step() parses, then the answer your reward()
# scores. They are rendered as the model's own tokens, so your parser, env_step(), the masking of observations and
# reward() run on real tokens and real datums, although the tiny model never writes a tool call. E.g.
#   def REHEARSAL_TURNS(task):
#       return ['<tool_call>\n{"name": "lookup", "arguments": {"item": "%s"}}\n</tool_call>' % task["item"],
#               str(task["answer"])]
REHEARSAL_TURNS = None

# ==== END OF EDIT ME ====


def main(argv=None):
    args = parse_args(argv)
    check_settings(args)
    saved = Run(args.log_path).config() if args.resume else {}  # read, no lock: what the run being resumed chose
    args.reward = (saved.get("reward") or "auto") if args.resume and args.reward == "auto" else args.reward
    args.rehearsal_tasks = saved.get("rehearsal_tasks")  # a real-model rehearsal's fixed tasks (scout_rehearsal_tasks)
    job = prepare(args)
    if args.dry_run:
        return dry_run(args, job)
    # `run` holds the folder's lock until the end: a second script on the same --log-path stops with exit 2
    # before it reads, deletes or writes anything. watch_service(): a service lost for TINKER_UNREACHABLE_S
    # ends the run with exit 4, not a hang.
    with Run(args.log_path, extra_files=("rollouts.jsonl", "failures.jsonl")) as run, watch_service():
        return train_run(args, job, run)


def train_run(args, job, run):
    resume_row = run.resume_point(resume=args.resume, overwrite=args.overwrite)
    check_context(args, job, args.context_window)
    service, context_window = connect(args.model_name)
    context_window = args.context_window or context_window
    check_context(args, job, context_window)
    start = resume_row["next_iteration"] if resume_row else 0
    tc = None
    if args.reward == "auto" or scouts_tasks(args, job):  # free local samples: which reward, which tasks
        tc = training_client(service, args.model_name, args.lora_rank, args.seed, init_from=args.init_from,
                             train_unembed=args.train_unembed)
        job = choose_reward(args, job, tc, context_window) if args.reward == "auto" else job
        if scouts_tasks(args, job):
            scout_rehearsal_tasks(args, job, tc, context_window)
    say_reward(args, job)
    config = run_config(args, job, context_window)
    if resume_row:
        run.check_resume(config, RESUME_KEYS)
    config["estimate_usd"] = estimate_total(estimate_cost(args, job, context_window, start))  # exit 3: folder unchanged
    if resume_row:  # rows past the checkpoint will be produced again
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            run.rewind(name, lambda row: row.get("iteration", -1) < start)
    else:
        run.begin(config)
    tc = tc or training_client(service, args.model_name, args.lora_rank, args.seed, resume_from=resume_row,
                               position=f"iteration {start}", init_from=args.init_from,
                               train_unembed=args.train_unembed)
    ro = Rollouts(job, args, context_window)
    cost = CostMeter(args.model_name, run, context=context_window)  # cost/* per row, priced as the estimate
    rewards_seen = [r["reward_mean"] for r in run.rows("metrics.jsonl")]
    next_usd = iteration_estimate_usd(args, job, context_window) if args.max_usd is not None else None

    def tasks_and_seeds(it):
        task_indices = args.rehearsal_tasks or batch_tasks(it, job.n_train, args.batch_size, args.seed)
        return task_indices, [group_seed(args.seed, it, slot) for slot in range(len(task_indices))]

    with ro.pools(), Sampling(ro, tc, start, args.iterations, tasks_and_seeds, args.max_staleness,
                              args.save_every) as sampling:
        for it in range(start, args.iterations):
            if next_usd is not None and cost.cumulative + next_usd > args.max_usd:  # --max-usd holds during the run
                raise over_budget(args, run, tc, job, it, cost.cumulative, next_usd)
            t0 = time.time()
            task_indices, seeds = tasks_and_seeds(it)
            groups = sampling.groups(it)  # with --max-staleness, sampled while earlier iterations trained
            evaluated = (sampling.run(ro.evaluate(sampling.sampler, args.eval_samples, args.seed, PASS_REWARD))
                         if args.eval_every and it % args.eval_every == 0 else {})
            t1 = time.time()
            batch = build_batch(groups, args.normalize_std, it, args.max_staleness)
            if it == 0 and it == start:  # the reward on the first samples, before any training
                say(reward_summary(groups, reward_label(args)))
                own = [e.info["own_reward"] for g in groups for e in g.episodes if "own_reward" in e.info]
                if args.reward != "own" and own:  # the environment's own reward, beside the stand-in
                    say(f"beside it, --env {args.env}'s own reward on the same episodes: mean {sum(own) / len(own):.3f}, "
                        f"max {max(own):.3g} (env/own_reward in metrics.jsonl; the tiny model cannot earn it)")
            floor = it == 0 and batch.tied == len(groups) and args.reward == "own"  # nothing to learn, ever
            fb_metrics = {}
            if batch.datums and not floor:
                result = train_step(tc, batch.datums, args.loss_fn, job.loss_config, args.learning_rate,
                                    on_error=lambda e: training_failure(e, args, run, it, start, {
                                        "iteration": it, "seconds_sampling": t1 - t0,
                                        "seconds_training": time.time() - t1, "datums": len(batch.datums),
                                        "tokens_trained": sum(d.model_input.length for d in batch.datums)}))
                fb_metrics = {"loss_sum": result.metrics.get("loss:sum"),
                              **kl_metrics(batch.datums, batch.masks, result.loss_fn_outputs)}
            t2 = time.time()
            row = iteration_row(it, groups, batch, args, job, {**fb_metrics, **evaluated}, task_indices, seeds,
                                seconds={"sampler_weights": sampling.take_snapshot_seconds(), "sampling": t1 - t0,
                                         "training": t2 - t1}, retries=ro.take_retries())
            row.update(cost.row(train=row["tokens_trained"], **rollout_tokens(groups)))
            run.append("metrics.jsonl", row)
            if floor or (args.trace_every and it % args.trace_every == 0):  # the floor's rollouts, always
                for trace_row in rollout_rows(it, groups, batch, job.tokenizer):
                    run.append("rollouts.jsonl", trace_row)
            if floor:  # the sampling was paid for: its row and rollouts are written above, then the run stops
                raise DataError(tied_message(groups, args, run.path))
            rewards_seen.append(row["reward_mean"])
            say(progress_line(it, args.iterations, row))
            done = it + 1
            if args.save_every and done % args.save_every == 0 and done < args.iterations:
                save_checkpoint(tc, run, f"{done:06d}", done, done * args.batch_size // job.n_train, job.fmt)
            sampling.trained(done)

    if start < args.iterations or resume_row.get("name") != "final":
        final = save_checkpoint(tc, run, "final", args.iterations,
                                args.iterations * args.batch_size // job.n_train, job.fmt, final=True)
    else:
        final = resume_row
    print_outcome(args, job, run, rewards_seen, final, cost.cumulative)
    report = {"status": "ok", "log_path": str(run.path), "iterations": args.iterations,
              "state_path": final["state_path"], "sampler_path": final["sampler_path"],
              "reward": {"first": rewards_seen[0] if rewards_seen else None,
                         "last": rewards_seen[-1] if rewards_seen else None},
              "loss_fn": args.loss_fn, "reward_source": args.reward, "init_from": args.init_from, "format": job.fmt,
              "sampling": {"model_path": final["sampler_path"], "stop": job.fmt["stop"],
                           "hint": script_command("tinker_infer.py", "--run", run.path, "--prompt", hint_prompt(job))}}
    return judge_rehearsal(report, rl_rehearsal_checks(args, job, run), run.path / "metrics.jsonl")


def hint_prompt(job):
    """The first task's question (its last user message, or its raw text): the --prompt of the printed sample
    command, which adds the recorded system prompt itself."""
    messages = job.env["render_prompt"](job.tasks[0])
    if isinstance(messages, str):
        return messages
    return next((m["content"] for m in reversed(messages) if m.get("role") == "user"
                 and isinstance(m.get("content"), str)), "Hello")


def choose_reward(args, job, tc, context_window):
    """A single-turn rehearsal without --init-from: sample the first iteration's groups (free, locally) and
    train the user's reward() when it tells some samples apart, else the stand-in task (said, with why).
    Returns the job to train."""
    tasks = batch_tasks(0, job.n_train, args.batch_size, args.seed)
    seeds = [group_seed(args.seed, 0, slot) for slot in range(len(tasks))]
    groups = sample_groups(args, job, tc, context_window, tasks, seeds, 0)
    say(reward_summary(groups, reward_label(args, "own")))
    if build_batch(groups).tied < len(groups):
        args.reward = "own"
        return job
    args.reward = "stand-in"
    say(f"the {'model standing in' if real_stand_in() else 'tiny random model'}'s samples all score alike under "
        f"{reward_label(args, 'own')}, so it cannot learn it: the rehearsal "
        "trains the stand-in task instead (the pipeline is the same). To rehearse your own reward, start from a "
        "checkpoint that writes your answers, e.g. an SFT rehearsal's: --init-from tinker://RUN/weights/final "
        "(its state_path)")
    job = prepare(args)
    check_context(args, job, context_window)
    return job


def say_reward(args, job):
    """Which reward this run trains, in one line."""
    kept = f"{len(args.rehearsal_tasks)} of " if args.rehearsal_tasks else "its "  # the rehearsal's fixed tasks
    source = ("the rehearsal's stand-in ('say something': the share of visible text)" if args.reward != "own"
              else "the calculator example's env_step() (--env calculator)" if args.env == "calculator"
              else f"your reward() from the EDIT ME block, on {kept}{job.n_train} TASKS" if job.env["env_step"] is None
              else f"your env_step() and reward() from the EDIT ME block, {tools_named(job.env['tools'])}"
              + (", on scripted (REHEARSAL_TURNS) and sampled episodes" if job.env.get("scripted_turns") else ""))
    start = f", from {args.init_from} (weights only, fresh optimizer)" if args.init_from else ""
    say(f"reward: {source}{start} (--env {args.env})")


def dry_run(args, job):
    """Everything that can be checked without Tinker: prompts, context, the reward's contract, the cost."""
    check_context(args, job, args.context_window)
    say("first prompt as the sampler sees it:\n" + job.tokenizer.decode(job.prompts[0]))
    if job.env["env_step"] is None and not inspect.iscoroutinefunction(job.env["reward"]):
        for i, task in enumerate(job.tasks):  # the reward must hold its contract before money is spent
            checked_reward(call_user_code(job.env["reward"], task_label(job.tasks, i), task, ""),
                           task_label(job.tasks, i))
    est = estimate_cost(args, job, args.context_window)
    lengths = [len(p) for p in job.prompts]
    emit({"status": "dry_run", "tasks": job.n_train, "eval_tasks": len(job.tasks) - job.n_train, "env": args.env,
          "prompt_tokens": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)},
          "max_tokens": args.max_tokens, "loss_fn": args.loss_fn, "loss_fn_config": job.loss_config,
          "estimate_usd": (est or {}).get("usd", {}).get("total") if est else None,
          "estimate_assumptions": estimate_assumptions(args, job), "format": job.fmt})
    return 0


# ---------------------------------------------------------------------------------------------
# Settings, tasks and format


def check_settings(args):
    """Every flag checked the same way for --dry-run and a real run, before any file or paid call."""
    check_numbers(args, {
        "learning_rate": dict(low=0, low_open=True), "max_usd": dict(low=0), "iterations": dict(low=1),
        "batch_size": dict(low=1), "lora_rank": dict(low=1), "max_tokens": dict(low=1),
        "temperature": dict(low=0, low_open=True), "max_turns": dict(low=1), "save_every": dict(low=0),
        "context_window": dict(low=1), "clip_low_threshold": dict(low=0), "clip_high_threshold": dict(low=0),
        "dro_beta": dict(low=0, low_open=True), "env_workers": dict(low=0), "max_in_flight": dict(low=1),
        "trace_every": dict(low=0), "eval_every": dict(low=0), "eval_samples": dict(low=1),
        "max_staleness": dict(low=0)})
    if args.group_size < 2:
        raise DataError(f"--group-size {args.group_size}: the advantage compares samples of one task, "
                        "so at least 2 are needed (4 is a good start)")
    if args.resume and args.overwrite:
        raise DataError("--resume and --overwrite contradict each other; pick one")
    in_flight = episodes_in_flight(args)
    if args.env_workers is None:
        args.env_workers = env_workers(args)
    elif 0 < args.env_workers < in_flight:
        say(f"note: --env-workers {args.env_workers} is below the {in_flight} episodes in flight "
            f"(--batch-size {args.batch_size} x --group-size {args.group_size}"
            + (f" x --max-staleness {args.max_staleness}" if args.max_staleness > 1 else "")
            + f"): a slow plain-function env_step()/reward() makes episodes wait for a thread; drop the flag for "
            f"{min(in_flight, MAX_ENV_WORKERS)} (the default)")
    if args.max_tokens is None:
        args.max_tokens = 4096 if any(m.lower() in args.model_name.lower() for m in REASONING_MODELS) else 256
    if args.log_path is None:
        args.log_path = f"runs/rl-{args.env}"
    check_writable_dir(args.log_path, "--log-path")
    if args.init_from:
        check_tinker_path(args.init_from, "weights")
    loss_fn_config(args)  # flag combinations, checked here so the dry run refuses them too


def loss_fn_config(args):
    """The loss_fn_config sent with forward_backward: defaults per loss, overridden by the flags."""
    config = DEFAULT_LOSS_CONFIG[args.loss_fn]
    config = dict(config) if config else None
    if args.loss_fn in ("ppo", "cispo"):
        for key in ("clip_low_threshold", "clip_high_threshold"):
            if getattr(args, key) is not None:
                config[key] = getattr(args, key)
    elif args.clip_low_threshold is not None or args.clip_high_threshold is not None:
        raise DataError(f"--clip-*-threshold applies to --loss-fn ppo or cispo, not {args.loss_fn}")
    if args.dro_beta is not None:
        if args.loss_fn != "dro":
            raise DataError(f"--dro-beta applies to --loss-fn dro, not {args.loss_fn}")
        config["beta"] = args.dro_beta
    return config


@dataclasses.dataclass
class Job:
    """What the settings and the EDIT ME block resolve to: the example, its tasks, the rendering."""

    env: dict  # tasks, render_prompt, reward, env_step (None: single-turn), tools
    tasks: list
    tokenizer: object
    fmt: dict
    prompts: list  # rendered first-prompt token ids, one per task (training tasks, then held-out ones)
    loss_config: dict | None
    tasks_sha256: str
    n_train: int = 0  # tasks[:n_train] are trained on, tasks[n_train:] only evaluated
    system: dict = dataclasses.field(default_factory=dict)  # config.json's system_prompt(s): what infer --run sends


def prepare(args) -> Job:
    """Tasks, tokenizer, format and rendered prompts; everything checked that can be without Tinker."""
    env = load_env(args.env, args.rehearse, args.reward, getattr(args, "rehearse_flag", "on"))
    if not env["tasks"]:
        raise DataError(f"the task list of --env {args.env} is empty; fill TASKS in the EDIT ME block")
    if args.eval_every and not env["eval_tasks"]:
        raise DataError(f"--eval-every {args.eval_every}: the example has no EVAL_TASKS; add held-out tasks "
                        "in the EDIT ME block or drop --eval-every")
    tasks = list(env["tasks"]) + list(env["eval_tasks"] or [])
    tokenizer_name = tokenizer_record(args.tokenizer or args.model_name)
    tokenizer = load_tokenizer(tokenizer_name)
    messages = []
    for i, task in enumerate(tasks):
        messages.append(call_user_code(env["render_prompt"], task_label(tasks, i), task))
    is_chat = [isinstance(m, list) and bool(m) and all(isinstance(x, dict) and "role" in x for x in m)
               for m in messages]
    if all(isinstance(m, str) for m in messages) and not tokenizer.chat_template:
        fmt = raw_format(tokenizer, name=tokenizer_name)
    elif all(is_chat):
        if not tokenizer.chat_template:
            raise DataError(f"tokenizer {tokenizer_name!r} has no chat template; render_prompt() must return "
                            "a str for this model")
        fmt = chat_format(tokenizer, name=tokenizer_name)
    else:
        bad = next(i for i, ok in enumerate(is_chat) if not ok)
        raise DataError(f"render_prompt() returned {type(messages[bad]).__name__} for {task_label(tasks, bad)}; "
                        "expected a list of {'role', 'content'} messages for every task (or a str for every "
                        "task with a base model)")
    if env["env_step"] is not None and fmt["kind"] != "chat":
        raise DataError("a multi-turn environment needs a chat template to render observations")
    prompts = [generation_prompt(m, tokenizer, fmt, tools=env["tools"]) for m in messages]
    digest = hashlib.sha256(json.dumps(tasks, sort_keys=True, default=str).encode()).hexdigest()
    lengths = [len(p) for p in prompts]
    say(f"{len(env['tasks'])} tasks + {len(tasks) - len(env['tasks'])} held out (--env {args.env}), prompts {min(lengths)}-{max(lengths)} tokens, max "
        f"{args.max_tokens} tokens per turn, up to {args.max_turns if env['env_step'] else 1} turn(s)")
    return Job(env, tasks, tokenizer, fmt, prompts, loss_fn_config(args), digest, len(env["tasks"]),
               system_prompt_record(messages))


def run_config(args, job, context_window):
    config = {k: v for k, v in vars(args).items() if k not in ("resume", "overwrite", "dry_run")}
    config.update(loss_fn_config=job.loss_config, context_window=context_window, n_tasks=job.n_train,
                  tasks_sha256=job.tasks_sha256, format=job.fmt, **job.system)
    return config


def check_context(args, job, context_window):
    if context_window is None:
        return
    for i, tokens in enumerate(job.prompts):
        if len(tokens) >= context_window:
            raise DataError(f"the prompt of {task_label(job.tasks, i)} is {len(tokens)} tokens, not below the "
                            f"context window of {context_window}; shorten it in render_prompt()")
    longest = max(len(t) for t in job.prompts)
    if longest + args.max_tokens > context_window:
        say(f"note: longest prompt {longest} + --max-tokens {args.max_tokens} exceeds the context window "
            f"{context_window}; turns are capped to the room left")


def training_failure(e, args, run, it, start, failed=None):
    """The ScriptError a failed forward_backward/optim_step ends the run with. The failed iteration's timings
    and size (`failed`) go to LOG/failures.jsonl first: its sampling was paid for and took time, and its
    metrics row is never written (resume repeats the iteration)."""
    rows = run.checkpoints()
    where = f"the last checkpoint is {rows[-1]['state_path']}" if rows else "no checkpoint was saved yet"
    status = getattr(e, "status_code", None)
    text = one_line(getattr(e, "message", None) or e, 200)
    described = f"{type(e).__name__}{f' {status}' if status else ''}: {text}"
    noted = ""
    if failed is not None:
        run.append("failures.jsonl", {**failed, "error": described})
        noted = f"; the iteration's timings are in {run.file('failures.jsonl')}"
    # A rejected loss (dro, gspo) leaves an SDK 0.38 client usable, but the same loss would be rejected
    # again, so the run stops; a failure mid-run is safer resumed from the last checkpoint.
    if is_rejection(e) and it == start and args.loss_fn != "importance_sampling":
        others = "|".join(x for x in LOSS_FNS if x != args.loss_fn)
        return DataError(f"the server rejected --loss-fn {args.loss_fn} ({described}); the run stops here "
                         f"({where}{noted}). Rerun with --loss-fn {others}")
    return ScriptError(f"forward_backward/optim_step failed at iteration {it} ({described}); the run stops "
                       f"here{noted}: {run.resume_hint()}")


# ---------------------------------------------------------------------------------------------
# Example environment (--env calculator): the model may call a calculator tool, reads the result,
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
    numbers = re.findall(r"-?\d[\d,]*", completion)
    return 1.0 if numbers and numbers[-1].replace(",", "") == str(task["answer"]) else 0.0


def calculator_env_step(task, conversation, model_turn, rng):
    """One environment step after the model's turn (contract in the EDIT ME block).
    A tool call that does not parse: the tool answers with an error message saying what is expected,
    the step's reward is 0 and the episode goes on (counted as env/tool_parse_errors)."""
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


def with_system_prompt(render, system_prompt):
    """render_prompt() with SYSTEM_PROMPT as the first message (unless it already starts with a system one)."""
    if not system_prompt:
        return render

    @functools.wraps(render)
    def rendered(task):
        messages = render(task)
        if isinstance(messages, list) and not (messages and isinstance(messages[0], dict)
                                               and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return messages

    return rendered


def load_env(name, rehearse=False, reward_source="stand-in", flag="on"):
    """The pieces of one example: tasks, render_prompt, reward, env_step (None = single-turn), tools, and in a
    scripted rehearsal scripted_turns (REHEARSAL_TURNS). `flag`: --rehearse as given, for the banner."""
    if name == "calculator":
        if SIMULATED_USER_TEMPERATURE > 0:
            say(f"warning: SIMULATED_USER_TEMPERATURE is {SIMULATED_USER_TEMPERATURE}: a simulated user that "
                "samples differently inside a group adds noise the advantage credits to the policy; use 0, or "
                "seed it from the rng env_step receives")
        env = dict(tasks=CALCULATOR_TASKS[:56], eval_tasks=CALCULATOR_TASKS[56:], render_prompt=calculator_render_prompt,
                   reward=calculator_reward, env_step=calculator_env_step, tools=CALCULATOR_TOOLS)
    else:
        env = dict(tasks=TASKS, eval_tasks=EVAL_TASKS,
                   render_prompt=with_system_prompt(render_prompt, edit_me("SYSTEM_PROMPT")),
                   reward=reward, env_step=env_step, tools=edit_me("TOOLS") or None)
    if not rehearse:
        return env
    scripted = edit_me("REHEARSAL_TURNS") if name != "calculator" else None
    return rehearsal_env(env, name, reward_source, flag, scripted, example=name == "calculator")


# ==== SHARED CODE (generated from common/: rehearsal, errors, flags, render, run_files, run_record, service, checkpoints, training, onpolicy, rollouts) ====
# Edit the files in common/ of the tinker-training-inference bundle, then run `python tools/splice.py`;
# tests/test_shared_code.py fails when this copy differs from its source. Only the definitions the code
# above uses (directly or through each other) are copied.


# ---- common/rehearsal.py ----
# The free rehearsal (--rehearse) on the local backend: which model stands in, each script's preset for it, and the
# shape of the rehearsal's checks.
#
# `tinker_local.py run` exports TINKER_LOCAL_STAND_IN, the model standing in for the named one:
# - the tiny random Qwen3 (default): the named model's exact tokenizer and chat template, so masks, token counts and
#   datums are Qwen3's; it memorises a few short answers and nothing more;
# - SmolLM2-135M-Instruct (`tinker_local.py run --real`): a real, weak instruct model with its own tokenizer and ChatML
#   template; it follows a prompt, learns a user's answers, earns a user's reward and calls a tool after a warm-up.
# Each preset below was measured on its model (references/setup.md, "Which model to rehearse on").
import os
from urllib.parse import urlsplit

STAND_IN_ENV = "TINKER_LOCAL_STAND_IN"
TINY_STAND_IN = "tiny-qwen3"


def stand_in() -> str | None:
    """The model standing in on the local backend (from the launcher), or None (Tinker, or an unknown server)."""
    return os.environ.get(STAND_IN_ENV) or None


def real_stand_in() -> bool:
    """True when a real model (`tinker_local.py run --real`) stands in: the rehearsal judges the user's task."""
    return stand_in() not in (None, TINY_STAND_IN)


def on_local_backend() -> bool:
    """TINKER_BASE_URL points at this machine: the local backend (scripts/tinker_local.py), not Tinker."""
    return urlsplit(os.environ.get("TINKER_BASE_URL") or "").hostname in ("127.0.0.1", "localhost", "::1")


def backend_record() -> dict:
    """What config.json says about where a run trained: {"kind": "local"|"tinker", "stand_in", "stand_in_kind"}.
    A loopback TINKER_BASE_URL without the launcher's variable is local with an unknown stand-in."""
    name = stand_in()
    local = name is not None or on_local_backend()
    return {"kind": "local" if local else "tinker", "stand_in": name,
            "stand_in_kind": None if name is None else "real" if real_stand_in() else "tiny"}


def model_label(model_name: str) -> str:
    """The model a run trained, as a summary names it: with the local model that stood in for it, if one did."""
    return f"{model_name} (the local backend's {stand_in()} standing in)" if stand_in() else model_name


def stand_in_cost_note() -> str:
    """What a rehearsal's dollar figure means: on the real model the tokens were counted by its tokenizer."""
    return ("; counted in SmolLM2's tokens, which differ from the named model's: a --dry-run without --real counts "
            "those" if real_stand_in() else "")


def preset(presets: dict) -> dict:
    """The rehearsal preset for the model standing in now: presets["real"] on the real model, else presets["tiny"]
    (also on the real model while a script has no preset measured on it)."""
    return dict(presets["real" if real_stand_in() and "real" in presets else "tiny"])


def rehearsal_check(text: str, passed) -> dict:
    return {"check": text, "passed": bool(passed)}


def rehearsal_result(checks: list[dict], reported=(), **extra) -> dict:
    """A rehearsal's verdict: passed when every check passed; `reported` lines are figures shown, not judged."""
    return {"passed": all(c["passed"] for c in checks), "checks": checks, "reported": list(reported),
            "stand_in": stand_in(), **extra}


# ---- tinker_rl.py --rehearse
# tiny: the local backend's tiny random model learns at a far larger rate than an 8B model and is slow per token:
# the rehearsal trains the rehearsal task with these unless a flag says otherwise. Temperature 1.2: at 1.0 about
# 1 sample in 8 leaves the blank lines, at 1.5 nearly all do (measured).
RL_REHEARSAL = {
    "tiny": dict(learning_rate=1e-2, iterations=5, batch_size=2, group_size=4, max_tokens=8, temperature=1.2,
                 max_turns=2, on_truncation="continue", lora_rank=8, save_every=0),
}
# Rehearsing your own reward from a checkpoint (--init-from, e.g. an SFT rehearsal's), over RL_REHEARSAL: room for
# the answers it was trained on, sampled as a trained policy is.
# real (measured 2026-12-07 from SFT rehearsals on a 24-row help-desk set, references/training-rl.md has the curves):
# 8 iterations of 4 fixed tasks (scout_rehearsal_tasks) x 8 samples at 3e-4 rose 0.36 -> 0.97; at 1e-3 the replies
# drift into repeated words within 8-12 iterations. real_tools: room for a tool call (SmolLM2 writes the
# calculator's in ~35 tokens), at 2e-4, which stays fluent.
RL_REHEARSAL_FROM_CHECKPOINT = {
    "tiny": dict(max_tokens=32, temperature=1.0),
    "real": dict(max_tokens=48, temperature=1.0, learning_rate=3e-4, iterations=8, batch_size=4, group_size=8),
    "real_tools": dict(max_tokens=48, temperature=1.0, learning_rate=2e-4, iterations=4, batch_size=4, group_size=4),
}


def rl_rehearsal_settings(init_from, multi_turn: bool) -> dict:
    """What --rehearse sets for every flag not on the command line: RL_REHEARSAL's preset and, with --init-from,
    RL_REHEARSAL_FROM_CHECKPOINT's over it ("real" for a single-turn reward on the real model, "real_tools" for a
    multi-turn environment: an iteration of tool episodes costs about 60 s there at 4 x 4)."""
    settings = preset(RL_REHEARSAL)
    if init_from:
        settings.update(RL_REHEARSAL_FROM_CHECKPOINT["real_tools"] if multi_turn and real_stand_in()
                        else preset(RL_REHEARSAL_FROM_CHECKPOINT))
    return settings


def quarter_means(values) -> tuple[int, float, float]:
    """(q, the mean of the first q values, the mean of the last q) with q a quarter of them, at least 1; 0.0 for
    both means when there are none. One iteration's figure is noisy: curves are judged quarter against quarter."""
    q = max(1, len(values) // 4)
    return (q, sum(values[:q]) / q, sum(values[-q:]) / q) if values else (q, 0.0, 0.0)


def rl_rehearsal_checks(args, job, run) -> dict | None:
    """The real model's verdict on an RL rehearsal from a checkpoint with your own reward (None elsewhere: on the
    tiny model the rehearsal proves the pipeline and the exit code says it ran): every iteration trained and,
    single-turn, the mean reward of the last quarter of the iterations is above the first quarter's; multi-turn,
    env_step() answered at least one of the model's turns (it parsed a tool call or went on)."""
    if not (args.rehearse and args.init_from and real_stand_in() and args.reward == "own"):
        return None
    rows = [r for r in run.rows("metrics.jsonl") if isinstance(r.get("reward_mean"), (int, float))]
    checks = [rehearsal_check(f"every iteration trained: {len(rows)} of {args.iterations} metrics rows",
                              len(rows) == args.iterations)]
    if job.env["env_step"] is None:
        q, head, tail = quarter_means([r["reward_mean"] for r in rows])
        checks.append(rehearsal_check(f"the mean reward rises ({head:.3f}, the mean of the first {q} iteration(s) "
                                      f"-> {tail:.3f}, the last {q})", len(rows) > 1 and tail > head))
    else:
        answered = sum(round(r["turns_mean"] * r["episodes"]) - r["episodes"] for r in rows)
        checks.append(rehearsal_check(f"env_step() answered the model's turns: {answered} turn(s) after a first "
                                      "one", answered > 0))
    return rehearsal_result(checks, tasks=getattr(args, "rehearsal_tasks", None))
# The stand-in task (--rehearse, automatic on the local backend). The tiny random model repeats blank lines at
# greedy and drifts into junk text now and then at temperature 1.2; it can never multiply or call a tool, so the
# examples would tie every group. "Say something" is a reward it earns partly and unevenly, which is what RL
# needs: the reward rises towards 1.0 within a few iterations when the pipeline is right.

REHEARSAL_TASKS = [{"topic": t} for t in ("the sky", "cats", "rain", "Paris", "bread", "the sea", "music", "snow",
                                          "trees", "coffee")]  # the last two are held out


def rehearsal_prompt(task):
    return [{"role": "user", "content": f"Say one word about {task['topic']}."}]


def rehearsal_reward(task, completion):
    """The share of the reply that is visible text (the untrained tiny model mostly writes blank lines)."""
    return sum(not c.isspace() for c in completion) / max(1, len(completion))


def rehearsal_env_step(shipped_env_step, task, conversation, model_turn, rng):
    """The shipped environment with two rehearsal changes: a first turn without a tool call gets a
    reminder (so episodes have two turns and exercise the multi-turn datum), and the final answer is
    scored by rehearsal_reward (the environment's own reward is kept as info own_reward)."""
    if len(conversation) == 1 and "<tool_call>" not in model_turn:
        return {"role": "user", "content": "Use the calculator tool first."}, 0.0, False, {"reminders": 1}
    observation, step_reward, done, *info = shipped_env_step(task, conversation, model_turn, rng)
    info = dict(info[0] or {}) if info else {}
    if done:  # the environment's own reward stays visible beside the stand-in: env/own_reward in metrics.jsonl
        info["own_reward"] = float(step_reward)
        step_reward = rehearsal_reward(task, model_turn)
    return observation, step_reward, done, info


# ---- common/errors.py ----
# Errors and exit codes: every script fails with one line on stderr and a documented exit code.
import atexit
import json
import os
import signal
import sys
from pathlib import Path


# 0 ok · 1 Tinker or runtime failure · 2 bad input or usage · 3 estimate above --max-usd ·
# 4 no credentials / Tinker unreachable · 130 interrupted (SIGINT) · 143 terminated (SIGTERM)
EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_OVER_BUDGET, EXIT_NO_ACCESS = 0, 1, 2, 3, 4


class ScriptError(Exception):
    """A failure explained in one line: what failed, what was expected, the next command."""

    exit_code = EXIT_FAILURE


class DataError(ScriptError):
    """Bad input or usage: data, flags, paths, unknown model, context overflow."""

    exit_code = EXIT_BAD_INPUT


class RenderError(DataError):
    """The chat template cannot produce a faithful datum for this example."""


class BudgetError(ScriptError):
    exit_code = EXIT_OVER_BUDGET


class AccessError(ScriptError):
    """No credentials, credentials refused, or the service cannot be reached."""

    exit_code = EXIT_NO_ACCESS


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the script is so `finally` blocks and the run record close cleanly."""


def _raise_terminated(signum, frame):
    raise Terminated()


def say(*parts) -> None:
    """Progress and warnings: stderr, so stdout carries only the final JSON object."""
    print(*parts, file=sys.stderr, flush=True)


def emit(obj: dict) -> None:
    """The one JSON object a script prints on stdout."""
    print(json.dumps(obj), flush=True)


def judge_rehearsal(report: dict, verdict: dict | None, figures) -> int:
    """Print the run's JSON with the rehearsal's verdict (None: nothing judged, status as it is); a failed check
    sets status "failed" first, then ends the run with exit 1 naming the checks that failed and `figures` (the
    file that holds the figures they judged)."""
    if verdict is not None:
        report["rehearsal"] = verdict
        if not verdict["passed"]:
            report["status"] = "failed"  # the JSON says what the exit code (1) says
    emit(report)
    if verdict is not None and not verdict["passed"]:
        failed = [c["check"] for c in verdict["checks"] if not c["passed"]]
        raise ScriptError(f"rehearsal check failed: {'; '.join(failed)} (figures above and in {figures})")
    return 0


def one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:limit]


RESUME_HINT = "the run record is saved; continue with the same command plus --resume"

# ---- next commands: printed as the user can run them, from where they stand

LOCAL_HINT = "for a free rehearsal start the local backend:"


def short_path(path) -> str:
    """A path to type from the working directory: relative when it climbs at most one folder, else absolute."""
    path = Path(path).resolve()
    rel = os.path.relpath(path)
    return rel if not rel.startswith(os.path.join("..", "..")) else str(path)


def sibling_script(name: str) -> str | None:
    """The path to type, from where the user stands, for `name` (another script of this bundle) beside this
    script; None when it is not beside it. Built on the script's path as the user typed it (sys.argv[0]), so a
    script copied into a project names its neighbours there, not the bundle's scripts/ folder."""
    here = Path(__file__).resolve()
    if not (here.parent / name).exists():
        return None
    folder = script_folder()
    return os.path.join(folder, name) if folder not in ("", ".") else name


def local_launcher() -> str | None:
    """The path to type for tinker_local.py: the one that started the local backend this script talks to
    (TINKER_LOCAL_LAUNCHER, set by `tinker_local.py run|serve`), else one beside this script, else None."""
    launcher = os.environ.get("TINKER_LOCAL_LAUNCHER")
    if launcher and Path(launcher).exists():
        return short_path(launcher)
    return sibling_script("tinker_local.py")


def python_command(script, *args) -> str:
    """The shell command that runs `script` (a path) with `args` under the interpreter running this script
    (sys.executable), shell-quoted: it works as printed with no venv activated, where a bare `python` may be
    another interpreter without the SDK (No module named 'tinker')."""
    import shlex

    return shlex.join([sys.executable or "python3", str(script), *map(str, args)])


def script_command(name: str, *args, server: bool = True) -> str:
    """The command that runs `name` (a bundle script) with ARGS: this interpreter, and the script beside this one,
    else beside the local backend's launcher (the bundle's scripts/), else where it belongs beside this one (copy
    it there from the bundle's scripts/ folder). On the local backend it is wrapped in `tinker_local.py run --`,
    which reaches the same checkpoint store, unless server=False (a command that never calls Tinker, e.g.
    `tinker_pricing.py list`)."""
    path = sibling_script(name)
    launcher = local_launcher()
    if path is None and launcher and (Path(launcher).parent / name).exists():
        path = os.path.join(os.path.dirname(launcher), name)
    command = python_command(path or os.path.join(script_folder(), name), *args)
    return under_launcher(command) if server else command


def under_launcher(command: str) -> str:
    """`command` wrapped in `tinker_local.py run [--real] --` when this script runs under the launcher: the
    same model stands in again and the same checkpoint store answers."""
    launcher = local_launcher()
    if launcher and os.environ.get("TINKER_LOCAL_LAUNCHER"):
        return f"{python_command(launcher, 'run', *(['--real'] if real_stand_in() else []), '--')} {command}"
    return command


def script_folder() -> str:
    """This script's folder as the user typed it (sys.argv[0]), else as a path to type from here."""
    here = Path(__file__).resolve()
    typed = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return os.path.dirname(typed) if typed and Path(typed).resolve() == here else short_path(here.parent)


def this_command(argv=None) -> str:
    """The command line that started this script (or `argv`, an edited copy of it), as the user typed it, under
    this interpreter."""
    argv = sys.argv if argv is None else argv
    return python_command(*argv) if argv and argv[0].endswith(".py") else "<this command>"


def local_hint() -> str:
    """How to rehearse this very command for free: wrapped in the local backend's launcher. A script copied
    without tinker_local.py says so, and names the command that works once the launcher is copied beside it."""
    launcher = local_launcher()
    if launcher is None:
        folder = script_folder()
        return (f"{LOCAL_HINT} tinker_local.py is not beside this script; copy tinker_local.py and "
                f"tinker_local_server.py from the tinker-training-inference bundle's scripts/ folder into "
                f"{os.path.abspath(folder or '.')}, then run "
                f"{python_command(os.path.join(folder, 'tinker_local.py'), 'run', '--')} {this_command()}")
    return f"{LOCAL_HINT} {python_command(launcher, 'run', '--')} {this_command()}"


def run_cli(main, argv=None, *, error_json: bool = False, interrupted_hint: str = RESUME_HINT) -> int:
    """Run main(argv) and turn every way it can end into an exit code and at most one stderr line.
    error_json: also print {"status": "error"|"interrupted", "exit_code", "error"} on stdout, for a script
    whose stdout always ends in one JSON object (tinker_infer.py); interrupted_hint: what to do after ^C."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return main(argv)
    except ScriptError as e:
        code, status, line = e.exit_code, "error", f"error: {one_line(e, 2000)}"
    except Terminated:
        code, status, line = 143, "interrupted", f"terminated: {interrupted_hint}"
    except KeyboardInterrupt:
        code, status, line = 130, "interrupted", f"interrupted: {interrupted_hint}"
    except Exception as e:  # Tinker or runtime failure: one line; the SDK's log has the details
        code, status, line = EXIT_FAILURE, "error", f"error: {type(e).__name__}: {one_line(e)}"
    say(line)
    if error_json:
        emit({"status": status, "exit_code": code, "error": line.split(": ", 1)[1] if status == "error" else line})
    return code


def teardown_can_abort() -> bool:
    """Whether interpreter teardown can abort this process: the SDK's HTTP transport (pyqwest) is loaded and
    CPython is older than 3.14 (see exit_process)."""
    return "pyqwest" in sys.modules and sys.version_info < (3, 14)


def exit_process(code: int | None):
    """End the script with `code`: sys.exit, except when the SDK's HTTP transport is loaded on CPython < 3.14,
    where the atexit handlers run, stdout and stderr are flushed and the process ends without interpreter
    teardown (os._exit). Why: tinker 0.38 sends its requests through pyqwest, whose Rust threads hand each
    response chunk to Python; one that lands while CPython < 3.14 tears the interpreter down makes glibc abort
    the process (exit 134, -6 from subprocess, nothing on stderr) after all the work is done and reported
    [pyqwest issue 164, PyO3 issue 6084]. A Ctrl-C during a request or a heartbeat in flight at the end
    hits it; seen in 2 of 1,127 test runs."""
    if not teardown_can_abort():
        sys.exit(code)
    if code is not None and not isinstance(code, int):  # as sys.exit("message") does: the message, then 1
        print(code, file=sys.stderr)
    try:
        atexit._run_exitfuncs()  # logging.shutdown and every other atexit handler, as a normal exit would
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0 if code is None else code if isinstance(code, int) else EXIT_FAILURE)


# ---- common/flags.py ----
# Flag checks shared by the dry run and the real run: run before any file changes or any paid call.
import math
import os
import shutil
from pathlib import Path


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_number(dest: str, value, *, low=None, high=None, low_open=False, high_open=False) -> None:
    """DataError unless value is a finite number within [low, high] (open ends where asked); None passes."""
    if value is None:
        return
    name = flag_name(dest)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{name} {value!r}: expected a finite number")
    bounds = (f"{'(' if low_open else '['}{'-inf' if low is None else low}, "
              f"{'inf' if high is None else high}{')' if high_open else ']'}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise DataError(f"{name} {value}: expected a value in {bounds}")


def check_numbers(args, rules: dict) -> None:
    """rules: {dest: dict(low=..., high=..., low_open=..., high_open=...)} checked against args.dest."""
    for dest, bounds in rules.items():
        check_number(dest, getattr(args, dest, None), **bounds)


def check_writable_dir(path, what: str) -> Path:
    """A folder that exists and is writable, or can be created under a writable parent."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise DataError(f"{what} {path} is a file; expected a folder (choose another {what})")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise DataError(f"{what} {path}: {probe} is a file, so the folder cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise DataError(f"{what} {path}: {probe} is not writable (permissions)")
    return p


def check_free_space(path, need_bytes: int, what: str, fix: str) -> None:
    """DataError when the disk that holds `path` (or its nearest existing parent) has less than need_bytes
    free: checked before any paid call, so a full disk never stops a run midway."""
    probe = Path(path).expanduser()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # cannot tell: the write itself will say
    if free < need_bytes:
        raise DataError(f"{what} needs about {need_bytes / 2**20:,.0f} MiB on the disk of {path} and "
                        f"{free / 2**20:,.0f} MiB are free; {fix}")


# ---- common/render.py ----
# Tokenizer loading, the run record's "format", and rendering through the model's own chat template.
#
# The masking rule: a datum's weights are 1 exactly on what the model must produce after the generation
# prompt (the assistant's tokens, end-of-turn token included) and 0 on everything else. Rendering is
# deterministic: the date a template prints is frozen, so a resumed run renders the same datums.
import contextlib
import dataclasses
import hashlib
import importlib
import json
import os


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


# ---- common/run_files.py ----
# A run folder's files at the lowest level, carried by every script that reads or writes one (the report
# tool too): JSONL lines as editors save them, and the one-writer lock.
#
# The lock: an exclusive advisory POSIX record lock (lockf) on LOG/.lock, held for the writer's whole life.
# The kernel drops it when its process ends, however it ends (SIGKILL too), and forked workers (the render
# pool) do not inherit it. The file says who holds it (pid, host, script, start time) for the error a second
# writer prints and for readers (tinker_report.py), which never take the lock: they test it for an instant.
# A record left by a process that died holding the lock is taken over by the next writer, which says so.
# Within one process a POSIX lock never conflicts with itself and closing any descriptor of the file drops
# it: only the lock's own code opens LOG/.lock.
import errno
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the scripts run, unguarded
    fcntl = None

LOCK_FILE = ".lock"
# A reader tests the lock for microseconds and a writer records itself right after taking it: a refused
# writer that finds no live holder named in the file tries again for this long before giving up.
SETTLE_S = 2.0


def jsonl_lines(text: str):
    """(line number, line) of each non-blank line of JSONL text: a UTF-8 byte-order mark (Windows editors,
    also where files were concatenated) and CRLF endings are accepted, as pandas and datasets accept them;
    only a newline ends a line (U+2028 and other characters str.splitlines() splits on are valid inside a
    JSON string)."""
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.strip().lstrip("\ufeff")
        if line:
            yield n, line


class FolderBusy(Exception):
    """A live process holds the folder's lock; `holder` is its record ({} when unreadable)."""

    def __init__(self, holder: dict):
        super().__init__(describe_holder(holder))
        self.holder = holder


def describe_holder(holder: dict) -> str:
    if not holder.get("pid"):
        return "another process (it has not recorded itself yet)"
    return (f"{holder.get('script') or 'a script'} (pid {holder['pid']} on host {holder.get('host')}, "
            f"since {holder.get('started')})")


def read_holder(fd) -> dict:
    try:
        data = os.pread(fd, 65536, 0)
        record = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def holder_alive(holder: dict) -> bool | None:
    """Whether the recorded process still runs: True/False on this host, None for another host."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same_file(fd, path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def acquire_lock(folder) -> tuple[int | None, dict]:
    """(descriptor holding FOLDER/.lock, the record of a dead holder taken over or {}). Creates the folder.
    FolderBusy when a live process holds it. Release with release_lock(fd, folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        return None, {}
    path = folder / LOCK_FILE
    deadline = time.monotonic() + SETTLE_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            holder = read_holder(fd)
            os.close(fd)
            if holder_alive(holder) or time.monotonic() > deadline:
                raise FolderBusy(holder) from None
            time.sleep(0.05)
            continue
        if not _same_file(fd, path):  # released and removed between our open and lock: lock the new file
            os.close(fd)
            continue
        previous = read_holder(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "script": Path(sys.argv[0]).name if sys.argv and sys.argv[0] else None,
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        return fd, previous


def release_lock(fd, folder) -> None:
    """Remove FOLDER/.lock (if it is still ours) and drop the lock."""
    if fd is None:
        return
    path = Path(folder) / LOCK_FILE
    try:
        if _same_file(fd, path):
            path.unlink()
    except OSError:
        pass
    os.close(fd)


# ---- common/run_record.py ----
# The run record: every read and write of a run's log folder (DEVELOPING.md, "Run record").
#
# Nothing is lost on a crash: rows are appended and fsynced one at a time, config.json is replaced
# atomically, a torn last line (a kill mid-write) is ignored when read, and nothing in the folder
# changes until every check that can refuse the run (flags, data, budget) has passed.
import json
import math
import os
import sys
from datetime import datetime, timezone
from pathlib import Path


RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints.jsonl", "eval.jsonl")
# Free space a run folder needs before the first paid call: a row is small, but a full disk would stop the
# run midway, after it was paid for. A floor, not an estimate (RL's rollout trace grows with --trace-every).
RECORD_MIN_FREE = 64 * 2**20

# Our metric names -> the tinker-cookbook's, written side by side in metrics.jsonl so tools built for the
# cookbook's records (tinkerscope, dashboards) read our runs too (references/run-records.md). Only names
# that mean the same in every script: SFT's loss is the cookbook's train_mean_nll, DPO's is not, so
# tinker_sft.py writes that one itself.
COOKBOOK_METRIC_NAMES = {
    "tokens": "num_tokens", "trained_tokens": "num_loss_tokens", "eval_nll": "test/nll",
    "reward_mean": "env/all/reward/total", "kl_sample_train_v1": "optim/kl_sample_train_v1",
    "kl_sample_train_v2": "optim/kl_sample_train_v2",
}
# The cookbook renderer whose rendering a chat "format" matches (tests/test_chat_templates_oracle.py), by
# model-id prefix: (thinking off, thinking on). First match wins; a raw format is the cookbook's role_colon.
COOKBOOK_RENDERERS = (
    ("Qwen/Qwen3.5", ("qwen3_5_disable_thinking", "qwen3_5")),
    ("Qwen/Qwen3.6", ("qwen3_5_disable_thinking", "qwen3_5")),
    ("Qwen/Qwen3-", ("qwen3_disable_thinking", "qwen3")),
    ("meta-llama/Llama-3", ("llama3", "llama3")),
    ("deepseek-ai/DeepSeek-V3", ("deepseekv3", "deepseekv3_thinking")),
    ("openai/gpt-oss", ("gpt_oss_no_sysprompt", "gpt_oss_no_sysprompt")),
    ("moonshotai/Kimi-K2", ("kimi_k2", "kimi_k2")),
    ("nvidia/NVIDIA-Nemotron-3", ("nemotron3_disable_thinking", "nemotron3")),
)


class NonFiniteError(ScriptError):
    """A loss, KL or reward that is NaN or inf: what follows it would train on garbage (exit 1)."""


def non_finite(row: dict) -> dict:
    """The numeric values of a metrics row (one level of nesting, as "outer/inner") that are NaN or inf."""
    bad = {}
    for key, value in row.items():
        if isinstance(value, dict):
            bad.update({f"{key}/{k}": v for k, v in non_finite(value).items()})
        elif isinstance(value, float) and not math.isfinite(value):
            bad[key] = value
    return bad


def edited_command(sets: dict, drop=()) -> str:
    """This script's command line with each flag in `sets` given that value in place (None: a bare flag), added
    at the end when absent, and the flags in `drop` (bare flags) removed: a command to paste after a failure."""
    argv, out, i, todo = list(sys.argv), [], 1, dict(sets)
    while i < len(argv):
        flag, eq, _ = argv[i].partition("=")
        if flag in drop or flag in sets:
            takes_value = not eq and flag not in drop and sets.get(flag) is not None
            i += 2 if takes_value and i + 1 < len(argv) else 1
            if flag in todo:
                value = todo.pop(flag)
                out += [flag] if value is None else [flag, str(value)]
            continue
        out.append(argv[i])
        i += 1
    for flag, value in todo.items():
        out += [flag] if value is None else [flag, str(value)]
    return under_launcher(this_command([argv[0], *out]))


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# Settings a flag turns off: config.json keeps the setting (train_unembed: false), the user types the flag.
OFF_FLAGS = {"train_unembed": "--no-train-unembed"}


def resume_diff(key: str, saved, now) -> str:
    """One setting that differs on --resume, named as the user types it."""
    if key in OFF_FLAGS:
        given = {False: "given"}  # the setting is off only when the flag was given
        return f"{OFF_FLAGS[key]} {given.get(saved, 'not given')} -> {given.get(now, 'not given')}"
    return f"--{key.replace('_', '-')} {saved!r} -> {now!r}"


class Run:
    """A log folder. Checks (`resume_point`, `check_resume`) write nothing; `begin`, `append`,
    `rewind` and `checkpoint` are the only writers."""

    def __init__(self, path, extra_files=()):
        self.path = Path(path)
        self.files = RUN_FILES + tuple(extra_files)
        self._lock_fd, self._made_folders = None, []
        self.began = False  # this process started or resumed the record (begin(), or resume_point() with a row)

    def lock(self) -> Run:
        """Hold LOG/.lock until unlock() (a `with` block): one writer per run folder. Taken before anything in
        the folder is read for a decision, deleted or written; a second script on the folder (plain, --resume
        or --overwrite) stops here with exit 2 naming the holder. A lock left by a killed run is taken over."""
        check_free_space(self.path, RECORD_MIN_FREE, "the run record (--log-path)",
                         "free some space or pass a --log-path on a disk with room")
        self._made_folders = [self.path, *self.path.parents]  # those missing now, leaf first
        self._made_folders = self._made_folders[:next(i for i, d in enumerate(self._made_folders) if d.exists())]
        try:
            self._lock_fd, previous = acquire_lock(self.path)
        except FolderBusy as busy:
            alive = holder_alive(busy.holder)
            elsewhere = " (that pid is not running here: the lock is held from another machine or container)"
            how = f"wait for it to end (or stop it: kill {busy.holder['pid']})" if alive else "wait for it to end"
            raise DataError(f"{self.path} is being written by {busy}{elsewhere if alive is False else ''}; one run "
                            f"folder takes one writer at a time: {how}, then run this command again, or pass "
                            "another --log-path") from None
        if previous.get("pid"):
            say(f"note: {self.path / '.lock'} was left by {previous.get('script') or 'a script'} (pid "
                f"{previous['pid']} on host {previous.get('host')}, since {previous.get('started')}), which ended "
                "without releasing it (killed?); this run takes the folder over")
        return self

    def unlock(self) -> None:
        """Release LOG/.lock; folders this run created and left empty are removed (a refused run leaves nothing)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        release_lock(fd, self.path)
        for folder in self._made_folders:  # leaf first, each only when empty
            try:
                folder.rmdir()
            except OSError:
                break

    def __enter__(self) -> Run:
        return self if self._lock_fd is not None else self.lock()

    def __exit__(self, exc_type, exc, tb) -> None:
        """Release the lock; a runtime failure of a run this process began says where the record stands and
        the command that continues it (the SDK's own errors do not)."""
        self.unlock()
        if (not isinstance(exc, Exception) or isinstance(exc, (DataError, BudgetError)) or not self.began
                or "--resume" in str(exc) or any(r.get("name") == "final" for r in self.checkpoints())):
            return
        text = f"{exc if isinstance(exc, ScriptError) else f'{type(exc).__name__}: {one_line(exc)}'}; {self.resume_hint()}"
        try:  # the same exit code (a lost service stays 4)
            failure = type(exc)(text) if isinstance(exc, ScriptError) else ScriptError(text)
        except TypeError:
            failure = ScriptError(text)
        raise failure from exc

    def resume_hint(self) -> str:
        """What to run after a failure: --resume from the last checkpoint, or the same command if there is none."""
        rows = self.checkpoints()
        if rows:
            return (f"the run record in {self.path} is saved up to its last checkpoint ({rows[-1].get('name')}, "
                    "step " f"{rows[-1].get('step')}): continue with the same command plus --resume")
        return (f"no checkpoint was saved in {self.path} yet: run the same command again with --overwrite "
                "(--resume has nothing to continue from)")

    def file(self, name) -> Path:
        return self.path / name

    def rows(self, name) -> list[dict]:
        """Rows of a JSONL file; a torn line (a kill mid-write) is skipped, a missing file is []."""
        path = self.file(name)
        if not path.exists():
            return []
        rows = []
        for _, line in jsonl_lines(path.read_text(encoding="utf-8", errors="replace")):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def append(self, name, row: dict) -> dict:
        """One row, fsynced; a torn last line left by a kill is closed first so the new row stays whole.
        A metrics row also carries the cookbook's names for the values it has (COOKBOOK_METRIC_NAMES).
        Returns the row as written."""
        bad = non_finite(row) if name == "metrics.jsonl" else {}
        if name == "metrics.jsonl":
            row = {**row, **{theirs: row[ours] for ours, theirs in COOKBOOK_METRIC_NAMES.items() if ours in row}}
            if bad:  # JSON has no NaN: the row stays valid JSON and says which values were not finite
                row = {k: (None if k in bad or COOKBOOK_METRIC_NAMES.get(k) in bad else v) for k, v in row.items()}
                row.update({theirs: None for ours, theirs in COOKBOOK_METRIC_NAMES.items() if ours in bad})
                row["non_finite"] = {k: repr(v) for k, v in bad.items()}
        path = self.file(name)
        with open(path, "ab+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write((json.dumps(row) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        if bad:
            raise NonFiniteError(self.diverged_message(row, bad))
        return row

    def diverged_message(self, row: dict, bad: dict) -> str:
        """Why a run stopped on a NaN or inf metric: which values, the likely cause, where to continue from."""
        where = next((f"{k} {row[k]}" for k in ("step", "iteration") if k in row), "the last row")
        values = ", ".join(f"{k} = {v!r}" for k, v in bad.items())
        config = self.config()
        lr = config.get("learning_rate")
        # (a reward that is not finite is refused where it is returned: checked_reward, before any training)
        cause = ("the learning rate is the usual cause" + (f" (--learning-rate {lr:g} on {config.get('model_name')})"
                                                            if isinstance(lr, (int, float)) else ""))
        lower = {"--learning-rate": f"{lr / 4:g}"} if isinstance(lr, (int, float)) else {}
        # A checkpoint is sound when a finite row evaluated its weights: the row at step s+1 (SFT, DPO) or
        # iteration s (RL, distillation) was computed with the weights after s optimizer steps.
        evaluated = row["step"] - 1 if "step" in row else row.get("iteration", 0)
        ckpt = [c for c in self.checkpoints() if (c.get("step") or 0) < evaluated]
        if ckpt:
            new_log = f"{self.path}-lr{lower.get('--learning-rate', 'lower')}"
            again = edited_command({**lower, "--init-from": ckpt[-1]["state_path"], "--log-path": new_log},
                                   drop=("--resume", "--overwrite"))
            resume = (f"the last sound checkpoint is {ckpt[-1].get('name')} ({ckpt[-1]['state_path']}): continue "
                      f"from it at a lower rate in a new folder: {again} (--resume would repeat the same settings)")
        else:
            again = edited_command({**lower, "--overwrite": None}, drop=("--resume",))
            resume = f"no checkpoint was saved before it (nothing sound to --resume from): start again: {again}"
        return (f"training diverged at {where}: {values} (metrics.jsonl in {self.path}, the run stops here, "
                f"exit 1, no later checkpoint is saved); {cause}; {resume}")

    def write_json(self, name, obj) -> None:
        """Atomic replace: a kill leaves the old file or the new one, never half of one."""
        path = self.file(name)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(obj, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def write_rows(self, name, rows) -> None:
        """Replace a JSONL file atomically (e.g. a dry run's datums.jsonl); creates the folder."""
        self.path.mkdir(parents=True, exist_ok=True)
        path = self.file(name)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def config(self) -> dict:
        try:
            return json.loads(self.file("config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def holds_run(self) -> bool:
        return any(self.file(n).exists() for n in ("metrics.jsonl", "checkpoints.jsonl"))

    def checkpoints(self) -> list[dict]:
        return [r for r in self.rows("checkpoints.jsonl") if r.get("state_path")]

    def resume_point(self, *, resume: bool, overwrite: bool, dry_run: bool = False) -> dict | None:
        """The checkpoint row --resume continues from (None for a new run). Refuses to mix two runs in
        one folder. Writes nothing."""
        if resume:
            rows = self.checkpoints()
            if not rows:
                raise DataError(f"--resume: no checkpoint in {self.file('checkpoints.jsonl')}; start a new run "
                                "without --resume (add --overwrite to replace what is there)")
            self.began = not dry_run
            return rows[-1]
        if self.holds_run() and not overwrite and not dry_run:
            raise DataError(f"{self.path} already holds a run; pass --resume to continue it or --overwrite to "
                            "replace it (or choose another --log-path)")
        return None

    def check_resume(self, config: dict, keys) -> None:
        """DataError naming every setting in `keys` (and the format) that differs from the saved run.
        config.json is never rewritten on resume: the saved settings stay the record of the run."""
        saved = self.config()
        if not saved:  # a folder holding only checkpoints.jsonl (copied, or written by other tools)
            say(f"warning: --resume: {self.file('config.json')} is missing or unreadable, so the settings of the "
                "saved run cannot be compared with these; continuing from its last checkpoint as asked")
            return
        diffs = [resume_diff(k, saved.get(k), config.get(k)) for k in keys if k in saved and saved.get(k) != config.get(k)]
        saved_fmt = dict(saved.get("format") or {})
        if saved_fmt.get("tokenizer"):  # runs recorded before tokenizer folders were made absolute
            saved_fmt["tokenizer"] = tokenizer_record(saved_fmt["tokenizer"])
        if saved_fmt and saved_fmt != config.get("format"):
            diffs.append("format (tokenizer, chat template or --format/--thinking)")
        trained_on, now = (saved.get("backend") or {}).get("stand_in"), backend_record()
        here = now["stand_in"]
        # unknown: a local server started without the launcher, or no service at all (a --dry-run with no key)
        known = here is not None or (now["kind"] == "tinker" and bool(os.environ.get("TINKER_API_KEY")))
        if saved.get("backend") and known and trained_on != here:  # a checkpoint of one model restored into another
            diffs.append(f"the model standing in ({trained_on or 'Tinker itself'} -> {here or 'Tinker itself'}: resume "
                         "under the launcher it trained with, `tinker_local.py run" +
                         (" --real" if (saved["backend"].get("stand_in_kind") == "real") else "") + " -- ...`)")
        if diffs:
            raise DataError(f"--resume with different settings than the saved run: {'; '.join(diffs)}; "
                            "resume with the original flags (or start a new --log-path)")

    def begin(self, config: dict) -> None:
        """A new run: the folder's old record removed, config.json written. Call after every check."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.began = True
        for name in self.files:
            self.file(name).unlink(missing_ok=True)
        self.write_json("config.json", {**config, "backend": backend_record(), **cookbook_config_fields(config)})

    def rewind(self, name, keep) -> None:
        """Keep only the rows where keep(row): rows past a resumed checkpoint will be produced again."""
        if not self.file(name).exists():
            return
        text = "".join(json.dumps(r) + "\n" for r in self.rows(name) if keep(r))
        tmp = self.file(name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.file(name))

    def checkpoint(self, *, name, step, position: dict, epoch, state_path, sampler_path, fmt, **extra) -> dict:
        """Append the checkpoints.jsonl row of a save whose paths are known; `position` is where a resume
        starts ({"next_batch": n} for SFT, {"next_iteration": n} for RL), so it neither replays nor skips."""
        row = {"name": name, "step": step, **position, "epoch": epoch, "state_path": state_path,
               "sampler_path": sampler_path, "format": fmt, "time": now_iso(), **extra,
               # the cookbook's names: `batch` is where training continues, `final` marks the last save
               "batch": next(iter(position.values())), "final": name == "final"}
        self.append("checkpoints.jsonl", row)
        return row


def system_prompt_record(conversations) -> dict:
    """config.json's record of what sampling needs to prompt as training did: the system prompt every
    conversation shares ("system_prompts": "shared"), none ("none"), or the note that they differ ("differ");
    tinker_infer.py --run uses a shared one by default. conversations: SFT examples ({"messages"} or
    {"prompt", "completion"}) or RL prompts as render_prompt() gave them (a message list, or a str)."""
    def system(conversation):
        messages = conversation.get("messages") if isinstance(conversation, dict) else conversation
        first = messages[0] if isinstance(messages, list) and messages else None
        return first["content"] if isinstance(first, dict) and first.get("role") == "system" else None

    systems = {system(c) for c in conversations}
    if systems <= {None}:
        return {"system_prompt": None, "system_prompts": "none"}
    if len(systems) == 1:
        return {"system_prompt": next(iter(systems)), "system_prompts": "shared"}
    return {"system_prompt": None, "system_prompts": "differ"}


def cookbook_renderer_name(model_name: str, fmt: dict) -> str | None:
    """The tinker-cookbook renderer name matching how a run renders (None when no family matches)."""
    if (fmt or {}).get("kind") == "raw":
        return "role_colon"
    thinking = bool(((fmt or {}).get("template_kwargs") or {}).get("enable_thinking"))
    for prefix, names in COOKBOOK_RENDERERS:
        if model_name.startswith(prefix):
            return names[thinking]
    return None


def cookbook_config_fields(config: dict) -> dict:
    """config.json keys the cookbook's chz config has and tinkerscope reads (renderer, data file)."""
    renderer = cookbook_renderer_name(config.get("model_name", ""), config.get("format") or {})
    common = {"renderer_name": renderer, "model_name_for_tokenizer": (config.get("format") or {}).get("tokenizer")}
    if "batch_size" in config:
        common["batch_size"] = config["batch_size"]
    return {"renderer_name": renderer,
            "dataset_builder": {"common_config": common, "file_path": config.get("data")}}


def write_report(log):
    """The run's HTML report by tinker_report.py when it is beside this script (else None): one page a person
    can open. A failure here costs the run nothing; the record is complete already."""
    tool = Path(__file__).resolve().parent / "tinker_report.py"
    if not tool.exists():
        return None
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, str(tool), str(log)], capture_output=True, text=True, timeout=300)
        return json.loads(out.stdout.strip().splitlines()[-1]).get("report") if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


# ---- common/service.py ----
# Reaching Tinker: credentials, a fast reachability check, the served-model check, checkpoint paths,
# and the optional cost preflight and per-step cost metering through tinker_pricing.py beside the script.
import contextlib
import importlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit


HOSTED_BASE_URL = "https://tinker.thinkingmachines.dev/services/tinker-prod"  # SDK 0.38 lib/base_url.py
REACH_TIMEOUT_S = 3.0
CAPABILITIES_TIMEOUT_S = 60.0  # once the TCP check passed, a server that never answers still ends
# A training run whose service refuses TCP connections for this long stops with exit 4, its record saved for
# --resume: the SDK alone retries a lost result forever. TINKER_UNREACHABLE_S changes it (the tests use 3).
UNREACHABLE_S = 600.0


class ServiceLost(AccessError):
    """The service stopped answering for longer than TINKER_UNREACHABLE_S (raised in the main thread)."""


_WATCH = {"active": False, "stop": None, "thread": None, "lost": None}


def _on_service_lost(signum, frame):
    if _WATCH["active"] and _WATCH["lost"]:
        raise ServiceLost(_WATCH["lost"])


@contextlib.contextmanager
def watch_service():
    """The span of a training run in which a lost service ends it: once connect() has reached Tinker, a
    daemon thread opens one TCP connection to it every few seconds, and after TINKER_UNREACHABLE_S (default
    UNREACHABLE_S) without one the main thread gets ServiceLost (exit 4) wherever it waits. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGUSR1, _on_service_lost)
    _WATCH.update(active=True, stop=threading.Event(), thread=None, lost=None)
    try:
        yield
    finally:
        _WATCH["stop"].set()
        _WATCH.update(active=False, thread=None)


def unreachable_limit() -> float:
    try:
        value = float(os.environ.get("TINKER_UNREACHABLE_S") or UNREACHABLE_S)
    except ValueError:
        raise DataError(f"TINKER_UNREACHABLE_S={os.environ['TINKER_UNREACHABLE_S']!r}: expected seconds, e.g. "
                        "600") from None
    return value if value > 0 else UNREACHABLE_S


def _start_watch(url: str) -> None:
    """Called by connect() once the service answered; nothing outside watch_service()."""
    import urllib.request

    parts = urlsplit(url)
    if not _WATCH["active"] or _WATCH["thread"] is not None or not parts.hostname:
        return
    if urllib.request.getproxies().get(parts.scheme) and not urllib.request.proxy_bypass(parts.hostname):
        return  # through an HTTP proxy a TCP connection proves nothing
    address = (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    limit, stop = unreachable_limit(), _WATCH["stop"]
    _WATCH["thread"] = threading.Thread(target=_watch, args=(url, address, limit, stop), daemon=True,
                                        name="tinker-service-watch")
    _WATCH["thread"].start()


def _watch(url, address, limit, stop):
    interval = min(10.0, max(0.2, limit / 6))
    answered = time.monotonic()
    while not stop.wait(interval):
        try:
            socket.create_connection(address, timeout=min(interval, REACH_TIMEOUT_S)).close()
            answered = time.monotonic()
        except OSError:
            if time.monotonic() - answered >= limit and not stop.is_set():
                _WATCH["lost"] = (f"lost Tinker at {url}: no TCP connection for {limit:g} s (TINKER_UNREACHABLE_S "
                                  "sets how long a run waits)")
                os.kill(os.getpid(), signal.SIGUSR1)
                return


def service_url() -> str:
    """Where the SDK will send requests: TINKER_BASE_URL, else hosted Tinker (as the SDK resolves it)."""
    return (os.environ.get("TINKER_BASE_URL") or HOSTED_BASE_URL).rstrip("/")


def check_reachable(url: str | None = None, timeout_s: float = REACH_TIMEOUT_S, setting: str = "TINKER_BASE_URL") -> None:
    """One TCP connection to the service within timeout_s, or AccessError. The SDK retries an unreachable
    first call for minutes; this turns a dead TINKER_BASE_URL into a one-line exit 4 in seconds. Once the
    service has answered, the SDK's own retries handle transient failures. setting: the flag or variable
    that chose url, named in the error."""
    import urllib.request

    url = url or service_url()
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        host, port = None, None
    if not host or parts.scheme not in ("http", "https"):
        raise AccessError(f"{setting} {url!r} is not an http(s) URL; expected e.g. http://127.0.0.1:8000"
                          + ("; unset it to use hosted Tinker" if setting == "TINKER_BASE_URL" else ""))
    if urllib.request.getproxies().get(parts.scheme) and not urllib.request.proxy_bypass(host):
        return  # through a proxy the TCP check proves nothing; the SDK reports the failure
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        if isinstance(e, socket.gaierror):
            reason = f"host {host} does not resolve"
        local = setting == "TINKER_BASE_URL" and os.environ.get("TINKER_BASE_URL")
        hint = local_hint() if local else "check the network"
        raise AccessError(f"cannot reach Tinker at {url} ({reason}, {host}:{port} within {timeout_s:g} s); "
                          f"{hint}, or fix {setting}") from None


def require_credentials(dry_run_hint: bool = True) -> str:
    """The API key (or token) the SDK will send, or AccessError; never prints its value. Imports the SDK
    (seconds on a busy machine) only when TINKER_API_KEY is unset, to look for a stored login.
    dry_run_hint: the script has --dry-run, so the error may offer it."""
    key = os.environ.get("TINKER_API_KEY", "")
    if key and not key.startswith(("tml-", "eyJ")):
        raise AccessError("TINKER_API_KEY does not start with tml-; expected a Tinker API key; copy it again "
                          "from the Tinker console")
    if key:
        return key
    import tinker

    if not tinker.auth.tinker_has_credentials():
        raise AccessError("no Tinker credentials: set TINKER_API_KEY (tml-...), "
                          + ("or check for free with --dry-run, " if dry_run_hint else "") + f"or {local_hint()}")
    return tinker.auth.get_tinker_token() or ""


def rest_client():
    """RestClient for the current environment. Explicit arguments, because RestClient() with none reuses
    the first one made in the process, whatever TINKER_BASE_URL says now."""
    import tinker

    return tinker.RestClient(base_url=os.environ.get("TINKER_BASE_URL") or None,
                             api_key=os.environ.get("TINKER_API_KEY") or None)


def connect(model_name: str | None, *, trainable: bool = True, flag: str = "--model-name", dry_run_hint: bool = True):
    """(ServiceClient, the model's context window) after credentials, reachability and the served-model
    check; AccessError / DataError before any paid call. model_name None (a tinker:// checkpoint is
    sampled): no served-model check, context window None."""
    import difflib

    require_credentials(dry_run_hint)
    check_reachable()
    import tinker

    _start_watch(service_url())
    if model_name is None:
        return tinker.ServiceClient(), None
    try:
        caps = rest_client().get_server_capabilities().result(timeout=CAPABILITIES_TIMEOUT_S)
    except (tinker.AuthenticationError, tinker.PermissionDeniedError) as e:
        raise AccessError(f"Tinker refused the credentials ({type(e).__name__}); check TINKER_API_KEY") from None
    except (tinker.APIConnectionError, tinker.APITimeoutError, TimeoutError, OSError) as e:
        raise AccessError(f"no answer from {service_url()} ({type(e).__name__}); check the network or "
                          "TINKER_BASE_URL") from None
    models = {m.model_name: m for m in caps.supported_models if m.model_name}
    model = models.get(model_name.split(":", 1)[0]) or models.get(model_name)
    if model is None:
        close = difflib.get_close_matches(model_name, list(models), n=5, cutoff=0.3)
        shown = ", ".join(close + [m for m in sorted(models) if m not in close][: max(0, 12 - len(close))])
        pricing = load_pricing()
        retired = getattr(pricing, "retired_note", lambda _: None)(model_name) if pricing else None
        retired = f"{retired}; " if retired else ""
        raise DataError(f"unknown model {model_name!r}: {retired}this Tinker serves {shown}; pass one with {flag}")
    if trainable and model.trainable is False:
        raise DataError(f"{model_name} is not trainable on this Tinker; pick another {flag}")
    return tinker.ServiceClient(), model.max_context_length


def check_tinker_path(path, need):
    """A tinker:// checkpoint path of the kind `need` ("weights" or "sampler_weights"); DataError otherwise."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights", "external_weights") or not all(parts):
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


def load_pricing():
    """tinker_pricing from beside this script, or None (then no dollar estimate)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        return importlib.import_module("tinker_pricing")
    except ImportError:
        return None


def estimate(model_name, tokens: dict, max_usd, *, label: str, context=None):
    """The pricing estimate dict, or None; BudgetError when --max-usd is exceeded or cannot be proven."""
    pricing = load_pricing()
    if pricing is None:
        # A dry run refuses --max-usd exactly as the real run does: a dry run that passes is an audit.
        if max_usd is not None:
            raise BudgetError(f"cannot check --max-usd: tinker_pricing.py (the prices) is not beside this script; "
                              f"{copy_pricing_command()}, or drop --max-usd")
        say("no dollar estimate: tinker_pricing.py is not beside this script")
        return None
    try:
        return pricing.preflight(model_name, tokens, max_usd, label=label, context=context)
    except pricing.BudgetExceeded as e:
        raise BudgetError(str(e)) from None
    except (pricing.UnknownModelError, ValueError, OverflowError) as e:
        if max_usd is not None:
            raise BudgetError(f"cannot check --max-usd: {e}") from None
        say(f"no dollar estimate: {e}")
        return None


def copy_pricing_command() -> str:
    """How to put the prices beside this script: a `cp` from the bundle when the local backend's launcher
    shows where the bundle is, else the words."""
    import shlex

    here = str(Path(__file__).resolve().parent)
    launcher = local_launcher()
    if launcher and (Path(launcher).parent / "tinker_pricing.py").exists():
        return f"copy it: cp {shlex.quote(os.path.join(os.path.dirname(launcher), 'tinker_pricing.py'))} {shlex.quote(here)}"
    return f"copy the bundle's scripts/tinker_pricing.py into {here}"


def estimate_total(est):
    """The dollar total of an estimate() result (or of a bare number) for config.json's estimate_usd; None
    when there is no estimate (tinker_pricing.py absent, model or price unknown)."""
    if isinstance(est, dict):
        est = (est.get("usd") or {}).get("total")
    return est if isinstance(est, (int, float)) and not isinstance(est, bool) else None


def sample_call_tokens(prompt_len, num_samples, sampled, cached_prefix=0) -> dict:
    """What one sample call meters, as tinker_pricing.sample_tokens / rl_tokens count it: the prompt is
    prefilled once (minus a prefix the server saw before, `cached_prefix`), the other num_samples - 1
    copies are cache hits, and every generated token is sampled (`sampled`: their total)."""
    return {"prefill": prompt_len - cached_prefix, "cached_prefill": cached_prefix + (num_samples - 1) * prompt_len,
            "sample": sampled}


def rollout_tokens(groups) -> dict:
    """Sampling tokens of RL groups (objects with .episodes, each with .turns of .observation and .action
    token lists): one call of G for a group's first turn, then one call per later turn whose prompt is a
    cache hit up to what the server last saw of that episode (its previous prompt + sampled action), the
    rest (the new observation) prefilled, as tinker_pricing.rl_tokens assumes."""
    total = {"prefill": 0, "cached_prefill": 0, "sample": 0}
    for group in groups:
        if not group.episodes:
            continue
        calls = [sample_call_tokens(len(group.episodes[0].turns[0].observation), len(group.episodes),
                                    sum(len(e.turns[0].action) for e in group.episodes))]
        for episode in group.episodes:
            for prev, turn in zip(episode.turns, episode.turns[1:]):
                seen = list(prev.observation) + list(prev.action)
                shared = next((i for i, (a, b) in enumerate(zip(seen, turn.observation)) if a != b),
                              min(len(seen), len(turn.observation)))
                calls.append(sample_call_tokens(len(turn.observation), 1, len(turn.action), shared))
        for call in calls:
            for kind, count in call.items():
                total[kind] += count
    return total


class CostMeter:
    """Dollars of the tokens a run actually sends, for its metrics rows (cost/step_usd, cost/cumulative_usd).

    Each step is priced by tinker_pricing.estimate_cost with the catalogue and model row the pre-run
    estimate uses, so the last cost/cumulative_usd compares directly with config.json's estimate_usd:
    equal where the estimate counts exact tokens, below it where the estimate is an upper bound (sampled
    tokens counted at --max-tokens). add() the tokens of a call when it is sent (prefill, cached_prefill,
    sample, train; `model` for another base model, e.g. a teacher); row() prices everything added since
    the last row. --resume: pass the Run after its rewind and the sum continues from the last row kept.
    Without tinker_pricing.py beside the script, or a price for the model, row() returns {} (said once)."""

    FIELDS = ("cost/step_usd", "cost/cumulative_usd")

    def __init__(self, model_name, run=None, *, context=None):
        self.model_name, self.context, self.pending, self.cumulative = model_name, context, {}, 0.0
        self.pricing = load_pricing()
        self.catalogue = self.pricing.load_catalogue()[0] if self.pricing else None
        if self.pricing is None:
            self.off("tinker_pricing.py is not beside this script")
        rows = run.rows("metrics.jsonl") if run is not None else []
        kept = [r["cost/cumulative_usd"] for r in rows if isinstance(r.get("cost/cumulative_usd"), (int, float))]
        self.cumulative = float(kept[-1]) if kept else 0.0
        if rows and not kept and self.pricing is not None:
            say("note: the rows before this --resume carry no cost/cumulative_usd; the sum counts from here")

    def off(self, reason):
        say(f"no cost/step_usd or cost/cumulative_usd in metrics.jsonl: {reason}")
        self.pricing = None

    def add(self, model=None, **tokens):
        pending = self.pending.setdefault(model or self.model_name, {})
        for kind, count in tokens.items():
            pending[kind] = pending.get(kind, 0) + count

    def row(self, **tokens) -> dict:
        """The two cost fields of a metrics row: what was added since the last row plus `tokens`, and the sum."""
        self.add(**tokens)
        pending, self.pending = self.pending, {}
        if self.pricing is None:
            return {}
        step = 0.0
        for model, counts in pending.items():
            try:
                est = self.pricing.estimate_cost(model, context=self.context if model == self.model_name else None,
                                                 rows=self.catalogue, **counts)
            except ValueError as e:  # UnknownModelError is one; so are bad counts
                self.off(str(e))
                return {}
            if est["usd"]["total"] is None:
                self.off(est["warning"])
                return {}
            step += est["usd"]["total"]
        self.cumulative += step
        return {"cost/step_usd": round(step, 10), "cost/cumulative_usd": round(self.cumulative, 10)}


# ---- common/checkpoints.py ----
# Checkpoints by path and by run: tinker:// paths, the server's listing of one run, the run record's checkpoint
# rows, and an SDK failure about a checkpoint as one line with the command that shows what exists.
import os


CHECKPOINT_SEGMENTS = ("weights", "sampler_weights", "external_weights")


def parse_tinker_path(path: str) -> tuple[str, str, str] | None:
    """tinker://RUN/SEGMENT/NAME -> (run, segment, name); None if not a tinker path; DataError if malformed."""
    if not path.startswith("tinker://"):
        return None
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in CHECKPOINT_SEGMENTS or not all(parts):
        raise DataError(f"{path} is not a checkpoint path; expected tinker://RUN_ID/sampler_weights/NAME "
                        "(or weights/, external_weights/); next: " + script_command("tinker_checkpoints.py", "list"))
    return parts[0], parts[1], parts[2]


def tinker_failure(e: Exception, what: str, model: str | None = None) -> ScriptError:
    """An SDK exception as a one-line error with its exit code and the next step (model: the base model or
    tinker:// path the call was about, named in the message)."""
    import tinker

    message = one_line(e)
    if isinstance(e, (tinker.AuthenticationError, tinker.PermissionDeniedError)):
        return AccessError(f"{what}: Tinker rejected the API key ({message}); next: check TINKER_API_KEY")
    if isinstance(e, tinker.APIConnectionError):
        return AccessError(f"{what}: cannot reach {service_url()} ({message}); next: check the network or "
                           "TINKER_BASE_URL")
    lowered = message.lower()
    if "not loaded" in lowered:
        return ScriptError(f"{what}: the server no longer has the model behind {model} loaded ({message}); "
                           f"next: sample a sampler_weights/ checkpoint of it ({script_command('tinker_checkpoints.py', 'list')}), "
                           "or restore its last save_state path")
    if isinstance(e, tinker.NotFoundError) or "not found" in lowered or "expired" in lowered:
        run = parse_tinker_path(model)[0] if model and model.startswith("tinker://") else None
        hint = script_command("tinker_checkpoints.py", "list", *(["--run", run] if run else []))
        if os.environ.get("TINKER_LOCAL_LAUNCHER"):  # the local backend: what keeps a checkpoint there
            hint += (" (local backend: checkpoints stay in the store of its cache folder for "
                     "30 days, the oldest pruned beyond 2 GB; a server started with --run-dir sees only that "
                     "folder's; `tinker_local.py prune --all` deletes them)")
        return DataError(f"{what}: {model or 'the checkpoint'} is unknown or expired ({message}); next: {hint}")
    if isinstance(e, (tinker.BadRequestError, tinker.UnprocessableEntityError)):
        return DataError(f"{what}: the server rejected the request ({message})")
    if isinstance(e, tinker.RequestFailedError) and str(getattr(e, "category", "")).lower().endswith("user"):
        return DataError(f"{what}: the server rejected the request ({message})")
    return ScriptError(f"{what} failed: {message}")


# ---- common/training.py ----
# Optimizer constants, learning-rate rules, data order, sizing advice and the training client shared by the training
# scripts; the teacher a distillation rehearsal trains first.
# The cookbook's Adam values; the SDK's default eps is 1e-12.
ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
PERIODIC_TTL_SECONDS = 7 * 24 * 3600  # periodic saves expire after a week; the final one is kept


def training_client(service, model_name, lora_rank, seed, *, resume_from=None, position="", init_from=None,
                    train_unembed=True):
    """The training client: the checkpoint --resume continues from (weights and optimizer state; `position`
    says where, e.g. "batch 12"), else the weights of --init-from with a fresh optimizer, else a new LoRA.
    A restored client trains the layers its checkpoint trained: `train_unembed` (--no-train-unembed) only
    shapes a new LoRA, and --resume refuses a changed value (RESUME_KEYS)."""
    import tinker

    if resume_from:
        try:
            tc = service.create_training_client_from_state_with_optimizer(resume_from["state_path"]).result()
        except tinker.NotFoundError as e:  # the store lost it: say which path, not "run again"
            raise tinker_failure(e, "--resume", resume_from["state_path"]) from e
        say(f"resumed from {resume_from['state_path']} at {position}")
        return tc
    if init_from:
        try:
            return service.create_training_client_from_state(init_from).result()
        except tinker.NotFoundError as e:
            raise tinker_failure(e, "--init-from", init_from) from e
    # The SDK's default trains the output head too (train_unembed=True); a LoRA on it is the one vLLM may refuse.
    head = {} if train_unembed else {"train_unembed": False}
    return service.create_lora_training_client(base_model=model_name, rank=lora_rank, seed=seed, **head).result()


# ---- common/onpolicy.py ----
# Sampling-based training shared by tinker_rl.py and tinker_distill.py: bounded, retried requests, the
# importance-sampling datum, the sampler/learner KL, the train step, the training client restored or
# created, and checkpoint saves.
import asyncio
import random
SAMPLE_RETRIES, RETRY_BASE_S, RETRY_MAX_S = 6, 0.5, 30.0


def is_transient(e):
    """Worth retrying the same request: rate limit (429), timeouts (408), conflicts, 5xx, connection loss."""
    import tinker

    status = getattr(e, "status_code", None)
    return (status in (408, 409, 429) or (status is not None and status >= 500)
            or isinstance(e, (tinker.APIConnectionError, asyncio.TimeoutError))
            or str(getattr(e, "category", "")).lower().endswith("server"))


def is_rejection(e):
    """A request the server refused as invalid (4xx, or a failed request of category user)."""
    status = getattr(e, "status_code", None)
    category = str(getattr(e, "category", "")).lower()
    return (status is not None and 400 <= status < 500) or category.endswith("user")


class RequestGate:
    """At most `limit` requests at once (per event loop; the rest wait), a 429 or transient error
    retried with jittered exponential back-off; `retries` counts them."""

    def __init__(self, limit):
        self.limit, self.retries = limit, 0
        self._loop = self._semaphore = None

    def take_retries(self):
        count, self.retries = self.retries, 0
        return count

    async def call(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a semaphore belongs to one event loop
            self._loop, self._semaphore = loop, asyncio.Semaphore(self.limit)
        for attempt in range(SAMPLE_RETRIES + 1):
            async with self._semaphore:
                try:
                    return await fn(*args, **kwargs)
                except Exception as e:
                    if not is_transient(e) or attempt == SAMPLE_RETRIES:
                        raise
                    self.retries += 1
            await asyncio.sleep(min(RETRY_MAX_S, RETRY_BASE_S * 2**attempt) * (0.75 + 0.25 * random.random()))


def rl_datum(tokens, logprobs, advs):
    """The importance-sampling datum of one sequence, shifted by one: position i predicts token i+1.
    logprobs (the sampler's) and advs are per token of `tokens`, 0 where nothing is learned; no `mask`
    key: prompt and observation positions are out of the loss because their advantage is 0."""
    import tinker

    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": list(tokens[1:]), "logprobs": list(logprobs[1:]),
                        "advantages": list(advs[1:])})


def kl_metrics(datums, masks, outputs):
    """Sampler vs learner on the sampled tokens (mask 1; the ratio importance sampling corrects):
    v1 = mean(lp_sampler - lp_learner), v2 = half the mean square (stable training keeps these below
    about 0.01), entropy = -mean(lp_sampler)."""
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


def train_step(training_client, datums, loss_fn, config, learning_rate, on_error=None):
    """forward_backward with the chosen loss and its config, optim_step submitted right behind it;
    on_error(exception) -> the exception to raise instead."""
    import tinker

    try:
        fb = training_client.forward_backward(datums, loss_fn=loss_fn, loss_fn_config=config)
        step = training_client.optim_step(tinker.AdamParams(learning_rate=learning_rate, **ADAM))
        result = fb.result()
        step.result()
    except ScriptError:  # ours already (a lost service stays exit 4)
        raise
    except Exception as e:
        if on_error is None:
            raise
        raise on_error(e) from None
    return result


def save_checkpoint(tc, run, name, next_iteration, epoch, fmt, final=False):
    """save_state (and, for the final save, save_weights_for_sampler) submitted together; the row is
    appended once both paths are known. Periodic saves expire after PERIODIC_TTL_SECONDS."""
    state = tc.save_state(name, ttl_seconds=None if final else PERIODIC_TTL_SECONDS)
    sampler = tc.save_weights_for_sampler(name) if final else None
    return run.checkpoint(name=name, step=next_iteration, position={"next_iteration": next_iteration}, epoch=epoch,
                          state_path=state.result().path, sampler_path=sampler.result().path if sampler else None,
                          fmt=fmt)


# ---- common/rollouts.py ----
# RL rollouts for tinker_rl.py: tasks and seeds per iteration, episodes sampled with bounded concurrency
# and environment calls that overlap, group-relative advantages, datums, the rollout trace, and the
# schedule of sampler versions (on-policy, or up to --max-staleness steps behind while training runs); what a
# run says about them (the metrics row, the progress line, the rehearsal's banner, the summary at the end); the
# cost of iterations (the estimate and its assumptions per episode, the running --max-usd check).
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import os
import random
import threading
import time


def task_label(tasks, index):
    text = json.dumps(tasks[index], default=str)
    return f"task {index} ({text[:60]}{'...' if len(text) > 60 else ''})"


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
    version: int | None = None  # optim steps in the weights it was sampled with (None: the iteration's own)


@dataclasses.dataclass
class Batch:
    datums: list  # what forward_backward receives
    masks: list  # per datum, 1 on sampled (trained) target positions: for the KL metrics
    tied: int  # groups skipped because every reward was the same
    advantages: dict  # (group index, sample index) -> advantage, for every episode of an untied group
    stale: int = 0  # groups dropped because their sampler was more than --max-staleness steps behind


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
            raise ScriptError(f"sampler returned {len(turn.logprobs)} logprobs for {len(turn.action)} tokens")
        tokens, lps, advs, mask = seq
        tokens += new + turn.action
        lps += [0.0] * len(new) + [float(x) for x in turn.logprobs]
        advs += [0.0] * len(new) + [float(advantage)] * len(turn.action)
        mask += [0.0] * len(new) + [1.0] * len(turn.action)
    if seq is not None:
        sequences.append(seq)
    return sequences


def build_batch(groups, normalize_std=False, iteration=None, max_staleness=0) -> Batch:
    """Datums of every group whose rewards do not all tie (tied groups carry no signal) and that was
    sampled at most max_staleness optim steps before `iteration` (staler groups are dropped, counted)."""
    batch = Batch([], [], 0, {})
    for g, group in enumerate(groups):
        if group.version is not None and iteration is not None and iteration - group.version > max_staleness:
            batch.stale += 1
            continue
        rewards = [e.reward for e in group.episodes]
        if max(rewards) - min(rewards) < 1e-9:
            batch.tied += 1
            continue
        for s, (episode, adv) in enumerate(zip(group.episodes, advantages(rewards, normalize_std))):
            batch.advantages[(g, s)] = adv
            for tokens, lps, advs, mask in episode_sequences(episode.turns, adv):
                if len(tokens) < 2 or not any(mask):
                    continue
                batch.datums.append(rl_datum(tokens, lps, advs))
                batch.masks.append(mask[1:])
    return batch


# --env-workers' default: one thread per episode in flight (a slow tool never waits for a free thread), capped.
MAX_ENV_WORKERS = 256


def episodes_in_flight(args):
    """Episodes sampled at once: one iteration's, or --max-staleness iterations' when they sample ahead."""
    return args.batch_size * args.group_size * max(1, args.max_staleness)


def env_workers(args):
    """--env-workers, or its default: the episodes in flight, at most MAX_ENV_WORKERS."""
    return min(episodes_in_flight(args), MAX_ENV_WORKERS) if args.env_workers is None else args.env_workers


class Rollouts:
    """Runs the groups of one iteration: at most --max-in-flight sampling requests at once (the rest
    wait), a 429 or transient error retried with back-off, plain-function environment code in a thread
    pool and tokenizer work in its own thread, so the event loop only schedules."""

    def __init__(self, job, args, context_window):
        self.job, self.args, self.context_window = job, args, context_window
        self.env_pool = self.token_pool = None
        self.gate = RequestGate(args.max_in_flight)

    @contextlib.contextmanager
    def pools(self):
        workers = env_workers(self.args)
        with concurrent.futures.ThreadPoolExecutor(max(workers, 1), thread_name_prefix="env") as env_pool, \
                concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as token_pool:
            self.env_pool = env_pool if workers else None
            self.token_pool = token_pool if workers else None
            try:
                yield self
            finally:
                self.env_pool = self.token_pool = None

    def take_retries(self):
        return self.gate.take_retries()

    async def batch(self, sampler, task_indices, seeds, version=None):
        """All groups of one iteration (every group started at once; the gate bounds requests), each
        marked with the version of the weights `sampler` holds."""
        groups = await asyncio.gather(*(self.group(sampler, t, s) for t, s in zip(task_indices, seeds)))
        for group in groups:
            group.version = version
        return list(groups)

    async def group(self, sampler, task_index, seed, n=None, temperature=None):
        """One group: the first turn of all its samples in one call, then each episode on its own. A scripted
        rehearsal (env["scripted_turns"]): the first scripted_share() samples play the script instead."""
        prompt = self.job.prompts[task_index]
        n = n or self.args.group_size
        script = self.script(task_index)
        scripted = scripted_share(n) if script else 0
        params = self.params(len(prompt), seed, temperature)
        firsts = [await self.scripted(sampler, prompt, script[0]) for _ in range(min(scripted, 1))] * scripted
        if n > scripted:
            firsts += list((await self.sample(sampler, prompt, n - scripted, params)).sequences)
        episodes = await asyncio.gather(*(self.episode(sampler, task_index, seed, i, seq, temperature,
                                                       script if i < scripted else None)
                                          for i, seq in enumerate(firsts)))
        return Group(task_index, seed, list(episodes))

    def script(self, task_index):
        """The scripted assistant turns (texts) of a task in a scripted rehearsal, else None."""
        scripted_turns = self.job.env.get("scripted_turns")
        if scripted_turns is None:
            return None
        task = self.job.tasks[task_index]
        turns = scripted_turns(task) if callable(scripted_turns) else scripted_turns
        if not isinstance(turns, (list, tuple)) or not turns or not all(isinstance(t, str) for t in turns):
            raise DataError(f"REHEARSAL_TURNS gave {type(turns).__name__} for {task_label(self.job.tasks, task_index)}; "
                            "expected a non-empty list of assistant turn texts")
        return list(turns)

    async def scripted(self, sampler, observation, text):
        """A scripted assistant turn as the sampler would return it: the text rendered by the chat template as
        the next assistant turn (cut after its end-of-turn token), with the sampler's own logprobs of those
        tokens (compute_logprobs), so the datum trains exactly like a sampled turn."""
        import tinker

        action = await self.off_loop(self.token_pool, assistant_tokens, self.job.tokenizer, self.job.fmt, text)
        logprobs = await self.gate.call(sampler.compute_logprobs,
                                        tinker.ModelInput.from_ints(list(observation) + action))
        return ScriptedTurn(action, [float(x) for x in logprobs[-len(action):]], "stop")

    async def evaluate(self, sampler, k, seed, pass_reward):
        """Held-out tasks: the mean reward of one greedy episode each, and pass@k (the share of tasks where
        one of k samples scores pass_reward or more)."""
        held_out = range(self.job.n_train, len(self.job.tasks))
        greedy, sampled = await asyncio.gather(
            asyncio.gather(*(self.group(sampler, t, seed, 1, 0.0) for t in held_out)),
            asyncio.gather(*(self.group(sampler, t, seed, k) for t in held_out)))
        passed = [max(e.reward for e in g.episodes) >= pass_reward for g in sampled]
        return {"eval/greedy_reward": sum(g.episodes[0].reward for g in greedy) / len(greedy),
                f"eval/pass@{k}": sum(passed) / len(passed), "eval/tasks": len(passed)}

    async def sample(self, sampler, prompt, n, params):
        import tinker

        return await self.gate.call(sampler.sample, prompt=tinker.ModelInput.from_ints(prompt), num_samples=n,
                                    sampling_params=params)

    def params(self, prompt_len, seed, temperature=None):
        import tinker

        cap = self.args.max_tokens
        if self.context_window is not None:
            cap = min(cap, self.context_window - prompt_len)
        temperature = self.args.temperature if temperature is None else temperature
        return None if cap <= 0 else tinker.SamplingParams(
            max_tokens=cap, temperature=temperature, stop=list(self.job.fmt["stop"]), seed=seed)

    async def off_loop(self, pool, fn, *args):
        """fn(*args) awaited: a coroutine function directly, a plain one in `pool` (inline without one)."""
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        if pool is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    async def user_code(self, fn, label, *args):
        """reward() / env_step(): an exception there is bad input, named by task."""
        try:
            return await self.off_loop(self.env_pool, fn, *args)
        except ScriptError:
            raise
        except Exception as e:
            name = getattr(fn, "__name__", None) or getattr(fn, "func", fn).__name__
            raise DataError(f"{name}() raised on {label}: {type(e).__name__}: {one_line(e, 120)}") from None

    async def episode(self, sampler, task_index, seed, index, first, temperature=None, script=None):
        """Continue one episode from its first sampled turn until the environment says done (turn k plays
        script[k] while the script lasts)."""
        job, args = self.job, self.args
        task, env = job.tasks[task_index], job.env
        label = task_label(job.tasks, task_index)
        rng = random.Random(seed)  # the same environment randomness for every sample of the group
        conversation = list(env["render_prompt"](task)) if env["env_step"] else None
        observation, sequence = job.prompts[task_index], first
        turns, total, truncated, info = [], 0.0, False, {}
        for turn_index in range(args.max_turns):
            if turn_index > 0 and script is not None and turn_index < len(script):
                sequence = await self.scripted(sampler, observation, script[turn_index])
            elif turn_index > 0:
                params = self.params(len(observation), seed + 7919 * index + turn_index, temperature)
                if params is None:  # no room left in the context window
                    truncated = True
                    break
                sequence = (await self.sample(sampler, observation, 1, params)).sequences[0]
            action = list(sequence.tokens)
            turns.append(Turn(observation, action, list(sequence.logprobs or []), sequence.stop_reason))
            text = await self.off_loop(self.token_pool, completion_text, job.tokenizer, job.fmt, action)
            cut = sequence.stop_reason == "length"
            truncated = truncated or cut
            if env["env_step"] is None:
                total += checked_reward(await self.user_code(env["reward"], label, task, text), label)
                break
            result = await self.user_code(env["env_step"], label, task, list(conversation), text, rng)
            if not isinstance(result, tuple) or len(result) not in (3, 4):
                raise DataError(f"env_step() returned {type(result).__name__} for {label}; expected "
                                "(observation, reward, done) or (observation, reward, done, info)")
            message, step_reward, done = result[:3]
            for key, value in (result[3] if len(result) == 4 and result[3] else {}).items():
                info[key] = info.get(key, 0) + value
            total += checked_reward(step_reward, label, "env_step()")
            if done or message is None or (cut and args.on_truncation == "end"):
                break
            message = message if isinstance(message, dict) else {"role": "user", "content": str(message)}
            conversation += [{"role": "assistant", "content": text}, message]
            closed = action if action and action[-1] in job.fmt["stop"] else action + job.fmt["stop"][:1]
            new = await self.off_loop(self.token_pool, observation_tokens, job.tokenizer, job.fmt, message)
            observation = observation + closed + new
        if script is not None:
            info["scripted_episodes"] = 1
        return Episode(turns, total, truncated, info)


@dataclasses.dataclass
class ScriptedTurn:
    """A scripted rehearsal turn, shaped like a sampled sequence."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


def scripted_share(group_size):
    """Samples of a group that play the script in a scripted rehearsal: half (at least 1, at most G - 1), so the
    script's reward and the sampled episodes' differ and the group trains."""
    return max(1, min(group_size - 1, group_size // 2))


def assistant_tokens(tokenizer, fmt, text):
    """The tokens of an assistant turn saying `text`, as the chat template renders it after the generation
    prompt (its end-of-turn token included): what the model would sample to say it."""
    probe = [{"role": "user", "content": "Hi"}]
    before = render_text(tokenizer, fmt, probe)
    after = render_text(tokenizer, fmt, probe + [{"role": "assistant", "content": text}], add_generation_prompt=False)
    eot = tokenizer.decode([fmt["stop"][0]])
    if after.startswith(before) and eot in after[len(before):]:
        body = after[len(before): after.index(eot, len(before)) + len(eot)]
        tokens = tokenizer.encode(body, add_special_tokens=False)
    else:  # a template that rewrites the turn: the text itself
        tokens = tokenizer.encode(text, add_special_tokens=False)
    return tokens if tokens and tokens[-1] in fmt["stop"] else tokens + list(fmt["stop"][:1])


def checked_reward(value, label, where="reward()"):
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where} returned {value!r} for {label}; expected a finite float. Fix it in the "
                        "EDIT ME block and check with --dry-run")
    return float(value)


def call_user_code(fn, label, *args):
    """render_prompt() / reward() called outside a rollout; an exception there is bad input."""
    try:
        return fn(*args)
    except ScriptError:
        raise
    except Exception as e:
        raise DataError(f"{fn.__name__}() raised on {label}: {type(e).__name__}: {one_line(e, 120)}") from None


_PROBE = "Zq7PROBEqZ"


def render_text(tokenizer, fmt, messages, tools=None, add_generation_prompt=True):
    kwargs = dict(fmt["template_kwargs"])
    frozen = kwargs.pop("strftime_now", None)
    with _frozen_clock(frozen):
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **kwargs)


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


def rollout_rows(it, groups, batch, tokenizer):
    """One rollouts.jsonl row per episode: exactly the tokens and numbers the update used.
    prompt_tokens + completion_tokens is the episode's sequence (observations included, sampler logprob
    0 there); each turn's observation_tokens are the tokens added before its action (the whole context
    when the turn starts a new datum), always masked; an action is masked when its rollout is not trained.
    Each turn also carries its observation_text and action_text (decoded), for reading one episode."""
    rows = []
    for g, group in enumerate(groups):
        for s, episode in enumerate(group.episodes):
            trained = (g, s) in batch.advantages
            prompt = episode.turns[0].observation
            completion, lps, turns, context = [], [], [], list(prompt)
            for k, turn in enumerate(episode.turns):
                extends = k > 0 and turn.observation[: len(context)] == context
                new = turn.observation[len(context):] if extends else ([] if k == 0 else list(turn.observation))
                turns.append({"observation_tokens": new, "action_tokens": turn.action, "masked": not trained,
                              "starts_datum": k > 0 and not extends, "stop_reason": turn.stop_reason,
                              "observation_text": tokenizer.decode(new), "action_text": tokenizer.decode(turn.action)})
                completion += new + turn.action
                lps += [0.0] * len(new) + [float(x) for x in turn.logprobs]
                context = (context if extends or k == 0 else []) + new + turn.action
            version = it if group.version is None else group.version
            rows.append({"iteration": it, "task": group.task_index, "group": g, "sample": s,
                         "sampler_version": version, "staleness": it - version,
                         "prompt_tokens": prompt, "completion_tokens": completion, "sampler_logprobs": lps,
                         "reward": episode.reward, "advantage": batch.advantages.get((g, s), 0.0),
                         "trained": trained, "turns": turns, "prompt_text": tokenizer.decode(prompt),
                         "completion_text": tokenizer.decode(completion)})
    return rows


# ---- What a run says about its rollouts: the metrics row, the progress line, the reward of a batch, a tied batch

def tools_named(tools):
    """'tools lookup, search' or 'no tools' for a banner."""
    names = [(t.get("function") or t).get("name", "?") for t in tools or [] if isinstance(t, dict)]
    return f"tool{'s' if len(names) > 1 else ''} {', '.join(names)}" if names else "no tools"


def reward_summary(groups, what):
    """The reward on a batch of groups: distribution and tied groups (a constant reward teaches nothing)."""
    import collections

    rewards = [e.reward for g in groups for e in g.episodes]
    tied = sum(1 for g in groups if max(e.reward for e in g.episodes) - min(e.reward for e in g.episodes) < 1e-9)
    values = collections.Counter(round(r, 4) for r in rewards)
    shown = ", ".join(f"{v:g} x{c}" for v, c in values.most_common(5)) + (" ..." if len(values) > 5 else "")
    return (f"{what} on the first {len(rewards)} samples ({len(groups)} groups): mean {sum(rewards) / len(rewards):.3f}, "
            f"min {min(rewards):.3g}, max {max(rewards):.3g}; values {shown}; tied groups {tied}/{len(groups)}")


def tied_message(groups, args=None, log_path=None):
    rewards = sorted({e.reward for g in groups for e in g.episodes})
    policy = f"the policy from {args.init_from}" if args is not None and args.init_from else "the base policy"
    where = ""
    if log_path is not None:
        log = short_path(log_path)
        where = (f"; what it sampled is in {os.path.join(log, 'metrics.jsonl')} (iteration 0) and "
                 f"{os.path.join(log, 'rollouts.jsonl')} (every episode, decoded: prompt_text, completion_text), "
                 f"one episode as text: {script_command('tinker_report.py', log, '--rollout', '0', server=False)}")
    return (f"{policy} ties every group (all {len(groups)} groups at reward {rewards[:3]}): no advantage, "
            "no gradient; nothing was trained" + where + ". Ways out: give partial credit in reward() (a score "
            "for the right format, the tool called, a near answer), make the tasks easier (reward floor) or harder "
            "(ceiling), raise --group-size / --temperature, or SFT first and start from its checkpoint with "
            "--init-from tinker://RUN/weights/final")


def iteration_row(it, groups, batch, args, job, fb_metrics, task_indices, seeds, seconds, retries):
    episodes = [e for g in groups for e in g.episodes]
    rewards = [e.reward for e in episodes]
    mean = sum(rewards) / len(rewards)
    versions = [it if g.version is None else g.version for g in groups]
    row = {
        "iteration": it, "step": it, "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        "reward_min": min(rewards), "reward_max": max(rewards),
        "groups": len(groups), "groups_tied": batch.tied, "frac_groups_tied": batch.tied / len(groups),
        "episodes": len(episodes), "frac_truncated": sum(e.truncated for e in episodes) / len(episodes),
        "turns_mean": sum(len(e.turns) for e in episodes) / len(episodes),
        "tokens_sampled": sum(len(t.action) for e in episodes for t in e.turns),
        "tokens_trained": sum(d.model_input.length for d in batch.datums), "datums": len(batch.datums),
        "loss_fn": args.loss_fn, "loss_fn_config": job.loss_config, "learning_rate": args.learning_rate,
        **fb_metrics, **{f"seconds_{k}": v for k, v in seconds.items()}, "sample_retries": retries,
        "sampler_version": min(versions), "staleness_max": it - min(versions), "groups_stale_dropped": batch.stale,
        "tasks": task_indices, "group_seeds": seeds,
    }
    for key in sorted({k for e in episodes for k in e.info}):
        row[f"env/{key}"] = sum(e.info.get(key, 0) for e in episodes)
    # The cookbook's group fractions: a tied group is "all good" when its common reward is above 0
    # (every sample passed), "all bad" otherwise; the rest are mixed and carry the signal.
    tied_rewards = [g.episodes[0].reward for g in groups
                    if max(e.reward for e in g.episodes) - min(e.reward for e in g.episodes) < 1e-9]  # as build_batch
    row["by_group/frac_all_good"] = sum(r > 0 for r in tied_rewards) / len(groups)
    row["by_group/frac_all_bad"] = sum(r <= 0 for r in tied_rewards) / len(groups)
    row["by_group/frac_mixed"] = 1 - len(tied_rewards) / len(groups)
    return row


def progress_line(it, total, row):
    kl = row.get("kl_sample_train_v1")
    return (f"iter {it + 1}/{total} | reward {row['reward_mean']:.3f} ± {row['reward_std']:.3f} | "
            f"tied {row['frac_groups_tied']:.2f} | trunc {row['frac_truncated']:.2f} | "
            + (f"loss {row['loss_sum']:.4g} | kl {kl if kl is not None else float('nan'):.2e} | "
               if row.get("loss_sum") is not None else "not trained (no datums: every group tied) | ")
            + f"sample {row['seconds_sampling']:.1f}s | "
            f"train {row['seconds_training']:.1f}s")


def sampler_version(iteration, start, max_staleness, save_every):
    """The weights (counted in optim steps) the rollouts of `iteration` are sampled with: its own when
    max_staleness is 0 (on-policy), else up to max_staleness steps older, but never older than the run's
    start or the last save point at or before it, so a --resume samples exactly what the uninterrupted
    run did."""
    floor = max(start, iteration // save_every * save_every) if save_every else start
    return max(iteration - max_staleness, floor)


class Sampling:
    """The sampler and the rollouts of each iteration. After every optim step `trained(version)` snapshots
    the weights and starts every iteration whose sampler_version() they are. With --max-staleness 0 that
    is the next iteration, sampled when asked for (today's on-policy loop); with K >= 1 the next K
    iterations sample in a background event loop while this one trains."""

    def __init__(self, rollouts, training_client, start, end, tasks_and_seeds, max_staleness, save_every):
        self.rollouts, self.tc, self.end, self.tasks_and_seeds = rollouts, training_client, end, tasks_and_seeds
        self.version_of = functools.partial(sampler_version, start=start, max_staleness=max_staleness,
                                            save_every=save_every)
        self.sampler = self.version = self.loop = None
        self.next, self.pending, self.snapshot_seconds = start, {}, 0.0
        if max_staleness:
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, name="sampling", daemon=True).start()

    def __enter__(self):
        self.trained(self.next)
        return self

    def __exit__(self, *exc):
        if not self.loop:
            for pending in self.pending.values():
                pending.close()  # never started
            return
        with contextlib.suppress(Exception):  # rollouts still in flight (an error or ^C): stop them
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def trained(self, version):
        """The weights now hold `version` optim steps: snapshot them (for the rollouts and evaluation of
        iterations still to run) and start every iteration whose sampler they are."""
        if version >= self.end:
            return
        t0 = time.time()
        self.sampler, self.version = self.tc.save_weights_and_get_sampling_client().result(), version
        self.snapshot_seconds += time.time() - t0
        while self.next < self.end and self.version_of(self.next) <= version:
            task_indices, seeds = self.tasks_and_seeds(self.next)
            self.pending[self.next] = self.start(self.rollouts.batch(self.sampler, task_indices, seeds, version))
            self.next += 1

    def start(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop) if self.loop else coroutine

    def wait(self, started):
        return started.result() if self.loop else asyncio.run(started)

    def groups(self, iteration):
        """The rollouts of `iteration` (waits for them)."""
        return self.wait(self.pending.pop(iteration))

    def run(self, coroutine):
        """Other sampling (evaluation) on the newest sampler, beside the rollouts in flight."""
        return self.wait(self.start(coroutine))

    def take_snapshot_seconds(self):
        seconds, self.snapshot_seconds = self.snapshot_seconds, 0.0
        return seconds


async def _cancel_all():
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# tinker_rl.py --rehearse on the real model from a checkpoint (--init-from) with your own single-turn reward: every
# iteration trains the same --batch-size tasks, ones the start partly solves, so the curve shows whether your reward
# teaches. Measured 2026-12-07 (a 24-step SFT start on 24 help-desk rows, a sparse 1.0/0.2/0 reward): tasks drawn
# afresh from all TASKS each iteration gave means that moved with the draw (0.39-0.64, no trend in 10 iterations);
# 4 fixed partly-solved tasks rose 0.36 -> 0.97 in 8. A scouting pass samples the first REHEARSAL_SCOUT_TASKS of
# TASKS once (free, locally) and keeps the --batch-size tasks whose samples your reward scores most unevenly.
REHEARSAL_SCOUT_TASKS = 12


def sample_groups(args, job, tc, context_window, task_indices, seeds, version=None):
    """One free pass of groups from the training client's current weights, before any training (--reward auto's
    check and the rehearsal's scouting): the same Rollouts, pools and seeds as an iteration's sampling."""
    ro = Rollouts(job, args, context_window)
    sampler = tc.save_weights_and_get_sampling_client().result()
    with ro.pools():
        return asyncio.run(ro.batch(sampler, task_indices, seeds, version))


def scouts_tasks(args, job) -> bool:
    """True when this run picks its fixed rehearsal tasks first (see REHEARSAL_SCOUT_TASKS); a --resume reads them
    back from config.json (rehearsal_tasks) instead."""
    return bool(args.rehearse and args.init_from and real_stand_in() and args.reward == "own" and not args.resume
                and job.env["env_step"] is None and job.n_train > args.batch_size)


def scout_rehearsal_tasks(args, job, tc, context_window):
    """Sample a group of each of the first REHEARSAL_SCOUT_TASKS tasks from the --init-from weights and set
    args.rehearsal_tasks to the --batch-size task indices with the widest spread of your reward (ties: the
    earlier task), trained every iteration; left None (tasks drawn as usual) when every group ties."""
    import statistics

    scouted = list(range(min(REHEARSAL_SCOUT_TASKS, job.n_train)))
    groups = sample_groups(args, job, tc, context_window, scouted, [group_seed(args.seed, "scout", i) for i in scouted])
    spread = [statistics.pstdev([e.reward for e in g.episodes]) for g in groups]
    keep = sorted(sorted(scouted, key=lambda i: (-spread[i], i))[:args.batch_size])
    means = [sum(e.reward for e in groups[i].episodes) / len(groups[i].episodes) for i in keep]
    if max(spread) == 0:
        say(f"rehearsal: your reward scores every sample of the first {len(scouted)} TASKS alike from this "
            "checkpoint; the tasks are drawn as usual")
        return
    args.rehearsal_tasks = keep
    say(f"rehearsal: sampled {args.group_size} replies to each of the first {len(scouted)} TASKS; every iteration "
        f"trains the {len(keep)} your reward scores most unevenly, so the curve shows it teach: TASKS "
        + ", ".join(f"[{i}] (mean {m:.2f})" for i, m in zip(keep, means))
        + " (config.json rehearsal_tasks; --rehearse off draws from all TASKS)")


def reward_label(args, reward: str | None = None) -> str:
    """Which reward trained (or is reported; `reward` overrides args.reward, e.g. "own" while --reward auto
    decides): the EDIT ME block's reward(), the calculator example's, or the stand-in a tiny model can earn."""
    if (reward or args.reward) != "own":
        return "the stand-in reward"
    return "the calculator example's reward() (--env calculator)" if args.env == "calculator" else "reward() (EDIT ME)"


def print_outcome(args, job, run, rewards, final, usd):
    """A few lines a newcomer can read, as tinker_sft.py ends: what trained, how the reward moved, where it is."""
    q, head, tail = quarter_means(rewards)  # rewards: every iteration's reward_mean, the resumed-from ones included
    start = f"from {args.init_from}" if args.init_from else f"a new LoRA (rank {args.lora_rank})"
    lines = ["", "==== what happened ====",
             f"trained  {model_label(args.model_name)}, {start}: {args.iterations} iterations of {args.batch_size} "
             f"tasks x {args.group_size} samples ({args.loss_fn}, --learning-rate {args.learning_rate:g}), reward "
             f"from {reward_label(args)}",
             f"reward   mean {head:.3f} over the first {q} iteration(s) -> {tail:.3f} over the last {q} "
             f"(per iteration: {', '.join(f'{r:.2f}' for r in rewards[-12:])})",
             f"record   {short_path(run.path)}/ (config.json, metrics.jsonl, rollouts.jsonl, checkpoints.jsonl); "
             f"final sampler {final.get('sampler_path')}",
             f"on Tinker this run cost about ${usd:.4f} ({args.model_name}, as metered in cost/cumulative_usd"
             f"{stand_in_cost_note()})",
             "next     sample it: " + script_command("tinker_infer.py", "--run", run.path)]
    page = write_report(run.path)
    if page:
        lines.insert(-1, f"report   {page} (its curves and checkpoints)")
    say("\n".join(lines))


def rehearsal_env(env, name, reward_source, flag, scripted, *, example):
    """The environment a tinker_rl.py rehearsal trains, said in one banner: `env` (the --env NAME's) with its
    scripted turns (REHEARSAL_TURNS), with its own reward (single-turn, `reward_source` "own" or "auto"), or scored
    by the stand-in task (common/rehearsal.py). `flag`: --rehearse as given; `example`: a shipped example
    environment (--env calculator), not the EDIT ME block's."""
    mode = (f"--rehearse {flag}" + (": on, TINKER_BASE_URL is this machine" if flag == "auto" else "")
            + ("" if on_local_backend() else ", forced"))
    if scripted is not None:
        group_size = preset(RL_REHEARSAL)["group_size"]
        say(f"rehearsal ({mode}): your environment '{name}' from the EDIT ME block ({tools_named(env['tools'])}); in "
            f"each group the first half of the samples (e.g. {scripted_share(group_size)} of {group_size}) play "
            "REHEARSAL_TURNS, rendered by the chat template as the model's own tokens with the sampler's logprobs, "
            "the rest are sampled; your " + ("env_step() and reward()" if env["env_step"] else "reward()")
            + " score every episode and train; --rehearse off trains as written")
        return dict(env, scripted_turns=scripted)
    if reward_source == "own" and env["env_step"] is not None:  # the real model from a tool-call warm-up
        say(f"rehearsal ({mode}): {name} episodes, scored and stepped by its own env_step() and reward(), from "
            "the --init-from checkpoint (a tool-call warm-up: references/agentic-rl.md); metrics.jsonl counts "
            "what env_step() reports (env/<key>); --rehearse off trains with your settings")
        return env
    if reward_source in ("own", "auto") and env["env_step"] is None:
        say(f"rehearsal ({mode}): your TASKS and reward() with "
            "the rehearsal's settings" + (" if the first samples score differently under it, else a stand-in task"
                                          if reward_source == "auto" else "") + "; --rehearse off trains with your settings")
        return env
    say(f"rehearsal ({mode}): "
        + ("the tiny model's task 'say something' replaces TASKS" if env["env_step"] is None else
           f"{name} episodes scored by 'said something', a first turn without a tool call is reminded"
           + ("" if example else "; your reward is not trained: define REHEARSAL_TURNS in the EDIT ME "
              "block to rehearse your env_step() and reward() on scripted turns"))
        + "; --rehearse off trains the example as written")
    if env["env_step"] is None:
        return dict(env, tasks=REHEARSAL_TASKS[:8], eval_tasks=REHEARSAL_TASKS[8:], render_prompt=rehearsal_prompt,
                    reward=rehearsal_reward)
    return dict(env, env_step=functools.partial(rehearsal_env_step, env["env_step"]))


# ---- The cost of RL iterations: the estimate before the run (and its assumptions per episode), the running
# --max-usd check and the stop it ends with

def estimate_cost(args, job, context_window, start=0):
    """Dollar estimate of iterations start..--iterations (what a --resume has left to pay for);
    completions counted at --max-tokens, an upper bound. BudgetError above --max-usd."""
    pricing = load_pricing()
    remaining = max(0, args.iterations - start)
    tokens = estimate_tokens(args, job, pricing, remaining) if pricing else {}
    if pricing:
        say_assumptions(args, job)
    label = "rl" if not start else f"rl, remaining {remaining} of {args.iterations} iterations after --resume"
    return estimate(args.model_name, tokens, args.max_usd, label=label, context=context_window)


def iteration_estimate_usd(args, job, context_window):
    """The dollar estimate of one iteration, as the pre-run estimate counts it (for the running --max-usd
    check); None without tinker_pricing.py or a price for the model."""
    pricing = load_pricing()
    if pricing is None:
        return None
    try:
        est = pricing.estimate_cost(args.model_name, context=context_window, **estimate_tokens(args, job, pricing, 1))
    except ValueError:
        return None
    return est["usd"]["total"]


def over_budget(args, run, tc, job, it, spent, next_usd):
    """The BudgetError that stops a run before iteration `it`: saved first (when `it` has no checkpoint yet),
    so --resume continues exactly there."""
    rows = run.checkpoints()
    if it > 0 and not (rows and rows[-1].get("next_iteration") == it):
        save_checkpoint(tc, run, f"{it:06d}", it, it * args.batch_size // job.n_train, job.fmt)
        rows = run.checkpoints()
    saved = (f"saved at iteration {it} ({rows[-1]['state_path']})" if rows and rows[-1].get("next_iteration") == it
             else "nothing to save yet")
    return BudgetError(
        f"--max-usd {args.max_usd:g}: ${spent:.4f} metered so far (cost/cumulative_usd in "
        f"{os.path.join(short_path(run.path), 'metrics.jsonl')}) + ${next_usd:.4f} estimated for the next iteration "
        f"would pass it; stopped before iteration {it} of {args.iterations}, {saved}. Continue with the same "
        "command plus --resume and a higher --max-usd (or fewer --iterations)")


# The estimate's assumption for a multi-turn episode's observations (a tool result, a user reply) without
# --estimate-from: tokens added before each later turn.
ASSUMED_OBSERVATION_TOKENS = 64


def estimate_assumptions(args, job):
    """What the cost estimate assumes per episode: turns, sampled tokens per turn, observation tokens before each
    later turn, and where the numbers come from (upper bounds, or measured with --estimate-from)."""
    multi = job.env["env_step"] is not None
    out = {"turns": args.max_turns if multi else 1, "completion_tokens": args.max_tokens,
           "observation_tokens": ASSUMED_OBSERVATION_TOKENS if multi and args.max_turns > 1 else 0,
           "prompt_tokens": sum(map(len, job.prompts)) / len(job.prompts),
           "source": "upper bounds: --max-turns turns, --max-tokens per turn"
                     + (f", {ASSUMED_OBSERVATION_TOKENS} observation tokens assumed" if multi else "")
                     + "; measure them with --estimate-from RUN_DIR"}
    if args.estimate_from:
        out.update(measured_assumptions(args.estimate_from))
    return out


def measured_assumptions(run_dir):
    """Turns per episode, sampled tokens per turn and observation tokens per later turn in RUN_DIR/rollouts.jsonl."""
    path = os.path.join(run_dir, "rollouts.jsonl")
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn last line
    except OSError as e:
        raise DataError(f"--estimate-from {run_dir}: cannot read {path} ({e.strerror}); pass the --log-path of a "
                        "tinker_rl.py run that wrote rollouts (--trace-every 1)") from None
    turns = [r["turns"] for r in rows if isinstance(r, dict) and r.get("turns")]
    if not turns:
        raise DataError(f"--estimate-from {run_dir}: {path} holds no rollouts with turns; pass the --log-path of a "
                        "tinker_rl.py run that wrote rollouts (--trace-every 1)")
    actions = [len(t["action_tokens"]) for ts in turns for t in ts]
    later = [len(t["observation_tokens"]) for ts in turns for t in ts[1:]]
    return {"turns": sum(map(len, turns)) / len(turns), "completion_tokens": sum(actions) / len(actions),
            "observation_tokens": sum(later) / len(later) if later else 0,
            "source": f"measured on {len(turns)} episodes of {path}"}


def estimate_tokens(args, job, pricing, iterations):
    """Tokens of `iterations` iterations as tinker_pricing.rl_tokens counts them, under estimate_assumptions()."""
    a = estimate_assumptions(args, job)
    return pricing.rl_tokens(iterations, args.batch_size, args.group_size, a["prompt_tokens"], a["completion_tokens"],
                             turns=a["turns"], avg_observation=a["observation_tokens"] if a["turns"] > 1 else 0)


def say_assumptions(args, job):
    a = estimate_assumptions(args, job)
    say(f"estimate assumes per episode: {a['turns']:.3g} turn(s), {a['completion_tokens']:.4g} sampled tokens per "
        f"turn, {a['observation_tokens']:.4g} observation tokens before each later turn, a {a['prompt_tokens']:.0f}-token "
        f"prompt (mean) ({a['source']})")
# ==== END SHARED CODE (sha256 c43373edddb7) ====


if __name__ == "__main__":
    exit_process(run_cli(main))
