"""The shared rules have one source (common/) and every script carries an exact generated copy."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import splice  # noqa: E402

MODULES = sorted(p.stem for p in (ROOT / "common").glob("*.py"))


def test_every_script_region_is_exactly_what_common_generates():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "splice.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_copy_and_edit_scripts_carry_a_shared_region():
    names = {p.name for p in splice.targets()}
    assert {"tinker_sft.py", "tinker_rl.py"} <= names, names


def test_a_hand_edit_inside_a_region_is_detected(tmp_path):
    script = tmp_path / "x.py"
    text = "import sys\n\n" + splice.region(["errors"]) + "\n"
    script.write_text(text)
    assert splice.spliced(text) == text
    edited = text.replace("exit_code = EXIT_BAD_INPUT", "exit_code = 5")
    assert splice.spliced(edited) != edited


@pytest.mark.parametrize("name", MODULES)
def test_a_generated_module_compiles_without_its_dropped_imports(name):
    ast.parse(splice.module_text(name))
    assert "# splice: drop" not in splice.module_text(name)
    assert "from __future__" not in splice.module_text(name)


def test_no_script_imports_the_shared_source():
    """A script copied alone has no common/ beside it: it must use its generated copy, never an import."""
    for path in (ROOT / "scripts").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in MODULES + ["common"], (path.name, node.module)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] not in MODULES + ["common"], (path.name, alias.name)


def test_the_region_sits_before_the_main_guard():
    for path in splice.targets():
        text = path.read_text()
        start, end, _ = splice.find_region(text)
        guard = text.find('if __name__ == "__main__":')
        assert guard > end, f"{path.name}: the generated region must end before the __main__ guard"


# ---- printed next commands (common/errors.py): runnable from where the user stands


def test_a_next_command_names_the_neighbour_as_the_user_typed_the_script_and_wraps_the_local_launcher(
        monkeypatch, tmp_path):
    import shutil

    import tinker_sft
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("TINKER_LOCAL_LAUNCHER", raising=False)
    monkeypatch.setattr(sys, "argv", ["scripts/tinker_sft.py", "--data", "my data.jsonl"])
    assert tinker_sft.script_command("tinker_infer.py", "--run", "runs/a b") == \
        "python scripts/tinker_infer.py --run 'runs/a b'"
    assert tinker_sft.this_command() == "python scripts/tinker_sft.py --data 'my data.jsonl'"
    monkeypatch.setenv("TINKER_LOCAL_LAUNCHER", str(ROOT / "scripts" / "tinker_local.py"))
    assert tinker_sft.script_command("tinker_infer.py", "--run", "runs/x") == \
        "python scripts/tinker_local.py run -- python scripts/tinker_infer.py --run runs/x"
    # a copy in a project without tinker_infer.py beside it: the bundle's, found beside the launcher
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy2(ROOT / "scripts" / "tinker_sft.py", project / "tinker_sft.py")
    monkeypatch.chdir(project)
    monkeypatch.setattr(tinker_sft, "__file__", str(project / "tinker_sft.py"))
    monkeypatch.setattr(sys, "argv", ["tinker_sft.py"])
    assert tinker_sft.script_command("tinker_infer.py") == (
        f"python {ROOT / 'scripts' / 'tinker_local.py'} run -- python {ROOT / 'scripts' / 'tinker_infer.py'}")
    shutil.copy2(ROOT / "scripts" / "tinker_infer.py", project / "tinker_infer.py")
    assert tinker_sft.script_command("tinker_infer.py") == \
        f"python {ROOT / 'scripts' / 'tinker_local.py'} run -- python tinker_infer.py"
