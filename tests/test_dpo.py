"""tinker_dpo.py offline: pair datums on the real tokenizers, the loss and its gradient against a plain
numpy DPO, the cost meters, bad input, and the script copied alone. No Tinker call."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tinker_dpo

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "tinker_dpo.py"
EXAMPLE = ROOT / "templates" / "dpo_example.jsonl"

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
# What each family's template makes the model produce after the generation prompt (trained tokens).
COMPLETIONS = {
    "Qwen3-8B": ("Paris.<|im_end|>", "Lyon, I think.<|im_end|>"),
    "Llama-3.1-8B-Instruct": ("Paris.<|eot_id|>", "Lyon, I think.<|eot_id|>"),
    "DeepSeek-V3.1": ("Paris.<｜end▁of▁sentence｜>", "Lyon, I think.<｜end▁of▁sentence｜>"),
    "gpt-oss-20b": ("<|channel|>final<|message|>Paris.<|return|>",
                    "<|channel|>final<|message|>Lyon, I think.<|return|>"),
    "Kimi-K2-Thinking": ("<think></think>Paris.<|im_end|>", "<think></think>Lyon, I think.<|im_end|>"),
}


def render(chat_family, name, obj):
    tok, fmt = chat_family(name)
    return tok, fmt, tinker_dpo.render_pairs([tinker_dpo.validate_pair(obj, 1)], tok, fmt, 10**6)


@pytest.mark.parametrize("name", sorted(COMPLETIONS))
def test_pair_sides_share_the_prompt_exactly_and_train_only_the_completion(chat_family, name):
    tok, fmt, (pair,) = render(chat_family, name, {"prompt": PROMPT, "chosen": "Paris.", "rejected": "Lyon, I think."})
    n = pair.prompt_tokens
    # the shared prefix is exactly the prompt the sampler is given
    assert pair.chosen.tokens[:n] == pair.rejected.tokens[:n] == tinker_dpo.generation_prompt(PROMPT, tok, fmt)
    for side, text in zip(("chosen", "rejected"), COMPLETIONS[name]):
        r = getattr(pair, side)
        assert r.weights == [0.0] * n + [1.0] * (len(r.tokens) - n)
        assert tok.decode(r.tokens[n:]) == text
        assert r.tokens[-1] in fmt["stop"]  # the end-of-turn token is trained, so the model learns to stop
        # target positions after the shift by one: exactly the completion tokens
        assert [r.tokens[j + 1] for j in pair.trained(side)] == r.tokens[n:]
    assert pair.chosen.tokens[n:] != pair.rejected.tokens[n:]


@pytest.mark.parametrize("name", sorted(COMPLETIONS))
def test_each_side_is_the_datum_sft_trains_on_the_same_conversation(chat_family, name):
    import tinker_sft

    tok, fmt, (pair,) = render(chat_family, name, {"prompt": PROMPT, "chosen": "Paris.", "rejected": "Lyon, I think."})
    for side, answer in (("chosen", "Paris."), ("rejected", "Lyon, I think.")):
        example = {"messages": PROMPT + [{"role": "assistant", "content": answer}], "line": 1}
        (sft,) = tinker_sft.render_example(example, tok, fmt, "last-assistant")
        assert (sft.tokens, sft.weights) == (getattr(pair, side).tokens, getattr(pair, side).weights)


def test_string_prompt_and_message_answers_render_like_the_message_form(chat_family):
    _, _, (a,) = render(chat_family, "Qwen3-8B", {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."})
    _, _, (b,) = render(chat_family, "Qwen3-8B", {"prompt": [{"role": "user", "content": "Hi"}],
                                                  "chosen": {"role": "assistant", "content": "Hello."},
                                                  "rejected": [{"role": "assistant", "content": "Go away."}]})
    assert (a.chosen.tokens, a.rejected.tokens) == (b.chosen.tokens, b.rejected.tokens)


def test_reasoning_on_one_side_only_is_refused_because_the_prompts_differ(chat_family):
    obj = {"prompt": "2+2?", "chosen": {"content": "4", "reasoning_content": "2+2 is 4."}, "rejected": "5"}
    with pytest.raises(tinker_dpo.RenderError, match="different prompts"):
        render(chat_family, "Qwen3-8B", obj)


@pytest.mark.parametrize("obj, message", [
    ({"prompt": "Hi", "chosen": "Yes."}, "'prompt', 'chosen' and 'rejected'"),
    ({"prompt": "Hi", "chosen": "Same.", "rejected": "Same."}, "same answer"),
    ({"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], "chosen": "a",
      "rejected": "b"}, "must end with a user"),
    ({"prompt": "Hi", "chosen": {"role": "user", "content": "a"}, "rejected": "b"}, "one assistant message"),
    ({"prompt": "Hi", "chosen": "", "rejected": "b"}, "empty content"),
])
def test_bad_pairs_name_the_line_and_what_was_expected(obj, message):
    with pytest.raises(tinker_dpo.DataError, match=message) as e:
        tinker_dpo.validate_pair(obj, 7)
    assert "line 7" in str(e.value)


def test_a_long_pair_is_dropped_whole_or_refused(chat_family):
    tok, fmt = chat_family("Qwen3-8B")
    raws = [tinker_dpo.validate_pair({"prompt": "Hi", "chosen": "Hello.", "rejected": "word " * 50}, 1),
            tinker_dpo.validate_pair({"prompt": "Hi", "chosen": "Hello.", "rejected": "Bye."}, 2)]
    kept = tinker_dpo.render_pairs(raws, tok, fmt, 40, drop_long=True)
    assert [p.line for p in kept] == [2]
    with pytest.raises(tinker_dpo.DataError, match="line 1: a side of this pair is 6[0-9] tokens, over the limit 40"):
        tinker_dpo.render_pairs(raws, tok, fmt, 40)


# ---- the loss -------------------------------------------------------------------------------

def reference_dpo(pol, ref, masks, beta):
    """Plain numpy DPO on per-token logprobs: loss and d loss / d policy logprob per token."""
    sums = lambda xs: np.array([x[m].sum() for x, m in zip(xs, masks)])  # noqa: E731
    s_pol, s_ref = sums(pol), sums(ref)
    d = (s_pol[0::2] - s_ref[0::2]) - (s_pol[1::2] - s_ref[1::2])
    z = beta * d
    loss = np.mean(np.log1p(np.exp(-z)))
    coef = -beta / (1 + np.exp(z)) / len(z)  # d loss / d (chosen sum); the rejected sum gets the opposite
    grads = []
    for k, m in enumerate(masks):
        g = np.zeros_like(pol[k])
        g[m] = coef[k // 2] * (1 if k % 2 == 0 else -1)
        grads.append(g)
    return loss, grads, z


class FakeRendered:
    def __init__(self, weights):
        self.weights = weights


class FakePair:
    def __init__(self, chosen_w, rejected_w):
        self.chosen, self.rejected = FakeRendered(chosen_w), FakeRendered(rejected_w)

    trained = tinker_dpo.Pair.trained


def test_loss_and_gradient_match_a_plain_numpy_dpo():
    import torch

    rng = np.random.default_rng(0)
    beta = 0.1
    # three pairs, sequences of different lengths, prompt weights 0 and completion weights 1 (unshifted)
    shapes = [((4, 3), (4, 5)), ((2, 2), (2, 6)), ((6, 1), (6, 2))]
    pairs, pol, ref, masks = [], [], [], []
    for (pc, cc), (pr, cr) in shapes:
        pairs.append(FakePair([0.0] * pc + [1.0] * cc, [0.0] * pr + [1.0] * cr))
        for prompt, completion in ((pc, cc), (pr, cr)):
            n = prompt + completion - 1  # targets after the shift
            mask = np.zeros(n, bool)
            mask[prompt - 1:] = True
            pol.append(rng.normal(-2, 1, n).astype(np.float32))
            ref.append(rng.normal(-2, 1, n).astype(np.float32))
            masks.append(mask)
    refs = [{"chosen": ref[2 * k][masks[2 * k]].tolist(), "rejected": ref[2 * k + 1][masks[2 * k + 1]].tolist()}
            for k in range(len(pairs))]
    logprobs = [torch.tensor(x, requires_grad=True) for x in pol]
    loss, metrics = tinker_dpo.make_dpo_loss_fn(pairs, refs, beta)(None, logprobs)
    loss.backward()

    want_loss, want_grads, z = reference_dpo(pol, ref, masks, beta)
    assert loss.item() == pytest.approx(want_loss, rel=1e-5)
    for got, want in zip(logprobs, want_grads):
        np.testing.assert_allclose(got.grad.numpy(), want, rtol=1e-4, atol=1e-7)
    assert metrics["dpo_loss"] == pytest.approx(want_loss, rel=1e-5)
    assert metrics["margin"] == pytest.approx(z.mean(), rel=1e-4)
    assert metrics["accuracy"] == pytest.approx(np.mean(z > 0))
    chosen = [beta * (pol[2 * k][masks[2 * k]].sum() - ref[2 * k][masks[2 * k]].sum()) for k in range(3)]
    assert metrics["chosen_reward"] == pytest.approx(np.mean(chosen), rel=1e-4)
    assert metrics["chosen_reward"] - metrics["rejected_reward"] == pytest.approx(z.mean(), rel=1e-4)
    k2 = [0.5 * (p[m] - r[m]) ** 2 for p, r, m in zip(pol, ref, masks)]
    assert metrics["implicit_kl"] == pytest.approx(np.concatenate(k2).mean(), rel=1e-4)


def test_at_the_reference_the_loss_is_log_2_with_no_drift_and_no_wins():
    import torch

    pairs = [FakePair([0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0])]
    lp_c, lp_r = [-0.5, -1.5], [-3.0, -0.2, -0.7]
    refs = [{"chosen": lp_c, "rejected": lp_r[1:]}]
    logprobs = [torch.tensor(lp_c, requires_grad=True), torch.tensor(lp_r, requires_grad=True)]
    loss, metrics = tinker_dpo.make_dpo_loss_fn(pairs, refs, 0.1)(None, logprobs)
    assert loss.item() == pytest.approx(math.log(2))
    assert (metrics["accuracy"], metrics["margin"], metrics["implicit_kl"]) == (0.0, 0.0, 0.0)
    assert metrics["policy_accuracy"] == 0.0  # the policy itself scores chosen -2.0 below rejected -0.9


# ---- cost meters ----------------------------------------------------------------------------

def test_cost_counts_the_reference_pass_and_the_extra_forward_of_every_step(chat_family):
    tok, fmt = chat_family("Qwen3-8B")
    raws = tinker_dpo.normalise_items(tinker_dpo.read_jsonl(EXAMPLE), validate=tinker_dpo.validate_pair)
    pairs = tinker_dpo.render_pairs(raws, tok, fmt, 10**6)
    per_epoch, total = tinker_dpo.plan_steps(len(pairs), 4, 3, None)
    order = tinker_dpo.BatchOrder(len(pairs), 4, per_epoch, 0)
    seq = sum(len(p.chosen.tokens) - 1 + len(p.rejected.tokens) - 1 for p in pairs)  # model_input tokens
    assert total == 6
    # 3 epochs: every pair trained 3 times, each time a forward + a forward_backward
    sampler = tinker_dpo.cost_tokens(pairs, order, 0, total, "sampler", need_reference=True)
    assert sampler == {"train": 2 * 3 * seq, "prefill": seq + 2 * len(pairs), "sample": 2 * len(pairs)}
    forward = tinker_dpo.cost_tokens(pairs, order, 0, total, "forward", need_reference=True)
    assert forward == {"train": 2 * 3 * seq + seq}
    # a resume from step 2 pays neither the reference nor the steps already done
    resumed = tinker_dpo.cost_tokens(pairs, order, 2, total, "sampler", need_reference=False)
    assert resumed == {"train": 2 * 2 * seq}


# ---- the command line -----------------------------------------------------------------------

def run_script(args, cwd, script=SCRIPT):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TINKER_API_KEY", None)
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def test_dry_run_writes_the_audit_and_prices_the_reference_pass(offline_tokenizer, tmp_path):
    out = run_script(["--data", str(EXAMPLE), "--tokenizer", offline_tokenizer("Qwen3-8B"), "--dry-run",
                      "--log-path", str(tmp_path / "run"), "--batch-size", "4"], tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["status"], result["pairs"], result["steps"]) == ("dry_run", 8, 2)
    assert set(result["tokens"]) == {"train", "prefill", "sample"}
    assert result["cost"]["tokens"] == {"cached_prefill": 0, **result["tokens"]} and result["cost"]["usd"]["total"] > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "datums.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rows] == list(range(1, 9))
    assert rows[0]["chosen"]["weighted"] == ["The capital of France is Paris.<|im_end|>"]
    assert rows[0]["rejected"]["weighted"] == ["France's capital is Lyon.<|im_end|>"]
    assert not (tmp_path / "run" / "config.json").exists()  # a dry run starts no run


@pytest.mark.parametrize("args, message", [
    (["--dpo-beta", "0"], "--dpo-beta 0.0: expected a value in (0, inf]"),
    (["--learning-rate", "-1"], "--learning-rate -1.0: expected a value in (0, 1]"),
    (["--batch-size", "0"], "--batch-size 0: expected a value in [1, inf]"),
    (["--init-from", "tinker://run/sampler_weights/x"], "sampler_weights/ checkpoint"),
])
def test_bad_flags_exit_2_with_one_line(offline_tokenizer, tmp_path, args, message):
    out = run_script(["--data", str(EXAMPLE), "--tokenizer", offline_tokenizer("Qwen3-8B"), "--dry-run",
                      "--log-path", str(tmp_path / "run"), *args], tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: {out.stderr.strip()[7:]}"] and message in out.stderr
    assert out.stdout == ""


def test_bad_data_exits_2_naming_the_line(offline_tokenizer, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
                    + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    out = run_script(["--data", str(data), "--tokenizer", offline_tokenizer("Qwen3-8B"), "--dry-run",
                      "--log-path", str(tmp_path / "run")], tmp_path)
    assert out.returncode == 2 and "line 2: expected a JSON object with 'prompt', 'chosen' and 'rejected'" in out.stderr


def test_the_script_copied_alone_shows_help_and_dry_runs(offline_tokenizer, tmp_path):
    alone = tmp_path / "project"
    alone.mkdir()
    shutil.copy(SCRIPT, alone / "tinker_dpo.py")
    shutil.copy(EXAMPLE, alone / "pairs.jsonl")
    help_ = run_script(["--help"], alone, script=alone / "tinker_dpo.py")
    assert help_.returncode == 0 and "--dpo-beta" in help_.stdout and "--reference" in help_.stdout
    out = run_script(["--data", "pairs.jsonl", "--tokenizer", offline_tokenizer("Qwen3-8B"), "--dry-run"], alone,
                     script=alone / "tinker_dpo.py")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["status"], result["pairs"], result["cost"]) == ("dry_run", 8, None)
    assert "no dollar estimate: tinker_pricing.py is not beside this script" in out.stderr
    assert (alone / "runs" / "dpo" / "datums.jsonl").exists()


def test_raw_format_pairs_share_the_prompt_text_and_train_the_answer_plus_eos(offline_tokenizer):
    tok = tinker_dpo.load_tokenizer(offline_tokenizer("Qwen3-8B-Base"))
    fmt = tinker_dpo.resolve_format("auto", "Qwen/Qwen3-8B-Base", tok, "Qwen3-8B-Base")
    assert fmt["kind"] == "raw"
    raw = tinker_dpo.validate_pair({"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5, I think"}, 1)
    (pair,) = tinker_dpo.render_pairs([raw], tok, fmt, 10**6)
    n = pair.prompt_tokens
    assert pair.chosen.tokens[:n] == pair.rejected.tokens[:n] == tok.encode("Q: 2+2?\nA:", add_special_tokens=False)
    assert tok.decode(pair.chosen.tokens[n:]) == " 4" + tok.eos_token
    assert tok.decode(pair.rejected.tokens[n:]) == " 5, I think" + tok.eos_token
    assert pair.rejected.weights == [0.0] * n + [1.0] * (len(pair.rejected.tokens) - n)


def test_an_estimate_over_max_usd_exits_3_before_anything_is_written(offline_tokenizer, tmp_path):
    log = tmp_path / "run"
    out = run_script(["--data", str(EXAMPLE), "--tokenizer", offline_tokenizer("Qwen3-8B"), "--log-path", str(log),
                      "--max-usd", "0.0001"], tmp_path)
    assert out.returncode == 3, out.stderr
    assert "exceeds --max-usd 0.0001" in out.stderr and out.stdout == ""
    assert not log.exists()


# ---- --rehearse: the preset, the built-in pairs, the checks -------------------------------------------

def test_the_rehearsal_preset_dry_runs_the_built_in_pairs_in_one_full_batch(offline_tokenizer, tmp_path):
    out = run_script(["--rehearse", "--tokenizer", offline_tokenizer("Qwen3-8B"), "--dry-run"], tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    # DPO_REHEARSAL: 10 steps, every pair in each step (no --batch-size given), the preset's own folder
    assert (result["status"], result["pairs"], result["steps"], result["per_epoch"]) == ("dry_run", 4, 10, 1)
    assert result["log_path"] == "runs/dpo-rehearsal"
    assert "no --data: using the built-in rehearsal pairs" in out.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs/dpo-rehearsal/datums.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rows] == [f"built-in pair {i}" for i in range(1, 5)]
    assert {(r["chosen"]["weighted"][0], r["rejected"]["weighted"][0]) for r in rows} == {("No.<|im_end|>", "Yes.<|im_end|>")}
    # a flag given wins over the preset; own data replaces the built-in pairs
    out = run_script(["--rehearse", "--data", str(EXAMPLE), "--batch-size", "2", "--tokenizer",
                      offline_tokenizer("Qwen3-8B"), "--dry-run"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert (json.loads(out.stdout)["pairs"], json.loads(out.stdout)["per_epoch"]) == (8, 4)


def test_a_rehearsal_with_a_broken_loss_mask_fails_before_any_tinker_call(chat_family, monkeypatch):
    tok, fmt = chat_family("Qwen3-8B")
    raw = [tinker_dpo.validate_pair(p, f"built-in pair {i}") for i, p in enumerate(tinker_dpo.DPO_REHEARSAL_PAIRS, 1)]
    pairs = tinker_dpo.render_pairs(raw, tok, fmt, 10**6)
    tinker_dpo.check_rehearsal_masks(pairs, raw, tok)  # the real masks pass
    pairs[1].rejected.weights[pairs[1].prompt_tokens - 1] = 1.0  # one prompt token trained
    with pytest.raises(tinker_dpo.ScriptError, match=r"rehearsal check failed: the loss mask of built-in pair 2 "
                                                     r"\(rejected\) trains '.*Yes\.<\|im_end\|>', expected only 'Yes\.'"):
        tinker_dpo.check_rehearsal_masks(pairs, raw, tok)


class RecordedRun:
    def __init__(self, rows, data=None):
        self._rows, self._data = rows, data

    def rows(self, name):
        return self._rows

    def config(self):
        return {"data": self._data}


def metrics(accuracies, margins):
    return [{"step": i + 1, "accuracy": a, "margin": m, "policy_accuracy": a, "implicit_kl": 0.1 * i}
            for i, (a, m) in enumerate(zip(accuracies, margins))]


def test_rehearsal_checks_pass_on_a_rise_from_the_reference_and_fail_naming_the_figures():
    saved = {"state_path": "tinker://r/weights/final", "sampler_path": "tinker://r/sampler_weights/final"}
    learnt = tinker_dpo.dpo_rehearsal_checks(RecordedRun(metrics([0.0, 0.5, 1.0], [0.0, 0.4, 1.2])), saved, 3)
    assert learnt["passed"] and learnt["data"] == "built-in" and len(learnt["checks"]) == 5
    assert learnt["checks"][-1]["check"] == ("preference accuracy rises to >= 0.9 (0.00 at step 1 -> 1.00 at "
                                             "step 3, margin +1.200)")
    stalled = tinker_dpo.dpo_rehearsal_checks(RecordedRun(metrics([0.0, 0.5, 0.75], [0.0, 0.1, 0.2]), "p.jsonl"), saved, 3)
    assert not stalled["passed"] and [c["passed"] for c in stalled["checks"]] == [True, True, True, True, False]
    short = tinker_dpo.dpo_rehearsal_checks(RecordedRun(metrics([0.3, 1.0], [0.01, 1.0])), {}, 3)
    assert [c["passed"] for c in short["checks"]] == [True, False, False, False, True]
