"""tinker_sft.py's training loop against a recording stand-in for the Tinker clients (offline):
the order in which calls are submitted and awaited, what each checkpoint row says, and that
--resume continues at exactly the next batch, trimming what a killed process logged past its save."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import tinker_sft as sft

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "templates" / "sft_example.jsonl"


class Future:
    def __init__(self, events, label, value):
        self.events, self.label, self.value = events, label, value

    def result(self):
        self.events.append(("wait", self.label))
        return self.value


class Logprobs(list):
    def tolist(self):
        return list(self)


class RecordingSampler:
    """Greedy sampling stand-in: answers every prompt with `answer` (token ids) + the Qwen3 stop token."""

    def __init__(self, answer):
        self.answer, self.prompts = answer, []

    def sample(self, prompt, num_samples, params):
        self.prompts.append(prompt.to_ints())
        seq = SimpleNamespace(tokens=[*self.answer, 151645])
        return SimpleNamespace(result=lambda: SimpleNamespace(sequences=[seq]))


def digits(text):
    """Qwen3 token ids of a short number: one token per digit."""
    return [15 + int(c) for c in text]  # "0" is id 15 in the Qwen3 vocabulary


class RecordingTrainingClient:
    """Answers at once; records every submission and every wait in one event list. Its samplers answer
    with the number of optim steps submitted before them, so a score shows which weights were sampled."""

    def __init__(self, events, origin):
        self.events, self.origin, self.batches, self.n, self.optim_steps = events, origin, [], 0, 0

    def _label(self, kind):
        self.n += 1
        return f"{kind}#{self.n}"

    def _output(self, data):
        # every target token gets logprob -1.5, so the NLL per trained token is exactly 1.5
        outs = [{"logprobs": Logprobs([-1.5] * d.model_input.length)} for d in data]
        loss = sum(1.5 * sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
        return SimpleNamespace(loss_fn_outputs=outs, metrics={"loss:sum": loss})

    def forward_backward(self, data, loss_fn):
        assert loss_fn == "cross_entropy"
        label = self._label("fb")
        self.batches.append([d.model_input.to_ints() for d in data])
        self.events.append(("submit", label))
        return Future(self.events, label, self._output(data))

    def forward(self, data, loss_fn):
        label = self._label("forward")
        self.events.append(("submit", label))
        return Future(self.events, label, self._output(data))

    def optim_step(self, params):
        self.optim_steps += 1
        label = self._label("optim")
        self.events.append(("submit", label, params.learning_rate, params.eps))
        return Future(self.events, label, SimpleNamespace(metrics=None))

    def save_state(self, name, ttl_seconds=None):
        label = self._label("save_state")
        self.events.append(("submit", label, name, ttl_seconds))
        return Future(self.events, label, SimpleNamespace(path=f"tinker://{self.origin}/weights/{name}"))

    def save_weights_and_get_sampling_client(self):
        label = self._label("sampler")
        self.events.append(("submit", label))
        return Future(self.events, label, RecordingSampler(digits(str(self.optim_steps))))

    def save_weights_for_sampler(self, name, ttl_seconds=None):
        label = self._label("save_sampler")
        self.events.append(("submit", label, name))
        return Future(self.events, label, SimpleNamespace(path=f"tinker://{self.origin}/sampler_weights/{name}"))


class RecordingService:
    def __init__(self):
        self.events, self.created = [], []

    def _client(self, how, arg):
        tc = RecordingTrainingClient(self.events, f"run{len(self.created)}")
        self.created.append((how, arg, tc))
        return SimpleNamespace(result=lambda: tc)

    def create_lora_training_client(self, base_model, rank, seed, train_unembed=True):  # the SDK's default
        self.train_unembed = train_unembed
        return self._client("lora", (base_model, rank, seed))

    def create_training_client_from_state_with_optimizer(self, path):
        return self._client("resume", path)

    def create_training_client_from_state(self, path):
        return self._client("init", path)

    def create_sampling_client(self, base_model=None, model_path=None):
        steps = self.created[-1][2].optim_steps if model_path else 0
        return SimpleNamespace(result=lambda: RecordingSampler(digits(str(steps))))

    def close(self, status):
        return SimpleNamespace(result=lambda: None)


@pytest.fixture
def offline_main(monkeypatch, offline_tokenizer):
    """main(*flags) with the Tinker connection replaced by a RecordingService; returns (code, service)."""
    tokenizer = offline_tokenizer("Qwen3-8B")

    def run(log, *flags):
        service = RecordingService()
        monkeypatch.setattr(sft, "connect", lambda model_name, **_: (service, 4096))
        code = sft.main(["--data", str(EXAMPLE), "--tokenizer", tokenizer, "--batch-size", "4", "--max-steps", "4",
                         "--save-every", "2", "--eval-every", "2", "--learning-rate", "1e-3", "--num-probes", "0",
                         "--log-path", str(log), *flags])
        return code, service

    return run


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def submitted(events):
    return [e[1] for e in events if e[0] == "submit"]


def test_steps_are_pipelined_and_saves_follow_their_step(offline_main, tmp_path, capsys):
    code, service = offline_main(tmp_path / "log")
    assert code == 0
    events = service.events
    order = submitted(events)
    fbs = [label for label in order if label.startswith("fb")]
    assert len(fbs) == 4
    # forward_backward and optim_step are submitted back to back, optim_step carrying the cookbook eps
    for label in fbs:
        assert order[order.index(label) + 1].startswith("optim")
    assert all(e[3] == 1e-8 for e in events if e[0] == "submit" and e[1].startswith("optim"))
    # step k+1 is queued before step k is awaited
    for first, second in zip(fbs, fbs[1:]):
        assert events.index(("submit", second)) < events.index(("wait", first))
    # the periodic save comes right after the optim_step of step 2, before step 3 is queued
    save = next(e for e in events if e[0] == "submit" and e[2:3] == ("000002",))
    assert order[order.index(save[1]) - 1] == order[order.index(fbs[1]) + 1]
    assert order.index(save[1]) < order.index(fbs[2]) and save[3] == 7 * 24 * 3600
    # held-out forwards: before training, before step 3 (after 2 steps), after training
    forwards = [i for i, label in enumerate(order) if label.startswith("forward")]
    assert forwards[0] < order.index(fbs[0]) and order.index(fbs[1]) < forwards[1] < order.index(fbs[2])
    assert forwards[2] > order.index(fbs[3])
    # linear decay over 4 steps
    assert [e[2] for e in events if e[0] == "submit" and e[1].startswith("optim")] == pytest.approx(
        [1e-3, 7.5e-4, 5e-4, 2.5e-4])
    log = tmp_path / "log"
    saved = rows(log / "checkpoints.jsonl")
    assert [(r["name"], r["step"], r["next_batch"], r["sampler_path"] is None) for r in saved] == [
        ("000002", 2, 2, True), ("final", 4, 4, False)]
    assert saved[1]["state_path"] == "tinker://run0/weights/final"
    assert saved[1]["sampler_path"] == "tinker://run0/sampler_weights/final"
    assert [r["loss"] for r in rows(log / "metrics.jsonl")] == pytest.approx([1.5] * 4)
    assert [(r["when"], r["step"]) for r in rows(log / "eval.jsonl")] == [("before", 0), ("during", 2), ("after", 4)]
    report = json.loads(capsys.readouterr().out)
    assert report["eval"] == {"nll_before": 1.5, "nll_after": 1.5, "probes": []}
    assert report["state_path"] == saved[1]["state_path"] and report["format"] == saved[1]["format"]


def test_resume_continues_at_the_next_batch_without_replay(offline_main, tmp_path, capsys):
    _, full = offline_main(tmp_path / "full")
    full_batches = full.created[0][2].batches
    capsys.readouterr()

    # A run killed after its first save, with one step logged past it (trained, never saved).
    log = tmp_path / "killed"
    log.mkdir()
    for name in ("config.json", "eval.jsonl"):
        (log / name).write_text((tmp_path / "full" / name).read_text())
    full_rows = rows(tmp_path / "full" / "checkpoints.jsonl")
    (log / "checkpoints.jsonl").write_text(json.dumps(full_rows[0]) + "\n")
    metrics = rows(tmp_path / "full" / "metrics.jsonl")
    (log / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics[:3]) + '{"step": 4, "lo')
    (log / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(log / "eval.jsonl")[:2]))

    code, resumed = offline_main(log, "--resume")
    assert code == 0
    [(how, path, tc)] = resumed.created
    assert (how, path) == ("resume", "tinker://run0/weights/000002")
    assert tc.batches == full_batches[2:]  # batches 3 and 4 only: no replay, no skip
    assert [r["step"] for r in rows(log / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["name"] for r in rows(log / "checkpoints.jsonl")] == ["000002", "final"]
    report = json.loads(capsys.readouterr().out)
    assert report["eval"]["nll_before"] == 1.5 and report["steps"] == 4


def test_resume_with_changed_settings_is_refused(offline_main, tmp_path, capsys):
    offline_main(tmp_path / "log")
    (tmp_path / "log" / "checkpoints.jsonl").write_text(
        (tmp_path / "log" / "checkpoints.jsonl").read_text().splitlines()[0] + "\n")
    with pytest.raises(sft.DataError, match="--batch-size 4 -> 2"):
        offline_main(tmp_path / "log", "--resume", "--batch-size", "2")


def test_no_train_unembed_leaves_the_head_out_is_recorded_and_holds_on_resume(offline_main, tmp_path, capsys):
    code, service = offline_main(tmp_path / "log", "--no-train-unembed")
    assert code == 0 and service.train_unembed is False  # create_lora_training_client(..., train_unembed=False)
    assert json.loads((tmp_path / "log" / "config.json").read_text())["train_unembed"] is False
    code, service = offline_main(tmp_path / "default")
    assert code == 0 and service.train_unembed is True  # the SDK's default, as before
    assert json.loads((tmp_path / "default" / "config.json").read_text())["train_unembed"] is True
    (tmp_path / "log" / "checkpoints.jsonl").write_text(
        (tmp_path / "log" / "checkpoints.jsonl").read_text().splitlines()[0] + "\n")
    with pytest.raises(sft.DataError, match="--no-train-unembed given -> not given"):
        offline_main(tmp_path / "log", "--resume")
    code, service = offline_main(tmp_path / "log", "--resume", "--no-train-unembed")
    assert code == 0 and [how for how, _, _ in service.created] == ["resume"]


@pytest.mark.parametrize("script", ["tinker_sft", "tinker_rl", "tinker_dpo", "tinker_distill"])
def test_every_training_script_takes_no_train_unembed_and_resume_checks_it(script):
    module = __import__(script)
    assert module.parse_args(["--no-train-unembed"]).train_unembed is False
    assert module.parse_args([]).train_unembed is True
    assert "train_unembed" in module.RESUME_KEYS
    source = Path(module.__file__).read_text()
    assert source.count("train_unembed=args.train_unembed") == source.count("init_from=args.init_from")


def test_resume_of_a_finished_run_reports_it_without_training(offline_main, tmp_path, capsys):
    offline_main(tmp_path / "log")
    capsys.readouterr()
    code, service = offline_main(tmp_path / "log", "--resume")
    assert code == 0 and service.created == []
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "complete" and report["state_path"] == "tinker://run0/weights/final"


def test_eval_every_scores_held_out_samples_at_the_right_steps(offline_main, tmp_path, monkeypatch, capsys,
                                                              offline_tokenizer):
    tok = sft.load_tokenizer(offline_tokenizer("Qwen3-8B"))
    assert tok.encode("0123456789") == digits("0123456789")
    seen = []
    monkeypatch.setattr(sft, "score", lambda example, completion: seen.append(completion) or float(completion == "4"))
    code, service = offline_main(tmp_path / "log", "--max-steps", "6", "--save-every", "0", "--eval-samples", "2")
    assert code == 0
    log = tmp_path / "log"
    evals = rows(log / "eval.jsonl")
    # before (base model), after 2 and 4 steps, after the last step; each scores the same 2 held-out prompts
    assert [(r["when"], r["step"], r["scored"], r["score"]) for r in evals] == [
        ("before", 0, 2, 0.0), ("during", 2, 2, 0.0), ("during", 4, 2, 1.0), ("after", 6, 2, 0.0)]
    assert seen == ["0", "0", "2", "2", "4", "4", "6", "6"]  # each sampler saw the weights of its step
    assert [s["line"] for s in evals[1]["samples"]] == [s["line"] for s in evals[0]["samples"]]
    # the eval lands in the metrics row of its step, and nowhere else
    metrics = rows(log / "metrics.jsonl")
    assert [(m["step"], m.get("eval_score")) for m in metrics] == [
        (1, None), (2, 0.0), (3, None), (4, 1.0), (5, None), (6, None)]
    assert metrics[1]["eval_nll"] == pytest.approx(1.5)
    # the sampler for step 2 is saved after step 2's optim_step and before step 3 is queued
    order = submitted(service.events)
    fbs = [label for label in order if label.startswith("fb")]
    samplers = [label for label in order if label.startswith("sampler")]
    assert order.index(fbs[1]) < order.index(samplers[0]) < order.index(fbs[2])
    assert order.index(fbs[3]) < order.index(samplers[1]) < order.index(fbs[4])
    report = json.loads(capsys.readouterr().out)
    assert [(s["when"], s["step"], s["score"]) for s in report["score"]] == [
        ("before", 0, 0.0), ("during", 2, 0.0), ("during", 4, 1.0), ("after", 6, 0.0)]


def test_a_refused_budget_leaves_the_previous_run_byte_identical(offline_main, tmp_path, capsys):
    offline_main(tmp_path / "log")
    before = {p.name: p.read_bytes() for p in (tmp_path / "log").iterdir()}
    with pytest.raises(sft.BudgetError, match="exceeds --max-usd"):
        offline_main(tmp_path / "log", "--overwrite", "--max-usd", "0.000001")
    assert {p.name: p.read_bytes() for p in (tmp_path / "log").iterdir()} == before
