"""tinker_distill.py offline: the per-token datum, the teacher check, the cost preflight, the flags, and
the script copied alone into an empty folder."""
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tinker_distill as distill

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "tinker_distill.py"


def run_main(argv, capsys):
    code = distill.run_cli(distill.main, argv)
    out, err = capsys.readouterr()
    return code, out, err


def as_list(tensor):
    return [float(x) for x in tensor.tolist()]


# ---- the datum --------------------------------------------------------------------------------

PROMPT = [11, 12, 13]
COMPLETION = [21, 22, 23, 24]
SAMPLER = [-0.5, -1.0, -2.0, -0.25]  # the student sampler's logprob of each completion token
TEACHER = [None, -3.0, -4.0, -0.75, -1.5, -0.5, -1.25]  # compute_logprobs(prompt + completion): None first


def test_the_datum_is_shifted_by_one_like_every_tinker_datum():
    datum, _ = distill.distill_datum(PROMPT, COMPLETION, SAMPLER, TEACHER, kl_coef=1.0)
    assert datum.model_input.to_ints() == [11, 12, 13, 21, 22, 23]
    assert [int(t) for t in datum.loss_fn_inputs["target_tokens"].tolist()] == [12, 13, 21, 22, 23, 24]


def test_prompt_positions_carry_zero_advantage_and_zero_behaviour_logprob():
    datum, _ = distill.distill_datum(PROMPT, COMPLETION, SAMPLER, TEACHER, kl_coef=1.0)
    # positions 0 and 1 predict prompt tokens 12 and 13: nothing to learn there
    assert as_list(datum.loss_fn_inputs["advantages"])[:2] == [0.0, 0.0]
    assert as_list(datum.loss_fn_inputs["logprobs"])[:2] == [0.0, 0.0]


def test_completion_advantage_is_teacher_minus_student_at_the_position_predicting_that_token():
    datum, reverse_kl = distill.distill_datum(PROMPT, COMPLETION, SAMPLER, TEACHER, kl_coef=1.0)
    # completion token j (target at position len(prompt)-1+j) is graded by teacher logprob TEACHER[3+j]
    assert reverse_kl == [-0.5 - -0.75, -1.0 - -1.5, -2.0 - -0.5, -0.25 - -1.25]
    assert as_list(datum.loss_fn_inputs["advantages"])[2:] == [-0.25, -0.5, 1.5, -1.0]
    assert as_list(datum.loss_fn_inputs["logprobs"])[2:] == SAMPLER
    targets = [int(t) for t in datum.loss_fn_inputs["target_tokens"].tolist()]
    assert targets[2:] == COMPLETION


def test_kl_coef_scales_the_advantage_not_the_logged_reverse_kl():
    datum, reverse_kl = distill.distill_datum(PROMPT, COMPLETION, SAMPLER, TEACHER, kl_coef=0.5)
    assert reverse_kl == [0.25, 0.5, -1.5, 1.0]
    assert as_list(datum.loss_fn_inputs["advantages"]) == [0.0, 0.0, -0.125, -0.25, 0.75, -0.5]


def test_a_student_that_matches_the_teacher_gets_no_advantage():
    teacher = [None, -1.0, -1.0] + SAMPLER
    datum, reverse_kl = distill.distill_datum(PROMPT, COMPLETION, SAMPLER, teacher, kl_coef=1.0)
    assert reverse_kl == [0.0] * 4
    assert all(a == 0.0 for a in as_list(datum.loss_fn_inputs["advantages"]))


def test_a_one_token_prompt_has_no_prompt_position():
    datum, reverse_kl = distill.distill_datum([5], [6, 7], [-1.0, -2.0], [None, -0.5, -0.5], kl_coef=1.0)
    assert datum.model_input.to_ints() == [5, 6]
    assert as_list(datum.loss_fn_inputs["advantages"]) == [0.5, 1.5]
    assert reverse_kl == [-0.5, -1.5]


@pytest.mark.parametrize("sampler, teacher", [
    (SAMPLER[:3], TEACHER),  # one sampler logprob short
    (SAMPLER, TEACHER[:-1]),  # teacher scored one token less than prompt + completion
])
def test_logprobs_that_do_not_line_up_with_the_tokens_are_refused(sampler, teacher):
    with pytest.raises(ValueError, match="do not match"):
        distill.distill_datum(PROMPT, COMPLETION, sampler, teacher, kl_coef=1.0)


def test_sampler_learner_kl_reads_only_completion_positions():
    datum, _ = distill.distill_datum(PROMPT, COMPLETION, SAMPLER, TEACHER, kl_coef=1.0)
    learner = [-9.0, -9.0] + [s - 0.1 for s in SAMPLER]  # prompt positions are junk; must be ignored
    import numpy as np

    out = {"logprobs": np.array(learner, dtype=np.float32)}
    kl = distill.kl_metrics([datum], [[0.0] * (len(PROMPT) - 1) + [1.0] * len(COMPLETION)], [out])
    assert math.isclose(kl["kl_sample_train_v1"], 0.1, rel_tol=1e-5)
    assert math.isclose(kl["kl_sample_train_v2"], 0.005, rel_tol=1e-4)


# ---- teacher and student must read token ids the same way ---------------------------------------

def qwen_dry_run(offline_tokenizer, tmp_path, *extra):
    return ["--dry-run", "--tokenizer", offline_tokenizer("Qwen3-8B"), "--log-path", str(tmp_path / "log"), *extra]


def test_a_llama_teacher_for_a_qwen3_student_is_refused_with_the_reasons(offline_tokenizer, tmp_path, capsys):
    code, out, err = run_main(qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", "meta-llama/Llama-3.1-8B-Instruct",
                                           "--teacher-tokenizer", offline_tokenizer("Llama-3.1-8B-Instruct")), capsys)
    assert code == 2
    assert out == ""
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: the teacher meta-llama/Llama-3.1-8B-Instruct does not share")
    assert "vocabularies differ (151669 vs 128256 tokens)" in line
    assert "chat templates differ" in line
    assert "stop tokens differ ([151645] vs [128009])" in line
    assert not (tmp_path / "log").exists()


def test_a_teacher_with_the_same_tokenizer_and_template_passes_the_dry_run(offline_tokenizer, tmp_path, capsys):
    code, out, _ = run_main(qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", "Qwen/Qwen3-8B",
                                         "--teacher-tokenizer", offline_tokenizer("Qwen3-8B")), capsys)
    assert code == 0
    record = json.loads(out)
    assert record["status"] == "dry_run"
    assert record["prompts"] == len(distill.PROMPTS)
    assert record["teacher"]["base_model"] == "Qwen/Qwen3-8B"
    assert record["format"]["stop"] == [151645]



def test_a_missing_teacher_tokenizer_names_the_teacher_tokenizer_flag(offline_tokenizer, tmp_path, capsys):
    code, out, err = run_main(qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", "Qwen/Qwen3-8B",
                                           "--teacher-tokenizer", str(tmp_path / "no-such-folder")), capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == (
        f"error: tokenizer folder {tmp_path / 'no-such-folder'} does not exist; pass --teacher-tokenizer PATH "
        "(a folder with tokenizer.json) or a hub name")


def test_an_unknown_model_the_catalogue_knows_as_retired_says_so_before_the_served_list(monkeypatch):
    class Model:
        def __init__(self, name):
            self.model_name, self.trainable, self.sampleable, self.max_context_length = name, True, True, 32768

    class Caps:
        supported_models = [Model("Qwen/Qwen3-8B"), Model("Qwen/Qwen3.6-35B-A3B")]

    class Rest:
        def get_server_capabilities(self):
            return type("F", (), {"result": lambda self, timeout=None: Caps()})()

    for name in ("require_credentials", "check_reachable", "_start_watch"):
        monkeypatch.setattr(distill, name, lambda *a, **k: None)
    monkeypatch.setattr(distill, "rest_client", Rest)
    with pytest.raises(distill.DataError) as err:
        distill.connect("Qwen/Qwen3-30B-A3B")
    assert str(err.value) == (
        "unknown model 'Qwen/Qwen3-30B-A3B': Qwen/Qwen3-30B-A3B was retired from Tinker on 2026-06-12; its "
        "recommended replacement is Qwen/Qwen3.6-35B-A3B; this Tinker serves Qwen/Qwen3.6-35B-A3B, Qwen/Qwen3-8B; "
        "pass one with --model-name")
    with pytest.raises(distill.DataError) as err:  # the teacher's check says the same
        distill.check_teacher_served("Qwen/Qwen3-30B-A3B")
    assert "(Qwen/Qwen3-30B-A3B was retired from Tinker on 2026-06-12; its recommended replacement is " \
           "Qwen/Qwen3.6-35B-A3B; it serves Qwen/Qwen3-8B, Qwen/Qwen3.6-35B-A3B)" in str(err.value)


def test_a_template_difference_alone_is_named(chat_family):
    tok, fmt = chat_family("Qwen3-8B")
    other = dict(fmt, template_sha256="0" * 64)
    assert distill.rendering_differences(tok, fmt, tok, fmt) == []
    assert distill.rendering_differences(tok, fmt, tok, other) == [
        f"chat templates differ (sha256 {fmt['template_sha256'][:12]} vs 000000000000)"]


def test_a_tinker_path_teacher_needs_its_base_model_for_a_dry_run(offline_tokenizer, tmp_path, capsys):
    path = "tinker://abc:train:0/sampler_weights/final"
    code, _, err = run_main(qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", path), capsys)
    assert code == 2
    assert "--teacher-base" in err.strip().splitlines()[-1]
    code, out, _ = run_main(qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", path, "--teacher-base",
                                         "Qwen/Qwen3-8B", "--teacher-tokenizer", offline_tokenizer("Qwen3-8B")), capsys)
    assert code == 0
    assert json.loads(out)["teacher"]["model_path"] == path


def test_a_training_checkpoint_is_not_a_teacher(offline_tokenizer, tmp_path, capsys):
    code, _, err = run_main(qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", "tinker://abc:train:0/weights/final",
                                         "--teacher-base", "Qwen/Qwen3-8B"), capsys)
    assert code == 2
    assert "sampler_weights" in err


def write_run_record(folder, fmt, model="Qwen/Qwen3-8B"):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_name": model, "format": fmt}))
    row = {"name": "final", "step": 4, "next_batch": 4, "epoch": 1, "state_path": "tinker://r:train:0/weights/final",
           "sampler_path": "tinker://r:train:0/sampler_weights/final", "format": fmt}
    (folder / "checkpoints.jsonl").write_text(json.dumps(row) + "\n")


def test_a_run_record_teacher_gives_its_final_sampler_and_its_format_is_checked(
        offline_tokenizer, chat_family, tmp_path, capsys):
    _, fmt = chat_family("Qwen3-8B")
    fmt = dict(fmt, tokenizer=offline_tokenizer("Qwen3-8B"))
    write_run_record(tmp_path / "sft", fmt)
    code, out, _ = run_main(qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", str(tmp_path / "sft")), capsys)
    assert code == 0
    teacher = json.loads(out)["teacher"]
    assert teacher["model_path"] == "tinker://r:train:0/sampler_weights/final"
    assert teacher["base_model"] == "Qwen/Qwen3-8B"

    write_run_record(tmp_path / "sft-raw", {"kind": "raw", "stop": [151643], "tokenizer": fmt["tokenizer"]})
    code, _, err = run_main(qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", str(tmp_path / "sft-raw")), capsys)
    assert code == 2
    assert "the student renders chat, the teacher raw" in err
    assert "stop tokens differ ([151645] vs [151643])" in err


def test_an_unfinished_run_record_is_not_a_teacher(offline_tokenizer, tmp_path, capsys):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    code, _, err = run_main(qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", str(tmp_path / "half")), capsys)
    assert code == 2
    assert "not a finished run record" in err


# ---- cost: the teacher's prefill is part of the preflight ---------------------------------------

def test_the_token_count_includes_the_teachers_prefill_of_every_sequence():
    student, teacher = distill.distill_tokens(iterations=10, batch_size=8, group_size=4, avg_prompt=30,
                                              avg_completion=100)
    sequences = 10 * 8 * 4
    assert student == {"prefill": 80 * 30, "cached_prefill": 80 * 3 * 30, "sample": sequences * 100,
                       "train": sequences * 129}
    assert teacher == {"prefill": sequences * 130, "sample": sequences}


def test_the_dry_run_estimate_prices_student_and_teacher(offline_tokenizer, tmp_path, capsys):
    import tinker_pricing

    argv = qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", "Qwen/Qwen3-8B", "--teacher-tokenizer",
                        offline_tokenizer("Qwen3-8B"), "--iterations", "10", "--max-tokens", "100")
    code, out, err = run_main(argv, capsys)
    assert code == 0
    record = json.loads(out)
    mean_prompt = record["prompt_tokens"]["mean"]
    rendered = distill.prepare_student(distill.parse_args(argv)).prompts
    student, teacher = distill.distill_tokens(10, 8, 4, sum(map(len, rendered)) / len(rendered), 100)
    merged = {k: student.get(k, 0) + teacher.get(k, 0) for k in ("prefill", "cached_prefill", "sample", "train")}
    expected = tinker_pricing.estimate_cost("Qwen/Qwen3-8B", **merged)["usd"]["total"]
    student_only = tinker_pricing.estimate_cost("Qwen/Qwen3-8B", **student)["usd"]["total"]
    assert record["estimate_usd"] == pytest.approx(expected)
    assert record["estimate_usd"] > student_only
    assert mean_prompt > 0
    assert "teacher prefill included" in err


def test_max_usd_below_the_estimate_stops_before_any_call(offline_tokenizer, tmp_path, capsys):
    code, out, err = run_main(qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", "Qwen/Qwen3-8B",
                                           "--teacher-tokenizer", offline_tokenizer("Qwen3-8B"), "--max-usd", "0.01"),
                              capsys)
    assert code == 3
    assert "exceeds --max-usd 0.01" in err


def test_an_unpriced_teacher_cannot_pass_a_max_usd_check(offline_tokenizer, tmp_path, capsys):
    code, _, err = run_main(qwen_dry_run(offline_tokenizer, tmp_path, "--teacher", "Qwen/Qwen3-32B",
                                         "--teacher-tokenizer", offline_tokenizer("Qwen3-8B"), "--max-usd", "100"), capsys)
    assert code == 3
    assert "no price for Qwen/Qwen3-32B" in err


# ---- flags and prompts --------------------------------------------------------------------------

@pytest.mark.parametrize("flags, expected", [
    (["--kl-coef", "0"], "--kl-coef 0.0: expected a value in (0, inf]"),
    (["--batch-size", "0"], "--batch-size 0: expected a value in [1, inf]"),
    (["--temperature", "nan"], "--temperature nan: expected a finite number"),
    (["--resume", "--overwrite"], "contradict"),
    (["--init-from", "tinker://run/sampler_weights/final"], "is a sampler_weights/ checkpoint: it cannot seed a training client"),
    (["--init-from", "runs/sft"], "is not a checkpoint path; expected tinker://RUN_ID/weights/NAME"),
])
def test_bad_flags_exit_2_with_one_line(flags, expected, tmp_path, capsys):
    code, out, err = run_main(["--teacher", "Qwen/Qwen3-8B", "--log-path", str(tmp_path / "l"), *flags], capsys)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and expected in err


def test_no_teacher_is_a_usage_error(tmp_path, capsys):
    code, _, err = run_main(["--log-path", str(tmp_path / "l")], capsys)
    assert code == 2
    assert "--teacher" in err


def test_prompts_from_sft_data_drop_the_answer(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Capital of France?"},
                                 {"role": "assistant", "content": "Paris."}]}) + "\n"
        + json.dumps({"prompt": "Sky colour?"}) + "\n")
    assert distill.load_prompts(str(data)) == [[{"role": "user", "content": "Capital of France?"}], "Sky colour?"]


def test_a_prompt_that_does_not_end_with_a_user_turn_is_refused(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."}]}) + "\n")
    with pytest.raises(distill.DataError, match="line 1: the prompt must end with a user"):
        distill.load_prompts(str(data))


def test_resume_keeps_the_prompt_slot_seeds():
    assert distill.sampling_seed(0, 3, 1) == distill.sampling_seed(0, 3, 1)
    assert len({distill.sampling_seed(0, it, slot) for it in range(5) for slot in range(8)}) == 40


# ---- the script alone in an empty folder ----------------------------------------------------------

def test_the_script_copied_alone_runs_help_and_dry_run(offline_tokenizer, tmp_path):
    alone = tmp_path / "project"
    alone.mkdir()
    shutil.copy(SCRIPT, alone / "tinker_distill.py")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"}
    help_ = subprocess.run([sys.executable, "tinker_distill.py", "--help"], cwd=alone, env=env,
                           capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0, help_.stderr
    assert "--teacher" in help_.stdout and "--kl-coef" in help_.stdout
    tok = offline_tokenizer("Qwen3-8B")
    dry = subprocess.run([sys.executable, "tinker_distill.py", "--dry-run", "--tokenizer", tok, "--teacher",
                          "Qwen/Qwen3-8B", "--teacher-tokenizer", tok], cwd=alone, env=env,
                         capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr
    record = json.loads(dry.stdout)
    assert record["status"] == "dry_run" and record["estimate_usd"] is None
    assert "no dollar estimate: tinker_pricing.py is not beside this script" in dry.stderr
    assert sorted(p.name for p in alone.iterdir()) == ["tinker_distill.py"]


# ---- --rehearse: the preset, the teacher trained first, the checks --------------------------------------

def test_the_rehearsal_preset_dry_runs_the_built_in_questions_with_a_teacher_of_the_same_base(offline_tokenizer,
                                                                                               tmp_path, capsys):
    code, out, err = run_main(["--rehearse", "--dry-run", "--tokenizer", offline_tokenizer("Qwen3-8B")], capsys)
    assert code == 0, err
    record = json.loads(out)
    assert record["prompts"] == len(distill.REHEARSAL_QA) and record["max_tokens"] == 8
    # no --teacher: the teacher is trained first on the student's base; its tokenizer is the student's
    assert record["teacher"]["base_model"] == "Qwen/Qwen3-8B" and record["teacher"]["tokenizer"] == \
        distill.tokenizer_record(offline_tokenizer("Qwen3-8B"))
    assert "no --prompts: the student answers the built-in rehearsal questions" in err
    args = distill.parse_args(["--rehearse", "--iterations", "3"])
    assert (args.train_teacher, args.iterations, args.learning_rate, args.log_path) == (True, 3, 5e-3,
                                                                                        "runs/distill-rehearsal")
    assert distill.parse_args(["--rehearse", "--teacher", "runs/sft"]).train_teacher is False


class RecordedRun:
    def __init__(self, curve):
        self._rows = [{"iteration": i, "reverse_kl": k, "teacher_logprob": -k - 1, "student_logprob": -1.0}
                      for i, k in enumerate(curve)]

    def rows(self, name):
        return self._rows


def test_rehearsal_checks_judge_the_last_quarter_against_the_first_iteration():
    saved = {"state_path": "tinker://r/weights/final", "sampler_path": "tinker://r/sampler_weights/final"}
    halved = distill.distill_rehearsal_checks(RecordedRun([5.0, 8.4, 11.2, 6.0, 3.0, 2.4, 2.0, 2.2]), saved, 8)
    assert halved["passed"] and halved["reverse_kl"] == {"first": 5.0, "last_quarter": 2.1}
    assert halved["checks"][-1]["check"] == ("the reverse KL to the teacher falls by half or more (5.000 at the "
                                             "first iteration -> 2.100, the mean of the last 2)")
    stalled = distill.distill_rehearsal_checks(RecordedRun([16.3, 13.7, 12.4, 13.3, 12.6, 12.1, 12.2, 13.9]), saved, 8)
    assert [c["passed"] for c in stalled["checks"]] == [True, True, False]
    assert [c["passed"] for c in distill.distill_rehearsal_checks(RecordedRun([5.0, 2.0]), {}, 8)["checks"]] == \
        [False, False, True]


def test_the_real_models_checks_judge_a_sample_whole_where_the_per_token_mean_rises(tmp_path, monkeypatch):
    """The real student shortens its samples as it takes the teacher's form (measured: 21 -> 4 tokens a sample):
    its per-token KL rises while the KL a sample falls. On the real model the checks judge a sample whole and print
    the per-token figure beside it; the tiny model's halving rule per token is unchanged."""
    folder = tmp_path / "run"
    folder.mkdir()
    rows = [{"iteration": i, "reverse_kl": 2.0 + 0.25 * i, "teacher_logprob": -4.5 - 0.2 * i, "sequences": 8,
             "tokens_sampled": 168 - 16 * i} for i in range(8)]  # per sample: 42 nats -> 26.25
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = {"state_path": "tinker://r/weights/final", "sampler_path": "tinker://r/sampler_weights/final"}
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", "HuggingFaceTB/SmolLM2-135M-Instruct")
    real = distill.distill_rehearsal_checks(distill.Run(folder), report, 8)
    assert real["passed"], real["checks"]
    assert real["checks"][2]["check"] == ("the reverse KL to the teacher falls (42.4 nats a sample, the mean of the "
                                          "first 2 iterations -> 28.9, the last 2; per token 2.125 -> 3.625)")
    assert real["checks"][3]["check"].startswith("the teacher rates the student's samples higher (-91.9 -> -46.3")
    monkeypatch.setenv("TINKER_LOCAL_STAND_IN", "tiny-qwen3")
    tiny = distill.distill_rehearsal_checks(distill.Run(folder), report, 8)
    assert not tiny["passed"] and len(tiny["checks"]) == 3 and "falls by half" in tiny["checks"][2]["check"]
