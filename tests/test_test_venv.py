"""tools/test_venv.py: a venv hard-linked from the cache names itself, and never writes into the cache."""
import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load():
    spec = importlib.util.spec_from_file_location("test_venv_tool", ROOT / "tools" / "test_venv.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_venv(folder: Path) -> Path:
    (folder / "bin").mkdir(parents=True)
    (folder / "lib" / "site-packages").mkdir(parents=True)
    (folder / "bin" / "pip").write_text(f"#!{folder}/bin/python3\nimport pip\n")
    (folder / "bin" / "pip").chmod(0o755)
    (folder / "bin" / "activate").write_text(f'VIRTUAL_ENV="{folder}"\n')
    (folder / "bin" / "python3").symlink_to("/usr/bin/python3")
    (folder / "pyvenv.cfg").write_text(f"home = /usr/bin\ncommand = /usr/bin/python3 -m venv {folder}\n")
    (folder / "lib" / "site-packages" / "big.py").write_text("X = 1\n")
    return folder


def test_a_linked_venv_names_itself_shares_the_packages_and_leaves_the_cache_as_it_was(tmp_path):
    tool = load()
    cached = fake_venv(tmp_path / "cache" / "KEY")
    before = {p: p.read_bytes() for p in cached.rglob("*") if p.is_file() and not p.is_symlink()}
    venv = tmp_path / "clone" / ".venv"
    venv.parent.mkdir()
    (venv / "stale").mkdir(parents=True)  # an earlier .venv is replaced whole
    tool.relink(cached, venv)

    assert not (venv / "stale").exists()
    assert (venv / "bin" / "pip").read_text().startswith(f"#!{venv}/bin/python3\n")
    assert os.access(venv / "bin" / "pip", os.X_OK)
    assert (venv / "bin" / "activate").read_text() == f'VIRTUAL_ENV="{venv}"\n'
    assert f"venv {venv}" in (venv / "pyvenv.cfg").read_text()
    assert os.readlink(venv / "bin" / "python3") == "/usr/bin/python3"
    package = venv / "lib" / "site-packages" / "big.py"
    assert package.stat().st_ino == (cached / "lib" / "site-packages" / "big.py").stat().st_ino  # linked, not copied
    assert (venv / "bin" / "pip").stat().st_ino != (cached / "bin" / "pip").stat().st_ino  # rewritten: its own file
    assert {p: p.read_bytes() for p in before} == before


def test_a_venv_built_in_another_folder_names_the_folder_it_becomes(tmp_path):
    tool = load()
    building = fake_venv(tmp_path / "KEY.building-1")
    cached = tmp_path / "KEY"
    tool.rename_in(building, building, cached)
    building.rename(cached)
    assert (cached / "bin" / "pip").read_text().startswith(f"#!{cached}/bin/python3\n")
    assert str(building) not in (cached / "pyvenv.cfg").read_text()


def test_the_cache_key_follows_pyproject_and_python(monkeypatch, tmp_path):
    tool = load()
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    first = tool.key()
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\ndependencies = ['rich']\n")
    second = tool.key()
    assert second != first
    monkeypatch.setattr(tool, "TORCH", "torch==0.0")
    assert tool.key() not in (first, second)
