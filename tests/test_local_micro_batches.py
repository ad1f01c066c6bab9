"""Micro-batching in the local backend (tinker_local_server.py shim group G): a batch cut into micro-batches
gives the unsplit batch's losses, logprobs, gradient step and samples.

One server of its own runs with TINKER_LOCAL_MICRO_BATCH_TOKENS=16, so a batch of four sequences (one padded
to 48 tokens, three to 32) runs one sequence per micro-batch, each padded to its own length and recomputing its
LM-head chunks (the path of a sequence longer than the budget), and sampling runs one row at a time; the session's server (default budget 512) runs the same batch unsplit.
"""
from __future__ import annotations

import importlib.util

import pytest

import tinker_local

BUDGET = 16
TEXTS = ["Short one.",
         "A longer sentence about rivers, bridges and the boats that pass below them, the locks that raise them "
         "and the keepers who open the gates at dawn, long before the first barges of the morning arrive.",
         "Micro-batches must not change a loss: each sequence's loss is its own, summed over the batch.",
         "Tiny."]


def server_module():
    spec = importlib.util.spec_from_file_location("tinker_local_server", tinker_local.SERVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def datums(tokenizer):
    from tinker import types
    out = []
    for text in TEXTS:
        ids = tokenizer.encode(text)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}))
    return out


def run_on(env: dict, model: str, data, prompt_ids) -> dict:
    """forward_backward, optim_step, forward, and a seeded sample with prompt logprobs, on one server."""
    import tinker
    from tinker import types
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        service = tinker.ServiceClient()
        try:
            training = service.create_lora_training_client(model, rank=8, seed=0).result()
            first = training.forward_backward(data, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            after = training.forward(data, "cross_entropy").result()
            sampler = service.create_sampling_client(base_model=model)
            sampler = sampler.result() if hasattr(sampler, "result") else sampler
            sampled = sampler.sample(types.ModelInput.from_ints(prompt_ids), num_samples=4,
                                     sampling_params=types.SamplingParams(max_tokens=8, seed=7, temperature=1.0),
                                     include_prompt_logprobs=True).result()
        finally:
            service.close("success").result()
    return {
        "loss": first.metrics["loss:sum"],
        "logprobs": [o["logprobs"].data for o in first.loss_fn_outputs],
        "loss_after_step": after.metrics["loss:sum"],
        "logprobs_after_step": [o["logprobs"].data for o in after.loss_fn_outputs],
        "tokens": [list(s.tokens) for s in sampled.sequences],
        "prompt_logprobs": sampled.prompt_logprobs,
    }


@pytest.mark.e2e
def test_a_micro_batched_batch_gives_the_unsplit_losses_logprobs_step_and_samples(local_tinker, local_backend_install,
                                                                                 tmp_path, monkeypatch):
    import transformers
    venv, home = local_backend_install
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(local_tinker.tokenizer_dir))
    data = datums(tokenizer)
    lengths = [d.model_input.length for d in data]
    assert 32 < max(lengths) <= 48 and sorted(lengths)[-2] <= 32  # padded to 48 and 32: one row per micro-batch
    prompt = tokenizer.encode(TEXTS[2])
    unsplit = run_on(local_tinker.client_env, local_tinker.model, data, prompt)
    monkeypatch.setenv("TINKER_LOCAL_MICRO_BATCH_TOKENS", str(BUDGET))
    server = tinker_local.start_server(venv=venv, home=home, run_dir=tmp_path)
    try:
        split = run_on(server.env, server.model, data, prompt)
        log = " ".join(server.log.read_text().split())  # the engine's log wraps lines at 80 columns
    finally:
        server.stop()
    assert split["loss"] == pytest.approx(unsplit["loss"], rel=1e-5)
    for got, want in zip(split["logprobs"], unsplit["logprobs"]):
        assert got == pytest.approx(want, abs=1e-4)
    assert split["loss_after_step"] == pytest.approx(unsplit["loss_after_step"], rel=1e-5)  # the same gradient
    assert split["loss_after_step"] < split["loss"]
    for got, want in zip(split["logprobs_after_step"], unsplit["logprobs_after_step"]):
        assert got == pytest.approx(want, abs=1e-4)
    assert split["tokens"] == unsplit["tokens"]
    assert split["prompt_logprobs"][0] is None and unsplit["prompt_logprobs"][0] is None
    assert split["prompt_logprobs"][1:] == pytest.approx(unsplit["prompt_logprobs"][1:], abs=1e-4)
    assert "micro-batches: 4 sequences padded to 48 tokens, 1 at a time" in log  # it did split
    assert "by length: 4 micro-batches of 144 padded tokens (not 192)" in log  # each row padded to its own
    assert "micro-batches: sampling 4 rows" in log
    assert "RESOURCE_EXHAUSTED" not in log


def test_micro_batch_rows_fit_the_budget_in_powers_of_two():
    server = server_module()
    assert server.micro_batch_rows(1024, 128, 512) == 1  # a sequence longer than the budget runs alone
    assert server.micro_batch_rows(384, 128, 1024) == 2
    assert server.micro_batch_rows(128, 128, 1024) == 8
    assert server.micro_batch_rows(96, 128, 1024) == 8  # 10 fit; 8 keeps the shapes few
    assert server.micro_batch_rows(32, 4, 512) == 4  # the whole batch fits: one pass, as before
    assert server.micro_batch_rows(1024, 128, 0) == 128  # 0 = off


def test_length_groups_pad_each_micro_batch_to_its_own_longest_row():
    server = server_module()
    lengths = [380, 100, 120, 300, 33, 32, 31, 30, 29, 10, 200]
    groups = server.length_groups(lengths, 512, server_round_up())
    assert sorted(i for rows, _ in groups for i in rows) == list(range(len(lengths)))  # every row once
    for rows, padded in groups:
        assert padded == server_round_up()(max(lengths[i] for i in rows))
        assert len(rows) & (len(rows) - 1) == 0  # a power of two: few shapes
        assert len(rows) == 1 or len(rows) * padded <= 512
    assert groups == [([0], 384), ([3], 384), ([10], 256), ([2, 1], 128), ([4], 48), ([5, 6, 7, 8], 32), ([9], 32)]
    assert sum(len(rows) * padded for rows, padded in groups) < len(lengths) * 384
    assert server.length_groups([40] * 5, 64, server_round_up()) == [([0], 48), ([1], 48), ([2], 48), ([3], 48),
                                                                     ([4], 48)]


def server_round_up():
    """skyrl's round_up_seq_len (two significant binary digits, at least 32), for tests without the server venv."""
    def round_up(n):
        if n <= 32:
            return 32
        top = 1 << (n.bit_length() - 1)
        half = top >> 1
        return top + half if n <= top + half and n > top else (top if n == top else top * 2)
    return round_up


def test_an_out_of_memory_answer_names_the_shape_the_limit_and_what_to_lower():
    server = server_module()
    message = server.out_of_memory_message(
        "RESOURCE_EXHAUSTED: Out of memory allocating 33618728856 bytes.\nmore", 128, 384, 1, 512,
        "forward/forward_backward")
    assert "128 sequence(s) padded to 384 tokens" in message
    assert "TINKER_LOCAL_MICRO_BATCH_TOKENS=512" in message and "smaller TINKER_LOCAL_MICRO_BATCH_TOKENS (e.g. 128)" in message
    assert "batch or group size" in message and "--resume" not in message
    assert message.endswith("XLA said: RESOURCE_EXHAUSTED: Out of memory allocating 33618728856 bytes.")
    assert server.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 5 bytes"))


def test_a_negative_budget_is_refused_by_name(monkeypatch):
    server = server_module()
    monkeypatch.setenv("TINKER_LOCAL_MICRO_BATCH_TOKENS", "-1")
    with pytest.raises(ValueError, match="TINKER_LOCAL_MICRO_BATCH_TOKENS=-1"):
        server.micro_batch_tokens()
    monkeypatch.setenv("TINKER_LOCAL_MICRO_BATCH_TOKENS", "")
    assert server.micro_batch_tokens() == server.DEFAULT_MICRO_BATCH_TOKENS
