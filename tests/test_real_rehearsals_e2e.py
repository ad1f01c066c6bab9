"""The rehearsals of DPO and multi-turn tool RL on the local backend's real model (SmolLM2-135M-Instruct,
`tinker_local.py run --real`), end to end through the real SDK on the session's real-model server
(`local_real_tinker`): each proves the user's task, not only the plumbing.

- DPO on the user's pairs (templates/dpo_example.jsonl): preference accuracy rises from the reference's tie.
- Tools: a short SFT warm-up on tool-call examples (templates/sft_tool_warmup.jsonl), then `tinker_rl.py --env
  calculator --init-from` it: the environment's own parser, env_step() and reward() run on calls the model wrote
  (env/tool_calls > 0 in metrics.jsonl)."""
import json
import subprocess
import sys

import pytest

from fixtures_local import ROOT

pytestmark = pytest.mark.e2e
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def run_script(name, args, env, cwd, timeout=1500):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                         env=env, cwd=cwd, timeout=timeout)
    lines = out.stdout.strip().splitlines()
    return out, (json.loads(lines[-1]) if lines else {})


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_dpo_rehearsal_on_the_users_pairs_raises_preference_accuracy(local_real_tinker, tmp_path):
    log = tmp_path / "runs" / "dpo-real"
    out, report = run_script("tinker_dpo.py", ["--rehearse", "--data", str(ROOT / "templates" / "dpo_example.jsonl"),
                                               "--log-path", str(log)], local_real_tinker.env, tmp_path)
    assert out.returncode == 0 and report["status"] == "ok", out.stderr[-3000:]
    assert all(c["passed"] for c in report["rehearsal"]["checks"]), report["rehearsal"]
    metrics = rows(log / "metrics.jsonl")
    assert abs(metrics[0]["margin"]) < 1e-3 and metrics[-1]["accuracy"] >= 0.9 and metrics[-1]["margin"] > 0
    config = json.loads((log / "config.json").read_text())
    assert config["backend"] == {"kind": "local", "stand_in": SMOLLM2, "stand_in_kind": "real"}
    assert config["format"]["stop"] == [2]  # SmolLM2's <|im_end|>: the pairs were rendered by its template


def test_after_a_tool_call_warm_up_the_rl_rehearsal_reaches_the_environments_own_tool(local_real_tinker, tmp_path):
    warm = tmp_path / "runs" / "tool-warmup"
    out, sft = run_script("tinker_sft.py", [
        "--rehearse", "--data", str(ROOT / "templates" / "sft_tool_warmup.jsonl"), "--train-on", "all-assistant",
        "--max-steps", "8", "--log-path", str(warm)], local_real_tinker.env, tmp_path)
    assert out.returncode == 0 and sft["status"] == "ok", out.stderr[-3000:]
    log = tmp_path / "runs" / "rl-tools"
    out, report = run_script("tinker_rl.py", ["--env", "calculator", "--init-from", sft["state_path"], "--iterations", "2",
                                              "--log-path", str(log)], local_real_tinker.env, tmp_path)
    assert out.returncode == 0 and report["status"] == "ok", out.stderr[-3000:]
    assert "scored and stepped by its own env_step() and reward()" in out.stderr
    config = json.loads((log / "config.json").read_text())
    assert config["reward"] == "own" and config["backend"]["stand_in_kind"] == "real"
    metrics = rows(log / "metrics.jsonl")
    calls = sum(r.get("env/tool_calls", 0) for r in metrics)
    assert calls > 0, metrics
    episodes = rows(log / "rollouts.jsonl")
    assert any(len(e["turns"]) > 1 and "<tool_call>" in e["completion_text"] for e in episodes)
    assert "env/own_reward" not in metrics[0]  # the environment's reward trained, no stand-in beside it
