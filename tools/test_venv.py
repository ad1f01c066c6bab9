#!/usr/bin/env python3
"""Make .venv with what the test suite needs (torch==2.13.0 and the project's `test` extra), from a cache.

Run (README's second command does, before `.venv/bin/python -m pytest`):
    python3 tools/test_venv.py            # .venv beside this repo's pyproject.toml
    python3 tools/test_venv.py PATH       # another folder

Why: `pip install torch==2.13.0 -e '.[test]'` into a new venv takes ~45 s on 2 cores (unpacking and
byte-compiling torch and transformers), on every fresh clone. The first run on a machine does exactly that
install, into ~/.cache/tinker-training-inference/test-venvs/KEY (KEY: a hash of pyproject.toml, this Python and
TORCH), then moves it in place whole; every run then hard-links that tree into PATH (~1 s) and rewrites the
few files that name their own folder (bin/ scripts, activate), so PATH is a venv of its own: `PATH/bin/pip
install` changes PATH only (pip replaces files, it never writes into a linked one). A change to
pyproject.toml or another Python gets a new KEY, so the cache never hides a missing install step.
TINKER_TEST_VENV_CACHE=0 installs straight into PATH instead (what the cache does once).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # a CPU wheel, named explicitly: pip's own choice is a multi-GB CUDA build
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tinker-training-inference" / "test-venvs"
KEEP = 3  # cached venvs kept (newest used first); older ones are removed


def say(message: str) -> None:
    print(f"test_venv: {message}", file=sys.stderr, flush=True)


def key() -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    digest.update(f"{sys.version}\n{sys.executable}\n{TORCH}".encode())
    return digest.hexdigest()[:16]


def install(venv: Path) -> None:
    """A new venv at `venv` with TORCH and the project's test extra. The project is installed as what it is, a
    distribution with no module (`py-modules = []`: tests import scripts/ and tests/ through pytest's pythonpath),
    so the venv names no clone's folder and serves every clone with this pyproject.toml."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", TORCH, f"{ROOT}[test]"], check=True)


def link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system (or no hard links there): a copy, slower but the same venv
        shutil.copy2(source, target)


def rename_in(venv: Path, old: Path, new: Path) -> None:
    """Every file of venv's bin/ and pyvenv.cfg that names folder `old` rewritten to name `new` (a new file each:
    a hard-linked original stays as it was)."""
    before, after = str(old).encode(), str(new).encode()
    for path in [*(venv / "bin").iterdir(), venv / "pyvenv.cfg"]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if before in data:
            mode = path.stat().st_mode
            path.unlink()
            path.write_bytes(data.replace(before, after))
            path.chmod(mode)


def relink(cached: Path, venv: Path) -> None:
    """`venv` as a hard-linked copy of `cached` that names itself."""
    if venv.is_symlink() or venv.is_file():
        venv.unlink()
    elif venv.exists():
        shutil.rmtree(venv)
    shutil.copytree(cached, venv, symlinks=True, copy_function=link_or_copy)
    rename_in(venv, cached, venv.resolve())


def main(argv: list[str]) -> int:
    venv = Path(argv[0]) if argv else ROOT / ".venv"
    if os.environ.get("TINKER_TEST_VENV_CACHE") == "0":
        if venv.exists():
            shutil.rmtree(venv)
        install(venv)
        return 0
    cached = CACHE / key()
    if not (cached / ".complete").exists():
        say(f"installing {TORCH} and '.[test]' once into {cached} (~45 s)")
        building = CACHE / f"{cached.name}.building-{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        install(building)
        rename_in(building, building, cached)  # its scripts name the folder it is about to become
        (building / ".complete").write_text("installed by tools/test_venv.py\n")
        if not (cached / ".complete").exists():  # another run may have finished one meanwhile
            shutil.rmtree(cached, ignore_errors=True)
            try:
                building.rename(cached)  # whole or not at all: a killed install leaves only a .building folder
            except OSError:  # another run's rename won
                if not (cached / ".complete").exists():
                    raise
        shutil.rmtree(building, ignore_errors=True)
        for stale in sorted((p for p in CACHE.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)[:-KEEP]:
            if stale != cached:
                shutil.rmtree(stale, ignore_errors=True)
    os.utime(cached)
    relink(cached, venv)
    say(f"{venv} ready (linked from {cached})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
