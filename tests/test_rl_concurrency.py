"""tinker_rl.py rollouts under load, with a fake sampler and no wall-clock assertions: environment calls
overlap (plain functions in the --env-workers pool, async ones awaited), at most --max-in-flight sampling
requests at once, a 429 retried without failing the iteration, tokenizer work off the event loop."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

import tinker_rl
from test_rl_units import FakeSampler, fake_tinker, qwen, rollout, rows  # noqa: F401  (fixtures)


class EventLog:
    """(event, call id) pairs in order; max_overlap = most calls between their enter and exit at once."""

    def __init__(self):
        self.events, self.lock, self.active, self.max_overlap = [], threading.Lock(), 0, 0

    def enter(self, ident):
        with self.lock:
            self.events.append(("enter", ident))
            self.active += 1
            self.max_overlap = max(self.max_overlap, self.active)

    def exit(self, ident):
        with self.lock:
            self.events.append(("exit", ident))
            self.active -= 1


def blank_reply(fmt):
    return lambda prompt, call, i: ([1040] * (i + 1) + [fmt["stop"][0]], "stop")


def test_plain_reward_functions_run_at_once_in_the_env_worker_pool(qwen):
    tok, fmt, _ = qwen
    log, barrier = EventLog(), threading.Barrier(4, timeout=60)

    def reward(task, completion):
        ident = (task["a"], len(completion))
        log.enter(ident)
        barrier.wait()  # returns only when 4 calls are inside at once; sequential calls would break it
        log.exit(ident)
        return float(len(completion))

    env = dict(tinker_rl.load_env("single"), reward=reward)
    groups, *_ = rollout(tok, fmt, env, blank_reply(fmt), tasks=env["tasks"][:4], group_size=4, env_workers=4)
    assert log.max_overlap == 4 and len(log.events) == 32
    assert log.events[:4] == [("enter", e[1]) for e in log.events[:4]]  # four entered before any left
    assert [e.reward for e in groups[0].episodes] == [float(len(tok.decode([1040] * (i + 1)))) for i in range(4)]


def test_env_workers_0_calls_the_environment_one_at_a_time_on_the_event_loop(qwen):
    tok, fmt, _ = qwen
    log, threads = EventLog(), set()

    def reward(task, completion):
        threads.add(threading.current_thread().name)
        log.enter(task["a"])
        log.exit(task["a"])
        return float(len(completion))

    env = dict(tinker_rl.load_env("single"), reward=reward)
    rollout(tok, fmt, env, blank_reply(fmt), tasks=env["tasks"][:4], group_size=4, env_workers=0)
    assert log.max_overlap == 1 and len(log.events) == 32 and threads == {threading.main_thread().name}


def test_async_env_step_is_awaited_and_every_episode_steps_at_once(qwen):
    """32 episodes (8 groups x 4): each env_step waits until all 32 have entered, which only concurrent
    awaiting allows (a sequential caller would time out and fail the rollout)."""
    tok, fmt, _ = qwen
    log = EventLog()
    everyone_in = {}

    async def env_step(task, conversation, model_turn, rng):
        gate = everyone_in.setdefault("gate", asyncio.Event())
        log.enter(task["a"])
        if log.active == 32:
            gate.set()
        await asyncio.wait_for(gate.wait(), timeout=60)
        log.exit(task["a"])
        return None, float(len(model_turn)), True

    env = dict(tinker_rl.load_env("calculator"), env_step=env_step)
    groups, *_ = rollout(tok, fmt, env, blank_reply(fmt), tasks=env["tasks"][:8], group_size=4)
    assert log.max_overlap == 32 and len(groups) == 8
    assert all(len(e.turns) == 1 for g in groups for e in g.episodes)


def test_sampling_requests_in_flight_never_exceed_max_in_flight(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("calculator")

    def reply(prompt, call, i):  # a broken tool call every turn: three sampled turns per episode
        return tok.encode("<tool_call>\n{oops}\n</tool_call>") + [fmt["stop"][0]], "stop"

    sampler = FakeSampler(reply, delay=0.005)
    groups, sampler, *_ = rollout(tok, fmt, env, reply, tasks=env["tasks"][:8], group_size=4, max_turns=3,
                                  max_in_flight=3, sampler=sampler)
    assert sampler.max_inflight == 3  # reached, never exceeded
    assert len(sampler.calls) == 8 + 8 * 4 * 2  # one group call per task, then one per later turn
    assert all(len(e.turns) == 3 for g in groups for e in g.episodes)


def test_a_429_is_retried_and_counted_without_failing_the_iteration(qwen, monkeypatch):
    tok, fmt, _ = qwen
    monkeypatch.setattr(tinker_rl, "RETRY_BASE_S", 0.0)
    env = tinker_rl.load_env("single")
    sampler = FakeSampler(blank_reply(fmt), fail={0, 2, 3})
    groups, sampler, _, ro = rollout(tok, fmt, env, None, tasks=env["tasks"][:4], group_size=2, sampler=sampler)
    assert sampler.failed == 3 and ro.take_retries() == 3
    assert len(sampler.calls) == 4 + 3 and [len(g.episodes) for g in groups] == [2, 2, 2, 2]


def test_an_error_that_is_not_transient_is_not_retried(qwen, monkeypatch):
    tok, fmt, _ = qwen

    class BadRequest(Exception):
        status_code = 400

    class Refusing(FakeSampler):
        async def sample(self, prompt, num_samples, sampling_params):
            self.calls.append(prompt)
            raise BadRequest("prompt too long")

    env = tinker_rl.load_env("single")
    with pytest.raises(BadRequest):
        rollout(tok, fmt, env, None, tasks=env["tasks"][:2], sampler=Refusing(None))


def test_retries_reach_the_metrics_row(fake_tinker, tmp_path, monkeypatch):
    monkeypatch.setattr(tinker_rl, "RETRY_BASE_S", 0.0)
    fake_tinker.sampler.fail = {1, 2}  # call 1 fails, so does its retry (call 2)
    log = tmp_path / "run"
    assert fake_tinker.run("--iterations", "2", "--log-path", str(log)) == 0
    assert [m["sample_retries"] for m in rows(log / "metrics.jsonl")] == [2, 0]


def test_tokenizer_work_runs_off_the_event_loop(qwen, monkeypatch):
    tok, fmt, _ = qwen
    threads = set()
    decode = tinker_rl.completion_text

    def recording(*args):
        threads.add(threading.current_thread().name)
        return decode(*args)

    monkeypatch.setattr(tinker_rl, "completion_text", recording)
    env = tinker_rl.load_env("single")
    rollout(tok, fmt, env, blank_reply(fmt), tasks=env["tasks"][:2])
    assert threads and all(name.startswith("tokenizer") for name in threads), threads


def test_trace_rows_rebuild_exactly_the_datums_the_update_used(qwen, monkeypatch, tmp_path):
    """rollouts.jsonl of a multi-turn run: prompt + completion tokens, sampler logprobs and the advantage
    of each trained rollout, shifted by one, are the datums forward_backward received."""
    from test_rl_units import FakeService

    tok, fmt, path = qwen
    eot = fmt["stop"][0]

    def reply(prompt, call, i):
        if "<tool_response>" not in tok.decode(prompt):
            return tok.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n'
                              "</tool_call>") + [eot], "stop"
        return tok.encode("6" * (call % 3 + 1)) + [eot], "stop"  # answers differ inside a group

    service = FakeService(FakeSampler(reply))
    monkeypatch.setattr(tinker_rl, "connect", lambda model_name, **kw: (service, 32768))
    monkeypatch.setattr(tinker_rl, "calculator_reward", lambda task, completion: float(len(completion)))
    log = tmp_path / "run"
    assert tinker_rl.run_cli(tinker_rl.main, ["--env", "calculator", "--tokenizer", path, "--batch-size", "2",
                                              "--group-size", "3", "--max-tokens", "40", "--iterations", "2",
                                              "--log-path", str(log)]) == 0
    trace = rows(log / "rollouts.jsonl")
    assert len(trace) == 2 * 2 * 3 and {r["iteration"] for r in trace} == {0, 1}
    assert all(len(r["turns"]) == 2 and r["turns"][1]["observation_tokens"] for r in trace)
    for it, (datums, loss_fn, _) in enumerate(service.trained):
        rebuilt = []
        for r in (r for r in trace if r["iteration"] == it and r["trained"]):
            tokens = r["prompt_tokens"] + r["completion_tokens"]
            lps = [0.0] * len(r["prompt_tokens"]) + r["sampler_logprobs"]
            # advantage on action tokens only: rebuild the mask from the turn spans
            mask = [0.0] * len(r["prompt_tokens"])
            for turn in r["turns"]:
                mask += [0.0] * len(turn["observation_tokens"]) + [1.0] * len(turn["action_tokens"])
            rebuilt.append({"model_input": tokens[:-1], "target_tokens": tokens[1:], "logprobs": lps[1:],
                            "advantages": [r["advantage"] * m for m in mask[1:]]})
        sent = [{"model_input": d.model_input.to_ints(),
                 **{k: v.tolist() for k, v in d.loss_fn_inputs.items()}} for d in datums]
        assert len(sent) == len(rebuilt) == sum(1 for r in trace if r["iteration"] == it and r["trained"]) > 0
        assert loss_fn == "importance_sampling"
        for got, want in zip(sent, rebuilt):
            assert got["model_input"] == want["model_input"] and got["target_tokens"] == want["target_tokens"]
            assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-6)
            assert got["advantages"] == pytest.approx(want["advantages"], abs=1e-6)
    text = trace[0]["completion_text"]
    assert "<tool_call>" in text and "<tool_response>\n6\n</tool_response>" in text
    assert json.loads(json.dumps(trace[0])) == trace[0]


def test_trace_every_keeps_every_nth_iteration(fake_tinker, tmp_path):
    log = tmp_path / "run"
    assert fake_tinker.run("--iterations", "5", "--trace-every", "2", "--log-path", str(log)) == 0
    assert sorted({r["iteration"] for r in rows(log / "rollouts.jsonl")}) == [0, 2, 4]
    assert fake_tinker.run("--iterations", "1", "--trace-every", "0", "--log-path", str(log), "--overwrite") == 0
    assert not (log / "rollouts.jsonl").exists()
