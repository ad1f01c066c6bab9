"""A NaN or inf loss, KL or metric stops a run: exit 1, the row kept as valid JSON, the cause and the sound
checkpoint named (issue 43 bullet 3, issue 44's "loss NaN reporting ok")."""
from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "common"))

import run_record  # noqa: E402
from run_record import NonFiniteError, Run, edited_command, non_finite  # noqa: E402

SCRIPTS = ROOT / "scripts"


def strict(text):
    """json.loads that refuses NaN and Infinity (what a browser's JSON.parse does)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines() if line.strip()]


def test_non_finite_finds_nan_and_inf_one_level_deep_and_ignores_the_rest():
    row = {"step": 3, "loss": float("nan"), "kl": 0.1, "name": "x", "ok": True,
           "eval": {"nll": float("inf"), "score": 1.0}, "none": None}
    bad = non_finite(row)
    assert set(bad) == {"loss", "eval/nll"} and math.isnan(bad["loss"]) and bad["eval/nll"] == math.inf
    assert non_finite({"step": 1, "loss": 2.0, "learning_rate": 1e-4}) == {}


def write_config(run, **config):
    run.path.mkdir(parents=True, exist_ok=True)
    run.write_json("config.json", {"model_name": "Qwen/Qwen3-8B", **config})


def test_a_nan_loss_row_is_written_as_json_then_stops_naming_the_rate_and_the_sound_checkpoint(tmp_path, monkeypatch):
    monkeypatch.delenv("TINKER_LOCAL_LAUNCHER", raising=False)
    monkeypatch.setattr(sys, "argv", ["scripts/tinker_sft.py", "--data", "d.jsonl", "--learning-rate", "0.01",
                                      "--log-path", str(tmp_path / "run"), "--resume"])
    run = Run(tmp_path / "run")
    write_config(run, learning_rate=0.01)
    for step in (1, 2, 3):
        run.checkpoint(name=f"{step:06d}", step=step, position={"next_batch": step}, epoch=0,
                       state_path=f"tinker://m/weights/{step:06d}", sampler_path=None, fmt={})
    for step in (1, 2, 3):
        run.append("metrics.jsonl", {"step": step, "loss": 1.0 / step})
    with pytest.raises(NonFiniteError) as caught:
        run.append("metrics.jsonl", {"step": 4, "loss": float("nan"), "trained_tokens": 12})
    text = str(caught.value)
    assert caught.value.exit_code == 1
    assert "training diverged at step 4: loss = nan" in text
    assert "--learning-rate 0.01 on Qwen/Qwen3-8B" in text
    # step 4's loss was computed with the weights after 3 steps: checkpoint 000003 holds them, so it is not
    # sound; 000002's weights gave step 3's finite loss
    assert "the last sound checkpoint is 000002 (tinker://m/weights/000002)" in text
    assert (f"tinker_sft.py --data d.jsonl --learning-rate 0.0025 --log-path {tmp_path / 'run'}-lr0.0025 "
            "--init-from tinker://m/weights/000002") in text
    assert " --resume --" not in text.split("continue from it")[1].split("(")[0]
    rows = strict(run.file("metrics.jsonl").read_text())
    assert rows[-1]["loss"] is None and rows[-1]["non_finite"] == {"loss": "nan"} and rows[-1]["trained_tokens"] == 12


def test_with_no_sound_checkpoint_it_says_start_again_at_a_lower_rate_with_overwrite(tmp_path, monkeypatch):
    monkeypatch.delenv("TINKER_LOCAL_LAUNCHER", raising=False)
    monkeypatch.setattr(sys, "argv", ["tinker_rl.py", "--learning-rate=0.004", "--log-path", "runs/rl"])
    run = Run(tmp_path / "rl")
    write_config(run, learning_rate=0.004)
    with pytest.raises(NonFiniteError) as caught:
        run.append("metrics.jsonl", {"iteration": 0, "reward_mean": 0.5, "kl_sample_train_v1": float("inf")})
    text = str(caught.value)
    assert "training diverged at iteration 0: kl_sample_train_v1 = inf" in text
    assert "nothing sound to --resume from" in text
    assert text.endswith(shlex.join([sys.executable, "tinker_rl.py", "--learning-rate", "0.001", "--log-path", "runs/rl",
                                     "--overwrite"]))
    rows = strict(run.file("metrics.jsonl").read_text())
    # the cookbook's name of the same value is nulled with ours
    assert rows[0]["optim/kl_sample_train_v1"] is None and rows[0]["reward_mean"] == 0.5


def test_a_finite_row_is_written_unchanged(tmp_path):
    run = Run(tmp_path / "ok")
    run.path.mkdir()
    row = run.append("metrics.jsonl", {"step": 1, "loss": 0.5})
    assert "non_finite" not in row and strict(run.file("metrics.jsonl").read_text())[0]["loss"] == 0.5


def test_edited_command_wraps_in_the_launcher_that_started_the_run(tmp_path, monkeypatch):
    launcher = tmp_path / "tinker_local.py"
    launcher.write_text("")
    monkeypatch.setenv("TINKER_LOCAL_LAUNCHER", str(launcher))
    monkeypatch.setattr(sys, "argv", ["tinker_dpo.py", "--overwrite", "--learning-rate", "1e-5"])
    command = edited_command({"--learning-rate": "2.5e-06", "--overwrite": None}, drop=("--resume",))
    assert command.endswith(" -- " + shlex.join([sys.executable, "tinker_dpo.py", "--overwrite", "--learning-rate",
                                                 "2.5e-06"]))
    assert command.split(" run -- ")[0].endswith("tinker_local.py")


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local_tinker", pytest.param("local_real_tinker", marks=pytest.mark.real_model)])
def test_a_diverging_sft_run_stops_with_exit_1_and_no_ok(backend, request, tmp_path):
    """A learning rate of 1e30 on the local backend, on the tiny model and on the real one (SmolLM2-135M-Instruct):
    the run stops at the first NaN loss, exit 1, no "ok", the diverged step's checkpoint not recorded."""
    local_tinker = request.getfixturevalue(backend)
    data = tmp_path / "data.jsonl"
    row = {"messages": [{"role": "user", "content": "What colour is the sky?"},
                        {"role": "assistant", "content": "Blue."}]}
    data.write_text("".join(json.dumps(row) + "\n" for _ in range(16)))
    log = tmp_path / "run"
    out = subprocess.run([sys.executable, str(SCRIPTS / "tinker_sft.py"), "--data", str(data), "--tokenizer",
                          str(local_tinker.tokenizer_dir), "--log-path", str(log), "--learning-rate", "1e30",
                          "--batch-size", "4", "--max-steps", "6", "--save-every", "1", "--num-probes", "0"],
                         capture_output=True, text=True, env=local_tinker.env, cwd=tmp_path, timeout=900)
    assert out.returncode == 1, out.stderr[-3000:]
    assert '"status": "ok"' not in out.stdout
    error = [line for line in out.stderr.splitlines() if line.startswith("error: training diverged at step")]
    assert error and "the learning rate is the usual cause (--learning-rate 1e+30" in error[0], out.stderr[-3000:]
    rows = strict((log / "metrics.jsonl").read_text())
    assert rows[-1]["non_finite"] and all(not r.get("non_finite") for r in rows[:-1])
    names = [r["name"] for r in strict((log / "checkpoints.jsonl").read_text())]
    assert "final" not in names and len(names) < len(rows)  # the diverged step's save is not recorded
    assert "Traceback" not in out.stderr


@pytest.mark.e2e
def test_an_rl_run_whose_weights_diverge_stops_at_its_next_sample_saying_why(local_tinker, tmp_path):
    """The default rehearsal at a learning rate of 1e30: iteration 1's loss is still finite (RL's loss is small),
    its optim step leaves NaN weights, and iteration 2's sample fails with the cause instead of retrying."""
    out = subprocess.run([sys.executable, str(SCRIPTS / "tinker_rl.py"), "--log-path", str(tmp_path / "rl"),
                          "--learning-rate", "1e30"],
                         capture_output=True, text=True, env=local_tinker.env, cwd=tmp_path, timeout=900)
    assert out.returncode == 1, out.stderr[-3000:]
    assert '"status": "ok"' not in out.stdout and "Traceback" not in out.stderr
    error = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert error and "the sampled log-probabilities are NaN or inf: the model's weights diverged" in error[-1]
    saved = tmp_path / "rl" / "checkpoints.jsonl"
    assert not saved.exists() or '"final"' not in saved.read_text()
