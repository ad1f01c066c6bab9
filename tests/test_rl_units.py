"""tinker_rl.py without a server: advantages, datums, rollouts with a scripted sampler, guards, CLI errors."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import tinker_rl
from tinker_rl import Turn

SCRIPT = Path(tinker_rl.__file__)


@pytest.fixture(scope="module")
def qwen(offline_tokenizer):
    path = offline_tokenizer("Qwen3-8B")
    tok = tinker_rl.load_tokenizer(path)
    return tok, tinker_rl.chat_format(tok, path), path


# ---------------------------------------------------------------- advantages and datums


def test_advantage_is_reward_minus_group_mean():
    assert tinker_rl.advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert tinker_rl.advantages([3.0, 1.0]) == [1.0, -1.0]


def test_normalize_std_divides_by_the_group_std():
    adv = tinker_rl.advantages([2.0, 0.0], normalize_std=True)
    assert adv[0] == pytest.approx(1.0, abs=1e-5) and adv[1] == pytest.approx(-1.0, abs=1e-5)


def test_single_turn_datum_zero_advantage_on_prompt_and_logprobs_on_targets():
    prompt, action, lps = [11, 12, 13, 14], [21, 22, 23], [-0.5, -1.5, -2.5]
    [(tokens, _, _, mask)] = tinker_rl.episode_sequences([Turn(prompt, action, lps, "stop")], 0.75)
    datum = tinker_rl.to_datum(*tinker_rl.episode_sequences([Turn(prompt, action, lps, "stop")], 0.75)[0][:3])
    inputs = {k: v.tolist() for k, v in datum.loss_fn_inputs.items()}
    assert set(inputs) == {"target_tokens", "logprobs", "advantages"}  # no mask key reaches the server
    assert datum.model_input.to_ints() == [11, 12, 13, 14, 21, 22]
    assert inputs["target_tokens"] == [12, 13, 14, 21, 22, 23]
    assert len(inputs["logprobs"]) == len(inputs["advantages"]) == datum.model_input.length == 6
    # position i predicts target i: the sampler's logprob of each sampled token sits on that token
    assert inputs["logprobs"] == pytest.approx([0, 0, 0, -0.5, -1.5, -2.5])
    assert inputs["advantages"] == pytest.approx([0, 0, 0, 0.75, 0.75, 0.75])
    assert mask[1:] == [0, 0, 0, 1, 1, 1]


def test_multi_turn_episode_that_extends_its_context_is_one_datum():
    prompt, a1, obs, a2 = [1, 2, 3], [40, 41], [90, 91, 92], [50, 51, 52]
    turns = [Turn(prompt, a1, [-0.1, -0.2], "stop"),
             Turn(prompt + a1 + obs, a2, [-0.3, -0.4, -0.5], "stop")]
    seqs = tinker_rl.episode_sequences(turns, -2.0)
    assert len(seqs) == 1
    datum = tinker_rl.to_datum(*seqs[0][:3])
    inputs = {k: v.tolist() for k, v in datum.loss_fn_inputs.items()}
    full = prompt + a1 + obs + a2
    assert datum.model_input.to_ints() == full[:-1] and inputs["target_tokens"] == full[1:]
    targets = inputs["target_tokens"]
    by_target = {t: (lp, adv) for t, lp, adv in zip(targets, inputs["logprobs"], inputs["advantages"])}
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
    datums, masks, tied = tinker_rl.build_batch(groups)
    assert tied == 2 and len(datums) == 2 == len(masks)
    assert [d.loss_fn_inputs["advantages"].tolist()[-1] for d in datums] == [0.5, -0.5]


def test_kl_estimate_compares_sampler_and_learner_logprobs_on_sampled_tokens_only():
    datum = tinker_rl.to_datum([1, 2, 3, 4], [0.0, 0.0, -1.0, -2.0], [0.0, 0.0, 1.0, 1.0])
    mask = [0, 1, 1]
    learner = SimpleNamespace(tolist=lambda: [-9.0, -1.5, -2.0])  # position 0 is prompt: ignored
    m = tinker_rl.kl_metrics([datum], [mask], [{"logprobs": learner}])
    assert m["kl_sample_train_v1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["kl_sample_train_v2"] == pytest.approx(0.5 * (0.25 + 0.0) / 2)
    assert m["entropy"] == pytest.approx(1.5)


def test_loss_fn_config_defaults_and_overrides():
    def cfg(*argv):
        args = tinker_rl.parse_args(list(argv))
        tinker_rl.validate_args(args)
        return tinker_rl.loss_fn_config(args)

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
            calls.append(("optim_step", params.learning_rate, params.eps))
            return Fut("opt")

    out = tinker_rl.train_step(Client(), [object()], "cispo", {"clip_low_threshold": 0.0}, 0.01)
    assert out == "fb"
    # both submitted before either is awaited
    assert calls == [("forward_backward", "cispo", {"clip_low_threshold": 0.0}, 1),
                     ("optim_step", 0.01, 1e-8), "awaited", "awaited"]


def test_tasks_per_iteration_are_deterministic_and_cover_every_task_each_epoch():
    first = [tinker_rl.batch_tasks(i, 10, 5, seed=3) for i in range(2)]
    assert sorted(first[0] + first[1]) == list(range(10))
    assert first == [tinker_rl.batch_tasks(i, 10, 5, seed=3) for i in range(2)]
    assert tinker_rl.group_seed(0, 4, 1) == tinker_rl.group_seed(0, 4, 1) != tinker_rl.group_seed(0, 4, 2)


# ---------------------------------------------------------------- rollouts with a scripted sampler


class ScriptedSampler:
    """Stands in for tinker.SamplingClient: replies come from `reply(prompt_tokens, call_index)`."""

    def __init__(self, reply, delay=0.02):
        self.reply, self.delay = reply, delay
        self.calls, self.inflight, self.max_inflight = [], 0, 0

    async def sample(self, prompt, num_samples, sampling_params):
        tokens = prompt.to_ints()
        self.calls.append((tokens, num_samples, sampling_params))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        await asyncio.sleep(self.delay)
        self.inflight -= 1
        seqs = [self.reply(tokens, len(self.calls) - 1, i) for i in range(num_samples)]
        return SimpleNamespace(sequences=[SimpleNamespace(tokens=t, logprobs=[-0.5] * len(t), stop_reason=s)
                                          for t, s in seqs])


def rollout(tok, fmt, env, reply, tasks=None, **kw):
    tasks = tasks or env["tasks"][:3]
    prompts = [tinker_rl.render_tokens(tok, fmt, env["render_prompt"](t), env["tools"]) for t in tasks]
    ro = tinker_rl.Rollout(tok, fmt, env, tasks, prompts, kw.get("max_tokens", 16), 1.0, kw.get("max_turns", 3),
                           kw.get("on_truncation", "end"), kw.get("context_window"))
    sampler = ScriptedSampler(reply)
    groups = asyncio.run(tinker_rl.rollout_batch(sampler, ro, list(range(len(tasks))), [11, 22, 33][: len(tasks)],
                                                 kw.get("group_size", 2), concurrent=kw.get("concurrent", True)))
    return groups, sampler, prompts


def test_every_group_is_in_flight_at_once(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("single")
    eot = fmt["stop"][0]
    groups, sampler, _ = rollout(tok, fmt, env, lambda p, c, i: (tok.encode("42") + [eot], "stop"))
    assert sampler.max_inflight == 3 and len(sampler.calls) == 3
    assert [c[1] for c in sampler.calls] == [2, 2, 2]  # one call of group_size per task
    assert [c[2].seed for c in sampler.calls] == [11, 22, 33]  # the per-group seeds reach the sampler
    assert all(c[2].stop == [eot] and c[2].max_tokens == 16 for c in sampler.calls)
    _, seq_sampler, _ = rollout(tok, fmt, env, lambda p, c, i: (tok.encode("42") + [eot], "stop"), concurrent=False)
    assert seq_sampler.max_inflight == 1


def test_single_turn_reward_sees_the_text_without_the_end_of_turn_token(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("single")
    task = env["tasks"][0]
    right = tok.encode(str(task["answer"])) + [fmt["stop"][0]]
    groups, _, _ = rollout(tok, fmt, env, lambda p, c, i: (right if i == 0 else tok.encode("7"), "stop"),
                           tasks=[task])
    assert [e.reward for e in groups[0].episodes] == [1.0, 0.0]


def test_reward_that_returns_nan_stops_with_the_task_named(qwen):
    tok, fmt, _ = qwen
    tasks = tinker_rl.load_env("single")["tasks"]
    env = dict(tinker_rl.load_env("single"), reward=lambda task, completion: float("nan") if task is tasks[1] else 0.0)
    with pytest.raises(tinker_rl.DataError, match=r"reward\(\) returned nan for task 1 \(\{\"a\""):
        rollout(tok, fmt, env, lambda p, c, i: ([1, 2], "stop"), tasks=env["tasks"][:2])


def test_reward_that_returns_a_string_stops_with_the_task_named(qwen):
    tok, fmt, _ = qwen
    env = dict(tinker_rl.load_env("single"), reward=lambda task, completion: "good")
    with pytest.raises(tinker_rl.DataError, match=r"returned 'good' for task 0"):
        rollout(tok, fmt, env, lambda p, c, i: ([1, 2], "stop"), tasks=env["tasks"][:1])


def calculator_reply(tok, fmt, task, bad_first=False):
    """Turn 1 calls the tool (or sends a broken call), then answers the right number."""
    eot = fmt["stop"][0]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%d*%d-%d"}}\n</tool_call>' % (
        task["a"], task["b"], task["c"])
    broken = "<tool_call>\n{name: calculator}\n</tool_call>"

    def reply(prompt, call_index, i):
        if call_index == 0:
            return tok.encode(broken if bad_first else call) + [eot], "stop"
        last_tool_reply = tok.decode(prompt).rsplit("<tool_response>", 1)[-1]
        if "error" in last_tool_reply:
            return tok.encode(call) + [eot], "stop"
        return tok.encode(str(task["answer"])) + [eot], "stop"

    return reply


def test_calculator_episode_is_one_datum_with_observations_at_zero_advantage(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("calculator")
    task = env["tasks"][0]
    groups, sampler, prompts = rollout(tok, fmt, env, calculator_reply(tok, fmt, task), tasks=[task], group_size=2)
    episode = groups[0].episodes[0]
    assert [len(groups[0].episodes), episode.reward, len(episode.turns)] == [2, 1.0, 2]
    assert episode.info == {"tool_calls": 1, "answers": 1}
    second = episode.turns[1].observation
    assert second[: len(prompts[0]) + len(episode.turns[0].action)] == prompts[0] + episode.turns[0].action
    obs_text = tok.decode(second[len(prompts[0]) + len(episode.turns[0].action):])
    assert f"<tool_response>\n{task['answer']}\n</tool_response>" in obs_text
    assert obs_text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    seqs = tinker_rl.episode_sequences(episode.turns, 0.5)
    assert len(seqs) == 1
    tokens, lps, advs, mask = seqs[0]
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
    groups, _, _ = rollout(tok, fmt, env, calculator_reply(tok, fmt, task, bad_first=True), tasks=[task],
                           max_turns=4)
    episode = groups[0].episodes[0]
    assert episode.info["tool_parse_errors"] == 1 and episode.reward == 1.0
    assert "error: could not run the tool call" in tok.decode(episode.turns[1].observation)


def test_environment_rng_is_the_same_for_every_sample_of_a_group(qwen):
    tok, fmt, _ = qwen
    draws = []

    def env_step(task, conversation, model_turn, rng):
        draws.append(rng.random())
        return None, 0.0, True

    env = dict(tinker_rl.load_env("calculator"), env_step=env_step)
    rollout(tok, fmt, env, lambda p, c, i: ([1, 2], "stop"), tasks=env["tasks"][:2], group_size=3)
    assert len(set(draws[:3])) == 1 and len(set(draws)) == 2  # one value per group, groups differ


def test_truncated_turn_ends_the_episode_or_continues_closed_by_policy(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("calculator")
    task = env["tasks"][0]
    cut = lambda p, c, i: (tok.encode("<tool_call>\n{\"name\""), "length")  # noqa: E731
    groups, _, _ = rollout(tok, fmt, env, cut, tasks=[task], on_truncation="end")
    assert [len(e.turns) for e in groups[0].episodes] == [1, 1]
    assert all(e.truncated for e in groups[0].episodes)
    groups, _, prompts = rollout(tok, fmt, env, cut, tasks=[task], on_truncation="continue", max_turns=3)
    episode = groups[0].episodes[0]
    assert len(episode.turns) == 3 and episode.truncated
    # the cut turn was closed with the end-of-turn token before the tool's reply
    after = episode.turns[1].observation[len(prompts[0]) + len(episode.turns[0].action)]
    assert after == fmt["stop"][0]


def test_turn_budget_is_capped_by_the_context_window(qwen):
    tok, fmt, _ = qwen
    env = tinker_rl.load_env("single")
    _, sampler, prompts = rollout(tok, fmt, env, lambda p, c, i: ([1], "stop"), tasks=env["tasks"][:1],
                                  context_window=len(tinker_rl.render_tokens(
                                      tok, fmt, env["render_prompt"](env["tasks"][0]))) + 5)
    assert sampler.calls[0][2].max_tokens == 5


# ---------------------------------------------------------------- format and CLI


def test_format_record_matches_the_sft_scripts(qwen):
    import tinker_sft

    tok, fmt, path = qwen
    assert fmt == tinker_sft.chat_format(tok, name=path)
    assert fmt["stop"] == [tok.convert_tokens_to_ids("<|im_end|>")]
    messages = tinker_rl.render_prompt(tinker_rl.TASKS[0])
    assert tinker_rl.render_tokens(tok, fmt, messages) == tinker_sft.generation_prompt(messages, tok, fmt)


def run_cli(*argv, env=None, cwd=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    base.update(HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=base,
                          cwd=cwd, timeout=300)


def test_dry_run_renders_checks_and_prints_one_json_object(qwen, tmp_path):
    _, fmt, path = qwen
    out = run_cli("--dry-run", "--tokenizer", path, "--env", "calculator", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["status"] == "dry_run" and result["tasks"] == 64 and result["format"] == fmt
    assert "<tools>" in out.stderr and "calculator" in out.stderr
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


@pytest.mark.parametrize("argv, message", [
    (["--group-size", "1"], "--group-size 1: the advantage compares samples"),
    (["--clip-high-threshold", "1.1"], "--clip-*-threshold applies to --loss-fn ppo or cispo"),
    (["--context-window", "20"], "is 29 tokens, not below the context window of 20"),
])
def test_bad_input_is_one_line_and_exit_code_2(qwen, argv, message):
    out = run_cli("--dry-run", "--tokenizer", qwen[2], *argv)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and out.stderr.rstrip().endswith(errors[0])
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_empty_task_list_is_bad_input(qwen, monkeypatch, capsys):
    monkeypatch.setattr(tinker_rl, "TASKS", [])
    assert tinker_rl.cli(["--dry-run", "--tokenizer", qwen[2]]) == 2
    assert "task list of --env single is empty" in capsys.readouterr().err


def test_no_credentials_exits_4_before_any_call(qwen, tmp_path):
    out = run_cli("--tokenizer", qwen[2], "--log-path", str(tmp_path / "run"), env={"HOME": str(tmp_path)})
    assert out.returncode == 4 and "no Tinker credentials" in out.stderr
    assert not (tmp_path / "run").exists()


def test_estimate_above_max_usd_exits_3_before_any_call(qwen):
    out = run_cli("--dry-run", "--tokenizer", qwen[2], "--max-usd", "0.0001")
    assert out.returncode == 3 and "exceeds --max-usd 0.0001" in out.stderr and out.stdout == ""


def test_simulated_user_above_temperature_zero_is_warned(qwen, monkeypatch, capsys):
    monkeypatch.setattr(tinker_rl, "SIMULATED_USER_TEMPERATURE", 0.7)
    assert tinker_rl.cli(["--dry-run", "--tokenizer", qwen[2], "--env", "calculator"]) == 0
    assert "warning: SIMULATED_USER_TEMPERATURE is 0.7" in capsys.readouterr().err


def test_reasoning_models_get_a_4096_token_turn_budget_by_default():
    for model, expected in (("openai/gpt-oss-20b", 4096), ("Qwen/Qwen3-8B", 256)):
        args = tinker_rl.parse_args(["--model-name", model])
        tinker_rl.validate_args(args)
        assert args.max_tokens == expected


# ---------------------------------------------------------------- tokenizer record and an unreachable hub


def test_a_relative_tokenizer_folder_is_recorded_absolute(qwen):
    folder = Path(qwen[2])
    out = run_cli("--dry-run", "--tokenizer", folder.name, cwd=folder.parent)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["format"]["tokenizer"] == os.path.join(os.path.realpath(folder.parent),
                                                                         folder.name)


def test_an_unreachable_hub_fails_in_seconds_naming_both_ways_to_run_offline(tmp_path):
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TINKER_"))}
    env.update(HF_HOME=str(tmp_path / "empty-hf"), HF_ENDPOINT=f"http://127.0.0.1:{closed}")
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env,
                         timeout=300)
    elapsed = time.monotonic() - started
    assert out.returncode == 2 and out.stdout == ""
    assert elapsed < 20, f"took {elapsed:.1f} s"  # huggingface_hub's retries took ~50 s
    error = out.stderr.strip().splitlines()[-1]
    assert error == ("error: cannot load the tokenizer for 'Qwen/Qwen3-8B': Qwen/Qwen3-8B is not in the Hugging "
                     f"Face cache and the hub is unreachable (127.0.0.1:{closed}: Connection refused); pass "
                     "--tokenizer PATH (a folder with tokenizer.json), or download it once and run with "
                     "HF_HUB_OFFLINE=1")


def test_the_tokenizer_loader_is_the_sft_scripts(qwen):
    import inspect

    import tinker_sft

    for name in ("load_tokenizer", "hub_unreachable"):
        assert inspect.getsource(getattr(tinker_rl, name)) == inspect.getsource(getattr(tinker_sft, name))


def test_a_resumed_run_prices_only_the_iterations_left(capsys):
    args = tinker_rl.parse_args(["--iterations", "10", "--max-tokens", "32"])
    whole = tinker_rl.estimate(args, 100.0, 1)
    rest = tinker_rl.estimate(args, 100.0, 1, start=7)
    assert whole["tokens"]["sample"] == 10 * 8 * 4 * 32
    assert rest["tokens"]["sample"] == 3 * 8 * 4 * 32 and rest["tokens"]["train"] * 10 == whole["tokens"]["train"] * 3
    assert rest["usd"]["total"] == pytest.approx(whole["usd"]["total"] * 3 / 10)
    first, second = capsys.readouterr().err.strip().splitlines()
    assert first.startswith("cost estimate (rl: Qwen/Qwen3-8B, catalogue ")
    assert second.startswith("cost estimate (rl, remaining 3 of 10 iterations after --resume: Qwen/Qwen3-8B, ")
