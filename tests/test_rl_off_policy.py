"""tinker_rl.py --max-staleness K (async off-policy RL) with a fake Tinker whose sampler replies depend on
the weights version: the next iteration samples while this one trains, each rollout records its sampler
version, rollouts staler than K are dropped and counted, and a resumed run trains exactly what an
uninterrupted one does."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import tinker_rl
from test_rl_units import Done, qwen  # noqa: F401  (fixture)

BATCH, GROUP = 2, 3


class VersionedSampler:
    """A sampler of the weights after `version` iterations: sample i of a group is 1 + (version + seed + i) % 3
    copies of one token, logprobs -0.1 * (version + 1) each, so both show which weights sampled."""

    def __init__(self, service, version):
        self.service, self.version = service, version

    async def sample(self, prompt, num_samples, sampling_params):
        self.service.log(("sample", self.version, sampling_params.seed))
        await asyncio.sleep(0.001)
        eot = self.service.eot
        seqs = [[1040] * (1 + (self.version + sampling_params.seed + i) % 3) + [eot] for i in range(num_samples)]
        return SimpleNamespace(sequences=[SimpleNamespace(tokens=t, logprobs=[-0.1 * (self.version + 1)] * len(t),
                                                          stop_reason="stop") for t in seqs])


class VersionedTraining:
    def __init__(self, service, steps):
        self.service, self.steps = service, steps

    def save_weights_and_get_sampling_client(self):
        return Done(VersionedSampler(self.service, self.steps))

    def forward_backward(self, datums, loss_fn, loss_fn_config):
        self.service.before_training(self.steps)
        self.service.trained.append((self.steps, [(d.model_input.to_ints(), d.loss_fn_inputs["logprobs"].tolist(),
                                                   d.loss_fn_inputs["advantages"].tolist()) for d in datums]))
        outputs = [{"logprobs": d.loss_fn_inputs["logprobs"].tolist()} for d in datums]
        return Done(SimpleNamespace(metrics={"loss:sum": -1.0}, loss_fn_outputs=outputs))

    def optim_step(self, params):
        self.steps += 1
        return Done(None)

    def save_state(self, name, ttl_seconds=None):
        return Done(SimpleNamespace(path=f"tinker://fake/weights/{name}@{self.steps}"))

    def save_weights_for_sampler(self, name):
        return Done(SimpleNamespace(path=f"tinker://fake/sampler_weights/{name}@{self.steps}"))


class VersionedService:
    def __init__(self, eot):
        self.eot, self.trained, self.events, self.lock = eot, [], [], threading.Lock()
        self.before_training = lambda steps: None

    def log(self, event):
        with self.lock:
            self.events.append(event)

    def create_lora_training_client(self, base_model, rank, seed=None):
        return Done(VersionedTraining(self, 0))

    def create_training_client_from_state_with_optimizer(self, path):
        return Done(VersionedTraining(self, int(path.rsplit("@", 1)[1])))


@pytest.fixture
def fake(monkeypatch, qwen):
    tok, fmt, path = qwen
    service = VersionedService(fmt["stop"][0])
    monkeypatch.setattr(tinker_rl, "connect", lambda model_name, **kw: (service, 32768))
    monkeypatch.setattr(tinker_rl, "reward", lambda task, completion: float(len(completion)))
    monkeypatch.setattr(tinker_rl, "TASKS", tinker_rl.TASKS[:6])

    def run(log, *argv):
        return tinker_rl.run_cli(tinker_rl.main, ["--rehearse", "off", "--tokenizer", path, "--batch-size", str(BATCH),
                                                  "--group-size", str(GROUP), "--max-tokens", "8",
                                                  "--log-path", str(log), *argv])

    service.run = run
    return service


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def seeds_of(iteration):
    return {tinker_rl.group_seed(0, iteration, slot) for slot in range(BATCH)}


def test_the_next_iteration_samples_with_the_previous_weights_while_this_one_trains(fake, tmp_path):
    """forward_backward of iteration k waits until a sampling request of iteration k+1 has started: only a
    loop that samples k+1 during k's training gets past it (a sequential one would time out)."""
    overlapped = []

    def before_training(steps):
        for _ in range(500 if steps < 3 else 0):  # up to 5 s; the last iteration has no next one
            with fake.lock:
                if any(e[0] == "sample" and e[2] in seeds_of(steps + 1) for e in fake.events):
                    overlapped.append(steps)
                    return
            time.sleep(0.01)

    fake.before_training = before_training
    log = tmp_path / "run"
    assert fake.run(log, "--iterations", "4", "--max-staleness", "1", "--save-every", "0") == 0
    assert overlapped == [0, 1, 2]  # the last iteration has no next one to overlap with
    trace = rows(log / "rollouts.jsonl")
    assert [(r["iteration"], r["sampler_version"], r["staleness"]) for r in trace[::GROUP * BATCH]] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 1), (3, 2, 1)]
    metrics = rows(log / "metrics.jsonl")
    assert [m["sampler_version"] for m in metrics] == [0, 0, 1, 2]
    assert [m["staleness_max"] for m in metrics] == [0, 1, 1, 1]
    assert [m["groups_stale_dropped"] for m in metrics] == [0, 0, 0, 0]
    # the importance-sampling loss gets the logprobs of the sampler that produced the tokens (version 1 for
    # iteration 2), not the learner's
    step, datums = fake.trained[2]
    assert step == 2 and {round(lp, 6) for _, lps, _ in datums for lp in lps if lp} == {-0.2}


def test_max_staleness_0_is_on_policy(fake, tmp_path):
    log = tmp_path / "run"
    assert fake.run(log, "--iterations", "3") == 0
    assert [m["sampler_version"] for m in rows(log / "metrics.jsonl")] == [0, 1, 2]
    assert {r["staleness"] for r in rows(log / "rollouts.jsonl")} == {0}
    samples = [e for e in fake.events if e[0] == "sample"]
    assert [v for v, seed in ((e[1], e[2]) for e in samples) for it in range(3) if seed in seeds_of(it)
            if v != it] == []


def test_rollouts_staler_than_max_staleness_are_dropped_and_counted(fake, tmp_path, monkeypatch):
    """A schedule that lets iteration 3 sample with the weights of iteration 1 (two steps behind) under
    --max-staleness 1: its groups are not trained, the row counts them, the trace marks them."""
    schedule = tinker_rl.sampler_version
    monkeypatch.setattr(tinker_rl, "sampler_version",
                        lambda it, start, max_staleness, save_every: 1 if it == 3 else schedule(
                            it, start, max_staleness, save_every))
    log = tmp_path / "run"
    assert fake.run(log, "--iterations", "4", "--max-staleness", "1", "--save-every", "0") == 0
    metrics = rows(log / "metrics.jsonl")
    assert [m["groups_stale_dropped"] for m in metrics] == [0, 0, 0, BATCH]
    assert metrics[3]["staleness_max"] == 2 and metrics[3]["datums"] == 0
    assert [step for step, _ in fake.trained] == [0, 1, 2]  # nothing left to train at iteration 3
    last = [r for r in rows(log / "rollouts.jsonl") if r["iteration"] == 3]
    assert len(last) == BATCH * GROUP and all(r["staleness"] == 2 and not r["trained"] for r in last)


def comparable(path):
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows(path)]


def test_off_policy_resume_trains_exactly_what_the_uninterrupted_run_does(fake, tmp_path):
    whole = tmp_path / "whole"
    assert fake.run(whole, "--iterations", "5", "--max-staleness", "1", "--save-every", "2") == 0
    uninterrupted, fake.trained = fake.trained, []

    def killed_at_3(steps):
        if steps == 3:
            raise KeyboardInterrupt

    fake.before_training = killed_at_3
    parts = tmp_path / "parts"
    assert fake.run(parts, "--iterations", "5", "--max-staleness", "1", "--save-every", "2") == 130
    assert [c["next_iteration"] for c in rows(parts / "checkpoints.jsonl")] == [2]
    fake.before_training, fake.trained = (lambda steps: None), []
    assert fake.run(parts, "--iterations", "5", "--max-staleness", "1", "--save-every", "2", "--resume") == 0
    assert comparable(parts / "metrics.jsonl") == comparable(whole / "metrics.jsonl")
    assert comparable(parts / "rollouts.jsonl") == comparable(whole / "rollouts.jsonl")
    resumed = [t for t in fake.trained if t[0] >= 2]
    assert resumed == [t for t in uninterrupted if t[0] >= 2] and [t[0] for t in resumed] == [2, 3, 4]
    # iterations 2 and 4 follow a save: sampled with the saved weights in both runs, so nothing differs
    assert [m["sampler_version"] for m in rows(whole / "metrics.jsonl")] == [0, 0, 2, 2, 4]


def test_max_staleness_below_0_is_refused(fake, tmp_path, capsys):
    assert fake.run(tmp_path / "run", "--max-staleness", "-1") == 2
    assert "--max-staleness" in capsys.readouterr().err


def test_evaluation_under_max_staleness_scores_the_iterations_own_weights(fake, tmp_path):
    """--eval-every runs on the background sampling loop beside the rollouts in flight, with the newest
    weights (iteration k's for the row of iteration k), as on-policy."""
    log = tmp_path / "run"
    assert fake.run(log, "--iterations", "4", "--max-staleness", "1", "--save-every", "0", "--eval-every", "2",
                    "--eval-samples", "2") == 0
    metrics = rows(log / "metrics.jsonl")
    assert [m["iteration"] for m in metrics if "eval/greedy_reward" in m] == [0, 2]
    greedy = [e for e in fake.events if e[0] == "sample" and e[2] == 0]  # eval groups use --seed 0
    assert sorted({version for _, version, _ in greedy}) == [0, 2]
