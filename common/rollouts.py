"""RL rollouts for tinker_rl.py: tasks and seeds per iteration, episodes sampled with bounded concurrency
and environment calls that overlap, group-relative advantages, datums, the rollout trace, and the
schedule of sampler versions (on-policy, or up to --max-staleness steps behind while training runs); what a
run says about them (the metrics row, the progress line, the rehearsal's banner, the summary at the end); the
cost of iterations (the estimate and its assumptions per episode, the running --max-usd check)."""
from __future__ import annotations

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

from errors import BudgetError, DataError, ScriptError, one_line, say, script_command, short_path  # splice: drop
from onpolicy import RequestGate, rl_datum, save_checkpoint  # splice: drop
from rehearsal import RL_REHEARSAL, model_label, on_local_backend, preset, quarter_means, real_stand_in  # splice: drop
from rehearsal import stand_in_cost_note  # splice: drop
from rehearsal import REHEARSAL_TASKS, rehearsal_env_step, rehearsal_prompt, rehearsal_reward  # splice: drop
from render import _frozen_clock  # splice: drop
from run_record import write_report  # splice: drop
from service import estimate, load_pricing  # splice: drop


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
