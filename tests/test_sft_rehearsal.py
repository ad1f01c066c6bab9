"""tinker_sft.py --rehearse: the built-in memorisable set, the checks that prove the pipeline learnt, and
that a wrong loss mask fails the rehearsal. Offline with recording stand-ins; the last test runs README's
rehearsal against the local backend (e2e)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import tinker_sft as sft
from test_sft_loop import RecordingService, RecordingTrainingClient

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "tinker_sft.py"


def jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_the_built_in_rehearsal_set_is_the_one_in_templates():
    assert jsonl(ROOT / "templates" / "sft_rehearsal.jsonl") == sft.REHEARSAL_TRAIN
    assert jsonl(ROOT / "templates" / "sft_rehearsal_test.jsonl") == sft.REHEARSAL_TEST
    questions = {m["content"] for ex in sft.REHEARSAL_TRAIN for m in ex["messages"] if m["role"] == "user"}
    assert not questions & {m["content"] for ex in sft.REHEARSAL_TEST for m in ex["messages"]}


class LearningClient(RecordingTrainingClient):
    """A training client whose held-out NLL is 2.0 per token before any optim_step and 0.5 after."""

    def _output(self, data):
        lp = -2.0 if self.optim_steps == 0 else -0.5
        outs = [{"logprobs": _Logprobs([lp] * d.model_input.length)} for d in data]
        return SimpleNamespace(loss_fn_outputs=outs, metrics={"loss:sum": 1.0})


class _Logprobs(list):
    def tolist(self):
        return list(self)


class AnsweringSampler:
    """Greedy sampler stand-in: answers a prompt with `answers[prompt tokens]` (token ids), else nothing."""

    def __init__(self, answers):
        self.answers = answers

    def sample(self, prompt, num_samples, params):
        seq = SimpleNamespace(tokens=[*self.answers.get(tuple(prompt.to_ints()), []), 151645])
        return SimpleNamespace(result=lambda: SimpleNamespace(sequences=[seq]))


class RehearsalService(RecordingService):
    """The base model answers nothing; the final sampler answers `learnt` (prompt tokens -> answer ids)."""

    def __init__(self, learnt):
        super().__init__()
        self.learnt = learnt

    def _client(self, how, arg):
        tc = LearningClient(self.events, f"run{len(self.created)}")
        self.created.append((how, arg, tc))
        return SimpleNamespace(result=lambda: tc)

    def create_sampling_client(self, base_model=None, model_path=None):
        return SimpleNamespace(result=lambda: AnsweringSampler(self.learnt if model_path else {}))


@pytest.fixture(scope="module")
def qwen3(offline_tokenizer):
    path = offline_tokenizer("Qwen3-8B")
    tok = sft.load_tokenizer(path)
    return path, tok, sft.chat_format(tok, name=sft.tokenizer_record(path))


def learnt_answers(tok, fmt, wrong=()):
    """Prompt tokens of each built-in training question -> the token ids of its answer (or of 'No.')."""
    out = {}
    for ex in sft.REHEARSAL_TRAIN:
        msgs = ex["messages"]
        answer = "No." if msgs[0]["content"] in wrong else msgs[1]["content"]
        out[tuple(sft.generation_prompt(msgs[:1], tok, fmt))] = tok.encode(answer)
    return out


def rehearse(monkeypatch, tmp_path, service, tokenizer_path, *flags):
    monkeypatch.setattr(sft, "connect", lambda model_name, **_: (service, 40960))
    return sft.main(["--rehearse", "--tokenizer", tokenizer_path, "--log-path", str(tmp_path / "log"),
                     "--max-steps", "4", *flags])


def test_a_rehearsal_that_learnt_passes_every_check(monkeypatch, tmp_path, capsys, qwen3):
    path, tok, fmt = qwen3
    assert rehearse(monkeypatch, tmp_path, RehearsalService(learnt_answers(tok, fmt)), path) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["rehearsal"]["passed"] is True
    assert [c["passed"] for c in report["rehearsal"]["checks"]] == [True, True, True]
    probes = report["eval"]["probes"]
    assert [(p["before"], p["after"]) for p in probes] == [("", ex["messages"][1]["content"]) for ex in sft.REHEARSAL_TRAIN]
    assert (report["eval"]["nll_before"], report["eval"]["nll_after"]) == (2.0, 0.5)
    # the newcomer's summary: what was trained, probes, record, cost, next command
    summary = out.err[out.err.index("==== what happened ===="):]
    assert "the built-in rehearsal set" in summary and "held-out NLL per token  2.000 -> 0.500" in summary
    assert "'What colour is the sky?'  expected 'Blue.'  before ''  after 'Blue.'" in summary
    assert f"record   {tmp_path / 'log'}/" in summary and re.search(r"on Tinker this run would cost about \$\d", summary)
    assert f"tinker_infer.py --run {tmp_path / 'log'} --prompt 'What colour is the sky?'" in summary


def test_a_rehearsal_whose_probes_did_not_learn_fails_with_exit_1(monkeypatch, tmp_path, capsys, qwen3):
    path, tok, fmt = qwen3
    service = RehearsalService(learnt_answers(tok, fmt, wrong={"Which way does rain fall?"}))
    with pytest.raises(sft.ScriptError, match=r"rehearsal check failed: after-training probes reproduce the "
                                              r"trained answers \(3/4\)") as failed:
        rehearse(monkeypatch, tmp_path, service, path)
    assert failed.value.exit_code == 1
    report = json.loads(capsys.readouterr().out)  # the run record and the report are still there
    assert report["rehearsal"]["passed"] is False and (tmp_path / "log" / "checkpoints.jsonl").exists()


@pytest.mark.parametrize("breakage", ["prompt tokens trained", "end-of-turn token not trained", "shifted by one"])
def test_a_broken_loss_mask_fails_the_rehearsal_before_anything_is_trained(monkeypatch, tmp_path, qwen3, breakage):
    path, tok, fmt = qwen3
    real = sft.render_example

    def broken(example, tokenizer, fmt, train_on="last-assistant"):
        out = []
        for r in real(example, tokenizer, fmt, train_on):
            if breakage == "prompt tokens trained":
                weights = [1.0] * len(r.weights)
            elif breakage == "end-of-turn token not trained":
                weights = r.weights[:-1] + [0.0]
            else:
                weights = r.weights[1:] + [0.0]
            out.append(sft.Rendered(r.tokens, weights))
        return out

    monkeypatch.setattr(sft, "render_example", broken)
    service = RehearsalService(learnt_answers(tok, fmt))
    with pytest.raises(sft.ScriptError, match=r"rehearsal check failed: the loss mask of line 1 of the built-in set "
                                              r"trains .* expected only the answer 'Blue\.' followed by '<\|im_end\|>'"):
        rehearse(monkeypatch, tmp_path, service, path)
    assert service.created == [] and not (tmp_path / "log").exists()


@pytest.mark.e2e
def test_readme_rehearsal_learns_on_the_local_backend(local_backend_install, tmp_path):
    """README's first command, as written after setup: `tinker_local.py run -- python scripts/tinker_sft.py
    --rehearse ...` on a server of its own, as a user gets it: the probes must show it learnt. (On the
    suite's long-lived shared server, after ~800 other tests, the same seed once gave held-out NLL 2.086
    and 2/4 probes instead of 3.274 and 4/4 on a fresh server; the cause is not pinned down.)"""
    venv, home = local_backend_install
    readme = (ROOT / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].splitlines()[0]
    run_part = first.split(" && ")[-1].split()
    assert run_part[1:4] == ["scripts/tinker_local.py", "run", "--"], run_part
    command = run_part[4:]
    assert command[1:3] == ["scripts/tinker_sft.py", "--rehearse"], command
    log = tmp_path / "rehearsal"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "tinker_local.py"), "run", "--venv", str(venv),
                          "--home", str(home), "--", sys.executable, str(SCRIPT), *command[2:],
                          "--log-path", str(log)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["rehearsal"]["passed"], report["rehearsal"]
    probes = report["eval"]["probes"]
    assert [p["after"].strip() for p in probes] == [p["expected"] for p in probes]
    assert all(p["before"].strip() != p["expected"] for p in probes)
    assert report["eval"]["nll_after"] <= report["eval"]["nll_before"] / 2
    assert "==== what happened ====" in out.stderr and "tinker_infer.py --run" in out.stderr


# ---------------------------------------------------------------- a rehearsal on the user's own data

SYSTEM = "You are the help desk of Acme Cloud. Answer in one short sentence."


def own_data(tmp_path, n=8, system=SYSTEM):
    path = tmp_path / "support.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": f"Question number {i}?"},
                    {"role": "assistant", "content": f"Answer number {i}, in a few more words than the built-in set."}]
            if system is not None:
                msgs.insert(0, {"role": "system", "content": system if isinstance(system, str) else f"System {i}."})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


class FlatService(RehearsalService):
    """A training client whose loss never falls (logprob -1.5 everywhere): a pipeline that does not train."""

    def _client(self, how, arg):
        tc = RecordingTrainingClient(self.events, f"run{len(self.created)}")
        self.created.append((how, arg, tc))
        return SimpleNamespace(result=lambda: tc)


def test_an_own_data_rehearsal_proves_the_pipeline_and_reports_probes_unjudged(monkeypatch, tmp_path, capsys, qwen3):
    path, tok, fmt = qwen3
    data = own_data(tmp_path)
    assert rehearse(monkeypatch, tmp_path, RehearsalService({}), path, "--data", str(data)) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["status"] == "ok" and report["rehearsal"]["passed"] and report["rehearsal"]["data"] == "own"
    checks = [c["check"] for c in report["rehearsal"]["checks"]]
    assert [c.split(" (")[0].split(":")[0] for c in checks] == [
        "loss masks train exactly the answers and the end-of-turn token", "every step trained",
        "the final checkpoint was saved", "the saved sampler samples every probe",
        "the training loss falls below 80% of the first step's"]
    assert report["rehearsal"]["reported"][0].startswith("probes reproducing their trained answer: 0/4")
    assert "report   held-out NLL 2.000 -> 0.500 (reported, not judged" in out.err
    # probes sample room for the longest trained answer, and the run records the shared system prompt
    config = json.loads((tmp_path / "log" / "config.json").read_text())
    longest = max(len(tok.encode(f"Answer number {i}, in a few more words than the built-in set.")) for i in range(8))
    assert config["max_tokens"] >= longest + 1 and "probes sample up to" in out.err
    assert (config["system_prompt"], config["system_prompts"]) == (SYSTEM, "shared")
    assert config["probe_sampling"]["temperature"] == 0.0


def test_an_own_data_rehearsal_whose_loss_does_not_fall_says_failed_in_json_and_exit_code(monkeypatch, tmp_path,
                                                                                         capsys, qwen3):
    path, _, _ = qwen3
    with pytest.raises(sft.ScriptError, match="rehearsal check failed: the training loss falls below 80%") as failed:
        rehearse(monkeypatch, tmp_path, FlatService({}), path, "--data", str(own_data(tmp_path)))
    assert failed.value.exit_code == 1
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "failed" and report["rehearsal"]["passed"] is False


@pytest.mark.parametrize("system, kind", [(None, "none"), (1, "differ")])
def test_the_run_record_says_when_examples_carry_no_or_different_system_prompts(monkeypatch, tmp_path, qwen3,
                                                                               system, kind):
    path, _, _ = qwen3
    assert rehearse(monkeypatch, tmp_path, RehearsalService({}), path, "--data", str(own_data(tmp_path, system=system))) == 0
    config = json.loads((tmp_path / "log" / "config.json").read_text())
    assert (config["system_prompt"], config["system_prompts"]) == (None, kind)
