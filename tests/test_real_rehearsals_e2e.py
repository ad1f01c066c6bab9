"""The rehearsals of DPO and multi-turn tool RL on the local backend's real model (SmolLM2-135M-Instruct,
`tinker_local.py run --real`), end to end through the real SDK on the session's real-model server
(`local_real_tinker`): each proves the user's task, not only the plumbing.

- DPO on the user's pairs (templates/dpo_example.jsonl): preference accuracy rises from the reference's tie.
- Distillation as first typed (`--rehearse`, no --teacher: it trains its teacher on the built-in facts first): the
  student's reverse KL to the teacher falls, judged a sample at a time.
- RL from an SFT checkpoint with the user's own sparse reward (1.0 / 0.2 / 0, written into the EDIT ME block of a
  copied tinker_rl.py): the rehearsal trains the tasks the start partly solves and its mean reward rises.
- Tools: a short SFT warm-up on tool-call examples (templates/sft_tool_warmup.jsonl), then `tinker_rl.py --env
  calculator --init-from` it: the environment's own parser, env_step() and reward() run on calls the model wrote
  (env/tool_calls > 0 in metrics.jsonl)."""
import json
import shutil
import subprocess
import sys

import pytest

from fixtures_local import ROOT
from test_journey_e2e import OWN_REWARD, SUPPORT, SYSTEM

pytestmark = [pytest.mark.e2e, pytest.mark.real_model]
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def run_script(name, args, env, cwd, timeout=1500, folder=ROOT / "scripts"):
    out = subprocess.run([sys.executable, str(folder / name), *args], capture_output=True, text=True,
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
    assert report["rehearsal"]["passed"] and "env_step() answered the model's turns" in \
        report["rehearsal"]["checks"][1]["check"], report["rehearsal"]
    config = json.loads((log / "config.json").read_text())
    assert config["reward"] == "own" and config["backend"]["stand_in_kind"] == "real"
    metrics = rows(log / "metrics.jsonl")
    calls = sum(r.get("env/tool_calls", 0) for r in metrics)
    assert calls > 0, metrics
    episodes = rows(log / "rollouts.jsonl")
    assert any(len(e["turns"]) > 1 and "<tool_call>" in e["completion_text"] for e in episodes)
    assert "env/own_reward" not in metrics[0]  # the environment's reward trained, no stand-in beside it


def test_a_distillation_rehearsal_brings_the_real_student_to_its_teacher(local_real_tinker, tmp_path):
    """The preset's teacher answers in one word ("Blue."); the base student starts with sentences and drops them
    for the teacher's form: the reverse KL a sample (and the teacher's logprob of a sample) move the right way
    from the first quarter of the iterations to the last, while the per-token mean may rise (measured 2.07 ->
    3.70: what is left are the answer words). Both figures are in the check's text."""
    log = tmp_path / "runs" / "distill-real"
    out, report = run_script("tinker_distill.py", ["--rehearse", "--log-path", str(log)], local_real_tinker.env,
                             tmp_path)
    assert out.returncode == 0 and report["status"] == "ok", out.stderr[-3000:]
    assert "rehearsal teacher: 16 SFT steps on the 4 built-in answers at lr 0.0005" in out.stderr
    checks = report["rehearsal"]["checks"]
    assert [c["passed"] for c in checks] == [True] * 4, checks
    assert "nats a sample" in checks[2]["check"] and "per token" in checks[2]["check"]
    metrics = rows(log / "metrics.jsonl")
    per_sample = [m["reverse_kl"] * m["tokens_sampled"] / m["sequences"] for m in metrics]
    assert len(per_sample) == 12 and sum(per_sample[-3:]) < sum(per_sample[:3]), per_sample
    config = json.loads((log / "config.json").read_text())
    assert config["backend"]["stand_in_kind"] == "real" and config["learning_rate"] == 1e-3


# What the user writes into tinker_rl.py's EDIT ME block: the journey's help-desk questions with a sparse reward.
JOURNEY_REWARD = '''def reward(task, completion):
    """How close the reply is to the documented answer: difflib's similarity ratio, 0 to 1."""
    return difflib.SequenceMatcher(None, completion.strip().lower(), task["answer"].lower()).ratio()
'''
SPARSE_REWARD = OWN_REWARD.replace(JOURNEY_REWARD, '''def reward(task, completion):
    """Sparse: 1.0 for the documented answer (similarity >= 0.8), 0.2 for a reply sharing one of its words, else 0."""
    c, a = completion.strip().lower(), task["answer"].lower()
    if difflib.SequenceMatcher(None, c, a).ratio() >= 0.8:
        return 1.0
    return 0.2 if set(re.findall(r"[a-z]{5,}", a)) & set(re.findall(r"[a-z]{5,}", c)) else 0.0
''')
assert SPARSE_REWARD != OWN_REWARD


def test_rl_from_an_sft_checkpoint_with_the_users_sparse_reward_rises(local_real_tinker, tmp_path):
    """SFT 24 steps on the 24 help-desk rows (half the preset's 48: a start that partly solves them; its own probe
    check fails, exit 1, which is the point: RL has something left to earn), then `tinker_rl.py --init-from` it
    with the real-model preset: the scouting pass keeps the 4 tasks the reward scores most unevenly, the mean
    reward of the last quarter of the 8 iterations is above the first quarter's, no group-tie exit."""
    project = tmp_path / "project"
    project.mkdir()
    with open(project / "support.jsonl", "w") as f:
        for question, answer in SUPPORT:
            f.write(json.dumps({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    for name in ("tinker_rl.py", "tinker_report.py", "tinker_pricing.py"):
        shutil.copy2(ROOT / "scripts" / name, project / name)
    script = (project / "tinker_rl.py").read_text()
    start, end = script.index("# ==== EDIT ME: TASKS"), script.index("# ==== END OF EDIT ME ====")
    (project / "tinker_rl.py").write_text(script[:start] + SPARSE_REWARD + script[end:])
    out, sft = run_script("tinker_sft.py", ["--rehearse", "--data", str(project / "support.jsonl"), "--max-steps", "24",
                                            "--log-path", str(project / "runs" / "sft24")], local_real_tinker.env, project)
    assert sft.get("state_path"), out.stderr[-3000:]
    log = project / "runs" / "rl"
    out, report = run_script("tinker_rl.py", ["--init-from", sft["state_path"], "--log-path", str(log)],
                             local_real_tinker.env, project, folder=project)
    assert out.returncode == 0 and report["status"] == "ok", out.stderr[-3000:]
    assert "every iteration trains the 4 your reward scores most unevenly" in out.stderr
    assert [c["passed"] for c in report["rehearsal"]["checks"]] == [True, True], report["rehearsal"]
    metrics = rows(log / "metrics.jsonl")
    kept = json.loads((log / "config.json").read_text())["rehearsal_tasks"]
    assert len(kept) == 4 and all(sorted(m["tasks"]) == kept for m in metrics)
    curve = [m["reward_mean"] for m in metrics]
    assert len(curve) == 8 and sum(curve[-2:]) / 2 > sum(curve[:2]) / 2 + 0.2, curve
    print(f"reward per iteration {[round(r, 2) for r in curve]} on TASKS {kept}")
