"""Every precondition of a paid step is checked before the first Tinker call, and fails with exit 2 and the
fix: torch for DPO's custom loss, free disk for the run record and the render cache. Offline: a listening
socket stands in for Tinker and counts the connections a refused run made (none)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections import namedtuple
from pathlib import Path

import pytest

import tinker_sft

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"

Usage = namedtuple("Usage", "total used free")


class CountingListener:
    """A TCP port that accepts and counts connections (each closed at once): TINKER_BASE_URL for a run that
    must not reach Tinker."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.accepted, self.stop = 0, threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.fixture
def tinker_stand_in():
    listener = CountingListener()
    yield listener
    listener.close()


WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_dpo_without_torch_exits_2_with_the_install_line_before_any_tinker_call(tmp_path, tinker_stand_in,
                                                                                 offline_tokenizer):
    env = {**os.environ, "TINKER_BASE_URL": tinker_stand_in.url, "TINKER_API_KEY": "tml-x", "HF_HUB_OFFLINE": "1"}
    argv = [str(SCRIPTS / "tinker_dpo.py"), "--data", str(ROOT / "templates" / "dpo_example.jsonl"), "--tokenizer",
            offline_tokenizer("Qwen3-8B"), "--log-path", str(tmp_path / "dpo")]
    out = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *argv], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 2, out.stderr
    [line] = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert "torch is not importable" in line and "pip install torch" in line and "uv run tinker_dpo.py" in line
    assert "Traceback" not in out.stderr
    assert tinker_stand_in.accepted == 0 and not (tmp_path / "dpo").exists()
    dry = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *argv, "--dry-run"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert dry.returncode == 0, dry.stderr
    assert "warning: torch is not importable" in dry.stderr and tinker_stand_in.accepted == 0


def test_a_full_disk_under_the_log_folder_exits_2_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(tinker_sft.shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 2**20, 2**20))
    with pytest.raises(tinker_sft.DataError, match=r"the run record \(--log-path\) needs about 64 MiB .* 1 MiB are "
                                                   r"free; free some space or pass a --log-path on a disk with room"):
        tinker_sft.Run(tmp_path / "run").lock()
    assert not (tmp_path / "run").exists()


def test_a_render_cache_that_would_not_fit_exits_2_naming_render_cache_off(tmp_path, monkeypatch, offline_tokenizer):
    tok = tinker_sft.load_tokenizer(offline_tokenizer("Qwen3-8B"))
    fmt = tinker_sft.resolve_format("auto", "Qwen/Qwen3-8B", tok, "Qwen3-8B", False)
    rows = [obj for _, obj in tinker_sft.read_jsonl(ROOT / "templates" / "sft_example.jsonl")]
    examples = tinker_sft.normalise_items(rows * 30)  # 1,020: the cache is used from 1,000 examples
    need = tinker_sft.render_cache_bytes(examples)
    monkeypatch.setattr(tinker_sft.shutil, "disk_usage", lambda path: Usage(10**12, 10**12, need - 1))
    with pytest.raises(tinker_sft.DataError, match=r"the render cache \(--render-cache\) needs about .*--render-cache "
                                                   r"off \(a --resume then renders again\)"):
        tinker_sft.render_all(examples, tok, fmt, "last-assistant", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    monkeypatch.setattr(tinker_sft.shutil, "disk_usage", lambda path: Usage(10**12, 0, need))
    assert len(tinker_sft.render_all(examples, tok, fmt, "last-assistant", cache_dir=tmp_path / "cache")) == 1020
    size = sum(p.stat().st_size for p in (tmp_path / "cache").iterdir())
    assert 0 < size <= need  # the estimate is an upper bound of what was written
