"""README opens with exactly two set-up commands, and CI runs the second one verbatim."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_commands_rehearsal_then_tests():
    first, second = readme_commands()
    assert "tinker_local.py setup" in first and "tinker_local.py run --" in first and "tinker_sft.py" in first
    # the suite in parallel, then the real-model tests in one process of their own (tests/conftest.py)
    assert second.endswith('-m pytest -m "not real_model" && .venv/bin/python -m pytest -m real_model -n 0')


def test_ci_runs_the_readme_test_command_verbatim():
    ci_lines = [l for l in (ROOT / ".ci/run").read_text().splitlines() if l and not l.startswith("#")]
    assert readme_commands()[1] in ci_lines


def _names(requirements):
    return {re.split(r"[<>=!~ \[;]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def test_the_install_in_the_first_command_has_every_package_the_scripts_declare():
    # A fresh `pip install -e .` (README's first command, no test extras) once lacked jinja2, which
    # transformers needs to render chat templates but does not declare: the rehearsal failed.
    project = _names(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    # torch is installed on purpose, never through pip's resolver (it would pick a multi-GB CUDA build):
    # tinker_dpo.py names it (forward_backward_custom differentiates its loss locally) and says how.
    project.add("torch")
    for script in sorted((ROOT / "scripts").glob("*.py")):
        header = re.search(r"^# /// script\n(.*?)^# ///$", script.read_text(), re.S | re.M)
        if header is None:
            continue
        declared = tomllib.loads("\n".join(line[2:] for line in header.group(1).splitlines()))
        assert _names(declared.get("dependencies", [])) <= project, script.name
