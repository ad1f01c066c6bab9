"""tinker_sft.py end to end against the local Tinker-compatible backend (tiny Qwen3 on the CPU):
training lowers held-out NLL, the run record holds the format, both checkpoints exist and the
sampler checkpoint samples, and a run killed after its first save resumes exactly."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import tinker_sft as sft

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "tinker_sft.py"
EXAMPLE = ROOT / "templates" / "sft_example.jsonl"
STEPS = 4


def sft_args(local_tinker, log, *extra):
    # batch 4 of the bundled example (every datum <= 128 tokens), lr high enough for a random tiny model
    return [sys.executable, str(SCRIPT), "--data", str(EXAMPLE), "--tokenizer", str(local_tinker.tokenizer_dir),
            "--model-name", local_tinker.model, "--batch-size", "4", "--max-steps", str(STEPS),
            "--save-every", "2", "--learning-rate", "1e-2", "--lora-rank", "8", "--log-path", str(log), *extra]


def run_sft(local_tinker, log, *extra, timeout=900):
    return subprocess.run(sft_args(local_tinker, log, *extra), capture_output=True, text=True,
                          env={**os.environ, **local_tinker.env}, timeout=timeout)


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(local_tinker, tmp_path_factory):
    log = tmp_path_factory.mktemp("sft") / "full"
    out = run_sft(local_tinker, log, "--num-probes", "1", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr[-3000:]
    return log, json.loads(out.stdout), out.stderr


def test_training_lowers_held_out_nll(full_run):
    _, report, stderr = full_run
    assert report["status"] == "ok" and report["steps"] == STEPS
    assert report["eval"]["nll_after"] < report["eval"]["nll_before"]
    assert "step 4/4 | loss " in stderr


def test_run_record_holds_the_format_next_to_every_checkpoint(full_run):
    log, report, _ = full_run
    fmt = report["format"]
    assert fmt["kind"] == "chat" and fmt["stop"] == [151645]
    assert json.loads((log / "config.json").read_text())["format"] == fmt
    assert "api_key" not in (log / "config.json").read_text().lower()
    saved = rows(log / "checkpoints.jsonl")
    assert [(r["name"], r["step"], r["next_batch"]) for r in saved] == [("000002", 2, 2), ("final", 4, 4)]
    assert all(r["format"] == fmt for r in saved)
    assert saved[-1]["state_path"] == report["state_path"] and "/weights/final" in report["state_path"]
    assert saved[-1]["sampler_path"] == report["sampler_path"] and report["sampler_path"].startswith("tinker://")
    metrics = rows(log / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["tokens"] > m["trained_tokens"] > 0 and m["loss"] > 0 for m in metrics)
    assert [m["learning_rate"] for m in metrics] == pytest.approx([1e-2, 7.5e-3, 5e-3, 2.5e-3])


def test_both_checkpoints_exist_and_the_sampler_checkpoint_samples(full_run, local_tinker):
    import tinker

    log, report, _ = full_run
    # the probes after training were sampled from a sampling client on the final sampler path
    after = [r for r in rows(log / "eval.jsonl") if r["when"] == "after"][-1]
    assert after["sampled_from"] == report["sampler_path"]
    [probe] = report["eval"]["probes"]
    assert 1 <= probe["after_sampled_tokens"] <= 8 and 1 <= probe["before_sampled_tokens"] <= 8
    assert isinstance(probe["after"], str) and probe["expected"]
    # the state path restores the trained weights: the held-out NLL recomputed on it is nll_after
    args = sft.parse_args(["--data", str(EXAMPLE), "--log-path", str(log)])
    tokenizer = sft.load_tokenizer(str(local_tinker.tokenizer_dir))
    fraction = json.loads((log / "config.json").read_text())["test_fraction"]  # as resolved (default: 10%, capped)
    train, test = sft.split_examples(sft.normalise_items(sft.load_dataset(args.data), None), None,
                                     fraction, args.seed)
    test_rendered = [r for _, r in sft.render_all(test, tokenizer, report["format"], args.train_on)]
    service = tinker.ServiceClient(base_url=local_tinker.base_url, api_key=local_tinker.env["TINKER_API_KEY"])
    try:
        restored = service.create_training_client_from_state(report["state_path"]).result()
        forward = sft.held_out_forward(restored, SimpleNamespace(test=test_rendered)).result()
        nll = sft.batch_nll(forward, [sft.trained_mask(r) for r in test_rendered])
        assert nll == pytest.approx(report["eval"]["nll_after"], abs=1e-4)
    finally:
        service.close("success").result()


def test_resume_after_sigkill_repeats_the_uninterrupted_run(full_run, local_tinker, tmp_path):
    full_log, full_report, _ = full_run
    log = tmp_path / "killed"
    proc = subprocess.Popen(sft_args(local_tinker, log, "--num-probes", "0"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **local_tinker.env})
    deadline = time.time() + 600
    while not ((log / "checkpoints.jsonl").exists() and "state_path" in (log / "checkpoints.jsonl").read_text()):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "no checkpoint within 600 s"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [r["name"] for r in rows(log / "checkpoints.jsonl")] == ["000002"]

    resumed = run_sft(local_tinker, log, "--num-probes", "0", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at batch 2" in resumed.stderr
    assert "step 3/4" in resumed.stderr and "step 1/4" not in resumed.stderr and "step 2/4" not in resumed.stderr
    report = json.loads(resumed.stdout)
    got, want = rows(log / "metrics.jsonl"), rows(full_log / "metrics.jsonl")
    assert [m["step"] for m in got] == [1, 2, 3, 4]  # nothing replayed, nothing skipped
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], abs=1e-4)
    assert report["eval"]["nll_after"] == pytest.approx(full_report["eval"]["nll_after"], abs=1e-4)
    assert report["eval"]["nll_before"] == pytest.approx(full_report["eval"]["nll_before"], abs=1e-4)


def test_unknown_model_exits_2_before_training(local_tinker, tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--data", str(EXAMPLE), "--tokenizer", str(local_tinker.tokenizer_dir),
         "--model-name", "Qwen/Qwen9-1T", "--log-path", str(tmp_path / "log")],
        capture_output=True, text=True, env={**os.environ, **local_tinker.env}, timeout=300)
    assert out.returncode == 2
    assert "unknown model 'Qwen/Qwen9-1T'" in out.stderr and local_tinker.model in out.stderr
    assert not (tmp_path / "log").exists()
