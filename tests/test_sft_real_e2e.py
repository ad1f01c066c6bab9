"""tinker_sft.py --rehearse on the local backend's real model (SmolLM2-135M-Instruct, `tinker_local.py run --real`):
the real-model preset and the checks that prove the user's task, end to end through the real SDK, on the session's
real-model SFT rehearsal (fixture `local_real_sft_run`)."""
import json
import subprocess
import sys

import pytest

from fixtures_local import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.real_model]
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_an_own_data_rehearsal_on_the_real_model_reproduces_the_trained_answers(local_real_sft_run):
    """The help-desk set (templates/sft_example.jsonl, 34 rows, one with reasoning_content that SmolLM2's template
    cannot render: trained on its answer alone, with a warning): 3/4 probes or more word for word, and the held-out
    NLL below its start at some evaluation."""
    run, report = local_real_sft_run, local_real_sft_run.report
    assert run.returncode == 0 and report["status"] == "ok", run.stderr[-3000:]
    assert "carry reasoning_content, which the local real model's ChatML template cannot render" in run.stderr
    assert report["rehearsal"]["stand_in"] == SMOLLM2
    checks = {c["check"].split(" (")[0]: c["passed"] for c in report["rehearsal"]["checks"]}
    assert checks["at least 3 of 4 probes"] is True, report["rehearsal"]
    assert checks["the held-out NLL falls below its start at some evaluation"] is True, report["rehearsal"]
    probes = report["eval"]["probes"]
    assert sum(p["after"].strip() == p["expected"].strip() for p in probes) >= 3, probes
    # a real model answers in its own words before training, never word for word
    assert all(p["before"].strip() != p["expected"].strip() for p in probes) and all(p["before"] for p in probes)
    evals = [json.loads(line) for line in (run.log / "eval.jsonl").read_text().splitlines()]
    before = next(r["nll"] for r in evals if r["when"] == "before")
    assert min(r["nll"] for r in evals if r["when"] != "before") < before
    # the printed next command starts the real model again (its checkpoint loads only there)
    assert "tinker_local.py run --real -- " in run.stderr.split("next     sample it:")[1].splitlines()[0]


def test_the_run_record_says_the_real_model_stood_in_and_used_its_preset(local_real_sft_run):
    config = json.loads((local_real_sft_run.log / "config.json").read_text())
    assert config["backend"] == {"kind": "local", "stand_in": SMOLLM2, "stand_in_kind": "real"}
    assert (config["learning_rate"], config["lr_schedule"], config["max_steps"], config["eval_every"]) == \
        (2e-3, "linear", 48, 8)
    assert config["format"]["stop"] == [2]  # SmolLM2's <|im_end|>, not Qwen3's 151645


def test_eval_on_the_real_model_scores_the_sft_checkpoint_above_the_base(local_real_sft_run, local_real_tinker):
    """tinker_eval.py --run on the real-model SFT rehearsal, its first 8 rows, exact match (the default score()):
    the base answers in its own words (0 of 8), the checkpoint gives its trained answers; the paired difference
    is positive and the record names the real model."""
    assert local_real_sft_run.returncode == 0, local_real_sft_run.stderr[-3000:]
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "tinker_eval.py"), "--run", str(local_real_sft_run.log),
                          "--data", str(ROOT / "templates" / "sft_example.jsonl"), "--limit", "8", "--max-tokens", "32"],
                         capture_output=True, text=True, env=local_real_tinker.env, cwd=local_real_sft_run.log.parent,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["status"] == "ok" and report["n"] == 8
    assert report["base"]["mean"] == 0.0 and report["trained"]["mean"] >= 0.5, report
    assert report["difference"]["wins"] >= 4 and report["difference"]["losses"] == 0, report["difference"]
