"""README opens with exactly two set-up commands, and CI runs the second one verbatim."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_commands_rehearsal_then_tests():
    first, second = readme_commands()
    assert "tinker_local.py setup" in first and "tinker_local.py run --" in first and "tinker_sft.py" in first
    assert second.endswith("-m pytest")


def test_ci_runs_the_readme_test_command_verbatim():
    ci_lines = [l for l in (ROOT / ".ci/run").read_text().splitlines() if l and not l.startswith("#")]
    assert readme_commands()[1] in ci_lines
