"""tinker_eval.py on the local backend: the base model and a run's checkpoint sampled on the same held-out prompts
(the run's format and system prompt), scored by the user's own score() from the EDIT ME block, with the paired
difference and the cost; and its dry run."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are the help desk of Harbor Ferries. Answer in one or two short sentences."
HELD_OUT = [
    {"messages": [{"role": "user", "content": "Is there a ferry at noon?"},
                  {"role": "assistant", "content": "Yes, one leaves Pier 3 at 12:00."}]},
    {"messages": [{"role": "user", "content": "Can I pay on board?"},
                  {"role": "assistant", "content": "Yes, by card at the kiosk."}]},
    {"prompt": "Do dogs ride free?", "completion": "Yes, on a leash."},
]
# The user's metric, written only inside the EDIT ME block: the completion's length in characters.
OWN_SCORE = '''def score(example, completion):
    """How many characters the model wrote (a stand-in for the user's metric)."""
    return float(len(completion))
'''


def copy_with_own_score(folder: Path) -> Path:
    text = (ROOT / "scripts" / "tinker_eval.py").read_text()
    block = re.compile(r"(# ==== EDIT ME: score\(\) ====\n).*?(# ==== END EDIT ME ====)", re.S)
    assert block.search(text)
    (folder / "tinker_eval.py").write_text(block.sub(lambda m: m.group(1) + OWN_SCORE + m.group(2), text))
    shutil.copy(ROOT / "scripts" / "tinker_pricing.py", folder / "tinker_pricing.py")
    return folder / "tinker_eval.py"


@pytest.mark.e2e
def test_base_and_checkpoint_scored_side_by_side_with_the_users_score(local_sft_run, local_tinker, tmp_path):
    script = copy_with_own_score(tmp_path)
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT))
    out = tmp_path / "eval.jsonl"
    proc = subprocess.run([sys.executable, str(script), "--run", str(local_sft_run), "--data", str(data),
                           "--max-tokens", "8", "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, **local_tinker.env}, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == "ok" and result["n"] == 3
    config = json.loads((local_sft_run / "config.json").read_text())
    assert result["base_model"] == config["model_name"]
    assert result["checkpoint"].startswith("tinker://") and "sampler_weights" in result["checkpoint"]
    assert result["sampling"]["temperature"] == 0 and result["sampling"]["system"] == SYSTEM
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    # the run's system prompt first in chat rows, the reference kept; both models got the same prompt
    assert rows[0]["messages"][0] == {"role": "system", "content": SYSTEM}
    assert rows[0]["messages"][-1]["content"] == "Is there a ferry at noon?" and rows[2]["prompt"] == "Do dogs ride free?"
    assert rows[1]["reference"] == "Yes, by card at the kiosk."
    for r in rows:  # the user's score() graded both completions
        for who in ("base", "trained"):
            assert r[who]["score"] == float(len(r[who]["text"]))
            assert 1 <= r[who]["completion_tokens"] <= 8
    base = [r["base"]["score"] for r in rows]
    trained = [r["trained"]["score"] for r in rows]
    assert result["base"]["mean"] == pytest.approx(sum(base) / 3)
    assert result["trained"]["mean"] == pytest.approx(sum(trained) / 3)
    diffs = [t - b for t, b in zip(trained, base)]
    mean = sum(diffs) / 3
    se = (sum((d - mean) ** 2 for d in diffs) / 2) ** 0.5 / 3 ** 0.5
    d = result["difference"]
    assert d["mean"] == pytest.approx(mean) and d["stderr"] == pytest.approx(se)
    assert d["ci95"] == pytest.approx([mean - 1.96 * se, mean + 1.96 * se])
    assert d["wins"] + d["ties"] + d["losses"] == 3
    assert result["usd"] is not None and result["usd"] > 0  # tinker_pricing.py beside the copy
    assert "difference" in proc.stderr and "sampling cost $" in proc.stderr
    # the trained and the base model are different models: the checkpoint was trained at lr 1e-2
    assert [r["base"]["text"] for r in rows] != [r["trained"]["text"] for r in rows]


@pytest.mark.e2e
def test_the_dry_run_renders_and_prices_without_a_call(local_sft_run, local_tinker, tmp_path):
    script = copy_with_own_score(tmp_path)
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT))
    env = {k: v for k, v in {**os.environ, **local_tinker.env}.items() if k != "TINKER_API_KEY"}
    proc = subprocess.run([sys.executable, str(script), "--run", str(local_sft_run), "--data", str(data),
                           "--dry-run", "--max-usd", "0.000001"], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]  # the most the sampling can cost is above the cap
    proc = subprocess.run([sys.executable, str(script), "--run", str(local_sft_run), "--data", str(data),
                           "--dry-run"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == "dry_run" and len(result["prompts"]) == 3 and result["estimate_usd"] > 0
    assert SYSTEM in proc.stderr  # the first prompt as rendered carries the run's system prompt


def run_eval(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("TINKER_API_KEY", "TINKER_BASE_URL")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tinker_eval.py"), *args], capture_output=True,
                          text=True, env=env, timeout=120, cwd=cwd)
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_missing_held_out_file_or_a_folder_that_is_no_run_is_exit_2_with_one_line(tmp_path):
    (tmp_path / "heldout.jsonl").write_text(json.dumps(HELD_OUT[0]) + "\n")
    proc, result = run_eval("--run", str(tmp_path), "--data", str(tmp_path / "nope.jsonl"), cwd=tmp_path)
    assert proc.returncode == 2 and result["status"] == "error"
    assert result["error"].startswith(f"--data {tmp_path / 'nope.jsonl'} not found; expected a held-out JSONL file")
    proc, result = run_eval("--run", str(tmp_path / "empty"), "--data", str(tmp_path / "heldout.jsonl"), cwd=tmp_path)
    assert proc.returncode == 2 and result["status"] == "error" and "Traceback" not in proc.stderr
    assert "checkpoints.jsonl" in result["error"]


def test_the_user_score_is_the_only_edit_and_sits_in_the_block():
    text = (ROOT / "scripts" / "tinker_eval.py").read_text()
    block = text.split("# ==== EDIT ME: score() ====")[1].split("# ==== END EDIT ME ====")[0]
    assert "def score(example, completion)" in block and text.count("# ==== EDIT ME") == 1
