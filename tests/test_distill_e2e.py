"""tinker_distill.py end to end on the local backend (tiny Qwen3 on the CPU): the teacher is the sampler
checkpoint of a short SFT run on a memorisable set, the student is the base model, and the student's
reverse KL to the teacher falls over iterations; a --resume continues the iteration count without
replaying an iteration."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]  # SFT teacher + 16 iterations + resume

ROOT = Path(__file__).resolve().parents[1]
SFT = ROOT / "scripts" / "tinker_sft.py"
DISTILL = ROOT / "scripts" / "tinker_distill.py"
# Four one-line answers the tiny model memorises in a few dozen steps (recipe in tinker_local's notes).
PAIRS = [("What colour is the sky?", "Blue."), ("What is the capital of France?", "Paris."),
         ("How many legs does a cat have?", "Four."), ("Which way does rain fall?", "Down.")]
SFT_EPOCHS = 30  # 4 examples, batch 4: one step per epoch
ITERATIONS = 16
GROUP_SIZE = 4  # 4 prompts x 4 samples x 8 tokens per iteration: enough tokens that the curve is not noise


def run(args, local_tinker, timeout=1500):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **local_tinker.env}, timeout=timeout)


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def memorisable(tmp_path_factory):
    path = tmp_path_factory.mktemp("distill-data") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in PAIRS))
    return path


@pytest.fixture(scope="module")
def teacher_log(local_tinker, memorisable, tmp_path_factory):
    log = tmp_path_factory.mktemp("distill-teacher") / "sft"
    out = run([SFT, "--data", memorisable, "--test-data", memorisable, "--tokenizer", local_tinker.tokenizer_dir,
               "--model-name", local_tinker.model, "--batch-size", "4", "--epochs", SFT_EPOCHS,
               "--learning-rate", "1e-2", "--lr-schedule", "constant", "--lora-rank", "8", "--save-every", "0",
               "--num-probes", "0", "--log-path", log], local_tinker)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["sampler_path"].startswith("tinker://")
    return log


def distill_args(local_tinker, teacher_log, memorisable, log, iterations, *extra):
    return [DISTILL, "--teacher", teacher_log, "--prompts", memorisable, "--tokenizer", local_tinker.tokenizer_dir,
            "--model-name", local_tinker.model, "--batch-size", "4", "--group-size", str(GROUP_SIZE), "--max-tokens", "8",
            "--iterations", iterations, "--learning-rate", "2e-2", "--lora-rank", "8", "--save-every", "8",
            "--log-path", log, *extra]


@pytest.fixture(scope="module")
def distilled(local_tinker, teacher_log, memorisable, tmp_path_factory):
    log = tmp_path_factory.mktemp("distill-student") / "run"
    out = run(distill_args(local_tinker, teacher_log, memorisable, log, ITERATIONS), local_tinker)
    assert out.returncode == 0, out.stderr[-3000:]
    return log, json.loads(out.stdout), out.stderr


def test_the_students_reverse_kl_to_the_teacher_falls(distilled):
    log, report, stderr = distilled
    curve = [r["reverse_kl"] for r in rows(log / "metrics.jsonl")]
    print("reverse KL per iteration:", [round(k, 4) for k in curve], file=sys.stderr)
    assert len(curve) == ITERATIONS
    assert report["reverse_kl"] == {"first": curve[0], "last": curve[-1]}
    # the base student starts far from the memorised teacher (~12 nats per token on the norm-x20 tiny
    # model) and one iteration's estimate is noisy (+-1 nat), so "falls" is a trend test: the least-squares
    # slope over the 16 iterations is negative, at least 2 standard errors from 0, and worth >= 1 nat over
    # the run. Measured slope/iteration (t): -0.19 (-4.1), -0.32 (-8.4), -0.20 (-4.4) on three seeds with
    # a fresh server, -0.11 (-3.4) in a full-suite run on its long-lived shared server (first/last quarter
    # means 11.41 -> 10.34 there, 10.96 -> 8.76 fresh)
    n = len(curve)
    fit = statistics.linear_regression(range(n), curve)
    residuals = [y - (fit.intercept + fit.slope * x) for x, y in enumerate(curve)]
    se = (sum(r * r for r in residuals) / (n - 2)) ** 0.5 / sum((x - (n - 1) / 2) ** 2 for x in range(n)) ** 0.5
    assert fit.slope < -2 * se and -fit.slope * (n - 1) >= 1.0, (fit.slope, se, curve)
    assert sum(curve[-4:]) < sum(curve[:4]), curve
    assert f"iter {ITERATIONS}/{ITERATIONS} | reverse KL" in stderr


def test_the_teacher_grades_every_sampled_token_and_trains_on_full_sequences(distilled):
    log, _, _ = distilled
    for row in rows(log / "metrics.jsonl"):
        assert row["sequences"] == 4 * GROUP_SIZE  # 4 prompts x GROUP_SIZE samples
        assert 4 * GROUP_SIZE <= row["tokens_sampled"] <= 4 * GROUP_SIZE * 8
        # teacher scores prompt + completion; the datum is that sequence minus its last token
        assert row["tokens_trained"] == row["tokens_teacher"] - row["sequences"]
        assert row["teacher_logprob"] <= 0 and row["student_logprob"] <= 0
        assert abs(row["kl_sample_train_v1"]) < 0.05  # learner and sampler hold the same weights


def test_the_run_record_names_the_teacher_and_ends_with_a_sampler_checkpoint(distilled, teacher_log):
    log, report, _ = distilled
    config = json.loads((log / "config.json").read_text())
    teacher_final = rows(Path(teacher_log) / "checkpoints.jsonl")[-1]["sampler_path"]
    assert config["teacher"] == teacher_final == report["teacher"]["model_path"]
    assert config["teacher_base"] == "Qwen/Qwen3-8B"
    checkpoints = rows(log / "checkpoints.jsonl")
    assert [c["name"] for c in checkpoints] == ["000008", "final"]
    assert [c["next_iteration"] for c in checkpoints] == [8, ITERATIONS]
    assert checkpoints[-1]["sampler_path"] == report["sampler_path"]
    assert checkpoints[-1]["format"] == config["format"] == report["format"]


def test_resume_continues_after_the_last_iteration_without_replaying_one(distilled, local_tinker, teacher_log,
                                                                         memorisable):
    log, _, _ = distilled
    out = run(distill_args(local_tinker, teacher_log, memorisable, log, ITERATIONS + 2, "--resume"), local_tinker)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"at iteration {ITERATIONS}" in out.stderr
    assert [r["iteration"] for r in rows(log / "metrics.jsonl")] == list(range(ITERATIONS + 2))
    checkpoints = rows(log / "checkpoints.jsonl")
    assert checkpoints[-1]["name"] == "final" and checkpoints[-1]["next_iteration"] == ITERATIONS + 2
    # a --resume with another --kl-coef would be a different run: refused before any call
    bad = run(distill_args(local_tinker, teacher_log, memorisable, log, ITERATIONS + 4, "--resume", "--kl-coef", "2"),
              local_tinker)
    assert bad.returncode == 2
    assert "--kl-coef 1.0 -> 2.0" in bad.stderr


# ---- --rehearse: a teacher trained first on the same base, then the student's KL to it halves ----------

def test_the_rehearsal_preset_trains_its_teacher_first_and_halves_the_reverse_kl(local_tinker, tmp_path):
    """Measured (load 6.5 on 2 shared cores): the soft teacher (3 SFT steps, the student's seed) rates the base
    student's samples at -5.5; reverse KL 4.995 at the first iteration -> 2.060 over the last 5 of 20 (lr 5e-3),
    61 s of script wall time on a running server."""
    import shlex
    import time

    started = time.monotonic()
    out = subprocess.run([sys.executable, str(DISTILL), "--rehearse", "--tokenizer", str(local_tinker.tokenizer_dir),
                          "--model-name", local_tinker.model], capture_output=True, text=True,
                         env={**os.environ, **local_tinker.env}, cwd=tmp_path, timeout=1700)
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["status"] == "ok" and result["rehearsal"]["passed"], result["rehearsal"]
    assert result["teacher"]["model_path"].startswith("tinker://") and "sampler_weights/rehearsal-teacher" in \
        result["teacher"]["model_path"]
    curve = [r["reverse_kl"] for r in rows(tmp_path / "runs/distill-rehearsal/metrics.jsonl")]
    assert len(curve) == 20 and sum(curve[-5:]) / 5 <= curve[0] / 2, curve
    sys.stderr.write(f"\ndistill rehearsal: reverse KL {curve[0]:.3f} -> {sum(curve[-5:]) / 5:.3f} (last 5), "
                     f"{took:.0f} s\n")
    summary = out.stderr[out.stderr.index("==== what happened ===="):]
    assert "on Tinker this run would cost about $" in summary and "rehearsal teacher: 3 SFT steps" in out.stderr
    [printed] = [line.split("sample it: ", 1)[1] for line in summary.splitlines() if "next     sample it: " in line]
    argv = shlex.split(printed)
    if "--" in argv:  # the launcher wrapper starts its own server: run its command on ours
        argv = argv[argv.index("--") + 1:]
    assert argv[1:4] == [str(ROOT / "scripts" / "tinker_infer.py"), "--run", "runs/distill-rehearsal"], printed
    sampled = subprocess.run([sys.executable, *argv[1:], "--max-tokens", "4"], capture_output=True, text=True,
                             env={**os.environ, **local_tinker.env}, cwd=tmp_path, timeout=600)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert json.loads(sampled.stdout)["model"] == result["sampler_path"]
