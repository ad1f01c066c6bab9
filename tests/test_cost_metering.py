"""cost/step_usd and cost/cumulative_usd in every training script's metrics rows, offline with fake Tinker
clients: each row prices the tokens its step sent with tinker_pricing.py's catalogue (CostMeter in
common/service.py), the cumulative is the running sum, a --resume continues it, and the total lands on the
pre-run estimate in config.json where the estimate counts exact tokens (and below it, by a computed amount,
where the estimate is an upper bound). Without tinker_pricing.py the rows carry no cost, said once."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import tinker_distill
import tinker_dpo
import tinker_pricing
import tinker_rl
import tinker_sft
from test_rl_units import Done
from test_sft_loop import RecordingService, digits

ROOT = Path(__file__).resolve().parents[1]
MODEL = "Qwen/Qwen3-8B"
RATES = {k: tinker_pricing.resolve_model(MODEL)[k] for k in tinker_pricing.PRICE_KINDS}  # USD per 1M tokens
STOP = 151645  # Qwen3 <|im_end|>


def usd(**tokens):
    return sum(RATES[kind] * count for kind, count in tokens.items()) / 1e6


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def assert_running_sum(metrics, start=0.0):
    """Every row carries both fields and the cumulative is the running sum of the step costs."""
    total = start
    for row in metrics:
        assert row["cost/step_usd"] > 0
        total += row["cost/step_usd"]
        assert row["cost/cumulative_usd"] == pytest.approx(total, rel=1e-9, abs=1e-12)
    return total


# ---------------------------------------------------------------- shared accounting


def test_rollout_tokens_count_multi_turn_groups_as_the_rl_estimate_does():
    """G episodes of T turns: prompt P, completion C per turn, O new observation tokens per later turn."""
    P, C, O, T, G = 30, 7, 5, 3, 4

    def episode(e):
        turns, observation = [], list(range(1000, 1000 + P))
        for k in range(T):
            action = [2000 + 10 * e + k] * (C - 1) + [STOP]
            turns.append(SimpleNamespace(observation=observation, action=action))
            observation = observation + action + [3000 + k] * O
        return SimpleNamespace(turns=turns)

    counted = tinker_rl.rollout_tokens([SimpleNamespace(episodes=[episode(e) for e in range(G)])])
    planned = tinker_pricing.rl_tokens(1, 1, G, P, C, turns=T, avg_observation=O)
    assert counted == {k: planned[k] for k in ("prefill", "cached_prefill", "sample")}
    assert counted == {"prefill": P + G * (T - 1) * O, "cached_prefill": 3 * P + G * (2 * (P + C) + (C + O)),
                       "sample": G * T * C}


def test_a_turn_that_breaks_the_prefix_is_prefilled_after_the_shared_part():
    first = SimpleNamespace(observation=[1, 2, 3, 4], action=[5, 6])
    second = SimpleNamespace(observation=[1, 2, 9, 9, 9], action=[7])  # the renderer rewrote the history
    counted = tinker_rl.rollout_tokens([SimpleNamespace(episodes=[SimpleNamespace(turns=[first, second])])])
    assert counted == {"prefill": 4 + 3, "cached_prefill": 2, "sample": 3}


def test_a_model_without_a_train_price_gets_no_cost_fields_and_one_message(capsys):
    meter = tinker_sft.CostMeter("thinkingmachines/Inkling-Small:peft:262144")  # no train price in any source
    assert meter.row(prefill=100, sample=10) != {}  # sampling is priced
    assert meter.row(train=1000) == {} and meter.row(train=1000, prefill=5) == {}
    err = capsys.readouterr().err
    assert err.count("no cost/step_usd or cost/cumulative_usd in metrics.jsonl: no train price") == 1


# ---------------------------------------------------------------- SFT


@pytest.fixture
def sft_main(monkeypatch, offline_tokenizer, capsys):
    """main(log, *flags) against the recording fake of test_sft_loop; returns (report, stderr). Its samplers
    answer one digit + <|im_end|>: 2 sampled tokens per prompt."""
    tokenizer = offline_tokenizer("Qwen3-8B")

    def run(log, *flags):
        service = RecordingService()
        monkeypatch.setattr(tinker_sft, "connect", lambda model_name, **_: (service, 4096))
        code = tinker_sft.main(["--data", str(ROOT / "templates" / "sft_example.jsonl"), "--tokenizer", tokenizer,
                                "--batch-size", "4", "--max-steps", "4", "--save-every", "2", "--eval-every", "2",
                                "--eval-samples", "2", "--num-probes", "2", "--learning-rate", "1e-3",
                                "--log-path", str(log), *flags])
        assert code == 0
        out, err = capsys.readouterr()
        return json.loads(out), err

    return run


def test_sft_total_equals_the_pre_run_estimate_when_every_sample_reaches_max_tokens(sft_main, tmp_path):
    report, _ = sft_main(tmp_path / "log", "--max-tokens", "2")
    log = tmp_path / "log"
    estimate = json.loads((log / "config.json").read_text())["estimate_usd"]
    assert estimate == report["cost"]["usd"]["total"] > 0
    metrics, evals = rows(log / "metrics.jsonl"), rows(log / "eval.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    logged = assert_running_sum(metrics)
    # a step without an eval pays its forward_backward tokens at the train rate, nothing else
    assert metrics[2]["cost/step_usd"] == pytest.approx(usd(train=metrics[2]["tokens"]), rel=1e-9)
    # step 1 also pays the eval before training: held-out forward + greedy samples of probes and eval prompts
    before = evals[0]
    assert before["when"] == "before" and len(before["probes"]) == 2 and before["scored"] == 2
    assert metrics[0]["cost/step_usd"] > usd(train=metrics[0]["tokens"])
    # the eval after the last step is past the last row: its eval.jsonl row carries the run's total
    after = evals[-1]
    assert after["when"] == "after" and after["cost/step_usd"] > 0
    assert after["cost/cumulative_usd"] == pytest.approx(logged + after["cost/step_usd"], rel=1e-9)
    # every token count of this run is exact (train and prefill always; samples here all reach --max-tokens)
    assert after["cost/cumulative_usd"] == pytest.approx(estimate, rel=1e-9)


def test_sft_total_stays_below_the_estimate_by_the_unsampled_tokens(sft_main, tmp_path):
    """--max-tokens 6 with 2-token answers: the estimate prices 4 sampled tokens per prompt that never came."""
    report, _ = sft_main(tmp_path / "log", "--max-tokens", "6")
    log = tmp_path / "log"
    estimate = json.loads((log / "config.json").read_text())["estimate_usd"]
    evals = rows(log / "eval.jsonl")
    sample_calls = sum(len(r.get("probes", [])) + r.get("scored", 0) for r in evals)
    assert sample_calls == 2 * 2 + 3 * 2  # probes before and after, eval prompts before, at step 2, after
    total = evals[-1]["cost/cumulative_usd"]
    assert total < estimate
    assert estimate - total == pytest.approx(usd(sample=(6 - 2) * sample_calls), rel=1e-6)


def test_sft_resume_continues_the_sum_from_the_last_row_kept(sft_main, tmp_path):
    sft_main(tmp_path / "full", "--max-tokens", "2")
    full = rows(tmp_path / "full" / "metrics.jsonl")
    log = tmp_path / "killed"  # killed after the save at step 2, with step 3 logged but never saved
    log.mkdir()
    (log / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    (log / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(tmp_path / "full" / "eval.jsonl")[:2]))
    (log / "checkpoints.jsonl").write_text(json.dumps(rows(tmp_path / "full" / "checkpoints.jsonl")[0]) + "\n")
    (log / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:3]))
    sft_main(log, "--max-tokens", "2", "--resume")
    resumed = rows(log / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("cost/step_usd", "cost/cumulative_usd"):  # as if never interrupted
        assert [r[key] for r in resumed] == pytest.approx([r[key] for r in full], rel=1e-9)
    assert rows(log / "eval.jsonl")[-1]["cost/cumulative_usd"] == pytest.approx(
        rows(tmp_path / "full" / "eval.jsonl")[-1]["cost/cumulative_usd"], rel=1e-9)


def test_without_tinker_pricing_beside_the_script_rows_carry_no_cost_and_it_is_said_once(
        sft_main, tmp_path, monkeypatch):
    monkeypatch.setattr(tinker_sft, "load_pricing", lambda: None)
    report, err = sft_main(tmp_path / "log", "--max-tokens", "2")
    log = tmp_path / "log"
    assert report["cost"] is None and json.loads((log / "config.json").read_text())["estimate_usd"] is None
    assert not [k for r in rows(log / "metrics.jsonl") + rows(log / "eval.jsonl") for k in r if k.startswith("cost/")]
    assert err.count("no cost/step_usd or cost/cumulative_usd in metrics.jsonl: tinker_pricing.py is not beside") == 1


# ---------------------------------------------------------------- fakes for RL, DPO and distill


class Values(list):
    def tolist(self):
        return list(self)


class FakeSampler:
    """Every sample is exactly max_tokens long (the estimate's assumption), a different token per sample
    index so rewards differ within a group; compute_logprobs gives -1 per token (None first)."""

    def __init__(self):
        self.calls = []  # (prompt length, num_samples, sampled tokens)
        self.scored = []  # sequence length of each compute_logprobs call

    def sample(self, prompt=None, num_samples=1, sampling_params=None, **kw):
        n = sampling_params.max_tokens
        seqs = [SimpleNamespace(tokens=[15 + i % 10] * (n - 1) + [STOP], logprobs=[-0.5] * n, stop_reason="stop")
                for i in range(num_samples)]
        self.calls.append((prompt.length, num_samples, num_samples * n))
        return Done(SimpleNamespace(sequences=seqs))

    def compute_logprobs(self, prompt, **kw):
        self.scored.append(prompt.length)
        return Done([None] + [-1.0] * (prompt.length - 1))

    def get_base_model(self):
        return MODEL


class FakeTraining:
    def __init__(self, service):
        self.service = service

    def save_weights_and_get_sampling_client(self, *a, **kw):
        return Done(self.service.sampler)

    def forward_backward(self, datums, loss_fn=None, loss_fn_config=None, **kw):
        self.service.trained += sum(d.model_input.length for d in datums)
        outputs = [{"logprobs": Values(d.loss_fn_inputs["logprobs"].tolist())} for d in datums]
        return Done(SimpleNamespace(metrics={"loss:sum": -1.0}, loss_fn_outputs=outputs))

    def forward(self, datums, loss_fn=None, **kw):
        self.service.forwarded += sum(d.model_input.length for d in datums)
        return Done(SimpleNamespace(loss_fn_outputs=[{"logprobs": Values([-1.0] * d.model_input.length)}
                                                     for d in datums]))

    def forward_backward_custom(self, data, loss_fn):
        import torch

        self.service.trained += 2 * sum(d.model_input.length for d in data)  # a forward, then forward_backward
        loss, metrics = loss_fn(data, [torch.full((d.model_input.length,), -1.0) for d in data])
        return Done(SimpleNamespace(metrics={"loss:sum": float(loss), **metrics}))

    def optim_step(self, params):
        return Done(None)

    def save_state(self, name, ttl_seconds=None):
        return Done(SimpleNamespace(path=f"tinker://fake/weights/{name}"))

    def save_weights_for_sampler(self, name, ttl_seconds=None):
        return Done(SimpleNamespace(path=f"tinker://fake/sampler_weights/{name}"))


class FakeService:
    def __init__(self):
        self.sampler, self.trained, self.forwarded = FakeSampler(), 0, 0

    def create_lora_training_client(self, *a, **kw):
        return Done(FakeTraining(self))

    def create_training_client_from_state_with_optimizer(self, path, *a, **kw):
        return Done(FakeTraining(self))

    def create_sampling_client(self, *a, **kw):
        return Done(self.sampler)

    def close(self, *a, **kw):
        return Done(None)


def sent_sampling_tokens(calls):
    """What the fake sampler was asked for, as Tinker meters it: prefill once, num_samples-1 cached copies."""
    return {"prefill": sum(p for p, _, _ in calls), "cached_prefill": sum((n - 1) * p for p, n, _ in calls),
            "sample": sum(s for _, _, s in calls)}


# ---------------------------------------------------------------- RL


def test_rl_rows_price_the_sampled_and_trained_tokens_and_stay_below_the_upper_bound_estimate(
        monkeypatch, offline_tokenizer, tmp_path, capsys):
    service = FakeService()
    monkeypatch.setattr(tinker_rl, "connect", lambda model_name, **kw: (service, 32768))
    monkeypatch.setattr(tinker_rl, "reward", lambda task, completion: float(completion[:1] or 0))
    monkeypatch.setattr(tinker_rl, "TASKS", tinker_rl.TASKS[:4])
    log = tmp_path / "log"
    code = tinker_rl.run_cli(tinker_rl.main, ["--tokenizer", offline_tokenizer("Qwen3-8B"), "--batch-size", "2",
                                              "--group-size", "3", "--max-tokens", "8", "--iterations", "2",
                                              "--rehearse", "off", "--log-path", str(log)])
    assert code == 0, capsys.readouterr().err
    metrics = rows(log / "metrics.jsonl")
    total = assert_running_sum(metrics)
    sent = sent_sampling_tokens(service.sampler.calls)
    assert sum(r["tokens_trained"] for r in metrics) == service.trained > 0
    assert total == pytest.approx(usd(train=service.trained, **sent), rel=1e-9)
    # the estimate: the same prompts (each task once), every completion at --max-tokens as here, but a datum
    # priced at prompt + completion tokens where Tinker trains one fewer (the shift by one)
    estimate = json.loads((log / "config.json").read_text())["estimate_usd"]
    datums = 2 * 2 * 3
    assert estimate - total == pytest.approx(usd(train=datums), rel=1e-6)


# ---------------------------------------------------------------- DPO


@pytest.mark.parametrize("reference", ["sampler", "forward"])
def test_dpo_total_equals_the_pre_run_estimate(monkeypatch, offline_tokenizer, tmp_path, capsys, reference):
    service = FakeService()
    monkeypatch.setattr(tinker_dpo, "connect", lambda model_name, **kw: (service, 32768))
    log = tmp_path / "log"
    code = tinker_dpo.run_cli(tinker_dpo.main, ["--data", str(ROOT / "templates" / "dpo_example.jsonl"),
                                                "--tokenizer", offline_tokenizer("Qwen3-8B"), "--batch-size", "4",
                                                "--reference", reference, "--log-path", str(log)])
    assert code == 0, capsys.readouterr().err
    metrics = rows(log / "metrics.jsonl")
    total = assert_running_sum(metrics)
    for row in metrics[1:]:  # forward_backward_custom bills the batch twice at the train rate
        assert row["cost/step_usd"] == pytest.approx(usd(train=2 * row["tokens"]), rel=1e-9)
    # step 1 also carries the reference pass (prefill + 1 sampled token per sequence, or a forward)
    assert metrics[0]["cost/step_usd"] > usd(train=2 * metrics[0]["tokens"])
    scored = service.sampler.scored  # compute_logprobs: each whole sequence prefilled, 1 token sampled
    assert total == pytest.approx(usd(train=service.trained + service.forwarded, prefill=sum(scored),
                                      sample=len(scored)), rel=1e-9)
    assert (len(scored) > 0) == (reference == "sampler") and (service.forwarded > 0) == (reference == "forward")
    estimate = json.loads((log / "config.json").read_text())["estimate_usd"]
    assert total == pytest.approx(estimate, rel=1e-9)  # every token count of the estimate is exact: equal


# ---------------------------------------------------------------- distillation


def test_distill_total_equals_the_pre_run_estimate_student_and_teacher(monkeypatch, offline_tokenizer, tmp_path,
                                                                      capsys):
    service = FakeService()
    monkeypatch.setattr(tinker_distill, "connect", lambda model_name, **kw: (service, 32768))
    monkeypatch.setattr(tinker_distill, "check_teacher_served", lambda base: None)  # the fake serves it
    tokenizer = offline_tokenizer("Qwen3-8B")
    log = tmp_path / "log"
    argv = ["--tokenizer", tokenizer, "--teacher", MODEL, "--teacher-tokenizer", tokenizer, "--iterations", "2",
            "--batch-size", str(len(tinker_distill.PROMPTS)), "--group-size", "2", "--max-tokens", "6",
            "--log-path", str(log)]
    code = tinker_distill.run_cli(tinker_distill.main, argv)
    assert code == 0, capsys.readouterr().err
    metrics = rows(log / "metrics.jsonl")
    total = assert_running_sum(metrics)
    # student: one call of group-size per prompt, every sample at --max-tokens; teacher: compute_logprobs on
    # each whole sequence (prefill) + 1 sampled token; train: every datum
    student = sent_sampling_tokens(service.sampler.calls)
    scored = service.sampler.scored
    assert len(scored) == sum(r["sequences"] for r in metrics) == 2 * len(tinker_distill.PROMPTS) * 2
    teacher = {"prefill": sum(scored), "sample": len(scored)}
    assert total == pytest.approx(usd(train=service.trained, **student) + usd(**teacher), rel=1e-9)
    # every prompt is sampled once per iteration, so the estimate's mean prompt is exact: equal totals
    estimate = json.loads((log / "config.json").read_text())["estimate_usd"]
    assert total == pytest.approx(estimate, rel=1e-9)
