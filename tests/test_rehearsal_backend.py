"""Which model stood in, recorded and respected (common/rehearsal.py): config.json's "backend", the preset chosen by
the stand-in, printed commands that start the same stand-in again, and a run's checkpoints refused where they do not
load. Offline."""
import json

import pytest

import tinker_infer
import tinker_sft
from fixtures_local import common_module

rehearsal = common_module("rehearsal")
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("env, expected", [
    ({}, {"kind": "tinker", "stand_in": None, "stand_in_kind": None}),
    ({"TINKER_LOCAL_STAND_IN": "tiny-qwen3"}, {"kind": "local", "stand_in": "tiny-qwen3", "stand_in_kind": "tiny"}),
    ({"TINKER_LOCAL_STAND_IN": SMOLLM2}, {"kind": "local", "stand_in": SMOLLM2, "stand_in_kind": "real"}),
    ({"TINKER_BASE_URL": "http://127.0.0.1:8765"}, {"kind": "local", "stand_in": None, "stand_in_kind": None}),
    ({"TINKER_BASE_URL": "https://tinker.example.com"}, {"kind": "tinker", "stand_in": None, "stand_in_kind": None}),
])
def test_the_backend_record_says_where_a_run_trained_and_which_model_stood_in(monkeypatch, env, expected):
    monkeypatch.delenv("TINKER_LOCAL_STAND_IN", raising=False)
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert rehearsal.backend_record() == expected


def test_the_rehearsal_preset_follows_the_model_standing_in(monkeypatch):
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", "tiny-qwen3")
    assert tinker_sft.parse_args(["--rehearse"]).learning_rate == 1e-2
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", SMOLLM2)
    args = tinker_sft.parse_args(["--rehearse"])
    assert (args.learning_rate, args.lr_schedule, args.max_steps, args.eval_every) == (2e-3, "linear", 48, 8)
    assert tinker_sft.parse_args(["--rehearse", "--learning-rate", "1e-3"]).learning_rate == 1e-3  # a flag wins


def test_preset_takes_the_tiny_entry_on_the_real_model_until_one_is_measured_there(monkeypatch):
    presets = {"tiny": {"learning_rate": 1e-2}}
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", SMOLLM2)
    assert rehearsal.preset(presets) == {"learning_rate": 1e-2}
    assert rehearsal.preset({**presets, "real": {"learning_rate": 5e-4}}) == {"learning_rate": 5e-4}
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", "tiny-qwen3")
    assert rehearsal.preset({**presets, "real": {"learning_rate": 5e-4}}) == {"learning_rate": 1e-2}
    chosen = rehearsal.preset(presets)
    chosen["learning_rate"] = 1.0  # a copy: the preset itself is never changed by a run
    assert presets["tiny"]["learning_rate"] == 1e-2


def test_a_printed_next_command_on_the_real_model_starts_the_real_model_again(monkeypatch, tmp_path):
    launcher = tmp_path / "tinker_local.py"
    launcher.write_text("")
    monkeypatch.setenv("TINKER_LOCAL_LAUNCHER", str(launcher))
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", SMOLLM2)
    assert " run --real -- " in tinker_sft.script_command("tinker_infer.py", "--run", "runs/x")
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", "tiny-qwen3")
    command = tinker_sft.script_command("tinker_infer.py", "--run", "runs/x")
    assert " run -- " in command and "--real" not in command


def fake_run(folder, backend):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"backend": backend, "model_name": "Qwen/Qwen3-8B"}))
    fmt = {"kind": "chat", "template_sha256": "x", "template_kwargs": {}, "stop": [2], "tokenizer": "Qwen/Qwen3-8B"}
    (folder / "checkpoints.jsonl").write_text(json.dumps(
        {"name": "final", "step": 1, "next_batch": 1, "epoch": 0, "state_path": "tinker://model_x/weights/final",
         "sampler_path": "tinker://model_x/sampler_weights/final", "format": fmt, "time": "2026-12-06"}) + "\n")
    return folder


@pytest.mark.parametrize("here", [{}, {"TINKER_LOCAL_STAND_IN": "tiny-qwen3"}])
def test_a_real_model_run_is_not_sampled_where_its_checkpoints_do_not_load(monkeypatch, tmp_path, here):
    monkeypatch.delenv("TINKER_LOCAL_STAND_IN", raising=False)
    for key, value in here.items():
        monkeypatch.setenv(key, value)
    log = fake_run(tmp_path / "run", {"kind": "local", "stand_in": SMOLLM2, "stand_in_kind": "real"})
    with pytest.raises(tinker_infer.DataError, match=r"trained on the local backend's real model .* load only there .*"
                                                     r"run --real -- "):
        tinker_infer.run_format(str(log))


def test_a_run_samples_where_it_trained(monkeypatch, tmp_path):
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", SMOLLM2)
    log = fake_run(tmp_path / "run", {"kind": "local", "stand_in": SMOLLM2, "stand_in_kind": "real"})
    assert tinker_infer.run_format(str(log))[0] == "tinker://model_x/sampler_weights/final"
    old = fake_run(tmp_path / "old", None)  # a record from before "backend" existed is not checked
    assert tinker_infer.run_format(str(old))[0].endswith("final")


def test_resume_refuses_another_model_standing_in(monkeypatch, tmp_path):
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", "tiny-qwen3")
    run = tinker_sft.Run(tmp_path / "log")
    run.begin({"model_name": "Qwen/Qwen3-8B"})
    assert json.loads((tmp_path / "log" / "config.json").read_text())["backend"]["stand_in"] == "tiny-qwen3"
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", SMOLLM2)
    with pytest.raises(tinker_sft.DataError, match=r"the model standing in \(tiny-qwen3 -> " + SMOLLM2):
        run.check_resume({"model_name": "Qwen/Qwen3-8B"}, ("model_name",))
