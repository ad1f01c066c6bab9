"""tinker_rl.py as a user's agentic environment (issue 33), offline: a tool environment written only inside
the EDIT ME block, the floor check's record, env-worker defaults, the running --max-usd cap."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tinker_report
import tinker_rl
from rl_inventory import inventory_script


@pytest.fixture(scope="module")
def qwen(offline_tokenizer):
    path = offline_tokenizer("Qwen3-8B")
    tok = tinker_rl.load_tokenizer(path)
    return tok, tinker_rl.chat_format(tok, name=path), path


def run_script(script, *argv, cwd=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    env.update(HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_a_tool_environment_written_only_in_the_edit_me_block_renders_its_tools_and_system_prompt(qwen, tmp_path):
    """ENV_NAME, TOOLS and SYSTEM_PROMPT of the block reach --env, the prompt (chat template tools=) and the banner."""
    _, _, path = qwen
    script = inventory_script(tmp_path / "project")
    out = run_script(script, "--dry-run", "--tokenizer", path, "--env", "inventory", "--max-turns", "3",
                     cwd=tmp_path / "project")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["status"] == "dry_run" and result["env"] == "inventory" and result["tasks"] == 6
    prompt = out.stderr.split("first prompt as the sampler sees it:\n", 1)[1]
    assert prompt.startswith("<|im_start|>system\nYou answer stock questions.")
    assert "<tools>" in prompt and '"name": "lookup"' in prompt
    assert "How many apples are in stock?" in prompt
    assert "(--env inventory)" in out.stderr and "up to 3 turn(s)" in out.stderr
    # the block's name is also the default: no --env needed, and the run folder is named after it
    default = run_script(script, "--dry-run", "--tokenizer", path, cwd=tmp_path / "project")
    assert default.returncode == 0 and json.loads(default.stdout)["env"] == "inventory"


def test_the_shipped_block_keeps_single_as_a_name_for_itself(qwen, monkeypatch):
    _, _, path = qwen
    args = tinker_rl.parse_args(["--env", "single", "--tokenizer", path])
    assert args.env == tinker_rl.ENV_NAME == "multiply"
    tinker_rl.check_settings(args)
    assert args.log_path == "runs/rl-multiply"
    env = tinker_rl.load_env(args.env)
    assert env["tools"] is None and env["render_prompt"] is tinker_rl.render_prompt


def test_system_prompt_is_added_once_before_render_prompts_messages(monkeypatch):
    render = tinker_rl.with_system_prompt(lambda task: [{"role": "user", "content": "q"}], "be brief")
    assert render({}) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]
    already = tinker_rl.with_system_prompt(lambda task: [{"role": "system", "content": "mine"}], "be brief")
    assert already({}) == [{"role": "system", "content": "mine"}]


# ---------------------------------------------------------------- a fake Tinker for main() (as test_rl_units)

from test_rl_units import FakeSampler, FakeService, varied_reply  # noqa: E402


@pytest.fixture
def fake_tinker(monkeypatch, qwen):
    tok, fmt, path = qwen
    service = FakeService(FakeSampler(varied_reply(fmt["stop"][0])))
    monkeypatch.setattr(tinker_rl, "connect", lambda model_name, **kw: (service, 32768))
    monkeypatch.setattr(tinker_rl, "reward", lambda task, completion: float(len(completion)))
    monkeypatch.setattr(tinker_rl, "TASKS", tinker_rl.TASKS[:6])

    def run(*argv):
        return tinker_rl.run_cli(tinker_rl.main, ["--tokenizer", path, "--batch-size", "2", "--group-size", "3",
                                                  "--max-tokens", "8", *argv])

    service.run = run
    return service


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_floor_check_writes_the_iterations_row_and_decoded_rollouts_before_it_stops(fake_tinker, monkeypatch,
                                                                                  tmp_path, capsys):
    monkeypatch.setattr(tinker_rl, "reward", lambda task, completion: 0.0)
    log = tmp_path / "run"
    assert fake_tinker.run("--iterations", "3", "--trace-every", "0", "--log-path", str(log)) == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "the base policy ties every group (all 2 groups at reward [0.0])" in line
    shown = tinker_rl.short_path(log)  # as typed from the working directory (relative or absolute)
    assert f"{os.path.join(shown, 'metrics.jsonl')} (iteration 0)" in line
    assert os.path.join(shown, "rollouts.jsonl") in line
    assert "tinker_report.py" in line
    for way_out in ("partial credit", "easier", "--group-size", "--init-from"):
        assert way_out in line
    assert fake_tinker.trained == []  # nothing was trained
    [row] = rows(log / "metrics.jsonl")
    assert row["iteration"] == 0 and row["groups_tied"] == 2 and row["datums"] == 0 and row["episodes"] == 6
    assert row["reward_mean"] == 0.0 and "loss_sum" not in row and row["cost/cumulative_usd"] > 0
    trace = rows(log / "rollouts.jsonl")  # written although --trace-every 0
    assert len(trace) == 6 and all(r["iteration"] == 0 and not r["trained"] for r in trace)
    assert all(r["completion_text"] for r in trace) and "What is" in trace[0]["prompt_text"]
    assert not (log / "checkpoints.jsonl").exists()
    assert all(t["action_text"] and "observation_text" in t for r in trace for t in r["turns"])
    # the rollout viewer shows one of them as text
    assert tinker_report.cli([str(log), "--rollout", "-1"]) == 0
    out = capsys.readouterr()
    shown = json.loads(out.out)
    assert shown["rollout"] == 5 and shown["reward"] == 0.0 and shown["trained"] is False
    assert out.err.startswith("rollout 5 of 6: iteration 0, task ")
    assert "not trained" in out.err and "--- prompt (masked) ---" in out.err and "What is" in out.err
    assert "[[" not in out.err and trace[-1]["turns"][0]["action_text"] in out.err
    assert tinker_report.cli([str(log), "--rollout", "6"]) == 2
    assert "--rollout 6: " in capsys.readouterr().err


def settled(*argv):
    args = tinker_rl.parse_args(["--rehearse", "off", *argv])
    tinker_rl.check_settings(args)
    return args


def test_env_workers_default_to_the_episodes_in_flight_and_a_lower_value_is_warned(capsys):
    assert settled("--batch-size", "16", "--group-size", "8").env_workers == 128
    assert settled("--batch-size", "4", "--group-size", "4", "--max-staleness", "2").env_workers == 32
    assert settled("--batch-size", "64", "--group-size", "16").env_workers == tinker_rl.MAX_ENV_WORKERS
    assert "--env-workers" not in capsys.readouterr().err
    assert settled("--batch-size", "16", "--group-size", "8", "--env-workers", "16").env_workers == 16
    err = capsys.readouterr().err
    assert "note: --env-workers 16 is below the 128 episodes in flight (--batch-size 16 x --group-size 8)" in err
    assert "drop the flag for 128 (the default)" in err
    assert settled("--env-workers", "0").env_workers == 0  # one at a time on the event loop: chosen, not warned
    assert "--env-workers" not in capsys.readouterr().err


class FakeMeter:
    """Stands in for CostMeter: every metrics row costs `step` dollars (a run whose real tokens cost more than
    the estimate assumed, e.g. longer tool results)."""

    step = 0.3

    def __init__(self, model_name, run=None, *, context=None):
        kept = [r["cost/cumulative_usd"] for r in (run.rows("metrics.jsonl") if run is not None else [])]
        self.cumulative = kept[-1] if kept else 0.0

    def row(self, **tokens):
        self.cumulative += self.step
        return {"cost/step_usd": self.step, "cost/cumulative_usd": self.cumulative}


def test_max_usd_holds_during_the_run_saves_and_stops_with_exit_3_then_resumes(fake_tinker, monkeypatch, tmp_path,
                                                                              capsys):
    monkeypatch.setattr(tinker_rl, "CostMeter", FakeMeter)
    log = tmp_path / "run"
    # the pre-run estimate (fractions of a cent) passes; the metered $0.30 per iteration passes $0.50 after two
    assert fake_tinker.run("--iterations", "4", "--save-every", "0", "--max-usd", "0.5", "--log-path", str(log)) == 3
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: --max-usd 0.5: $0.6000 metered so far")
    assert "stopped before iteration 2 of 4, saved at iteration 2 (tinker://fake/weights/000002)" in line
    assert "--resume and a higher --max-usd" in line
    assert [r["iteration"] for r in rows(log / "metrics.jsonl")] == [0, 1]
    [ckpt] = rows(log / "checkpoints.jsonl")
    assert (ckpt["name"], ckpt["next_iteration"]) == ("000002", 2)
    assert len(fake_tinker.trained) == 2
    # resumable: the same command plus --resume and a higher cap continues at iteration 2
    assert fake_tinker.run("--iterations", "4", "--save-every", "0", "--max-usd", "5", "--log-path", str(log),
                           "--resume") == 0
    assert [r["iteration"] for r in rows(log / "metrics.jsonl")] == [0, 1, 2, 3]
    assert fake_tinker.resumed_from == ["tinker://fake/weights/000002"]
    assert rows(log / "metrics.jsonl")[-1]["cost/cumulative_usd"] == pytest.approx(1.2)


def test_the_running_cap_does_not_stop_a_run_whose_costs_match_the_estimate(fake_tinker, tmp_path, capsys):
    log = tmp_path / "run"
    assert fake_tinker.run("--iterations", "3", "--max-usd", "0.5", "--log-path", str(log)) == 0
    metered = rows(log / "metrics.jsonl")[-1]["cost/cumulative_usd"]
    est = json.loads((log / "config.json").read_text())["estimate_usd"]
    assert 0 < metered <= est <= 0.5


def test_a_scripted_turn_is_the_templates_assistant_turn_closed_by_its_end_of_turn_token(qwen):
    tok, fmt, _ = qwen
    text = '<tool_call>\n{"name": "lookup", "arguments": {"item": "figs"}}\n</tool_call>'
    tokens = tinker_rl.assistant_tokens(tok, fmt, text)
    assert tokens[-1] == fmt["stop"][0] and tok.decode(tokens[:-1]) == text
    assert [tinker_rl.scripted_share(g) for g in (2, 3, 4, 8)] == [1, 1, 2, 4]


def test_the_estimate_prints_its_assumptions_and_takes_them_from_measured_rollouts(qwen, tmp_path):
    _, _, path = qwen
    measured = tmp_path / "measured"
    measured.mkdir()
    turn = lambda obs, act: {"observation_tokens": [1] * obs, "action_tokens": [2] * act}  # noqa: E731
    episodes = [[turn(50, 20), turn(12, 10)], [turn(50, 30)], [turn(50, 20), turn(20, 20)]]
    (measured / "rollouts.jsonl").write_text("".join(json.dumps({"turns": t}) + "\n" for t in episodes) + '{"torn')
    script = tinker_rl.__file__
    bound = run_script(script, "--dry-run", "--tokenizer", path, "--env", "calculator", cwd=tmp_path)
    assert bound.returncode == 0, bound.stderr
    assert ("estimate assumes per episode: 4 turn(s), 256 sampled tokens per turn, 64 observation tokens before "
            "each later turn") in bound.stderr and "--estimate-from RUN_DIR" in bound.stderr
    out = run_script(script, "--dry-run", "--tokenizer", path, "--env", "calculator", "--estimate-from", str(measured),
                     cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assumed = json.loads(out.stdout)["estimate_assumptions"]
    assert (assumed["turns"], assumed["completion_tokens"], assumed["observation_tokens"]) == (5 / 3, 20, 16)
    assert f"measured on 3 episodes of {measured / 'rollouts.jsonl'}" in out.stderr
    assert 0 < json.loads(out.stdout)["estimate_usd"] < json.loads(bound.stdout)["estimate_usd"] / 5
    missing = run_script(script, "--dry-run", "--tokenizer", path, "--estimate-from", str(tmp_path / "nope"),
                         cwd=tmp_path)
    assert missing.returncode == 2 and "--estimate-from" in missing.stderr and "Traceback" not in missing.stderr


OLDER_BLOCK = '''# ==== EDIT ME: TASKS, render_prompt(), reward(), env_step() ====
TASKS, EVAL_TASKS = [{"q": "2+2", "answer": 4}], []
PASS_REWARD = 1.0


def render_prompt(task):
    return [{"role": "user", "content": f"What is {task['q']}?"}]


def reward(task, completion):
    return float(str(task["answer"]) in completion)


env_step = None

# ==== END OF EDIT ME ===='''


def test_a_block_written_before_env_name_tools_and_rehearsal_turns_still_runs(qwen, tmp_path):
    _, _, path = qwen
    script = inventory_script(tmp_path / "project", OLDER_BLOCK)
    out = run_script(script, "--dry-run", "--tokenizer", path, "--env", "single", cwd=tmp_path / "project")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["env"] == "single" and "What is 2+2?" in out.stderr and "<tools>" not in out.stderr
