"""Smoke tests for the Tinker scripts copied into this project (template from tinker-training-inference).

Copy this file to your project's tests/ folder, next to your copies of tinker_sft.py and tinker_rl.py
(set SCRIPTS and SFT_DATA below), and register the marker in pyproject.toml:

    [tool.pytest.ini_options]
    markers = ["integration: runs the copied Tinker scripts against a Tinker backend"]

Run:
    python -m pytest -m "not integration"     # offline: your reward() on known answers
    # two steps of each script on the free local backend (tiny random model, CPU; tinker_local.py and
    # tinker_local_server.py copied from the bundle's scripts/ beside your scripts):
    python tinker_local.py run -- python -m pytest -m integration
    # the same two steps on hosted Tinker, opt-in because it is paid (a fraction of a cent on Qwen3-8B):
    TINKER_SMOKE_PAID=1 TINKER_API_KEY=tml-... python -m pytest -m integration

Without a backend (no TINKER_API_KEY, or a TINKER_BASE_URL that does not answer) the integration tests
are skipped and say how to run them (the command with this interpreter and SCRIPTS' real path, as printed
it runs); with a hosted key they are skipped unless TINKER_SMOKE_PAID=1.
What the local backend proves: your copy of the scripts, your data file and the SDK calls run end to
end, checkpoints are saved and recorded. It does not prove learning (a tiny random model stands in),
and on the local backend tinker_rl.py --rehearse auto trains its stand-in task instead of TASKS and
reward(): test_reward_scores_known_completions covers your reward() instead.

CI (GitHub Actions, say): `python tinker_local.py setup` once (cache TINKER_LOCAL_HOME and
TINKER_LOCAL_VENV between runs), then the `tinker_local.py run -- python -m pytest -m integration` line.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

# ==== EDIT ME: where your copies and your data live ====
SCRIPTS = Path(__file__).resolve().parents[1]  # the folder holding tinker_sft.py and tinker_rl.py
SFT_DATA = SCRIPTS / "data" / "train.jsonl"    # your SFT JSONL (at least 4 examples)
MODEL = "Qwen/Qwen3-8B"
REWARD_CASES = [  # (task, completion, expected reward) for your reward() in tinker_rl.py
    ({"a": 12, "b": 3, "answer": 36}, "12 * 3 = 36", 1.0),
    ({"a": 12, "b": 3, "answer": 36}, "I think 35.", 0.0),
]
MAX_USD = 0.5  # a paid smoke run stops before its first step above this (needs tinker_pricing.py beside)


def launcher(*args: str) -> str:
    """How to run `tinker_local.py ARGS`, to paste as printed: this interpreter and the launcher beside SCRIPTS
    (first copied there, with tinker_local_server.py, from the bundle's scripts/ folder when it is not yet)."""
    command = f"`{shlex.join([sys.executable, str(SCRIPTS / 'tinker_local.py'), *args])}`"
    if (SCRIPTS / "tinker_local.py").exists():
        return f"run {command}"
    return (f"copy tinker_local.py and tinker_local_server.py from the tinker-training-inference bundle's scripts/ "
            f"folder into {SCRIPTS}, then run {command}")


def backend_env() -> dict:
    """The environment of a run, or a skip that says how to get a backend."""
    key, base = os.environ.get("TINKER_API_KEY"), os.environ.get("TINKER_BASE_URL", "")
    local = base.startswith(("http://127.0.0.1", "http://localhost"))
    if not key:
        pytest.skip(f"no TINKER_API_KEY: {launcher('run', '--', sys.executable, '-m', 'pytest', '-m', 'integration')} "
                    "(free), or export TINKER_API_KEY=tml-... and TINKER_SMOKE_PAID=1 (paid)")
    if not local and os.environ.get("TINKER_SMOKE_PAID") != "1":
        pytest.skip("TINKER_API_KEY points at hosted Tinker, which bills these steps: set TINKER_SMOKE_PAID=1, "
                    f"or, for free, {launcher('run', '--', sys.executable, '-m', 'pytest', '-m', 'integration')}")
    if not local and not (SCRIPTS / "tinker_pricing.py").exists():
        pytest.skip("a paid smoke run needs tinker_pricing.py beside the scripts, so --max-usd can stop it "
                    f"above ${MAX_USD}: copy it from the bundle's scripts/")
    if local:
        try:
            urllib.request.urlopen(base.rstrip("/") + "/api/v1/healthz", timeout=5).close()
        except OSError as e:
            pytest.skip(f"TINKER_BASE_URL={base} does not answer ({e}): {launcher('serve')}")
    return dict(os.environ)


def run_script(name: str, *args: str) -> dict:
    """Run a copied script as a user would; its stdout is one JSON object. With tinker_pricing.py beside
    the scripts, --max-usd stops a run whose estimate is above MAX_USD before its first step."""
    env = backend_env()
    budget = ["--max-usd", str(MAX_USD)] if (SCRIPTS / "tinker_pricing.py").exists() else []
    out = subprocess.run([sys.executable, str(SCRIPTS / name), *args, *budget], capture_output=True, text=True,
                         env=env, timeout=1800)
    assert out.returncode == 0, f"{name} exited {out.returncode}:\n{out.stderr[-3000:]}"
    return json.loads(out.stdout)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.integration
def test_sft_trains_two_steps_and_saves_a_sampler_checkpoint(tmp_path):
    result = run_script("tinker_sft.py", "--data", str(SFT_DATA), "--model-name", MODEL, "--max-steps", "2",
                        "--batch-size", "2", "--lora-rank", "8", "--num-probes", "0", "--log-path",
                        str(tmp_path / "sft"))
    assert result["status"] == "ok" and result["steps"] == 2
    losses = [r["loss"] for r in rows(tmp_path / "sft" / "metrics.jsonl")]
    assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses)  # finite, not NaN
    assert rows(tmp_path / "sft" / "checkpoints.jsonl")[-1]["sampler_path"].startswith("tinker://")


@pytest.mark.integration
def test_rl_runs_two_iterations_and_saves_a_sampler_checkpoint(tmp_path):
    # On hosted Tinker this samples your TASKS and scores them with your reward(); if the base model ties
    # every group (all 0: the reward's floor), tinker_rl.py stops with exit 2 and says so: that is the smoke
    # test doing its job, fix the task or the reward before paying for a run.
    result = run_script("tinker_rl.py", "--model-name", MODEL, "--iterations", "2", "--batch-size", "2",
                        "--group-size", "4", "--max-tokens", "8", "--lora-rank", "8", "--log-path",
                        str(tmp_path / "rl"))
    assert result["status"] == "ok" and result["iterations"] == 2
    metrics = rows(tmp_path / "rl" / "metrics.jsonl")
    assert len(metrics) == 2 and all(0 <= m["frac_groups_tied"] <= 1 for m in metrics)
    assert rows(tmp_path / "rl" / "checkpoints.jsonl")[-1]["sampler_path"].startswith("tinker://")


@pytest.mark.parametrize("task,completion,expected", REWARD_CASES)
def test_reward_scores_known_completions(task, completion, expected):
    sys.path.insert(0, str(SCRIPTS))
    import tinker_rl
    assert tinker_rl.reward(task, completion) == pytest.approx(expected)
