"""A user's tool environment, written only inside tinker_rl.py's EDIT ME block, rehearsed on the local backend
(issue 33): scripted tool calls (REHEARSAL_TURNS) parsed by the user's env_step(), observations masked, the
user's reward trained, asserted on the datums forward_backward received."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rl_inventory import inventory_script

pytestmark = pytest.mark.e2e


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"inventory_rl_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_tool_environment_rehearses_with_scripted_tool_calls_parsed_and_observations_masked(
        local_tinker, monkeypatch, capsys, tmp_path):
    script = inventory_script(tmp_path / "project")
    rl = load_script(script)
    sent = []
    real_train_step = rl.train_step

    def train_step(tc, datums, *args, **kwargs):
        sent.append(list(datums))
        return real_train_step(tc, datums, *args, **kwargs)

    monkeypatch.setattr(rl, "train_step", train_step)
    local_tinker.apply(monkeypatch)
    log = tmp_path / "run"
    code = rl.run_cli(rl.main, ["--tokenizer", str(local_tinker.tokenizer_dir), "--lora-rank", "8", "--max-turns", "3",
                                "--iterations", "2", "--batch-size", "2", "--group-size", "4", "--max-tokens", "8",
                                "--log-path", str(log)])
    out = capsys.readouterr()
    assert code == 0, out.err
    # banners: the user's environment and mode, with the flag as given (auto)
    assert "rehearsal (--rehearse auto: on, TINKER_BASE_URL is this machine): your environment 'inventory'" in out.err
    assert "tool lookup" in out.err and "REHEARSAL_TURNS" in out.err
    assert "reward: your env_step() and reward() from the EDIT ME block, tool lookup, on scripted" in out.err
    assert "calculator" not in out.err and "said something" not in out.err
    assert json.loads(out.out)["reward_source"] == "own"

    metrics = rows(log / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1]
    for m in metrics:  # 2 scripted episodes per group of 4: one lookup each, parsed by the user's env_step()
        assert m["env/scripted_episodes"] == 4 and m["env/tool_calls"] >= 4
        assert m["env/answers"] + m.get("env/tool_parse_errors", 0) >= 4
    trace = rows(log / "rollouts.jsonl")
    scripted = [r for r in trace if r["sample"] < 2]
    assert len(scripted) == 8 and all(r["reward"] == 1.0 for r in scripted)  # the user's reward() on real tokens
    inventory = {"apples": 12, "pears": 7, "plums": 30, "figs": 4, "limes": 19, "kiwis": 8}
    for r in scripted:
        assert len(r["turns"]) == 2 and not r["turns"][1]["starts_datum"]
        item = next(k for k in inventory if f"How many {k} are in stock?" in r["prompt_text"])
        assert f'<tool_call>\n{{"name": "lookup", "arguments": {{"item": "{item}"}}}}\n</tool_call>' in r["completion_text"]
        assert f"<tool_response>\n{inventory[item]}\n</tool_response>" in r["completion_text"]
        assert r["trained"] and r["advantage"] > 0

    # the rollout viewer: the scripted episode as text, the trained tool call and answer marked apart
    import tinker_report
    first = next(i for i, r in enumerate(trace) if r["sample"] == 0)
    assert tinker_report.cli([str(log), "--rollout", str(first)]) == 0
    shown = capsys.readouterr().err
    assert "| reward 1.0 | advantage +" in shown and "--- turn 1: the model (trained" in shown
    assert '[[<tool_call>\n{"name": "lookup"' in shown and "--- observation before turn 2 (masked) ---" in shown
    assert "<tool_response>" in shown.split("--- observation before turn 2 (masked) ---")[1].split("--- turn 2")[0]

    # the datums: one per episode of an untied group; in a scripted one, the observation (the tool's reply) and
    # the prompt carry advantage 0 and the scripted tokens the episode's advantage with the sampler's logprobs
    tok = rl.load_tokenizer(str(local_tinker.tokenizer_dir))
    checked = 0
    for datums in sent:
        for d in datums:
            targets = d.loss_fn_inputs["target_tokens"].tolist()
            advs = d.loss_fn_inputs["advantages"].tolist()
            lps = d.loss_fn_inputs["logprobs"].tolist()
            text = tok.decode(targets)
            if "<tool_response>" not in text:
                continue
            trained = tok.decode([t for t, a in zip(targets, advs) if a != 0])
            masked = tok.decode([t for t, a in zip(targets, advs) if a == 0])
            assert "<tool_call>" in trained and "lookup" in trained and "</tool_call>" in trained
            assert "<tool_response>" in masked and "How many" in masked and "<tools>" in masked
            assert "<tool_response>" not in trained and "stock questions" not in trained
            assert all(lp < 0 for lp, a in zip(lps, advs) if a != 0)  # the sampler's logprobs of the script
            assert all(lp == 0 for lp, a in zip(lps, advs) if a == 0)
            checked += 1
    assert checked >= 4


@pytest.mark.timeout(1800)  # one big iteration: about 3 minutes on 2 idle cores
def test_a_16_by_8_by_3_turn_iteration_completes_on_the_local_backend(local_tinker, tmp_path):
    """The user's batch shape (issue 33): 16 groups of 8 episodes of up to 3 turns, 64 tokens a turn, 128 sequences
    of up to ~570 tokens in one forward_backward: the server's micro-batches keep it in memory (before them it
    asked for 33.6 GB), and the iteration writes its metrics row and every rollout."""
    import os
    import subprocess

    log = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "tinker_rl.py"), "--env", "calculator",
         "--rehearse", "on", "--batch-size", "16", "--group-size", "8", "--max-turns", "3", "--iterations", "1",
         "--max-tokens", "64", "--tokenizer", str(local_tinker.tokenizer_dir), "--log-path", str(log)],
        capture_output=True, text=True, env={**os.environ, **local_tinker.env}, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = rows(log / "metrics.jsonl")
    assert row["iteration"] == 0 and row["episodes"] == 128
    episodes = rows(log / "rollouts.jsonl")
    assert len(episodes) == 128
    assert json.loads(proc.stdout)["iterations"] == 1
