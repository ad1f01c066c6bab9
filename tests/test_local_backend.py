"""The local Tinker-compatible backend (scripts/tinker_local.py) against the real tinker SDK.

Shapes are kept to a batch of 8 sequences of one length and one sampling shape: each new
shape costs a JAX compile on the CPU.
"""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tinker_local

SCRIPT = Path(tinker_local.__file__).resolve()
TEXTS = [f"The quick brown fox number {i} jumps over the lazy dog near the river bank."
         for i in range(8)]


# ---------------------------------------------------------------- helpers


def processes_mentioning(marker: str) -> list[str]:
    """Command lines of live (non-zombie) processes whose arguments contain `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline[:160]}")
    return found


def wait_no_processes(marker: str, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def tinker_local_cli(*args: str, timeout: float = 600, env: dict | None = None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="session")
def installed(local_tinker):
    """The server venv and cache folder, installed (the local_tinker fixture runs setup)."""
    return tinker_local.resolve_venv(), tinker_local.resolve_home()


def datums(tokenizer, texts=TEXTS, **extra_inputs):
    from tinker import types
    out = []
    for text in texts:
        ids = tokenizer.encode(text)
        inputs = {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}
        inputs.update({k: v(len(ids) - 1) for k, v in extra_inputs.items()})
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs))
    return out


# ---------------------------------------------------------------- the SDK path, end to end


@pytest.fixture(scope="module")
def sdk(local_tinker):
    """A ServiceClient, a rank-8 training client and the tokenizer, pointed at the local server."""
    import tinker
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(local_tinker.tokenizer_dir))
    with pytest.MonkeyPatch.context() as mp:  # the SDK reads the key and URL lazily
        local_tinker.apply(mp)
        service = tinker.ServiceClient()
        training = service.create_lora_training_client(local_tinker.model, rank=8, seed=0).result()
        yield service, training, tokenizer
        service.close("success").result()


@pytest.mark.e2e
def test_capabilities_list_the_served_name(local_tinker, sdk):
    service, _, _ = sdk
    with pytest.warns(FutureWarning):  # deprecated in 0.38, still the only model list
        caps = service.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [local_tinker.model]


@pytest.mark.e2e
def test_training_client_reports_the_served_model_and_rank(local_tinker, sdk):
    _, training, _ = sdk
    info = training.get_info()
    assert info.model_data.model_name == local_tinker.model
    assert training.model_id


@pytest.mark.e2e
def test_get_tokenizer_resolves_the_real_name_offline(local_tinker, tmp_path):
    # A subprocess, because huggingface_hub reads HF_HOME once at import.
    code = textwrap.dedent(f"""
        import tinker
        sc = tinker.ServiceClient()
        tc = sc.create_lora_training_client({local_tinker.model!r}, rank=8).result()
        tok = tc.get_tokenizer()
        print(len(tok), tok.eos_token, tok.apply_chat_template(
            [{{"role": "user", "content": "hi"}}], tokenize=False, add_generation_prompt=True)
            .count("<|im_start|>"))
        sc.close("success").result()
    """)
    done = subprocess.run([sys.executable, "-c", code], env=local_tinker.env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["151669", "<|im_end|>", "2"]


@pytest.mark.e2e
def test_each_supported_loss_runs_forward_backward(local_tinker, sdk):
    import tinker
    service, _, tokenizer = sdk
    training = service.create_lora_training_client(local_tinker.model, rank=8, seed=1).result()
    rl_inputs = {"logprobs": lambda n: [-2.0] * n, "advantages": lambda n: [0.5] * n}
    sums = {}
    for loss in ("cross_entropy", "importance_sampling", "ppo", "cispo"):
        data = datums(tokenizer) if loss == "cross_entropy" else datums(tokenizer, **rl_inputs)
        out = training.forward_backward(data, loss).result()
        assert len(out.loss_fn_outputs) == 8
        assert len(out.loss_fn_outputs[0]["logprobs"].data) == len(data[0].loss_fn_inputs["target_tokens"].data)
        sums[loss] = out.metrics["loss:sum"]
        assert math.isfinite(sums[loss])
    # Random init: mean NLL near ln(151936) = 11.93 per token.
    tokens = sum(len(d.loss_fn_inputs["target_tokens"].data) for d in datums(tokenizer))
    assert 10.5 < sums["cross_entropy"] / tokens < 13.0
    assert isinstance(training, tinker.TrainingClient)


@pytest.mark.e2e
def test_unsupported_loss_is_rejected_with_a_clear_error(local_tinker, sdk):
    service, _, tokenizer = sdk
    training = service.create_lora_training_client(local_tinker.model, rank=8).result()
    with pytest.raises(Exception, match="not supported"):
        training.forward_backward(datums(tokenizer, **{"logprobs": lambda n: [-2.0] * n,
                                                       "advantages": lambda n: [0.5] * n}),
                                  "gspo").result()


@pytest.mark.e2e
def test_optim_step_lowers_the_loss_on_a_fixed_batch(sdk):
    from tinker import types
    _, training, tokenizer = sdk
    data = datums(tokenizer)
    losses = []
    for _ in range(3):
        fb = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=5e-2))  # submitted before awaiting
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    after = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert after < losses[0] * 0.99, (losses, after)


@pytest.mark.e2e
def test_restored_state_reproduces_the_loss(local_tinker, sdk):
    service, training, tokenizer = sdk
    data = datums(tokenizer)
    saved = training.save_state("e2e-state").result()
    assert saved.path == f"tinker://{training.model_id}/weights/e2e-state"
    before = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    restored = service.create_training_client_from_state_with_optimizer(saved.path).result()
    after = restored.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert after == pytest.approx(before, rel=1e-5)
    weights_only = service.create_training_client_from_state(saved.path).result()
    assert weights_only.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(before, rel=1e-5)


@pytest.mark.e2e
def test_sampler_checkpoint_samples_with_stop_strings_and_a_seed(sdk):
    from tinker import types
    service, training, tokenizer = sdk
    saved = training.save_weights_for_sampler("e2e-sampler").result()
    assert saved.path == f"tinker://{training.model_id}/sampler_weights/e2e-sampler"
    sampler = service.create_sampling_client(model_path=saved.path).result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("Once upon a time"))

    def sample(seed, stop=None):
        params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=seed, stop=stop)
        return sampler.sample(prompt, num_samples=2, sampling_params=params).result().sequences

    first, again = sample(7), sample(7)
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert all(len(s.tokens) == 16 and len(s.logprobs) == 16 for s in first)
    # A stop string taken from what seed 7 produces must cut that same sample short.
    tokens = first[0].tokens
    stop = next(text for i in range(2, 12)
                if (text := tokenizer.decode([tokens[i]]).strip()) and text not in tokenizer.decode(tokens[:i]))
    cut = sample(7, stop=[stop])[0]
    assert len(cut.tokens) < 16
    assert cut.tokens == tokens[:len(cut.tokens)]
    assert cut.stop_reason == "stop"


@pytest.mark.e2e
def test_rest_client_lists_the_runs_checkpoints(local_tinker, sdk):
    import tinker
    _, training, _ = sdk
    training.save_state("e2e-listed").result()
    rest = tinker.RestClient()
    names = {c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert "e2e-listed" in names
    runs = rest.list_training_runs().result().training_runs
    assert training.model_id in {r.training_run_id for r in runs}
