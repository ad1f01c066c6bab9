"""templates/test_tinker_scripts.py, the smoke-test template for a project's copied scripts (issue 30),
run as a user runs it: copied into a throwaway project beside copies of the scripts and a data file,
with the marker registered in that project's pyproject.toml, under pytest in a fresh process.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = """[tool.pytest.ini_options]
markers = ["integration: runs the copied Tinker scripts against a Tinker backend"]
addopts = "-rs --strict-markers"
"""


def make_project(tmp_path: Path, pricing: bool = True) -> Path:
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "data").mkdir()
    for name in ("tinker_sft.py", "tinker_rl.py", *(["tinker_pricing.py"] if pricing else [])):
        shutil.copy(ROOT / "scripts" / name, project / name)
    shutil.copy(ROOT / "templates" / "sft_example.jsonl", project / "data" / "train.jsonl")
    shutil.copy(ROOT / "templates" / "test_tinker_scripts.py", project / "tests" / "test_tinker_scripts.py")
    (project / "pyproject.toml").write_text(PYPROJECT)
    return project


def pytest_in(project: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if k not in ("PYTEST_ADDOPTS", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=project, env=env, capture_output=True, text=True, timeout=1800)


def counts(output: str) -> dict[str, int]:
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", output)}


def test_without_a_backend_the_integration_tests_skip_and_say_how_to_run_them(tmp_path):
    project = make_project(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    out = pytest_in(project, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert counts(out.stdout) == {"passed": 2, "skipped": 2}  # the reward cases run offline
    # the command to run, with this interpreter and the real folder, after copying the launcher there (issue 44)
    command = shlex.join([sys.executable, str(project / "tinker_local.py"), "run", "--", sys.executable, "-m", "pytest",
                          "-m", "integration"])
    assert (f"copy tinker_local.py and tinker_local_server.py from the tinker-training-inference bundle's scripts/ "
            f"folder into {project}, then run `{command}`") in " ".join(out.stdout.split()), out.stdout[-3000:]
    assert "PATH/TO" not in out.stdout


def test_a_hosted_key_without_opt_in_skips_the_paid_steps(tmp_path):
    project = make_project(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")} | {"TINKER_API_KEY": "tml-not-used"}
    out = pytest_in(project, env, "-m", "integration")
    assert out.returncode == 0 and counts(out.stdout) == {"skipped": 2, "deselected": 2}, out.stdout[-3000:]
    assert "TINKER_SMOKE_PAID=1" in out.stdout


def test_a_paid_run_without_the_price_table_beside_the_scripts_skips_before_any_call(tmp_path):
    project = make_project(tmp_path, pricing=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")} | {
        "TINKER_API_KEY": "tml-not-used", "TINKER_SMOKE_PAID": "1"}
    out = pytest_in(project, env, "-m", "integration")
    assert out.returncode == 0 and counts(out.stdout) == {"skipped": 2, "deselected": 2}, out.stdout[-3000:]
    assert "needs tinker_pricing.py beside the scripts" in out.stdout


@pytest.mark.e2e
def test_the_template_trains_two_steps_of_each_copied_script_on_the_local_backend(tmp_path, local_tinker):
    project = make_project(tmp_path)
    out = pytest_in(project, local_tinker.env, "-m", "integration")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert counts(out.stdout) == {"passed": 2, "deselected": 2}
