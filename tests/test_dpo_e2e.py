"""tinker_dpo.py against the local backend: preference accuracy rises on a learnable pair set, the first
step sits exactly at the reference, and --resume repeats the run without paying the reference again."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures_local import fixture_output

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "tinker_dpo.py"
# 4 pairs = 8 sequences per step, each under 40 tokens. One rule separates every pair (agree vs refuse),
# and both answers are 2 tokens + end-of-turn, so the policy's own preference (summed logprob) is not
# decided by length. On the earlier tiny model (final norm weight 1) unrelated pairs (Blue. vs Green.,
# Paris. vs Rome., ...) stalled at accuracy 0.75 after 8 steps at these settings (measured 2026-12-03).
PAIRS = [("Can you help me write a letter?", "Yes.", "No."),
         ("Could you check my sums?", "Yes.", "No."),
         ("Will you explain this error to me?", "Yes.", "No."),
         ("Can you suggest a name for my cat?", "Yes.", "No.")]
STEPS, SAVE_EVERY = 8, 4


def dpo_args(local_tinker, data, log, *extra):
    return [sys.executable, str(SCRIPT), "--data", str(data), "--tokenizer", str(local_tinker.tokenizer_dir),
            "--model-name", local_tinker.model, "--log-path", str(log), "--batch-size", "4", "--epochs", str(STEPS),
            "--learning-rate", "1e-2", "--lr-schedule", "constant", "--lora-rank", "8",
            "--save-every", str(SAVE_EVERY), *extra]


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def full_run(local_tinker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    data = tmp / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n" for q, c, r in PAIRS))
    log = tmp / "run"
    out = subprocess.run(dpo_args(local_tinker, data, log), capture_output=True, text=True, env=local_tinker.env,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    sys.stderr.write(out.stderr)
    return {"data": data, "log": log, "result": json.loads(out.stdout), "stderr": out.stderr}


def test_preference_accuracy_rises_on_the_training_pairs(full_run):
    metrics = rows(full_run["log"] / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    first, last = metrics[0], metrics[-1]
    # before: indifferent (every reward within float noise of 0, so the strict accuracy of the first row is
    # noise); after: the implicit reward prefers chosen on every pair, and so does the policy itself
    # (measured: first row margin 4e-7, last 2.53; policy_accuracy was already 1.0 on the base model)
    assert abs(first["margin"]) < 1e-3
    assert last["accuracy"] == 1.0 and last["policy_accuracy"] == 1.0
    assert last["margin"] > 0.05 and last["chosen_reward"] > last["rejected_reward"]
    assert last["loss"] < first["loss"] - 0.02
    assert last["implicit_kl"] > 0
    assert full_run["result"]["last"] == last


def test_the_first_step_sits_at_the_reference(full_run):
    """The reference is a snapshot of the starting weights scored by compute_logprobs: at step 0 the
    policy equals it, so the loss is log 2 and every reward is 0 (up to sampler/trainer numerics)."""
    first = rows(full_run["log"] / "metrics.jsonl")[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert abs(first["chosen_reward"]) < 1e-3 and abs(first["rejected_reward"]) < 1e-3
    refs = rows(full_run["log"] / "reference_logprobs.jsonl")
    assert [r["pair"] for r in refs] == [0, 1, 2, 3]
    assert all(len(r["chosen"]) >= 2 and len(r["rejected"]) >= 2 for r in refs)  # word(s) + end-of-turn
    assert all(v < 0 for r in refs for v in r["chosen"] + r["rejected"])


def test_checkpoints_record_where_to_resume(full_run):
    ckpts = rows(full_run["log"] / "checkpoints.jsonl")
    assert [(c["name"], c["next_batch"]) for c in ckpts] == [(f"{SAVE_EVERY:06d}", SAVE_EVERY), ("final", STEPS)]
    assert ckpts[0]["sampler_path"] is None and ckpts[-1]["sampler_path"].startswith("tinker://")
    assert full_run["result"]["state_path"] == ckpts[-1]["state_path"]


def test_resume_repeats_the_run_without_a_second_reference_pass(full_run, local_tinker, tmp_path):
    log = tmp_path / "run"
    shutil.copytree(full_run["log"], log)
    ckpts = (log / "checkpoints.jsonl").read_text().splitlines()
    (log / "checkpoints.jsonl").write_text(ckpts[0] + "\n" + '{"name": "final", "ste')  # killed mid-write
    out = subprocess.run(dpo_args(local_tinker, full_run["data"], log, "--resume"), capture_output=True, text=True,
                         env=local_tinker.env, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reference logprobs" not in out.stderr and "prefill" not in out.stderr
    assert json.loads(out.stdout)["tokens"] == {"train": 2 * (STEPS - SAVE_EVERY) * rows(
        full_run["log"] / "metrics.jsonl")[0]["tokens"]}
    before, after = rows(full_run["log"] / "metrics.jsonl"), rows(log / "metrics.jsonl")
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))
    for a, b in zip(before[SAVE_EVERY:], after[SAVE_EVERY:]):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
        assert b["margin"] == pytest.approx(a["margin"], abs=1e-4)
    assert after[:SAVE_EVERY] == before[:SAVE_EVERY]


def test_resume_with_changed_pairs_is_refused_before_any_call(full_run, local_tinker, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text(full_run["data"].read_text().replace('"No."', '"Never."', 1))
    log = tmp_path / "run"
    shutil.copytree(full_run["log"], log)
    out = subprocess.run(dpo_args(local_tinker, data, log, "--resume"), capture_output=True, text=True,
                         env={**local_tinker.env, "TINKER_BASE_URL": "http://127.0.0.1:9"}, timeout=300)
    assert out.returncode == 2 and "--pairs-sha256" in out.stderr
    assert rows(log / "metrics.jsonl") == rows(full_run["log"] / "metrics.jsonl")


def test_resume_of_a_finished_run_does_nothing_and_calls_nothing(full_run, local_tinker, tmp_path):
    log = tmp_path / "run"
    shutil.copytree(full_run["log"], log)
    out = subprocess.run(dpo_args(local_tinker, full_run["data"], log, "--resume"), capture_output=True, text=True,
                         env={**local_tinker.env, "TINKER_BASE_URL": "http://127.0.0.1:9"}, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["status"], result["state_path"]) == ("complete", full_run["result"]["state_path"])
    assert "nothing to do" in out.stderr


# ---- --rehearse on the local backend: the preset learns, checks pass, the printed next command runs ----

def test_the_rehearsal_preset_learns_the_built_in_pairs(local_dpo_rehearsal):
    """Measured (load ~5-6 on 2 shared cores): accuracy 0.00 -> 1.00 in 10 full-batch steps at lr 1e-3, the
    policy's own preference 0.00 -> 1.00, margin -4e-7 -> +3.5; about 11 s of script wall time on a warm server.
    Its printed next command is pasted as printed by tests/test_printed_commands.py."""
    out = fixture_output(local_dpo_rehearsal)
    result = json.loads(out["stdout"])
    assert result["status"] == "ok" and result["rehearsal"]["passed"], result["rehearsal"]
    assert [c["passed"] for c in result["rehearsal"]["checks"]] == [True] * 5
    metrics = rows(local_dpo_rehearsal / "metrics.jsonl")
    assert [r["pairs"] for r in metrics] == [4] * 10 and {r["learning_rate"] for r in metrics} == {1e-3}
    assert abs(metrics[0]["margin"]) < 1e-3 and metrics[-1]["accuracy"] >= 0.9 and metrics[-1]["margin"] > 0
    sys.stderr.write(f"\nDPO rehearsal: accuracy {metrics[0]['accuracy']:.2f} -> {metrics[-1]['accuracy']:.2f}, "
                     f"policy {metrics[0]['policy_accuracy']:.2f} -> {metrics[-1]['policy_accuracy']:.2f}, margin "
                     f"{metrics[-1]['margin']:+.3f}, {result['seconds']:.1f} s\n")
    summary = out["stderr"][out["stderr"].index("==== what happened ===="):]
    assert "from the built-in rehearsal pairs" in summary
    assert "on Tinker this run would cost about $" in summary
    assert (local_dpo_rehearsal / "report.html").is_file()


def test_a_rehearsal_of_own_pairs_trains_them_in_one_full_batch(local_tinker, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n" for q, c, r in PAIRS))
    out = subprocess.run([sys.executable, str(SCRIPT), "--rehearse", "--data", str(data), "--tokenizer",
                          str(local_tinker.tokenizer_dir), "--model-name", local_tinker.model, "--log-path",
                          str(tmp_path / "own")], capture_output=True, text=True, env=local_tinker.env, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["status"] == "ok" and result["rehearsal"]["passed"] and result["rehearsal"]["data"] == "own"
    assert result["last"]["accuracy"] >= 0.9 and result["steps"] == 10 and result["last"]["pairs"] == len(PAIRS)
    assert f"from {data}" in out.stderr
