"""A standard eval harness against a checkpoint through the OpenAI-compatible endpoint (issue 30):
Inspect AI's `openai-api` provider, pointed at the local backend's `/oai/api/v1`, evaluates a
`tinker://.../sampler_weights/...` checkpoint, and what it recorded is what the endpoint served.

Inspect AI 0.3.285 (+ openai 3.63.0) installs from PyPI without torch; it is installed once per
machine into a folder of its own (`inspect_dir()`, pip --target), never into the test venv. The
provider reads `<SERVICE>_BASE_URL` / `<SERVICE>_API_KEY` for `openai-api/<service>/<model>`: the
service is named `tinker-oai` so that the SDK's own `TINKER_BASE_URL` (the service root, without
`/oai/api/v1`) is not taken for the OpenAI base URL.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

INSPECT_VERSION = "0.3.285"
OPENAI_VERSION = "3.63.0"
INSPECT_DIR = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
               / "tinker-training-inference" / f"inspect-ai-{INSPECT_VERSION}")

TASK = '''
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate

QUESTIONS = {questions!r}


@task
def tiny_qa():
    return Task(dataset=[Sample(input=q, target=a) for q, a in QUESTIONS],
                solver=generate(), scorer=includes())
'''
QUESTIONS = [("What is 2+2? Answer with a number.", "4"), ("Name the capital of France.", "Paris")]
MAX_TOKENS = 8


def inspect_dir() -> Path:
    """A folder holding inspect-ai and openai (pip --target, once per machine, from PyPI; no torch)."""
    if not (INSPECT_DIR / "inspect_ai" / "__init__.py").exists():
        partial = INSPECT_DIR.with_name(INSPECT_DIR.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(partial),
                              f"inspect-ai=={INSPECT_VERSION}", f"openai=={OPENAI_VERSION}"],
                             capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            pytest.fail(f"cannot install inspect-ai=={INSPECT_VERSION} from PyPI into {partial}: {out.stderr[-800:]}")
        partial.rename(INSPECT_DIR)
    return INSPECT_DIR


def run_inspect(local_tinker, model: str, task_file: Path, log_dir: Path) -> dict:
    """`inspect eval` in a fresh process, as a user runs it; returns the JSON log."""
    env = {**local_tinker.env, "PYTHONPATH": str(inspect_dir()),
           "TINKER_OAI_BASE_URL": local_tinker.base_url + "/oai/api/v1",
           "TINKER_OAI_API_KEY": local_tinker.env["TINKER_API_KEY"]}
    out = subprocess.run(
        [sys.executable, "-m", "inspect_ai", "eval", task_file.name, "--model", f"openai-api/tinker-oai/{model}",
         "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--seed", "0",
         "--extra-body", '{"chat_template_kwargs": {"enable_thinking": false}}',
         "--log-dir", str(log_dir), "--log-format", "json", "--display", "plain"],
        capture_output=True, text=True, env=env, cwd=task_file.parent, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    [log] = list(log_dir.glob("*.json"))
    return json.loads(log.read_text())


@pytest.mark.e2e
def test_inspect_evaluates_a_checkpoint_through_the_openai_endpoint_and_records_what_it_served(
        local_tinker, monkeypatch, tmp_path):
    import tinker
    from transformers import AutoTokenizer

    local_tinker.apply(monkeypatch)
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(local_tinker.model, rank=8).result()
    checkpoint = training.save_weights_for_sampler("inspect-eval").result().path
    assert "/sampler_weights/" in checkpoint

    task_file = tmp_path / "tiny_qa.py"
    task_file.write_text(TASK.format(questions=QUESTIONS))
    log = run_inspect(local_tinker, checkpoint, task_file, tmp_path / "logs")

    assert log["status"] == "success" and log["eval"]["model"] == f"openai-api/tinker-oai/{checkpoint}"
    samples = sorted(log["samples"], key=lambda s: s["input"])
    assert len(samples) == len(QUESTIONS) and all("includes" in s["scores"] for s in samples)

    # what the endpoint served: the prompt rendered with the checkpoint's chat template (thinking off),
    # and the greedy completion the SDK samples from the same checkpoint
    tokenizer = AutoTokenizer.from_pretrained(str(local_tinker.tokenizer_dir))
    sampler = service.create_sampling_client(model_path=checkpoint).result()
    params = tinker.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=0,
                                   stop=[tokenizer.eos_token, "<|endoftext|>"])
    for sample in samples:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": sample["input"]}], tokenize=True,
                                               add_generation_prompt=True, enable_thinking=False)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        usage = sample["output"]["usage"]
        assert usage["input_tokens"] == len(prompt)
        [sequence] = sampler.sample(tinker.ModelInput.from_ints(prompt), 1, params).result().sequences
        assert usage["output_tokens"] == len(sequence.tokens)
        assert sample["output"]["choices"][0]["message"]["content"] == tokenizer.decode(sequence.tokens)

    # the eval's cost on Tinker: the logged tokens priced by tinker_pricing.py (prefill + sample rates)
    import tinker_pricing
    used = log["stats"]["model_usage"][f"openai-api/tinker-oai/{checkpoint}"]
    assert used["input_tokens"] == sum(s["output"]["usage"]["input_tokens"] for s in samples)
    cost = tinker_pricing.estimate_cost(local_tinker.model, prefill=used["input_tokens"], sample=used["output_tokens"])
    rates = cost["rates"]
    assert cost["usd"]["total"] == pytest.approx(
        (used["input_tokens"] * rates["prefill"] + used["output_tokens"] * rates["sample"]) / 1e6)
