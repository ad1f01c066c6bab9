"""tinker_rl.py end to end on the local backend (a tiny random Qwen3 behind the real SDK)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import tinker_rl

pytestmark = pytest.mark.e2e


def newline_share(task, completion):
    """A reward the random model can learn fast: the share of an 8-token budget spent on blank lines.

    At temperature 0.07 the tiny model's samples concentrate on a few tokens, among them "\\n\\n" (the
    token its prompt ends with), so groups disagree from the start and one push moves a lot of mass."""
    return min(1.0, completion.count("\n") / 16)


def ascii_letter_share(task, completion):
    """Always differs between random samples: the share of ASCII letters in the text."""
    return sum(c.isascii() and c.isalpha() for c in completion) / max(1, len(completion))


def small_tasks(monkeypatch, reward):
    monkeypatch.setattr(tinker_rl, "TASKS", [{"id": i} for i in range(4)])
    monkeypatch.setattr(tinker_rl, "render_prompt", lambda task: [{"role": "user", "content": f"Say something {task['id']}."}])
    monkeypatch.setattr(tinker_rl, "reward", reward)


def run_in_process(local_tinker, monkeypatch, capsys, *argv):
    local_tinker.apply(monkeypatch)
    code = tinker_rl.run_cli(tinker_rl.main, ["--tokenizer", str(local_tinker.tokenizer_dir), "--lora-rank", "8", *argv])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else None), out.err


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_advantage_sign_raises_a_learnable_reward(local_tinker, monkeypatch, capsys, tmp_path):
    small_tasks(monkeypatch, newline_share)
    code, result, err = run_in_process(
        local_tinker, monkeypatch, capsys, "--batch-size", "2", "--group-size", "8", "--max-tokens", "8",
        "--iterations", "4", "--learning-rate", "0.003", "--temperature", "0.07", "--seed", "0",
        "--save-every", "0", "--log-path", str(tmp_path / "run"))
    assert code == 0, err
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    means = [m["reward_mean"] for m in metrics]
    assert [m["iteration"] for m in metrics] == [0, 1, 2, 3]
    assert means[0] < 0.35 and means[-1] > means[0] + 0.4, means
    assert result["reward"] == {"first": means[0], "last": means[-1]}
    assert all(abs(m["kl_sample_train_v1"]) < 1e-3 for m in metrics)  # sampler and learner agree
    assert all(m["loss_fn"] == "importance_sampling" and m["tokens_sampled"] == 2 * 8 * 8 for m in metrics)


def test_ppo_and_cispo_reach_the_server_with_their_clip_thresholds(local_tinker, monkeypatch):
    """The loss the server computes matches each loss's formula, with the thresholds we sent."""
    import tinker

    local_tinker.apply(monkeypatch)
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=local_tinker.model, rank=8).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = list(range(1000, 1012))
    seq = sampler.sample(prompt=tinker.ModelInput.from_ints(prompt), num_samples=1,
                         sampling_params=tinker.SamplingParams(max_tokens=6, seed=5)).result().sequences[0]
    n = len(seq.tokens)
    # Sampler logprobs 0.5 below the learner's: ratio exp(0.5) = 1.65, outside ppo's 0.8..1.2.
    shifted = [lp - 0.5 for lp in seq.logprobs]
    turn = tinker_rl.Turn(prompt, list(seq.tokens), shifted, seq.stop_reason)
    [(tokens, lps, advs, _)] = tinker_rl.episode_sequences([turn], 1.0)
    datum = tinker_rl.rl_datum(tokens, lps, advs)
    losses = {}
    for loss_fn, config in [("importance_sampling", None),
                            ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
                            ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.5}),
                            ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0})]:
        out = tinker_rl.train_step(tc, [datum], loss_fn, config, 1e-9)  # lr ~0: the weights stay put
        p = out.loss_fn_outputs[0]["logprobs"].tolist()[-n:]
        losses[(loss_fn, (config or {}).get("clip_high_threshold"))] = (out.metrics["loss:sum"], p)
    is_loss, p = losses[("importance_sampling", None)]
    ratios = [math.exp(a - b) for a, b in zip(p, shifted)]
    assert all(1.6 < r < 1.7 for r in ratios)
    assert is_loss == pytest.approx(-sum(ratios), rel=1e-3)
    assert losses[("ppo", 1.2)][0] == pytest.approx(-1.2 * n, rel=1e-3)
    assert losses[("ppo", 1.5)][0] == pytest.approx(-1.5 * n, rel=1e-3)
    cispo_loss, p_c = losses[("cispo", 4.0)]
    assert cispo_loss == pytest.approx(-sum(r * lp for r, lp in zip(ratios, p_c)), rel=1e-3)
    # SDK 0.38 poisons a client only on a failed forward_backward_custom: after a rejected dro the same
    # client still trains, which is why tinker_rl.py's error no longer calls it poisoned.
    with pytest.raises(Exception) as rejected:
        tc.forward_backward([datum], loss_fn="dro", loss_fn_config={"beta": 0.05}).result()
    assert tinker_rl.is_rejection(rejected.value), repr(rejected.value)
    after = tc.forward_backward([datum], loss_fn="importance_sampling").result()
    assert after.metrics["loss:sum"] == pytest.approx(is_loss, rel=1e-3)
    service.close("success").result()


def test_dro_on_the_local_backend_stops_with_a_clear_error(local_tinker, monkeypatch, capsys, tmp_path):
    small_tasks(monkeypatch, ascii_letter_share)
    code, result, err = run_in_process(
        local_tinker, monkeypatch, capsys, "--loss-fn", "dro", "--batch-size", "2", "--group-size", "2",
        "--max-tokens", "8", "--iterations", "2", "--log-path", str(tmp_path / "run"))
    assert code == 2 and result is None
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "the server rejected --loss-fn dro" in line and "the run stops here (no checkpoint was saved yet)" in line
    assert "poisoned" not in line  # SDK 0.38: a rejected loss leaves the client usable
    assert "--loss-fn importance_sampling|ppo|cispo" in line
    assert "Traceback" not in err


def test_base_policy_that_ties_every_group_stops_before_training(local_tinker, tmp_path):
    """The shipped single-turn example, unchanged, as a subprocess: the random model never multiplies."""
    out = subprocess.run([sys.executable, tinker_rl.__file__, "--tokenizer", str(local_tinker.tokenizer_dir),
                          "--lora-rank", "8", "--batch-size", "2", "--group-size", "2", "--max-tokens", "8",
                          "--iterations", "2", "--log-path", str(tmp_path / "run")],
                         env=local_tinker.env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr
    assert "the base policy ties every group (all 2 groups at reward [0.0])" in out.stderr
    assert out.stdout == "" and not (tmp_path / "run" / "checkpoints.jsonl").exists()


def test_calculator_episodes_of_two_turns_train_as_one_datum_each(local_tinker, monkeypatch, capsys, tmp_path):
    """The multi-turn example for two iterations. A random model never writes <tool_call>, so its first
    turn is handed to the shipped environment as a call that does not parse (its error reply becomes
    the observation); the second turn is the answer, scored by a reward random text varies on."""
    shipped = tinker_rl.calculator_env_step

    def env_step(task, conversation, model_turn, rng):
        first_turn = not any(m["role"] == "tool" for m in conversation)
        return shipped(task, conversation, ("<tool_call>" + model_turn) if first_turn else model_turn, rng)

    monkeypatch.setattr(tinker_rl, "calculator_env_step", env_step)
    monkeypatch.setattr(tinker_rl, "calculator_reward", ascii_letter_share)
    monkeypatch.setattr(tinker_rl, "CALCULATOR_TASKS", tinker_rl.CALCULATOR_TASKS[:4])
    # Without the 160-token tool preamble the sequences stay in small (fast, lean) compile buckets;
    # the preamble's rendering is checked offline (test_rl_units dry run).
    monkeypatch.setattr(tinker_rl, "CALCULATOR_TOOLS", None)
    code, result, err = run_in_process(
        local_tinker, monkeypatch, capsys, "--env", "calculator", "--batch-size", "2", "--group-size", "2",
        "--max-tokens", "8", "--max-turns", "2", "--on-truncation", "continue", "--iterations", "2",
        "--save-every", "1", "--log-path", str(tmp_path / "run"))
    assert code == 0, err
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["turns_mean"] == 2 and m["env/tool_parse_errors"] == 4 and m["env/answers"] == 4
        assert m["datums"] == 4 - 2 * m["groups_tied"]  # one datum per episode of an untied group
        assert m["tokens_sampled"] == 4 * 2 * 8 and m["loss_sum"] is not None
    ckpts = rows(tmp_path / "run" / "checkpoints.jsonl")
    assert [(c["name"], c["next_iteration"]) for c in ckpts] == [("000001", 1), ("final", 2)]
    assert ckpts[-1]["sampler_path"] and result["sampler_path"] == ckpts[-1]["sampler_path"]
    assert result["format"]["stop"] == [151645]


def test_resume_neither_replays_nor_skips_an_iteration(local_tinker, monkeypatch, capsys, tmp_path):
    small_tasks(monkeypatch, ascii_letter_share)
    common = ["--batch-size", "2", "--group-size", "2", "--max-tokens", "8", "--save-every", "1",
              "--log-path", str(tmp_path / "run")]
    code, _, err = run_in_process(local_tinker, monkeypatch, capsys, "--iterations", "2", *common)
    assert code == 0, err
    code, _, err = run_in_process(local_tinker, monkeypatch, capsys, "--iterations", "2", *common)
    assert code == 2 and "add --resume" in err
    code, result, err = run_in_process(local_tinker, monkeypatch, capsys, "--iterations", "3", "--resume", *common)
    assert code == 0, err
    assert "resumed from" in err and "/weights/final" in err
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    assert metrics[2]["tasks"] == tinker_rl.batch_tasks(2, 4, 2, 0)
    assert metrics[2]["group_seeds"] == [tinker_rl.group_seed(0, 2, s) for s in range(2)]
    ckpts = rows(tmp_path / "run" / "checkpoints.jsonl")
    assert [(c["name"], c["next_iteration"]) for c in ckpts] == [("000001", 1), ("final", 2), ("final", 3)]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["format"] == result["format"] and config["iterations"] == 3
