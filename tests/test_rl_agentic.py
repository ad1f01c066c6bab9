"""tinker_rl.py as a user's agentic environment (issue 33), offline: a tool environment written only inside
the EDIT ME block, the floor check's record, env-worker defaults, the running --max-usd cap."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
