"""One writer per run folder, and JSONL as editors save it. Offline: the lock is taken before any Tinker
call, so a refused script never needs a server.

- A live holder of LOG/.lock makes every training script (plain, --resume, --overwrite) exit 2 naming it,
  with the folder byte for byte as it was.
- A lock left by a killed process is taken over with a message; a finished run leaves no lock file; a
  folder made only for the lock of a refused run is removed.
- Two processes racing for one folder: exactly one gets it.
- JSONL with a UTF-8 byte-order mark, CRLF endings or U+2028 inside a string reads like plain JSONL.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tinker_pricing
import tinker_report
import tinker_sft

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
SFT_DATA = ROOT / "templates" / "sft_example.jsonl"
DPO_DATA = ROOT / "templates" / "dpo_example.jsonl"

HOLD = ("import sys, tinker_sft; tinker_sft.Run(sys.argv[1]).lock(); print('held', flush=True); "
        "sys.stdin.read()")


@pytest.fixture
def held_folder(tmp_path):
    """A run folder with a record in it, locked by a live process (its pid in .pid)."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_name": "Qwen/Qwen3-8B"}\n')
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (folder / "checkpoints.jsonl").write_text('{"name": "000001", "step": 1, "next_batch": 1, "next_iteration": 1, '
                                              '"state_path": "tinker://x:train:0/weights/000001"}\n')
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=SCRIPTS)
    assert holder.stdout.readline().strip() == "held"
    yield folder, holder.pid
    holder.kill()
    holder.wait(timeout=30)


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def script_argv(script, tokenizer, log):
    common = ["--log-path", str(log)]
    if script == "tinker_sft.py":
        return ["--data", str(SFT_DATA), "--tokenizer", tokenizer, *common]
    if script == "tinker_dpo.py":
        return ["--data", str(DPO_DATA), "--tokenizer", tokenizer, *common]
    if script == "tinker_rl.py":
        return ["--tokenizer", tokenizer, *common]
    return ["--teacher", "Qwen/Qwen3-8B", "--tokenizer", tokenizer, "--teacher-tokenizer", tokenizer, *common]


@pytest.mark.parametrize("mode", ["plain", "--resume", "--overwrite"])
@pytest.mark.parametrize("script", ["tinker_sft.py", "tinker_rl.py", "tinker_dpo.py", "tinker_distill.py"])
def test_a_second_writer_exits_2_naming_the_holder_and_changes_nothing(script, mode, held_folder, offline_tokenizer):
    held_folder, pid = held_folder
    before = snapshot(held_folder)
    argv = script_argv(script, offline_tokenizer("Qwen3-8B"), held_folder) + ([] if mode == "plain" else [mode])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_API_KEY": "tml-never-used",
           "TINKER_BASE_URL": "http://127.0.0.1:9"}  # nothing listens: a script that got past the lock would exit 4
    out = subprocess.run([sys.executable, str(SCRIPTS / script), *argv], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 2, out.stderr
    assert f"pid {pid}" in out.stderr and "is being written by" in out.stderr
    assert f"kill {pid}" in out.stderr and "Traceback" not in out.stderr
    assert snapshot(held_folder) == before


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_message(tmp_path, capsys):
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=SCRIPTS)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()  # SIGKILL: no release, the lock file stays and names a dead process
    holder.wait(timeout=30)
    assert json.loads((folder / ".lock").read_text())["pid"] == holder.pid
    with tinker_sft.Run(folder) as run:
        err = capsys.readouterr().err
        assert f"pid {holder.pid}" in err and "takes the folder over" in err
        assert json.loads((folder / ".lock").read_text())["pid"] == os.getpid()
        run.append("metrics.jsonl", {"step": 1})
    assert not (folder / ".lock").exists()  # released: a finished run leaves no lock file
    assert folder.is_dir()  # it holds a record now, so it stays


def test_a_folder_made_only_for_the_lock_is_removed_when_the_run_is_refused(tmp_path, offline_tokenizer):
    log = tmp_path / "new" / "run"
    out = subprocess.run([sys.executable, str(SCRIPTS / "tinker_sft.py"), "--data", str(tmp_path / "missing.jsonl"),
                          "--tokenizer", offline_tokenizer("Qwen3-8B"), "--log-path", str(log)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2 and "missing.jsonl" in out.stderr, out.stderr
    assert not log.exists()


def test_two_processes_racing_for_one_folder_give_it_to_exactly_one(tmp_path):
    folder = tmp_path / "race"
    race = ("import sys, time, tinker_sft\n"
            "go = float(sys.argv[2])\n"
            "while time.time() < go: pass\n"
            "try:\n    tinker_sft.Run(sys.argv[1]).lock()\nexcept tinker_sft.DataError:\n    print('refused', flush=True)\n"
            "else:\n    print('held', flush=True); sys.stdin.read()\n")
    go = str(time.time() + 3.0)  # all start together: imports take about a second
    procs = [subprocess.Popen([sys.executable, "-c", race, str(folder), go], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=SCRIPTS) for _ in range(4)]
    try:
        answers = sorted(p.stdout.readline().strip() for p in procs)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    assert answers == ["held", "refused", "refused", "refused"]


# ---------------------------------------------------------------------------------------------
# JSONL as editors save it

ROWS = [{"messages": [{"role": "user", "content": "Hi\u2028there"}, {"role": "assistant", "content": "Hello."}]},
        {"prompt": "2+2?", "completion": "4"}]


def editor_bytes(rows):
    """A UTF-8 byte-order mark, CRLF endings, U+2028 written raw inside a string, a blank line."""
    body = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n\r\n"
    return b"\xef\xbb\xbf" + body.encode("utf-8")


def test_jsonl_with_a_byte_order_mark_and_crlf_reads_like_plain_jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(editor_bytes(ROWS))
    assert [obj for _, obj in tinker_sft.read_jsonl(path)] == ROWS
    assert [n for n, _ in tinker_sft.read_jsonl(path)] == [1, 2]  # line numbers still name the lines
    assert [tinker_sft.validate_example(obj, n)["line"] for n, obj in tinker_sft.read_jsonl(path)] == [1, 2]


def test_run_record_and_report_readers_accept_bom_and_crlf(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_bytes(editor_bytes([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]))
    assert tinker_sft.Run(folder).rows("metrics.jsonl") == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    skipped = {}
    assert [r["step"] for r in tinker_report.read_rows(folder / "metrics.jsonl", skipped)] == [1, 2] and skipped == {}


def test_the_pricing_token_count_reads_bom_and_crlf(tmp_path, offline_tokenizer):
    from transformers import AutoTokenizer

    plain, edited = tmp_path / "plain.jsonl", tmp_path / "edited.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    edited.write_bytes(editor_bytes(ROWS))
    tok = AutoTokenizer.from_pretrained(offline_tokenizer("Qwen3-8B"))
    assert tinker_pricing.count_sft_tokens(edited, tok) == tinker_pricing.count_sft_tokens(plain, tok)
