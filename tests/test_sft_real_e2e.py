"""tinker_sft.py --rehearse on the local backend's real model (SmolLM2-135M-Instruct, `tinker_local.py run --real`):
the real-model preset and the checks that prove the user's task, end to end through the real SDK. One real-model
server for the session (fixture `local_real_tinker`)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "tinker_sft.py"
pytestmark = pytest.mark.e2e


def rehearse(local_real_tinker, tmp_path, *flags):
    log = tmp_path / "rehearsal"
    out = subprocess.run([sys.executable, str(SCRIPT), "--rehearse", "--log-path", str(log), *flags],
                         capture_output=True, text=True, env=local_real_tinker.env, cwd=tmp_path, timeout=1500)
    report = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else None
    return out, report, log


def test_the_real_model_rehearsal_learns_the_built_in_facts_and_records_the_stand_in(local_real_tinker, tmp_path):
    out, report, log = rehearse(local_real_tinker, tmp_path)
    assert out.returncode == 0 and report["status"] == "ok", out.stderr[-3000:]
    assert report["rehearsal"]["stand_in"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    probes = report["eval"]["probes"]
    assert [p["after"].strip() for p in probes] == [p["expected"] for p in probes]
    # a real model already knows the facts in its own words, never word for word
    assert all(p["before"].strip() != p["expected"] for p in probes) and "blue" in probes[0]["before"].lower()
    assert report["eval"]["nll_after"] <= report["eval"]["nll_before"] / 2
    config = json.loads((log / "config.json").read_text())
    assert config["backend"] == {"kind": "local", "stand_in": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                 "stand_in_kind": "real"}
    # the real-model preset, not the tiny model's
    assert (config["learning_rate"], config["lr_schedule"], config["max_steps"]) == (2e-3, "linear", 48)
    assert config["format"]["stop"] == [2]  # SmolLM2's <|im_end|>, not Qwen3's 151645


def test_an_own_data_rehearsal_on_the_real_model_reproduces_the_trained_answers(local_real_tinker, tmp_path):
    """The help-desk set (templates/sft_example.jsonl, 34 rows, one with reasoning_content that SmolLM2's template
    cannot render: trained on its answer alone, with a warning): 3/4 probes or more word for word, and the held-out
    NLL below its start at some evaluation."""
    data = ROOT / "templates" / "sft_example.jsonl"
    out, report, log = rehearse(local_real_tinker, tmp_path, "--data", str(data))
    assert out.returncode == 0 and report["status"] == "ok", out.stderr[-3000:]
    assert "carry reasoning_content, which the local real model's ChatML template cannot render" in out.stderr
    checks = {c["check"].split(" (")[0]: c["passed"] for c in report["rehearsal"]["checks"]}
    assert checks["at least 3 of 4 probes"] is True, report["rehearsal"]
    assert checks["the held-out NLL falls below its start at some evaluation"] is True, report["rehearsal"]
    probes = report["eval"]["probes"]
    assert sum(p["after"].strip() == p["expected"].strip() for p in probes) >= 3, probes
    evals = [json.loads(line) for line in (log / "eval.jsonl").read_text().splitlines()]
    before = next(r["nll"] for r in evals if r["when"] == "before")
    assert min(r["nll"] for r in evals if r["when"] != "before") < before
