"""tinker_rl.py without a server: advantages, datums, rollouts with a scripted sampler, the run record
(budget refusal, torn rows, resume guard) through main() with a fake Tinker, guards, CLI errors."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import tinker_rl
from assets import build_tokenizers
from tinker_rl import Turn

SCRIPT = Path(tinker_rl.__file__)


@pytest.fixture(scope="module")
def qwen(offline_tokenizer):
    path = offline_tokenizer("Qwen3-8B")
    tok = tinker_rl.load_tokenizer(path)
    return tok, tinker_rl.chat_format(tok, name=path), path


# ---------------------------------------------------------------- a fake Tinker for main()


class Done:
    """A finished future: .result() and await both give the value."""

    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value

    def __await__(self):
        if False:
            yield
        return self.value


class FakeSampler:
    """Stands in for tinker.SamplingClient: replies come from `reply(prompt_tokens, call_index, sample_index)`
    -> (tokens, stop_reason); counts requests in flight; `fail` raises on chosen call indices."""

    def __init__(self, reply, delay=0.0, fail=()):
        self.reply, self.delay, self.fail = reply, delay, set(fail)
        self.calls, self.inflight, self.max_inflight, self.failed = [], 0, 0, 0

    async def sample(self, prompt, num_samples, sampling_params):
        tokens = prompt.to_ints()
        index = len(self.calls)
        self.calls.append((tokens, num_samples, sampling_params))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            await asyncio.sleep(self.delay)
            if index in self.fail:
                self.failed += 1
                raise RateLimited("429 Too Many Requests")
        finally:
            self.inflight -= 1
        seqs = [self.reply(tokens, index, i) for i in range(num_samples)]
        return SimpleNamespace(sequences=[SimpleNamespace(tokens=t, logprobs=[-0.25 - 0.01 * k for k in range(len(t))],
                                                          stop_reason=s) for t, s in seqs])


class RateLimited(Exception):
    status_code = 429


class FakeTraining:
    def __init__(self, service):
        self.service = service

    def save_weights_and_get_sampling_client(self):
        return Done(self.service.sampler)

    def forward_backward(self, datums, loss_fn, loss_fn_config):
        self.service.trained.append((datums, loss_fn, loss_fn_config))
        outputs = [{"logprobs": d.loss_fn_inputs["logprobs"].tolist()} for d in datums]
        return Done(SimpleNamespace(metrics={"loss:sum": -1.0}, loss_fn_outputs=outputs))

    def optim_step(self, params):
        self.service.learning_rates.append(params.learning_rate)
        return Done(None)

    def save_state(self, name, ttl_seconds=None):
        return Done(SimpleNamespace(path=f"tinker://fake/weights/{name}"))

    def save_weights_for_sampler(self, name):
        return Done(SimpleNamespace(path=f"tinker://fake/sampler_weights/{name}"))


class FakeService:
    def __init__(self, sampler):
        self.sampler, self.trained, self.learning_rates, self.resumed_from = sampler, [], [], []

    def create_lora_training_client(self, base_model, rank, seed=None):
        return Done(FakeTraining(self))

    def create_training_client_from_state_with_optimizer(self, path):
        self.resumed_from.append(path)
        return Done(FakeTraining(self))

    def create_training_client_from_state(self, path):
        self.initialised_from = getattr(self, "initialised_from", []) + [path]
        return Done(FakeTraining(self))


def varied_reply(eot):
    """Sample i of a group is i+1 copies of one token: rewards (text length) differ inside every group."""
    return lambda prompt, call, i: ([1040] * (i + 1) + [eot], "stop")


@pytest.fixture
def fake_tinker(monkeypatch, qwen):
    """main() against a fake service: the single-turn example scored by reply length."""
    tok, fmt, path = qwen
    service = FakeService(FakeSampler(varied_reply(fmt["stop"][0])))
    monkeypatch.setattr(tinker_rl, "connect", lambda model_name, **kw: (service, 32768))
    monkeypatch.setattr(tinker_rl, "reward", lambda task, completion: float(len(completion)))
    monkeypatch.setattr(tinker_rl, "TASKS", tinker_rl.TASKS[:6])

    def run(*argv):
        return tinker_rl.run_cli(tinker_rl.main, ["--tokenizer", path, "--batch-size", "2", "--group-size", "3",
                                                  "--max-tokens", "8", *argv])

    service.run = run
    return service


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- defects of the old script (issue 12)


def test_a_run_refused_by_max_usd_leaves_the_previous_run_byte_identical(fake_tinker, tmp_path, capsys):
    log = tmp_path / "run"
    assert fake_tinker.run("--iterations", "2", "--save-every", "1", "--log-path", str(log)) == 0
    before = snapshot(log)
    # report.html: the end summary writes the run's report (tinker_report.py is beside the script)
    assert set(before) == {"config.json", "metrics.jsonl", "checkpoints.jsonl", "rollouts.jsonl", "report.html"}
    capsys.readouterr()
    assert fake_tinker.run("--iterations", "2", "--log-path", str(log), "--overwrite", "--max-usd", "0.000001") == 3
    assert "exceeds --max-usd" in capsys.readouterr().err
    assert fake_tinker.run("--iterations", "5", "--log-path", str(log), "--resume", "--max-usd", "0.000001") == 3
    assert snapshot(log) == before


def test_resume_after_a_torn_last_checkpoint_row_starts_from_the_last_complete_row(fake_tinker, tmp_path, capsys):
    log = tmp_path / "run"
    assert fake_tinker.run("--iterations", "2", "--save-every", "1", "--log-path", str(log)) == 0
    with open(log / "checkpoints.jsonl", "a") as f:  # a kill in the middle of the next row
        f.write('{"name": "000003", "step": 3, "next_iteration": 3, "state_path": "tinker://fake/wei')
    capsys.readouterr()
    assert fake_tinker.run("--iterations", "3", "--save-every", "1", "--log-path", str(log), "--resume") == 0
    assert fake_tinker.resumed_from == ["tinker://fake/weights/final"]
    assert [m["iteration"] for m in rows(log / "metrics.jsonl")] == [0, 1, 2]
    ckpts = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()
             if line.strip().endswith("}")]
    assert [(c["name"], c["next_iteration"]) for c in ckpts] == [("000001", 1), ("final", 2), ("final", 3)]
    assert json.loads(capsys.readouterr().out)["state_path"] == "tinker://fake/weights/final"


def test_eval_rows_land_in_metrics_at_the_eval_steps(fake_tinker, qwen, tmp_path):
    """--eval-every 2 over 5 iterations: iterations 0, 2 and 4 carry the held-out scores (greedy: one sample
    at temperature 0 per held-out task; pass@3: three samples at the run's temperature)."""
    log = tmp_path / "run"
    assert fake_tinker.run("--iterations", "5", "--eval-every", "2", "--eval-samples", "3", "--log-path", str(log)) == 0
    metrics = rows(log / "metrics.jsonl")
    assert [m["iteration"] for m in metrics if "eval/greedy_reward" in m] == [0, 2, 4]
    held_out = len(tinker_rl.EVAL_TASKS)
    first_sample = float(len(qwen[0].decode([1040])))  # the fake scores a reply by its length
    for m in metrics:
        if m["iteration"] % 2 == 0:
            assert m["eval/tasks"] == held_out and m["eval/greedy_reward"] == first_sample
            assert m["eval/pass@3"] == 1.0  # every reply scores above PASS_REWARD 1.0
    calls = fake_tinker.sampler.calls
    greedy = [c for c in calls if c[2].temperature == 0.0]
    assert len(greedy) == 3 * held_out and all(c[1] == 1 for c in greedy)
    assert sum(1 for c in calls if c[1] == 3) == 3 * held_out + 5 * 2  # pass@3 calls, 2 training groups a step


def test_eval_without_held_out_tasks_is_refused(qwen, monkeypatch, capsys):
    monkeypatch.setattr(tinker_rl, "EVAL_TASKS", [])
    assert tinker_rl.run_cli(tinker_rl.main, ["--dry-run", "--tokenizer", qwen[2], "--eval-every", "5"]) == 2
    assert "the example has no EVAL_TASKS" in capsys.readouterr().err


@pytest.mark.parametrize("change, named", [
    (["--learning-rate", "1e-4"], "--learning-rate 4e-05 -> 0.0001"),
    (["--loss-fn", "ppo"], "--loss-fn 'importance_sampling' -> 'ppo'"),
    (["--temperature", "0.7"], "--temperature 1.0 -> 0.7"),
    (["--tokenizer", "LLAMA"], "format (tokenizer, chat template"),
    ("tasks", "--tasks-sha256"),
])
def test_resume_with_changed_settings_is_refused_naming_the_setting(fake_tinker, tmp_path, capsys, monkeypatch,
                                                                  offline_tokenizer, change, named):
    log = tmp_path / "run"
    assert fake_tinker.run("--iterations", "1", "--log-path", str(log)) == 0
    before = snapshot(log)
    if change == "tasks":
        monkeypatch.setattr(tinker_rl, "TASKS", tinker_rl.TASKS[1:])
        change = []
    change = [offline_tokenizer("Llama-3.1-8B-Instruct") if c == "LLAMA" else c for c in change]
    capsys.readouterr()
    assert fake_tinker.run("--iterations", "2", "--log-path", str(log), "--resume", *change) == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "--resume with different settings than the saved run" in line and named in line, line
    assert snapshot(log) == before and fake_tinker.resumed_from == []


def test_resume_never_rewrites_config_json(fake_tinker, tmp_path):
    log = tmp_path / "run"
    assert fake_tinker.run("--iterations", "1", "--log-path", str(log)) == 0
    config = (log / "config.json").read_bytes()
    assert fake_tinker.run("--iterations", "2", "--log-path", str(log), "--resume") == 0
    assert (log / "config.json").read_bytes() == config
    assert [m["iteration"] for m in rows(log / "metrics.jsonl")] == [0, 1]


@pytest.mark.parametrize("family", [n for n in build_tokenizers.NAMES if not n.endswith("-Base")])
def test_prompts_stop_tokens_and_frozen_date_are_the_sft_scripts_on_every_family(offline_tokenizer, family,
                                                                                 monkeypatch):
    """RL samples from exactly the prompt SFT trains after, stops where SFT's datums end, and prints the
    same frozen date (Llama 3.1 and gpt-oss print today's date unless it is frozen)."""
    import tinker_sft

    path = offline_tokenizer(family)
    tok = tinker_sft.load_tokenizer(path)
    args = tinker_rl.parse_args(["--tokenizer", path])
    tinker_rl.check_settings(args)
    job = tinker_rl.prepare(args)
    sft_fmt = tinker_sft.chat_format(tok, name=tinker_sft.tokenizer_record(path))
    assert job.fmt == sft_fmt
    messages = tinker_rl.render_prompt(tinker_rl.TASKS[0])
    assert job.prompts[0] == tinker_sft.generation_prompt(messages, tok, sft_fmt)
    # SFT's datum of that prompt plus an answer ends on the token RL stops at
    [datum] = tinker_sft.render_example({"messages": messages + [{"role": "assistant", "content": "42"}]},
                                        tok, sft_fmt)
    assert datum.tokens[: len(job.prompts[0])] == job.prompts[0]
    assert datum.tokens[-1] in job.fmt["stop"]
    text = tok.decode(job.prompts[0])
    if family.startswith("Llama"):
        assert "26 Jul 2024" in text
    if family.startswith("gpt-oss"):
        assert "2024-07-26" in text


def test_base_model_renders_raw_with_eos_stop(offline_tokenizer, monkeypatch):
    import tinker_sft

    path = offline_tokenizer("Qwen3-8B-Base")
    tok = tinker_sft.load_tokenizer(path)
    monkeypatch.setattr(tinker_rl, "render_prompt", lambda task: f"{task['a']} * {task['b']} =")
    assert not tok.chat_template  # a base model's prompts are plain text, stopped by EOS
    args = tinker_rl.parse_args(["--tokenizer", path])
    tinker_rl.check_settings(args)
    job = tinker_rl.prepare(args)
    assert job.fmt["kind"] == "raw" and job.fmt["stop"] == [tok.eos_token_id]
    assert job.fmt == tinker_sft.raw_format(tok, name=tinker_sft.tokenizer_record(path))


# ---------------------------------------------------------------- advantages and datums


def test_advantage_is_reward_minus_group_mean():
    assert tinker_rl.advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert tinker_rl.advantages([3.0, 1.0]) == [1.0, -1.0]


def test_normalize_std_divides_by_the_group_std():
    adv = tinker_rl.advantages([2.0, 0.0], normalize_std=True)
    assert adv[0] == pytest.approx(1.0, abs=1e-5) and adv[1] == pytest.approx(-1.0, abs=1e-5)


def test_single_turn_datum_zero_advantage_on_prompt_and_logprobs_on_targets():
    prompt, action, lps = [11, 12, 13, 14], [21, 22, 23], [-0.5, -1.5, -2.5]
    [(tokens, seq_lps, advs, mask)] = tinker_rl.episode_sequences([Turn(prompt, action, lps, "stop")], 0.75)
    datum = tinker_rl.rl_datum(tokens, seq_lps, advs)
    inputs = {k: v.tolist() for k, v in datum.loss_fn_inputs.items()}
    assert set(inputs) == {"target_tokens", "logprobs", "advantages"}  # no mask key reaches the server
    assert datum.model_input.to_ints() == [11, 12, 13, 14, 21, 22]
    assert inputs["target_tokens"] == [12, 13, 14, 21, 22, 23]
    # position i predicts target i: the sampler's logprob of each sampled token sits on that token
    assert inputs["logprobs"] == pytest.approx([0, 0, 0, -0.5, -1.5, -2.5])
    assert inputs["advantages"] == pytest.approx([0, 0, 0, 0.75, 0.75, 0.75])
    assert mask[1:] == [0, 0, 0, 1, 1, 1]


def test_multi_turn_episode_that_extends_its_context_is_one_datum():
    prompt, a1, obs, a2 = [1, 2, 3], [40, 41], [90, 91, 92], [50, 51, 52]
    turns = [Turn(prompt, a1, [-0.1, -0.2], "stop"), Turn(prompt + a1 + obs, a2, [-0.3, -0.4, -0.5], "stop")]
    [seq] = tinker_rl.episode_sequences(turns, -2.0)
    datum = tinker_rl.rl_datum(*seq[:3])
    inputs = {k: v.tolist() for k, v in datum.loss_fn_inputs.items()}
    full = prompt + a1 + obs + a2
    assert datum.model_input.to_ints() == full[:-1] and inputs["target_tokens"] == full[1:]
    by_target = {t: (lp, adv) for t, lp, adv in zip(inputs["target_tokens"], inputs["logprobs"], inputs["advantages"])}
    for t in obs + prompt[1:]:  # observation and prompt positions: no advantage, no sampler logprob
        assert by_target[t] == (0.0, 0.0)
    for t, lp in zip(a1 + a2, [-0.1, -0.2, -0.3, -0.4, -0.5]):
        assert by_target[t] == (pytest.approx(lp), -2.0)


def test_turn_that_does_not_extend_the_context_starts_a_new_datum():
    turns = [Turn([1, 2], [3, 4], [-1.0, -1.0], "stop"), Turn([7, 8, 9], [5], [-2.0], "stop")]
    seqs = tinker_rl.episode_sequences(turns, 1.0)
    assert [s[0] for s in seqs] == [[1, 2, 3, 4], [7, 8, 9, 5]]
    assert [s[2] for s in seqs] == [[0, 0, 1, 1], [0, 0, 0, 1]]


def test_constant_reward_groups_are_skipped_and_counted():
    def ep(r):
        return tinker_rl.Episode([Turn([1, 2], [3, 4], [-0.1, -0.2], "stop")], r)

    groups = [tinker_rl.Group(0, 1, [ep(1.0), ep(1.0)]), tinker_rl.Group(1, 2, [ep(1.0), ep(0.0)]),
              tinker_rl.Group(2, 3, [ep(0.0), ep(0.0)])]
    batch = tinker_rl.build_batch(groups)
    assert batch.tied == 2 and len(batch.datums) == 2 == len(batch.masks)
    assert [d.loss_fn_inputs["advantages"].tolist()[-1] for d in batch.datums] == [0.5, -0.5]
    assert batch.advantages == {(1, 0): 0.5, (1, 1): -0.5}


def test_kl_estimate_compares_sampler_and_learner_logprobs_on_sampled_tokens_only():
    datum = tinker_rl.rl_datum([1, 2, 3, 4], [0.0, 0.0, -1.0, -2.0], [0.0, 0.0, 1.0, 1.0])
    learner = SimpleNamespace(tolist=lambda: [-9.0, -1.5, -2.0])  # position 0 is prompt: ignored
    m = tinker_rl.kl_metrics([datum], [[0, 1, 1]], [{"logprobs": learner}])
    assert m["kl_sample_train_v1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["kl_sample_train_v2"] == pytest.approx(0.5 * (0.25 + 0.0) / 2)
    assert m["entropy"] == pytest.approx(1.5)


def settings(*argv):
    args = tinker_rl.parse_args(list(argv))
    tinker_rl.check_settings(args)
    return args


def test_loss_fn_config_defaults_and_overrides():
    def cfg(*argv):
        return tinker_rl.loss_fn_config(settings(*argv))

    assert cfg() is None
    assert cfg("--loss-fn", "ppo") == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert cfg("--loss-fn", "cispo") == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert cfg("--loss-fn", "dro") == {"beta": 0.05}
    assert cfg("--loss-fn", "ppo", "--clip-high-threshold", "1.3") == {"clip_low_threshold": 0.8,
                                                                     "clip_high_threshold": 1.3}
    with pytest.raises(tinker_rl.DataError, match="ppo or cispo"):
        cfg("--clip-low-threshold", "0.5")


def test_train_step_sends_the_chosen_loss_and_config_then_optim_step():
    calls = []

    class Fut:
        def __init__(self, value):
            self.value = value

        def result(self):
            calls.append("awaited")
            return self.value

    class Client:
        def forward_backward(self, data, loss_fn, loss_fn_config):
            calls.append(("forward_backward", loss_fn, loss_fn_config, len(data)))
            return Fut("fb")

        def optim_step(self, params):
            calls.append(("optim_step", params.learning_rate, params.eps, params.beta2))
            return Fut("opt")

    out = tinker_rl.train_step(Client(), [object()], "cispo", {"clip_low_threshold": 0.0}, 0.01)
    assert out == "fb"
    # both submitted before either is awaited; Adam constants are the shared ones (eps 1e-8, beta2 0.95)
    assert calls == [("forward_backward", "cispo", {"clip_low_threshold": 0.0}, 1),
                     ("optim_step", 0.01, 1e-8, 0.95), "awaited", "awaited"]


def test_tasks_per_iteration_are_deterministic_and_cover_every_task_each_epoch():
    first = [tinker_rl.batch_tasks(i, 10, 5, seed=3) for i in range(2)]
    assert sorted(first[0] + first[1]) == list(range(10))
    assert first == [tinker_rl.batch_tasks(i, 10, 5, seed=3) for i in range(2)]
    assert tinker_rl.group_seed(0, 4, 1) == tinker_rl.group_seed(0, 4, 1) != tinker_rl.group_seed(0, 4, 2)


# ---------------------------------------------------------------- rollouts with a scripted sampler


def rollout(tok, fmt, env, reply, tasks=None, sampler=None, **kw):
    tasks = tasks or env["tasks"][:3]
    prompts = [tinker_rl.generation_prompt(env["render_prompt"](t), tok, fmt, tools=env["tools"]) for t in tasks]
    argv = ["--group-size", str(kw.get("group_size", 2)), "--max-tokens", str(kw.get("max_tokens", 16)),
            "--max-turns", str(kw.get("max_turns", 3)), "--on-truncation", kw.get("on_truncation", "end"),
            "--env-workers", str(kw.get("env_workers", 4)), "--max-in-flight", str(kw.get("max_in_flight", 64))]
    job = tinker_rl.Job(env, tasks, tok, fmt, prompts, None, "x")
    ro = tinker_rl.Rollouts(job, settings(*argv), kw.get("context_window"))
    sampler = sampler or FakeSampler(reply, delay=0.01)
    seeds = kw.get("seeds") or [11, 22, 33, 44, 55, 66, 77, 88][: len(tasks)]
    with ro.pools():
        groups = asyncio.run(ro.batch(sampler, list(range(len(tasks))), seeds))
    return groups, sampler, prompts, ro


def test_every_group_is_sampled_with_its_own_seed_and_the_stop_tokens(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("single")
    eot = fmt["stop"][0]
    groups, sampler, _, _ = rollout(tok, fmt, env, lambda p, c, i: (tok.encode("42") + [eot], "stop"))
    assert sampler.max_inflight == 3 and len(sampler.calls) == 3
    assert [c[1] for c in sampler.calls] == [2, 2, 2]  # one call of group_size per task
    assert [c[2].seed for c in sampler.calls] == [11, 22, 33]  # the per-group seeds reach the sampler
    assert all(c[2].stop == [eot] and c[2].max_tokens == 16 for c in sampler.calls)


def test_single_turn_reward_sees_the_text_without_the_end_of_turn_token(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("single")
    task = env["tasks"][0]
    right = tok.encode(str(task["answer"])) + [fmt["stop"][0]]
    groups, *_ = rollout(tok, fmt, env, lambda p, c, i: (right if i == 0 else tok.encode("7"), "stop"), tasks=[task])
    assert [e.reward for e in groups[0].episodes] == [1.0, 0.0]


def test_reward_that_returns_nan_stops_with_the_task_named(qwen):
    tok, fmt, _ = qwen
    tasks = tinker_rl.load_env("single")["tasks"]
    env = dict(tinker_rl.load_env("single"), reward=lambda task, completion: float("nan") if task is tasks[1] else 0.0)
    with pytest.raises(tinker_rl.DataError, match=r"reward\(\) returned nan for task 1 \(\{\"a\""):
        rollout(tok, fmt, env, lambda p, c, i: ([1, 2], "stop"), tasks=env["tasks"][:2])


def test_reward_that_raises_stops_with_the_task_named(qwen):
    tok, fmt, _ = qwen

    def reward(task, completion):
        raise KeyError("score")

    env = dict(tinker_rl.load_env("single"), reward=reward)
    with pytest.raises(tinker_rl.DataError, match=r"reward\(\) raised on task 0 .*KeyError"):
        rollout(tok, fmt, env, lambda p, c, i: ([1, 2], "stop"), tasks=env["tasks"][:1])


def calculator_reply(tok, fmt, task, bad_first=False):
    """Turn 1 calls the tool (or sends a broken call), then answers the right number."""
    eot = fmt["stop"][0]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%d*%d-%d"}}\n</tool_call>' % (
        task["a"], task["b"], task["c"])
    broken = "<tool_call>\n{name: calculator}\n</tool_call>"

    def reply(prompt, call_index, i):
        if tok.decode(prompt).count("<tool_response>") == 0:
            return tok.encode(broken if bad_first else call) + [eot], "stop"
        if "error" in tok.decode(prompt).rsplit("<tool_response>", 1)[-1]:
            return tok.encode(call) + [eot], "stop"
        return tok.encode(str(task["answer"] if i == 0 else 7)) + [eot], "stop"

    return reply


def test_calculator_episode_is_one_datum_with_observations_at_zero_advantage(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("calculator")
    task = env["tasks"][0]
    groups, sampler, prompts, _ = rollout(tok, fmt, env, calculator_reply(tok, fmt, task), tasks=[task])
    episode = groups[0].episodes[0]
    assert [len(groups[0].episodes), episode.reward, len(episode.turns)] == [2, 1.0, 2]
    assert episode.info == {"tool_calls": 1, "answers": 1}
    second = episode.turns[1].observation
    assert second[: len(prompts[0]) + len(episode.turns[0].action)] == prompts[0] + episode.turns[0].action
    obs_text = tok.decode(second[len(prompts[0]) + len(episode.turns[0].action):])
    assert f"<tool_response>\n{task['answer']}\n</tool_response>" in obs_text
    assert obs_text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    [(tokens, lps, advs, mask)] = tinker_rl.episode_sequences(episode.turns, 0.5)
    n_obs = len(second) - len(prompts[0]) - len(episode.turns[0].action)
    assert sum(mask) == len(episode.turns[0].action) + len(episode.turns[1].action)
    trained = [t for t, m in zip(tokens, mask) if m]
    assert tok.decode(trained).count("<tool_call>") == 1 and str(task["answer"]) in tok.decode(trained)
    assert all(a == 0.0 and lp == 0.0 for a, lp, m in zip(advs, lps, mask) if not m)
    assert mask.count(0.0) == len(prompts[0]) + n_obs


def test_calculator_tool_call_that_does_not_parse_gets_an_error_reply_not_a_crash(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("calculator")
    task = env["tasks"][0]
    groups, *_ = rollout(tok, fmt, env, calculator_reply(tok, fmt, task, bad_first=True), tasks=[task], max_turns=4)
    episode = groups[0].episodes[0]
    assert episode.info["tool_parse_errors"] == 1 and episode.reward == 1.0
    assert "error: could not run the tool call" in tok.decode(episode.turns[1].observation)


def test_environment_rng_is_the_same_for_every_sample_of_a_group(qwen):
    tok, fmt, _ = qwen
    draws = []

    def env_step(task, conversation, model_turn, rng):
        draws.append((task["a"], rng.random()))
        return None, 0.0, True

    env = dict(tinker_rl.load_env("calculator"), env_step=env_step)
    rollout(tok, fmt, env, lambda p, c, i: ([1, 2], "stop"), tasks=env["tasks"][:2], group_size=3)
    by_task = {}
    for a, value in draws:
        by_task.setdefault(a, set()).add(value)
    assert len(draws) == 6 and all(len(v) == 1 for v in by_task.values())  # one value per group
    assert len({v for vs in by_task.values() for v in vs}) == 2  # groups differ


def test_truncated_turn_ends_the_episode_or_continues_closed_by_policy(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("calculator")
    task = env["tasks"][0]
    cut = lambda p, c, i: (tok.encode("<tool_call>\n{\"name\""), "length")  # noqa: E731
    groups, *_ = rollout(tok, fmt, env, cut, tasks=[task], on_truncation="end")
    assert [len(e.turns) for e in groups[0].episodes] == [1, 1]
    assert all(e.truncated for e in groups[0].episodes)
    groups, _, prompts, _ = rollout(tok, fmt, env, cut, tasks=[task], on_truncation="continue", max_turns=3)
    episode = groups[0].episodes[0]
    assert len(episode.turns) == 3 and episode.truncated
    # the cut turn was closed with the end-of-turn token before the tool's reply
    after = episode.turns[1].observation[len(prompts[0]) + len(episode.turns[0].action)]
    assert after == fmt["stop"][0]


def test_turn_budget_is_capped_by_the_context_window(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("single")
    prompt = tinker_rl.generation_prompt(env["render_prompt"](env["tasks"][0]), tok, fmt)
    _, sampler, *_ = rollout(tok, fmt, env, lambda p, c, i: ([1], "stop"), tasks=env["tasks"][:1],
                             context_window=len(prompt) + 5)
    assert sampler.calls[0][2].max_tokens == 5


# ---------------------------------------------------------------- CLI: dry run, bad input, copied alone


def run_script(*argv, env=None, cwd=None, script=SCRIPT):
    base = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    base.update(HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, env=base,
                          cwd=cwd, timeout=300)


def test_dry_run_renders_checks_and_prints_one_json_object(qwen, tmp_path):
    _, fmt, path = qwen
    out = run_script("--dry-run", "--tokenizer", path, "--env", "calculator", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["status"] == "dry_run" and result["format"] == fmt
    assert (result["tasks"], result["eval_tasks"]) == (56, 8)
    assert "<tools>" in out.stderr and "calculator" in out.stderr
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_copied_alone_into_an_empty_folder_help_and_dry_run_work(qwen, tmp_path):
    alone = tmp_path / "project"
    alone.mkdir()
    shutil.copy(SCRIPT, alone / "tinker_rl.py")
    helped = run_script("--help", cwd=alone, script=alone / "tinker_rl.py")
    assert helped.returncode == 0 and "--max-in-flight" in helped.stdout and "--env-workers" in helped.stdout
    out = run_script("--dry-run", "--tokenizer", qwen[2], cwd=alone, script=alone / "tinker_rl.py")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "dry_run"
    assert "no dollar estimate: tinker_pricing.py is not beside this script" in out.stderr
    assert sorted(p.name for p in alone.iterdir()) == ["tinker_rl.py"]


BAD_FLAGS = [
    (["--group-size", "1"], "--group-size 1: the advantage compares samples"),
    (["--clip-high-threshold", "1.1"], "--clip-*-threshold applies to --loss-fn ppo or cispo"),
    (["--context-window", "20"], "is 29 tokens, not below the context window of 20"),
    (["--learning-rate", "nan"], "--learning-rate nan: expected a finite number"),
    (["--learning-rate", "0"], "--learning-rate 0.0: expected a value in (0, inf]"),
    (["--learning-rate=-1e-5"], "--learning-rate -1e-05: expected a value in (0, inf]"),
    (["--max-usd", "nan"], "--max-usd nan: expected a finite number"),
    (["--max-usd", "-1"], "--max-usd -1.0: expected a value in [0, inf]"),
    (["--iterations", "0"], "--iterations 0: expected a value in [1, inf]"),
    (["--batch-size", "0"], "--batch-size 0: expected a value in [1, inf]"),
    (["--temperature", "0"], "--temperature 0.0: expected a value in (0, inf]"),
    (["--temperature", "inf"], "--temperature inf: expected a finite number"),
    (["--max-tokens", "0"], "--max-tokens 0: expected a value in [1, inf]"),
    (["--save-every", "-1"], "--save-every -1: expected a value in [0, inf]"),
    (["--max-in-flight", "0"], "--max-in-flight 0: expected a value in [1, inf]"),
    (["--env-workers", "-2"], "--env-workers -2: expected a value in [0, inf]"),
    (["--resume", "--overwrite"], "--resume and --overwrite contradict each other"),
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS)
@pytest.mark.parametrize("mode", ["dry-run", "real"])
def test_bad_flags_are_one_line_and_exit_2_in_dry_run_and_real_run(qwen, tmp_path, monkeypatch, capsys, argv,
                                                                   message, mode):
    """The same checks refuse a flag in a dry run and in a real run (which has a key and would train)."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:9")
    extra = ["--dry-run"] if mode == "dry-run" else ["--log-path", str(tmp_path / "run")]
    assert tinker_rl.run_cli(tinker_rl.main, ["--rehearse", "off", "--tokenizer", qwen[2], *extra, *argv]) == 2
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and out.err.rstrip().endswith(errors[0])
    assert out.out == "" and not (tmp_path / "run").exists()


def test_bad_input_from_the_command_line_has_no_traceback(qwen):
    out = run_script("--dry-run", "--tokenizer", qwen[2], "--max-usd", "nan")
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == "error: --max-usd nan: expected a finite number"


def test_empty_task_list_is_bad_input(qwen, monkeypatch, capsys):
    monkeypatch.setattr(tinker_rl, "TASKS", [])
    assert tinker_rl.run_cli(tinker_rl.main, ["--dry-run", "--tokenizer", qwen[2]]) == 2
    assert "task list of --env multiply is empty" in capsys.readouterr().err


def test_no_credentials_exits_4_before_any_call(qwen, tmp_path):
    out = run_script("--tokenizer", qwen[2], "--log-path", str(tmp_path / "run"), env={"HOME": str(tmp_path)})
    assert out.returncode == 4 and "no Tinker credentials" in out.stderr
    assert not (tmp_path / "run").exists()


def test_dead_base_url_exits_4_in_seconds(qwen, tmp_path):
    out = run_script("--tokenizer", qwen[2], "--log-path", str(tmp_path / "run"),
                     env={"TINKER_API_KEY": "tml-test", "TINKER_BASE_URL": "http://127.0.0.1:9"})
    assert out.returncode == 4 and "cannot reach Tinker at http://127.0.0.1:9" in out.stderr
    assert not (tmp_path / "run").exists()


def test_estimate_above_max_usd_exits_3_before_any_call(qwen):
    out = run_script("--dry-run", "--tokenizer", qwen[2], "--max-usd", "0.0001")
    assert out.returncode == 3 and "exceeds --max-usd 0.0001" in out.stderr and out.stdout == ""


def test_simulated_user_above_temperature_zero_is_warned(qwen, monkeypatch, capsys):
    monkeypatch.setattr(tinker_rl, "SIMULATED_USER_TEMPERATURE", 0.7)
    assert tinker_rl.run_cli(tinker_rl.main, ["--dry-run", "--tokenizer", qwen[2], "--env", "calculator"]) == 0
    assert "warning: SIMULATED_USER_TEMPERATURE is 0.7" in capsys.readouterr().err


def test_reasoning_models_get_a_4096_token_turn_budget_by_default():
    assert settings("--model-name", "openai/gpt-oss-20b").max_tokens == 4096
    assert settings("--model-name", "Qwen/Qwen3-8B").max_tokens == 256


def test_a_relative_tokenizer_folder_is_recorded_absolute(qwen):
    folder = Path(qwen[2])
    out = run_script("--dry-run", "--tokenizer", folder.name, cwd=folder.parent)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["format"]["tokenizer"] == os.path.join(os.path.realpath(folder.parent), folder.name)


def test_a_resumed_run_prices_only_the_iterations_left(qwen, capsys):
    args = settings("--iterations", "10", "--max-tokens", "32", "--tokenizer", qwen[2])
    job = tinker_rl.prepare(args)
    whole = tinker_rl.estimate_cost(args, job, None)
    rest = tinker_rl.estimate_cost(args, job, None, start=7)
    assert whole["tokens"]["sample"] == 10 * 8 * 4 * 32
    assert rest["tokens"]["sample"] == 3 * 8 * 4 * 32 and rest["tokens"]["train"] * 10 == whole["tokens"]["train"] * 3
    assert rest["usd"]["total"] == pytest.approx(whole["usd"]["total"] * 3 / 10)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("cost estimate")]
    assert lines[0].startswith("cost estimate (rl: Qwen/Qwen3-8B, catalogue ")
    assert lines[1].startswith("cost estimate (rl, remaining 3 of 10 iterations after --resume: Qwen/Qwen3-8B, ")


# ---------------------------------------------------------------- --init-from and which reward a rehearsal trains


def test_init_from_starts_the_policy_from_a_weights_checkpoint_recorded_and_resume_checked(fake_tinker, tmp_path,
                                                                                         capsys):
    log, state = tmp_path / "run", "tinker://sft-run/weights/final"
    assert fake_tinker.run("--iterations", "2", "--save-every", "1", "--init-from", state, "--log-path", str(log)) == 0
    out = capsys.readouterr()
    assert fake_tinker.initialised_from == [state] and json.loads(out.out)["init_from"] == state
    assert json.loads((log / "config.json").read_text())["init_from"] == state
    assert f"reward: your reward() from the EDIT ME block, on its 6 TASKS, from {state}" in out.err
    code = fake_tinker.run("--iterations", "3", "--resume", "--init-from", "tinker://other/weights/final",
                           "--log-path", str(log))
    assert code == 2 and "--init-from 'tinker://sft-run/weights/final' -> 'tinker://other/weights/final'" in \
        capsys.readouterr().err


def test_init_from_a_sampler_checkpoint_is_refused_before_any_call(fake_tinker, tmp_path, capsys):
    code = fake_tinker.run("--init-from", "tinker://sft-run/sampler_weights/final", "--log-path", str(tmp_path / "r"))
    assert code == 2 and "cannot seed a training client" in capsys.readouterr().err
    assert not hasattr(fake_tinker, "initialised_from") and not (tmp_path / "r").exists()


@pytest.mark.parametrize("constant", [False, True])
def test_a_local_rehearsal_trains_your_reward_when_it_separates_the_first_samples_else_the_stand_in(
        fake_tinker, tmp_path, capsys, monkeypatch, constant):
    """--rehearse auto on the local backend: the first iteration's groups, sampled before anything is written,
    decide; the distribution is shown either way."""
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:9")  # the local backend (nothing is reached: faked)
    if constant:
        monkeypatch.setattr(tinker_rl, "reward", lambda task, completion: 0.0)
    log = tmp_path / "run"
    assert fake_tinker.run("--iterations", "1", "--log-path", str(log)) == 0
    out = capsys.readouterr()
    assert "reward() (EDIT ME) on the first 6 samples (2 groups)" in out.err
    config = json.loads((log / "config.json").read_text())
    if constant:
        assert "values 0 x6; tied groups 2/2" in out.err and config["reward"] == "stand-in"
        assert "reward: the rehearsal's stand-in ('say something'" in out.err and "--init-from" in out.err
        assert config["n_tasks"] == len(tinker_rl.REHEARSAL_TASKS[:8])
    else:
        assert "tied groups 0/2" in out.err and config["reward"] == "own" and config["n_tasks"] == 6
        assert json.loads(out.out)["reward_source"] == "own"


def test_every_reasoning_model_in_the_catalogue_gets_room_to_think():
    """tinker_rl.py's 4096-token default reaches every model the price catalogue lists as Reasoning."""
    import tinker_pricing
    import tinker_rl

    reasoning = [row["id"] for row in tinker_pricing.SNAPSHOT if "Reasoning" in (row["type"] or "")]
    assert "moonshotai/Kimi-K2.6" in reasoning and "openai/gpt-oss-20b" in reasoning
    for name in reasoning:
        assert any(k.lower() in name.lower() for k in tinker_rl.REASONING_MODELS), name


def test_an_iteration_with_every_group_tied_says_it_did_not_train_instead_of_printing_nan():
    row = {"reward_mean": 0.15, "reward_std": 0.09, "frac_groups_tied": 1.0, "frac_truncated": 0.0,
           "seconds_sampling": 3.0, "seconds_training": 0.0, "datums": 0}
    line = tinker_rl.progress_line(7, 10, row)
    assert "not trained (no datums: every group tied)" in line and "nan" not in line
    trained = tinker_rl.progress_line(7, 10, dict(row, loss_sum=-1.5, kl_sample_train_v1=2e-7, datums=8))
    assert "loss -1.5 | kl 2.00e-07" in trained and "not trained" not in trained


def test_the_reward_is_named_for_the_environment_that_supplies_it():
    """--env calculator trains the calculator example's reward, not the EDIT ME block's: the first-sample line and
    the outcome name the right one."""
    import argparse
    label = lambda reward, env: tinker_rl.reward_label(argparse.Namespace(reward=reward, env=env))  # noqa: E731
    assert label("own", "calculator") == "the calculator example's reward() (--env calculator)"
    assert label("own", "multiply") == "reward() (EDIT ME)"
    assert label("stand-in", "calculator") == "the stand-in reward"
    # --reward auto's first samples, scored before it decides: the reward that would train
    auto = argparse.Namespace(reward="auto", env="calculator")
    assert tinker_rl.reward_label(auto, "own") == "the calculator example's reward() (--env calculator)"


def test_an_init_from_checkpoint_the_store_lacks_names_it_and_the_listing_not_a_rerun(fake_tinker, tmp_path, capsys):
    """--init-from a path the server no longer has: the error names that path and the command that lists what
    exists, not "run the same command again with --overwrite" (which fails the same way)."""
    import httpx
    import tinker

    def gone(path):
        response = httpx.Response(404, request=httpx.Request("POST", "http://local/api/v1/create_model"))
        raise tinker.NotFoundError("Model not found", response=response, body=None)

    fake_tinker.create_training_client_from_state = gone
    path = "tinker://model_gone/weights/final"
    code = fake_tinker.run("--iterations", "1", "--init-from", path, "--log-path", str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--init-from: {path} is unknown or expired" in err
    assert "tinker_checkpoints.py list --run model_gone" in err
    assert "--overwrite" not in err


def real_rehearsal(fake_tinker, monkeypatch, qwen, rising):
    """main() as a real-model rehearsal from a checkpoint (the launcher's stand-in variable set): the user's reward
    scores only TASKS 3 and 5 unevenly (reply length), every other task 0.0; replies grow with each sampling call
    when `rising`, so the reward of the kept tasks rises as iterations go."""
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", "HuggingFaceTB/SmolLM2-135M-Instruct")
    eot = qwen[1]["stop"][0]
    fake_tinker.sampler.reply = lambda prompt, call, i: ([1040] * (i + 1 + (call if rising else 0)) + [eot], "stop")
    uneven = [tinker_rl.TASKS[3], tinker_rl.TASKS[5]]
    monkeypatch.setattr(tinker_rl, "reward", lambda task, completion: float(len(completion)) if task in uneven else 0.0)
    return ("--rehearse", "on", "--init-from", "tinker://sft/weights/final", "--temperature", "1.0",
            "--learning-rate", "1e-4")


def test_a_real_model_rehearsal_from_a_checkpoint_trains_the_tasks_its_reward_scores_unevenly(
        fake_tinker, monkeypatch, qwen, tmp_path, capsys):
    """Drawn afresh from all TASKS, an iteration's mean moves with the draw; the real-model rehearsal samples the
    first TASKS once and trains the --batch-size ones the reward tells apart, every iteration; its verdict: every
    iteration trained and the mean reward rose. A --resume keeps the same tasks without scouting again."""
    flags = real_rehearsal(fake_tinker, monkeypatch, qwen, rising=True)
    log = tmp_path / "run"
    assert fake_tinker.run(*flags, "--iterations", "2", "--save-every", "1", "--log-path", str(log)) == 0
    err = capsys.readouterr().err
    assert "reward: your reward() from the EDIT ME block, on 2 of 6 TASKS" in err
    assert "sampled 3 replies to each of the first 6 TASKS; every iteration trains the 2 your reward scores most " \
           "unevenly" in err and "TASKS [3] (mean " in err
    assert json.loads((log / "config.json").read_text())["rehearsal_tasks"] == [3, 5]
    assert fake_tinker.run(*flags, "--iterations", "4", "--log-path", str(log), "--resume") == 0
    out = capsys.readouterr()
    assert "sampled 3 replies" not in out.err
    assert [sorted(m["tasks"]) for m in rows(log / "metrics.jsonl")] == [[3, 5]] * 4
    report = json.loads(out.out.strip().splitlines()[-1])
    assert report["status"] == "ok" and report["rehearsal"]["passed"], report["rehearsal"]
    assert [c["check"].split(" (")[0] for c in report["rehearsal"]["checks"]] == [
        "every iteration trained: 4 of 4 metrics rows", "the mean reward rises"]
    assert report["rehearsal"]["tasks"] == [3, 5]


def test_a_real_model_rehearsal_whose_reward_does_not_rise_says_failed_in_json_and_exit_code(
        fake_tinker, monkeypatch, qwen, tmp_path, capsys):
    flags = real_rehearsal(fake_tinker, monkeypatch, qwen, rising=False)
    assert fake_tinker.run(*flags, "--iterations", "4", "--log-path", str(tmp_path / "run")) == 1
    out = capsys.readouterr()
    report = json.loads(out.out.strip().splitlines()[-1])
    assert report["status"] == "failed" and not report["rehearsal"]["passed"]
    assert "rehearsal check failed: the mean reward rises (" in out.err
    assert report["state_path"] == "tinker://fake/weights/final"  # the run itself finished and saved


def test_the_tiny_models_rehearsal_from_a_checkpoint_draws_its_tasks_and_is_not_judged(fake_tinker, monkeypatch,
                                                                                      qwen, tmp_path, capsys):
    flags = real_rehearsal(fake_tinker, monkeypatch, qwen, rising=False)
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", "tiny-qwen3")
    assert fake_tinker.run(*flags, "--iterations", "3", "--log-path", str(tmp_path / "run")) == 0
    out = capsys.readouterr()
    assert "sampled 3 replies" not in out.err and "rehearsal" not in json.loads(out.out.strip().splitlines()[-1])
    assert len({tuple(m["tasks"]) for m in rows(tmp_path / "run" / "metrics.jsonl")}) > 1
