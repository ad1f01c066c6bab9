"""tinker_rl.py end to end on the local backend (a tiny random Qwen3 behind the real SDK)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import tinker_rl

pytestmark = pytest.mark.e2e


def run_in_process(local_tinker, monkeypatch, capsys, *argv):
    local_tinker.apply(monkeypatch)
    code = tinker_rl.run_cli(tinker_rl.main, ["--tokenizer", str(local_tinker.tokenizer_dir), "--lora-rank", "8", *argv])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else None), out.err


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
    code, result, err = run_in_process(local_tinker, monkeypatch, capsys, "--loss-fn", "dro", "--iterations", "2",
                                       "--log-path", str(tmp_path / "run"))
    assert code == 2 and result is None
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "the server rejected --loss-fn dro" in line and "the run stops here (no checkpoint was saved yet; " in line
    # the failed iteration's timings are written, though its metrics row is not (resume repeats it)
    (failed,) = rows(tmp_path / "run" / "failures.jsonl")
    assert f"the iteration's timings are in {tmp_path / 'run' / 'failures.jsonl'}" in line
    assert failed["iteration"] == 0 and failed["seconds_sampling"] > 0 and failed["seconds_training"] >= 0
    assert failed["datums"] > 0 and failed["tokens_trained"] > 0 and "UnprocessableEntityError" in failed["error"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not rows(tmp_path / "run" / "metrics.jsonl")
    assert "poisoned" not in line  # SDK 0.38: a rejected loss leaves the client usable
    assert "--loss-fn importance_sampling|ppo|cispo" in line
    assert "Traceback" not in err


def test_default_rehearsal_runs_every_iteration_with_reward_rising(local_tinker, tmp_path):
    """The documented free rehearsal, as a subprocess with no flag but the log folder: on the local backend
    --rehearse auto picks the task the tiny model can learn ('say something') and its settings."""
    out = subprocess.run([sys.executable, tinker_rl.__file__, "--log-path", str(tmp_path / "run")],
                         env=local_tinker.env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    assert "rehearsal (--rehearse auto: on, TINKER_BASE_URL is this machine)" in out.stderr
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    means = [m["reward_mean"] for m in metrics]
    print("rehearsal reward per iteration:", means)
    assert [m["iteration"] for m in metrics] == list(range(5))
    assert means[-1] >= means[0] + 0.3 and means[-1] >= 0.75, means
    assert sum(m["datums"] for m in metrics) > 0
    assert all(abs(m["kl_sample_train_v1"]) < 1e-3 for m in metrics if m["datums"])  # sampler = learner
    assert all(m["tokens_sampled"] <= 2 * 4 * 8 for m in metrics)
    result = json.loads(out.stdout)
    assert result["status"] == "ok" and result["reward"] == {"first": means[0], "last": means[-1]}
    # it ends with the summary tinker_sft.py prints: what trained, the reward's move, the record, the cost, next
    summary = out.stderr.split("==== what happened ====\n", 1)[1].splitlines()
    assert summary[0].startswith("trained  Qwen/Qwen3-8B (the local backend's tiny-qwen3 standing in), a new LoRA")
    assert summary[1].startswith(f"reward   mean {means[0]:.3f} over the first 1 iteration(s) -> {means[-1]:.3f}")
    assert any(line.startswith("record   ") for line in summary) and any("cost/cumulative_usd" in x for x in summary)
    assert any(line.startswith("next     sample it: ") and "tinker_infer.py --run" in line for line in summary)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["rehearse"] is True and config["learning_rate"] == 1e-2 and config["batch_size"] * config["group_size"] == 8


def test_base_policy_that_ties_every_group_stops_before_training(local_tinker, tmp_path):
    """--rehearse off (what a run on Tinker does): the shipped example on the random model ties every
    group at 0 (it never multiplies), and the run stops at iteration 0 with nothing trained."""
    out = subprocess.run([sys.executable, tinker_rl.__file__, "--rehearse", "off", "--tokenizer",
                          str(local_tinker.tokenizer_dir), "--lora-rank", "8", "--batch-size", "2", "--group-size",
                          "2", "--max-tokens", "8", "--iterations", "2", "--log-path", str(tmp_path / "run")],
                         env=local_tinker.env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr
    assert "the base policy ties every group (all 2 groups at reward [0.0])" in out.stderr
    assert out.stdout == "" and not (tmp_path / "run" / "checkpoints.jsonl").exists()
    # what the stopped iteration sampled is kept: its metrics row and its decoded rollouts
    [row] = rows(tmp_path / "run" / "metrics.jsonl")
    assert row["iteration"] == 0 and row["groups_tied"] == 2 and row["datums"] == 0
    trace = rows(tmp_path / "run" / "rollouts.jsonl")
    assert len(trace) == 4 and all("What is" in r["prompt_text"] and not r["trained"] for r in trace)


def test_calculator_rehearsal_trains_two_turn_episodes(local_tinker, monkeypatch, capsys, tmp_path):
    """The multi-turn example's rehearsal: the tiny model never calls the tool, so its first turn is
    reminded, the second is the answer ('said something'); each episode trains as one datum."""
    monkeypatch.setattr(tinker_rl, "CALCULATOR_TASKS", tinker_rl.CALCULATOR_TASKS[:4])
    # Without the 160-token tool preamble the sequences stay under 128 tokens (fast, lean compile
    # buckets); the preamble's rendering is checked offline (test_rl_units dry run).
    monkeypatch.setattr(tinker_rl, "CALCULATOR_TOOLS", None)
    code, result, err = run_in_process(local_tinker, monkeypatch, capsys, "--env", "calculator", "--iterations",
                                       "3", "--save-every", "1", "--log-path", str(tmp_path / "run"))
    assert code == 0, err
    assert "calculator episodes scored by 'said something'" in err
    assert "rehearsal (--rehearse auto: on, TINKER_BASE_URL is this machine)" in err
    assert "beside it, --env calculator's own reward on the same episodes: mean 0.000" in err
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    print("calculator rehearsal reward per iteration:", [m["reward_mean"] for m in metrics],
          "datums:", [m["datums"] for m in metrics])
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m["turns_mean"] == 2 and m["env/reminders"] == 8 and m["env/answers"] == 8
        assert m["env/own_reward"] == 0.0  # the calculator's own reward, kept beside the stand-in
        assert m["datums"] == 8 - 4 * m["groups_tied"]  # one datum per episode of an untied group
    assert any(m["datums"] for m in metrics)
    trained = [r for r in rows(tmp_path / "run" / "rollouts.jsonl") if r["trained"]]
    assert trained and all(len(r["turns"]) == 2 and not r["turns"][1]["starts_datum"] for r in trained)
    assert all("Use the calculator tool first." in r["completion_text"] for r in trained)
    ckpts = rows(tmp_path / "run" / "checkpoints.jsonl")
    assert [(c["name"], c["next_iteration"]) for c in ckpts] == [("000001", 1), ("000002", 2), ("final", 3)]
    assert ckpts[-1]["sampler_path"] and result["sampler_path"] == ckpts[-1]["sampler_path"]


def test_resume_neither_replays_nor_skips_an_iteration(local_tinker, monkeypatch, capsys, tmp_path):
    common = ["--save-every", "1", "--log-path", str(tmp_path / "run")]
    code, _, err = run_in_process(local_tinker, monkeypatch, capsys, "--iterations", "2", *common)
    assert code == 0, err
    code, _, err = run_in_process(local_tinker, monkeypatch, capsys, "--iterations", "2", *common)
    assert code == 2 and "already holds a run; pass --resume to continue it" in err
    code, result, err = run_in_process(local_tinker, monkeypatch, capsys, "--iterations", "3", "--resume", *common)
    assert code == 0, err
    assert "resumed from" in err and "/weights/final" in err
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    assert metrics[2]["tasks"] == tinker_rl.batch_tasks(2, len(tinker_rl.load_env("single", True)["tasks"]), 2, 0)
    assert metrics[2]["group_seeds"] == [tinker_rl.group_seed(0, 2, s) for s in range(2)]
    ckpts = rows(tmp_path / "run" / "checkpoints.jsonl")
    assert [(c["name"], c["next_iteration"]) for c in ckpts] == [("000001", 1), ("final", 2), ("final", 3)]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["format"] == result["format"] and config["iterations"] == 2  # never rewritten on resume


def test_off_policy_rehearsal_samples_one_iteration_behind_and_trains(local_tinker, monkeypatch, capsys, tmp_path):
    """--max-staleness 1 on the local backend: every iteration after the first samples with the weights of
    the one before (the real SDK's sampler, awaited from the background sampling loop), trains on them
    with the sampler's logprobs, and the learner then differs from the sampler (KL no longer ~0)."""
    code, result, err = run_in_process(local_tinker, monkeypatch, capsys, "--max-staleness", "1",
                                       "--log-path", str(tmp_path / "run"))
    assert code == 0, err
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    print("off-policy rehearsal reward per iteration:", [m["reward_mean"] for m in metrics],
          "kl v1:", [m.get("kl_sample_train_v1") for m in metrics])
    assert [m["sampler_version"] for m in metrics] == [0, 0, 1, 2, 3]
    assert [m["staleness_max"] for m in metrics] == [0, 1, 1, 1, 1]
    assert all(m["groups_stale_dropped"] == 0 for m in metrics)
    assert abs(metrics[0]["kl_sample_train_v1"]) < 1e-3  # iteration 0: the sampler is the learner
    behind = [m["kl_sample_train_v1"] for prev, m in zip(metrics, metrics[1:]) if prev["datums"] and m["datums"]]
    assert behind and max(abs(k) for k in behind) > 1e-3, behind  # one update between sampler and learner
    trace = rows(tmp_path / "run" / "rollouts.jsonl")
    assert {(r["iteration"], r["sampler_version"]) for r in trace} == {(0, 0), (1, 0), (2, 1), (3, 2), (4, 3)}
    assert result["status"] == "ok" and result["sampler_path"]
