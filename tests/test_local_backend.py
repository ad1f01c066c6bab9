"""The local Tinker-compatible backend (scripts/tinker_local.py) against the real tinker SDK.

Shapes are kept to a batch of 8 sequences of one length and one sampling shape: each new
shape costs a JAX compile on the CPU.
"""
from __future__ import annotations

import contextlib
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
from fixtures_local import EXIT_WITHOUT_TEARDOWN

SCRIPT = Path(tinker_local.__file__).resolve()
SERVER = tinker_local.SERVER
TEXTS = [f"The quick brown fox number {i} jumps over the lazy dog near the river bank."
         for i in range(8)]


# ---------------------------------------------------------------- helpers


def processes_mentioning(marker: str) -> list[str]:
    """Command lines of live (non-zombie) processes whose arguments contain `marker`. An engine forked by the test
    session's engine zygote has the zygote's command line: tests that count processes take `real_engines`."""
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
def installed(local_backend_install):
    """The server venv and cache folder, installed; no server started."""
    return local_backend_install


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
    # Tinker's window for the served name (a shim adds it), so scripts' context checks rehearse.
    assert caps.supported_models[0].max_context_length == tinker_local.tinker_context_window(local_tinker.model)
    assert tinker_local.tinker_context_window("Qwen/Qwen3-8B") == 32768
    assert tinker_local.tinker_context_window("no-such/model") == tinker_local.DEFAULT_CONTEXT


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
    """) + EXIT_WITHOUT_TEARDOWN
    done = subprocess.run([sys.executable, "-c", code], env=local_tinker.env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["151669", "<|im_end|>", "2"]


@pytest.mark.e2e
def test_each_supported_loss_runs_forward_backward(local_tinker, sdk, monkeypatch):
    import tinker
    _, _, tokenizer = sdk
    local_tinker.apply(monkeypatch)
    service = tinker.ServiceClient()  # closed when the test ends, so its adapter slots come back
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
    # Random init with the final norm weight at 20: logits are peaked at random tokens, so the
    # NLL per token is far above ln(151936) = 11.93 (measured 19.18 on TEXTS; was 11.9 at weight 1).
    tokens = sum(len(d.loss_fn_inputs["target_tokens"].data) for d in datums(tokenizer))
    assert 15.0 < sums["cross_entropy"] / tokens < 24.0
    assert isinstance(training, tinker.TrainingClient)


@pytest.mark.e2e
def test_unsupported_loss_is_rejected_with_a_clear_error(local_tinker, sdk, monkeypatch):
    import tinker
    _, _, tokenizer = sdk
    local_tinker.apply(monkeypatch)
    service = tinker.ServiceClient()  # closed when the test ends, so its adapter slots come back
    rl_inputs = {"logprobs": lambda n: [-2.0] * n, "advantages": lambda n: [0.5] * n}
    training = service.create_lora_training_client(local_tinker.model, rank=8).result()
    with pytest.raises(tinker.UnprocessableEntityError, match="stable_reinforce"):
        training.forward_backward(datums(tokenizer, **rl_inputs), "stable_reinforce").result()
    # gspo is served, but only with the input that defines its sequence ratio
    training = service.create_lora_training_client(local_tinker.model, rank=8).result()
    with pytest.raises(tinker.BadRequestError, match="sequence_ratio_mask"):
        training.forward_backward(datums(tokenizer, **rl_inputs), "gspo").result()


def gspo_reference(p, q, mask, advantages, lo=0.8, hi=1.2) -> float:
    """Tinker's GSPO-token loss:sum (tinker docs, Loss Functions > GSPO), in numpy: per datum,
    s = exp(mean over the masked tokens of (p - q)); every token's ratio has s's value; the loss is
    -sum_t min(s A_t, clip(s, lo, hi) A_t)."""
    import numpy as np
    total = 0.0
    for p_i, q_i, m_i, a_i in zip(p, q, mask, advantages):
        p_i, q_i, m_i, a_i = (np.asarray(x, dtype=np.float64) for x in (p_i, q_i, m_i, a_i))
        s = np.exp((p_i - q_i)[m_i != 0].mean())
        total += -np.minimum(s * a_i, np.clip(s, lo, hi) * a_i).sum()
    return float(total)


def gspo_batch(tokenizer, learner_logprobs, log_ratios, advantage):
    """Datums whose second half is "sampled" (mask 1, advantage A) with sampler logprobs q set so
    that datum i's sequence log-ratio is log_ratios[i] (token noise around it, mean zero)."""
    import numpy as np
    from tinker import types
    rng = np.random.default_rng(0)
    out, qs, masks, advs = [], [], [], []
    for d, p, r in zip(datums(tokenizer), learner_logprobs, log_ratios):
        n = len(p)
        mask = np.array([0.0] * (n // 2) + [1.0] * (n - n // 2), dtype=np.float32)
        noise = rng.normal(0, 0.05, n)
        noise -= noise[mask != 0].mean()
        q = (np.asarray(p) - r + noise).astype(np.float32)
        adv = (mask * advantage).astype(np.float32)
        out.append(types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": types.TensorData.from_numpy(q),
            "advantages": types.TensorData.from_numpy(adv),
            "sequence_ratio_mask": types.TensorData.from_numpy(mask)}))
        qs.append(q), masks.append(mask), advs.append(adv)
    return out, qs, masks, advs


@pytest.mark.e2e
def test_gspo_loss_is_tinkers_gspo_token_loss_and_clipping_stops_its_gradient(local_tinker, sdk, monkeypatch):
    """loss:sum equals the numpy reference from the same logprobs, with default and configured clip
    thresholds; a batch whose every sequence ratio sits above the clip (A > 0) gets no gradient
    (an optim_step leaves the weights as they were); an unclipped batch with A > 0 raises the
    sampled tokens' logprobs."""
    import numpy as np
    _, _, tokenizer = sdk
    local_tinker.apply(monkeypatch)
    import tinker
    service = tinker.ServiceClient()  # closed when the test ends, so its adapter slots come back
    training = service.create_lora_training_client(local_tinker.model, rank=8, seed=3).result()

    def logprobs(data):
        return [np.array(o["logprobs"].data) for o in training.forward(data, "cross_entropy").result().loss_fn_outputs]

    p0 = logprobs(datums(tokenizer))
    log_ratios = [-0.6, -0.15, -0.02, 0.0, 0.05, 0.12, 0.3, 0.9]  # ratios 0.55 .. 2.46, both sides of the clip
    for advantage in (1.0, -1.0):
        data, q, mask, adv = gspo_batch(tokenizer, p0, log_ratios, advantage)
        for config, (lo, hi) in ((None, (0.8, 1.2)), ({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, (0.9, 1.1))):
            out = training.forward(data, "gspo", loss_fn_config=config).result()
            p = [np.array(o["logprobs"].data) for o in out.loss_fn_outputs]
            assert max(np.abs(a - b).max() for a, b in zip(p, p0)) < 1e-4  # the learner's logprobs
            expected = gspo_reference(p, q, mask, adv, lo, hi)
            assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-3), (advantage, config)

    # every sequence ratio above hi with A > 0: min() picks the clipped, constant term -> zero gradient
    clipped, *_ = gspo_batch(tokenizer, p0, [0.5] * 8, 1.0)
    from tinker import types
    fb = training.forward_backward(clipped, "gspo")
    step = training.optim_step(types.AdamParams(learning_rate=5e-2))
    fb.result(), step.result()
    after_clipped = logprobs(datums(tokenizer))
    assert max(np.abs(a - b).max() for a, b in zip(after_clipped, p0)) < 1e-6

    # inside the clip range with A > 0: the step raises the sampled (masked) tokens' logprobs
    inside, _, mask, _ = gspo_batch(tokenizer, p0, [0.0] * 8, 1.0)
    fb = training.forward_backward(inside, "gspo")
    step = training.optim_step(types.AdamParams(learning_rate=5e-2))
    fb.result(), step.result()
    after = logprobs(datums(tokenizer))
    assert sum((a * m).sum() for a, m in zip(after, mask)) > sum((b * m).sum() for b, m in zip(p0, mask)) + 1.0


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
def test_a_restored_runs_checkpoints_are_listed_and_deleted_by_its_sdk_id(local_tinker, sdk):
    """SDK 0.38 names a restored client "{session}:train:{n}"; skyrl's routes refused the colon."""
    import tinker
    service, training, _ = sdk
    restored = service.create_training_client_from_state(training.save_state("e2e-restore-src").result().path).result()
    assert ":train:" in restored.model_id
    path = restored.save_state("e2e-restored").result().path
    rest = tinker.RestClient(base_url=local_tinker.base_url, api_key=local_tinker.env["TINKER_API_KEY"])
    listed = rest.list_checkpoints(restored.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [path]
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(restored.model_id).result().checkpoints == []


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
def test_compute_logprobs_follows_tinkers_contract_and_agrees_with_the_learner(sdk):
    """One entry per prompt token, None first (a shim adds the None skyrl drops), and the
    sampler's numbers are the learner's for the same weights."""
    from tinker import types
    _, training, tokenizer = sdk
    data = datums(tokenizer)[:1]
    ids = tokenizer.encode(TEXTS[0])
    sampler = training.save_weights_and_get_sampling_client().result()  # SDK 0.38: a future; `name` is deprecated
    got = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert len(got) == len(ids) and got[0] is None
    learner = training.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    assert got[1:] == pytest.approx(learner, abs=1e-4)


@pytest.mark.e2e
def test_rest_client_lists_the_runs_checkpoints(local_tinker, sdk):
    import tinker
    _, training, _ = sdk
    training.save_state("e2e-listed").result()
    rest = tinker.RestClient(base_url=local_tinker.base_url, api_key=local_tinker.env["TINKER_API_KEY"])
    names = {c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert "e2e-listed" in names
    runs = rest.list_training_runs().result().training_runs
    assert training.model_id in {r.training_run_id for r in runs}


@pytest.mark.e2e
def test_forward_backward_custom_reports_the_client_side_loss(sdk):
    """The SDK's custom loss reads the server's metrics["loss:sum"] (a shim adds it)."""
    import torch
    _, training, tokenizer = sdk
    data = datums(tokenizer)
    reference = training.forward(data, "cross_entropy").result().metrics["loss:sum"]

    def weighted_nll(batch, logprobs):
        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum()
                   for d, lp in zip(batch, logprobs))
        return loss, {"custom_nll:sum": float(loss.detach())}

    out = training.forward_backward_custom(data, weighted_nll).result()
    assert out.metrics["loss:sum"] == pytest.approx(reference, rel=1e-4)
    assert out.metrics["custom_nll:sum"] == pytest.approx(reference, rel=1e-4)
    assert "surrogate_loss:sum" in out.metrics


@pytest.mark.e2e
def test_a_client_a_test_leaves_open_is_closed_and_its_adapter_unloaded(local_tinker, monkeypatch):
    """What the autouse fixture does after every test that uses local_tinker."""
    import sqlite3

    import fixtures_local
    import tinker
    local_tinker.apply(monkeypatch)
    before = {id(c) for c in fixtures_local._service_clients}
    left_open = tinker.ServiceClient()
    model_id = left_open.create_lora_training_client(local_tinker.model, rank=8).result().model_id
    assert any(c is left_open for c in fixtures_local._service_clients)
    assert fixtures_local.close_service_clients_since(before) == 1
    assert not any(c is left_open for c in fixtures_local._service_clients)
    if local_tinker.server is not None:  # the fixture's own server: its database is readable
        db = local_tinker.server.run_dir / "tinker.db"
        deadline, status = time.monotonic() + 30, None
        while status != "unloaded" and time.monotonic() < deadline:
            with contextlib.closing(sqlite3.connect(db)) as conn:
                status = conn.execute("select status from models where model_id = ?", (model_id,)).fetchone()[0]
            time.sleep(0.2)
        assert status == "unloaded"


def _train(training, data, steps):
    from tinker import types
    losses = []
    for _ in range(steps):
        fb = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=5e-2))
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    return losses


@pytest.mark.e2e
def test_a_new_training_client_does_not_inherit_gradients_left_in_its_slot(local_tinker, monkeypatch):
    """skyrl clears a slot's gradient sum only in optim_step; a shim clears it on create. Without
    it the second run below differs from the first from step 2 on (453.39 vs 456.57)."""
    import tinker
    import transformers
    local_tinker.apply(monkeypatch)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(local_tinker.tokenizer_dir))
    data = datums(tokenizer)

    def fresh_run():
        service = tinker.ServiceClient()
        losses = _train(service.create_lora_training_client(local_tinker.model, rank=8, seed=0).result(),
                        data, 3)
        service.close("success").result()
        return losses

    first = fresh_run()
    leaver = tinker.ServiceClient()  # gets the slot just freed, leaves gradients in it, goes away
    other = datums(tokenizer, texts=[t.replace("quick brown fox", "slow grey wolf") for t in TEXTS])
    leaver.create_lora_training_client(local_tinker.model, rank=8, seed=7).result() \
        .forward_backward(other, "cross_entropy").result()
    leaver.close("success").result()
    assert fresh_run() == pytest.approx(first, abs=1e-4)


def sampling_setup(local_tinker, monkeypatch, max_tokens=16, seed=3):
    """The SDK pointed at the local server; training datums, a prompt and seeded sampling params."""
    import transformers
    from tinker import types
    local_tinker.apply(monkeypatch)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(local_tinker.tokenizer_dir))
    return (datums(tokenizer), types.ModelInput.from_ints(tokenizer.encode("Once upon a time")),
            types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed))


@pytest.mark.e2e
def test_a_sampler_checkpoint_is_served_apart_from_the_client_that_saved_it(local_tinker, monkeypatch):
    """Tinker samples a saved checkpoint whatever its training client does next, and after that
    client is gone; skyrl loads it into the training slot (a shim gives it its own slot)."""
    import tinker
    data, prompt, params = sampling_setup(local_tinker, monkeypatch)
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(local_tinker.model, rank=8, seed=0).result()
    _train(training, data, 2)
    path = training.save_weights_for_sampler("served-apart").result().path
    sampler = service.create_sampling_client(model_path=path).result()
    first = sampler.sample(prompt, num_samples=2, sampling_params=params).result().sequences
    _train(training, data, 2)
    trained = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    again = sampler.sample(prompt, num_samples=2, sampling_params=params).result().sequences
    assert [s.tokens for s in again] == [s.tokens for s in first]  # the checkpoint, not step 4
    assert sum((s.logprobs for s in again), []) == pytest.approx(sum((s.logprobs for s in first), []), abs=1e-5)
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] == trained  # untouched
    service.close("success").result()

    later = tinker.ServiceClient()  # the run that saved it is unloaded now
    late = later.create_sampling_client(model_path=path).result().sample(
        prompt, num_samples=2, sampling_params=params).result().sequences
    assert [s.tokens for s in late] == [s.tokens for s in first]
    with pytest.raises(Exception, match="not found"):
        later.create_sampling_client(model_path=path.replace("served-apart", "never-saved")).result().sample(
            prompt, num_samples=1, sampling_params=params).result()
    later.close("success").result()


@pytest.mark.e2e
def test_newer_checkpoints_take_the_oldest_sampler_slot_and_each_samples_as_its_own(local_tinker, monkeypatch):
    """Three sampler checkpoints stay loaded; a newer one takes over the least recently sampled slot
    (shim C: its weights are overwritten by the load; the model is not deleted and re-created, which
    cost 0.6-0.9 s per RL iteration). Five checkpoints sampled in turn, then each again: every
    checkpoint gives its own tokens both times."""
    import tinker
    data, prompt, params = sampling_setup(local_tinker, monkeypatch)
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(local_tinker.model, rank=8, seed=0).result()
    samplers, first = [], []
    for i in range(5):
        _train(training, data, 1)
        samplers.append(service.create_sampling_client(
            model_path=training.save_weights_for_sampler(f"recycle-{i}").result().path).result())
        first.append([s.tokens for s in samplers[-1].sample(prompt, 2, params).result().sequences])
    again = [[s.tokens for s in sampler.sample(prompt, 2, params).result().sequences] for sampler in samplers]
    service.close("success").result()
    assert again == first
    assert len({str(tokens) for tokens in first}) > 1  # the checkpoints differ, so a stale slot would show


@pytest.mark.e2e
def test_sampling_runs_beside_training_and_changes_neither_result(local_tinker, monkeypatch):
    """Tinker samples on other workers while it trains; the local engine samples on a thread of its own
    (shim D, so tinker_rl.py --max-staleness overlaps here too). Training steps sent while a sample
    generates start beside it (the server log says so), and both results are the ones each gets alone."""
    import tinker
    data, prompt, params = sampling_setup(local_tinker, monkeypatch, max_tokens=64, seed=5)
    service = tinker.ServiceClient()
    first = service.create_lora_training_client(local_tinker.model, rank=8, seed=0).result()
    alone_losses = _train(first, data, 2)
    sampler = service.create_sampling_client(
        model_path=first.save_weights_for_sampler("beside").result().path).result()
    alone = sampler.sample(prompt, num_samples=8, sampling_params=params).result().sequences
    log = local_tinker.server.log if local_tinker.server is not None else None
    log_start = log.stat().st_size if log else 0

    second = service.create_lora_training_client(local_tinker.model, rank=8, seed=0).result()
    pending = sampler.sample(prompt, num_samples=8, sampling_params=params)
    time.sleep(0.02)  # the sample reaches the server first; steps in the same poll or later run beside it
    beside_losses = _train(second, data, 2)
    beside = pending.result().sequences

    assert beside_losses == pytest.approx(alone_losses, abs=1e-4)
    assert [s.tokens for s in beside] == [s.tokens for s in alone]
    assert sum((s.logprobs for s in beside), []) == pytest.approx(sum((s.logprobs for s in alone), []), abs=1e-5)

    def overlapped() -> bool:
        with open(log, "rb") as f:
            f.seek(log_start)
            return b"beside sampling:" in f.read()

    # A warm server may finish a sample before the steps arrive (a full-suite run did once): then a few
    # more sample + forward pairs; the claim is that ops do start while a sample generates.
    for _ in range(5):
        if not log or overlapped():
            break
        pending = sampler.sample(prompt, num_samples=8, sampling_params=params)
        time.sleep(0.02)
        second.forward(data, "cross_entropy").result()
        pending.result()
    service.close("success").result()
    if log:  # the fixture's own server (not a reused TINKER_TEST_BASE_URL): its log is ours to read
        assert overlapped()


# ---------------------------------------------------------------- the OpenAI-compatible endpoint


def oai_post(local_tinker, path: str, body: dict, key: str | None = "tml-local"):
    import httpx
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(local_tinker.base_url + "/oai/api/v1" + path, json=body, headers=headers, timeout=600)
    return response.status_code, response.json()


@pytest.mark.e2e
def test_openai_completions_return_text_usage_and_the_sampled_tokens_logprobs(local_tinker, sdk):
    """The endpoint samples with the SDK's sampler: same seed, same tokens and logprobs."""
    from tinker import types
    service, _, tokenizer = sdk
    code, body = oai_post(local_tinker, "/completions", {
        "model": local_tinker.model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0,
        "seed": 11, "n": 2, "logprobs": 0})
    assert code == 200, body
    assert body["object"] == "text_completion" and len(body["choices"]) == 2
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(prompt)
    base = service.create_sampling_client(base_model=local_tinker.model).result()
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11, stop=["<|im_end|>", "<|endoftext|>"])
    sequences = base.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences
    for choice, seq in zip(body["choices"], sequences):
        n = len(choice["logprobs"]["token_logprobs"])
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
        assert choice["text"] == tokenizer.decode(seq.tokens[:n], skip_special_tokens=False)
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(seq.logprobs[:n], abs=1e-5)
        assert choice["finish_reason"] == ("length" if n == 8 else "stop")
    assert body["usage"]["completion_tokens"] == sum(len(seq.tokens) for seq in sequences)


@pytest.mark.e2e
def test_openai_chat_completions_render_the_template_and_honour_max_tokens(local_tinker):
    code, body = oai_post(local_tinker, "/chat/completions", {
        "model": local_tinker.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "temperature": 0.0, "logprobs": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert code == 200, body
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 4
    assert choice["finish_reason"] in ("stop", "length")
    assert len(choice["logprobs"]["content"]) == body["usage"]["completion_tokens"] - (choice["finish_reason"] == "stop")
    # the generation prompt of Qwen3's template with thinking off ends "<think>\n\n</think>\n\n"
    assert body["usage"]["prompt_tokens"] == 13


@pytest.mark.e2e
@pytest.mark.parametrize("path,body,key,status,words", [
    ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, None, 401, "API key"),
    ("/completions", {"model": "Qwen/Qwen3-32B", "prompt": "Hi"}, "tml-local", 404, "not served here"),
    ("/completions", {"model": "tinker://x/weights/final", "prompt": "Hi"}, "tml-local", 404, "sampler_weights"),
    ("/completions", {"prompt": "Hi", "logprobs": 2}, "tml-local", 400, "top logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}, "tml-local", 400, "stream"),
])
def test_openai_endpoint_refuses_what_it_cannot_serve_with_an_openai_error(local_tinker, path, body, key, status, words):
    code, reply = oai_post(local_tinker, path, {"model": local_tinker.model, **body}, key=key)
    assert code == status
    assert words in reply["error"]["message"]


# ---------------------------------------------------------------- the shims: present and needed


@pytest.mark.e2e
def test_each_shim_still_bridges_a_gap_in_the_pinned_skyrl(installed):
    """If a skyrl release closes a gap, this fails: retire that shim rather than carry it."""
    venv, home = installed
    done = subprocess.run([str(tinker_local.venv_python(venv)), str(SERVER), "gaps"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    gaps = json.loads(done.stdout.strip().splitlines()[-1])
    assert gaps == {
        "typing_typeddict_py311": True, "engine_started_by_uv_run": True,
        "asample_without_sample_sequence_ids": True, "load_weights_requires_model_id": True,
        "no_loss_sum_metric": True, "sampler_path_without_kind": True,
        "silent_sessions_never_expire": True, "no_session_finish_route": True,
        "sampling_a_checkpoint_needs_its_training_model": True,
        "stale_gradients_survive_slot_reuse": True, "prompt_logprobs_without_leading_none": True,
        "restored_run_ids_rejected_by_checkpoint_routes": True, "retried_save_conflicts": True,
        "capabilities_without_context_window": True, "no_openai_endpoint": True,
        "jax_backend_without_gspo": True, "sampling_waits_for_training": True,
        "checkpoints_die_with_their_server": True,
        "training_steps_update_every_adapter_slot": True, "loss_chunks_pad_small_batches": True,
        "engine_loop_sleeps_between_polls": True, "future_poller_sleeps_between_queries": True,
        "sqlite_fsync_every_commit": True, "api_process_imports_torch": True,
        "sampler_compiles_per_batch_size_and_length": True, "sampler_argmax_is_a_pair_reduction": True,
        "model_passes_hold_the_whole_batchs_logits": True, "queue_read_without_snapshot": True,
    }


@pytest.mark.e2e
def test_shims_apply_to_the_installed_versions(installed):
    """`check` applies every shim and fails loudly on another skyrl or tinker version. It also replays the race
    behind `queue_read_without_snapshot`: a forward_backward and its optim_step commit between the engine loop's
    first query and its last; the loop must not be handed the optim_step without the forward_backward."""
    venv, _ = installed
    done = subprocess.run([str(tinker_local.venv_python(venv)), str(SERVER), "check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shims ok: skyrl 0.4.0, tinker 0.38.0" in done.stdout


def test_the_sdk_still_relies_on_what_the_shims_add():
    """The client side of each gap, read from the installed tinker SDK."""
    import inspect

    import tinker
    from tinker.lib.public_interfaces import sampling_client, service_client, training_client
    assert tinker.__version__ == "0.38.0"
    assert "asample promises always carry sample_sequence_ids" in inspect.getsource(sampling_client)
    assert 'metrics.pop("loss:sum")' in inspect.getsource(training_client)
    assert {"session_id", "model_seq_id"} <= set(tinker.types.LoadWeightsRequest.model_fields)
    assert 'model_id = f"{session_id}:train:{model_seq_id}"' in inspect.getsource(service_client)
    assert "/api/v1/sessions/{session_id}/finish" in inspect.getsource(service_client)


# ---------------------------------------------------------------- setup


@pytest.mark.e2e
def test_setup_when_done_skips_every_step(installed):
    venv, home = installed
    started = time.monotonic()
    done = tinker_local_cli("setup", "--venv", str(venv), "--home", str(home), timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert {k: v for k, v in result["steps"].items() if k != "seed HF cache"} == {
        "install torch": "skipped", "install pinned packages": "skipped",
        "install skyrl": "skipped", "check shims": "skipped", "build tiny model": "skipped"}
    assert time.monotonic() - started < 60


@pytest.mark.e2e
def test_tiny_model_build_is_byte_identical(installed, tmp_path):
    import hashlib
    venv, home = installed
    installed_model = tinker_local.tiny_model_dir(home)
    spec = tinker_local.tiny_model_spec()
    assert json.loads((installed_model / "tinker-local-model.json").read_text())["config"] == spec["key"]
    done = subprocess.run([str(tinker_local.venv_python(venv)), str(SERVER), "build-model",
                           str(tmp_path / "tiny"), json.dumps(spec)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert digest(tmp_path / "tiny" / name) == digest(installed_model / name), name
    meta = json.loads((tmp_path / "tiny" / "tinker-local-model.json").read_text())
    assert 9_700_000 < meta["params"] < 9_900_000


def test_setup_with_a_broken_package_index_names_the_step_and_log_and_resumes(tmp_path):
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "",
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "",
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "1", "PIP_NO_CACHE_DIR": "1"}
    args = ("setup", "--venv", str(tmp_path / "venv"), "--home", str(tmp_path / "home"))
    first = tinker_local_cli(*args, env=env, timeout=300)
    assert first.returncode == 1
    error = first.stderr.strip().splitlines()[-1]
    log = tmp_path / "home" / "logs" / "setup-torch.log"
    assert f"setup step 'install torch' failed (exit 1); log: {log}" in error
    assert "torch" in log.read_text()
    assert first.stdout == ""
    second = tinker_local_cli(*args, env=env, timeout=300)
    assert second.returncode == 1
    assert "create venv" not in second.stderr  # the finished step is not redone
    assert "setup step 'install torch' failed" in second.stderr


# ---------------------------------------------------------------- serve / run: faults and processes


def test_run_without_a_command_is_a_usage_error():
    done = tinker_local_cli("run", "--")
    assert done.returncode == 2
    assert "run needs a command" in done.stderr


def test_run_with_a_missing_command_fails_before_starting_a_server(tmp_path):
    done = tinker_local_cli("run", "--run-dir", str(tmp_path), "--", "no-such-command-xyz", timeout=30)
    assert done.returncode == 2
    assert "command not found: 'no-such-command-xyz'" in done.stderr
    assert not (tmp_path / "server.log").exists()


@pytest.mark.e2e
def test_serve_on_a_taken_port_fails_in_one_line_naming_the_log(installed, real_engines, tmp_path):
    venv, home = installed
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = tinker_local_cli("serve", "--venv", str(venv), "--home", str(home),
                                "--port", str(port), "--run-dir", str(tmp_path), timeout=60)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("tinker_local: local rehearsal: a tiny random model stands in for Qwen/Qwen3-8B")
    assert len(lines) == 2
    assert f"port {port} on 127.0.0.1 is taken" in lines[1]
    assert f"log: {tmp_path / 'server.log'}" in lines[1]
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.e2e
def test_server_crash_at_start_is_reported_with_the_log_and_leaves_no_process(installed, real_engines, tmp_path):
    venv, home = installed
    empty = tmp_path / "no-weights"
    empty.mkdir()
    run_dir = tmp_path / "run"
    done = tinker_local_cli("run", "--venv", str(venv), "--home", str(home), "--weights", str(empty),
                            "--run-dir", str(run_dir), "--", sys.executable, "-c", "print('never')")
    assert done.returncode == 1
    assert "never" not in done.stdout
    error = done.stderr.strip().splitlines()[-1]
    assert "the server exited during start" in error and f"log: {run_dir / 'server.log'}" in error
    assert (run_dir / "server.log").stat().st_size > 0
    assert wait_no_processes(str(run_dir)) == []


@pytest.mark.e2e
def test_engine_not_ready_in_time_is_reported_with_the_log_and_leaves_no_process(installed, real_engines, tmp_path):
    venv, home = installed
    done = tinker_local_cli("run", "--venv", str(venv), "--home", str(home), "--ready-timeout", "2",
                            "--run-dir", str(tmp_path), "--", sys.executable, "-c", "print('never')")
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()[-1]
    assert f"the engine was not ready within 2 s; log: {tmp_path / 'server.log'}" in error
    assert wait_no_processes(str(tmp_path)) == []


@pytest.mark.e2e
def test_run_interrupts_the_command_when_the_server_dies_under_it(installed, real_engines, tmp_path):
    """The SDK retries a dead server forever; `run` notices the server is gone, stops the command and
    says so with the log, instead of leaving both hanging."""
    venv, home = installed
    run_dir = tmp_path / "run"
    kill_server = ("import json, os, signal, sys, time; "
                   f"os.kill(json.load(open({str(run_dir / 'server.json')!r}))['pid'], signal.SIGKILL); "
                   "time.sleep(600)")
    started = time.monotonic()
    done = tinker_local_cli("run", "--venv", str(venv), "--home", str(home), "--run-dir", str(run_dir),
                            "--", sys.executable, "-c", kill_server, timeout=300)
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()[-1]
    assert "the server stopped by itself" in error and f"log: {run_dir / 'server.log'}" in error
    assert time.monotonic() - started < 200  # not the command's 600 s sleep
    assert wait_no_processes(str(run_dir)) == []


CHILD = """
import os, sys, urllib.request
url = os.environ["TINKER_BASE_URL"]
urllib.request.urlopen(url + "/api/v1/healthz", timeout=10).read()
print(url, os.environ["TINKER_API_KEY"], os.environ["HF_HUB_OFFLINE"])
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.e2e
def test_two_runs_at_once_use_separate_ports_and_folders_and_return_the_commands_code(installed, real_engines, tmp_path):
    venv, home = installed
    runs = {}
    for name, code in (("a", 0), ("b", 7)):
        runs[name] = subprocess.Popen(
            [sys.executable, str(SCRIPT), "run", "--venv", str(venv), "--home", str(home),
             "--run-dir", str(tmp_path / name), "--", sys.executable, "-c", CHILD, str(code)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = {name: proc.communicate(timeout=900) for name, proc in runs.items()}
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    assert runs["a"].returncode == 0, out["a"][1]
    assert runs["b"].returncode == 7, out["b"][1]
    url_a, url_b = out["a"][0].split()[0], out["b"][0].split()[0]
    assert url_a != url_b and url_a.startswith("http://127.0.0.1:")
    assert out["a"][0].split()[1:] == ["tml-local", "1"]
    for name in "ab":
        assert "local rehearsal: a tiny random model stands in for Qwen/Qwen3-8B" in out[name][1]
        assert (tmp_path / name / "server.log").exists() and (tmp_path / name / "tinker.db").exists()
        assert wait_no_processes(str(tmp_path / name)) == []


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_serve_leaves_no_process_when_stopped_or_killed(installed, real_engines, tmp_path, sig):
    venv, home = installed
    serve = subprocess.Popen([sys.executable, str(SCRIPT), "serve", "--json", "--venv", str(venv),
                              "--home", str(home), "--run-dir", str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = serve.stdout.readline()
        assert line, serve.stderr.read()
        info = json.loads(line)
        assert info["env"]["TINKER_BASE_URL"] == info["base_url"]
        assert len(processes_mentioning(str(tmp_path))) == 3  # serve, the API process, its engine
        serve.send_signal(sig)
        serve.wait(timeout=60)
    finally:
        if serve.poll() is None:  # a failed assertion must not leave a server behind
            serve.terminate()
            serve.wait(timeout=60)
    if sig == signal.SIGTERM:
        assert serve.returncode == 130
    assert wait_no_processes(str(tmp_path), timeout=30) == []


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def wait_gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] \
            if Path(f"/proc/{pid}/stat").exists() else "Z"
        if state == "Z":
            return True
        time.sleep(0.1)
    return not Path(f"/proc/{pid}").exists()


LEND = textwrap.dedent("""
    import importlib.util, os, sys
    spec = importlib.util.spec_from_file_location("server", sys.argv[1])
    server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server)
    folder, held, stale, missed = sys.argv[2], object(), object(), []
    files = server.tokenizer_files(folder)
    server.lend_held_tokenizers({server.tokenizer_key((folder,), {}): (files, held),
                                 server.tokenizer_key((folder,), {"padding_side": "right"}): (files, stale)},
                                missed.append)
    from transformers import AutoTokenizer
    first, second = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    left = AutoTokenizer.from_pretrained(folder, padding_side="left")
    config = os.path.join(folder, "tokenizer_config.json")
    os.utime(config, ns=(os.stat(config).st_atime_ns, os.stat(config).st_mtime_ns + 10**9))  # edited since
    right = AutoTokenizer.from_pretrained(folder, padding_side="right")
    print(first is held, second is held, second.encode("hi") == [6023], left.padding_side, len(missed),
          right is stale, right.padding_side)
""")


def test_a_forked_engine_gets_its_zygotes_tokenizer_once_and_never_stale(tmp_path, offline_tokenizer):
    """The engine zygote's child (and the scripts' zygote's): the first load of a held tokenizer is the zygote's
    object, a second load is parsed afresh, another key is reported as missed, edited files are parsed again."""
    import shutil
    folder = tmp_path / "tok"
    shutil.copytree(offline_tokenizer("Qwen3-8B"), folder)
    done = subprocess.run([sys.executable, "-c", LEND, str(SERVER), str(folder)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "True", "left", "1", "False", "right"]


@pytest.mark.e2e
def test_engine_zygote_forks_engines_that_train_and_die_with_their_server(installed, tmp_path, monkeypatch):
    """tinker_local.EngineZygote (the test session runs every server's engine through one): the engine is the
    zygote's child, trains, and goes when its server is stopped or killed; an engine whose import-time
    environment differs, or with no zygote listening, is started as a process of its own."""
    import tinker
    import tinker_local_server
    import transformers
    venv, home = installed
    monkeypatch.delenv(tinker_local.ENGINE_ZYGOTE_ENV, raising=False)
    zygote = tinker_local.EngineZygote(venv, home, folder=tmp_path / "zygote")
    try:
        assert os.environ[tinker_local.ENGINE_ZYGOTE_ENV] == str(zygote.path)
        servers = [tinker_local.start_server(venv=venv, home=home, run_dir=tmp_path / name) for name in "ab"]
        try:
            engines = [int((server.run_dir / "engine.ready").read_text()) for server in servers]
            assert [parent_of(pid) for pid in engines] == [zygote.proc.pid] * 2
            # the engine's log lines go to its server's log, as a real engine's do
            assert "Started background engine" in servers[0].log.read_text()
            for key, value in servers[0].env.items():
                monkeypatch.setenv(key, value)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(tinker_local.tiny_model_dir(home)))
            service = tinker.ServiceClient()
            training = service.create_lora_training_client(servers[0].model, rank=8, seed=0).result()
            out = training.forward_backward(datums(tokenizer)[:1], "cross_entropy").result()
            assert math.isfinite(out.metrics["loss:sum"])
            service.close("success").result()
            servers[0].stop()                                      # SIGTERM: passed on, the engine exits
            assert wait_gone(engines[0])
            os.killpg(servers[1].proc.pid, signal.SIGKILL)         # the whole group at once, as a crash
            servers[1].proc.wait(timeout=60)
            assert wait_gone(engines[1])                           # the zygote saw its asker go
        finally:
            for server in servers:
                server.stop()
        # declined: another value of an import-time variable, or no zygote at the path (None: be the engine)
        for key, value in tinker_local._server_env(home).items():  # what a server's engine has
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("PYTHONPATH", raising=False)
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false" if os.environ.get("TOKENIZERS_PARALLELISM") != "false"
                           else "true")
        assert tinker_local_server.engine_from_zygote(["--never-run"]) is None
        assert "import-time environment differs: ['TOKENIZERS_PARALLELISM']" in zygote.log.read_text()
    finally:
        zygote.close()
    assert zygote.proc.returncode is not None
    assert tinker_local.ENGINE_ZYGOTE_ENV not in os.environ
    monkeypatch.setenv(tinker_local.ENGINE_ZYGOTE_ENV, str(zygote.path))
    assert tinker_local_server.engine_from_zygote(["--never-run"]) is None


# ---------------------------------------------------------------- adapter slots


@pytest.mark.e2e
def test_more_training_clients_than_adapter_slots_succeed_once_earlier_ones_end(installed, real_engines, tmp_path,
                                                                              monkeypatch):
    """3 adapters = 2 slots. A closed ServiceClient frees its slots at once; a client process
    that dies without closing frees them when its session expires."""
    import tinker
    venv, home = installed
    server = tinker_local.start_server(venv=venv, home=home, run_dir=tmp_path, max_lora_adapters=3,
                                       session_timeout_sec=20)
    try:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        first = tinker.ServiceClient()
        created = [first.create_lora_training_client(server.model, rank=8).result() for _ in range(2)]
        assert len({c.model_id for c in created}) == 2
        with pytest.raises(Exception, match=r"Maximum number of LoRA adapters \(3\) reached"):
            first.create_lora_training_client(server.model, rank=8).result()
        first.close("success").result()

        second = tinker.ServiceClient()
        kept = second.create_lora_training_client(server.model, rank=8).result()
        dies = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import os, tinker
            tinker.ServiceClient().create_lora_training_client({server.model!r}, rank=8).result()
            os._exit(0)  # no close(): the slot is freed only when the session expires
        """)], env={**os.environ, **server.env}, capture_output=True, text=True, timeout=300)
        assert dies.returncode == 0, dies.stderr[-2000:]
        deadline, attempts, late = time.monotonic() + 120, 0, None
        while late is None:
            attempts += 1
            try:
                late = second.create_lora_training_client(server.model, rank=8).result()
            except Exception as exc:
                assert "Maximum number of LoRA adapters" in str(exc)
                assert time.monotonic() < deadline, "the dead client's slot never came back"
                time.sleep(3)
        assert attempts > 1  # it was full until the dead session expired
        assert late.model_id != kept.model_id
        second.close("success").result()
    finally:
        server.stop()
    assert wait_no_processes(str(tmp_path)) == []


# ---------------------------------------------------------------- parity table (DEVELOPING.md)

PARITY_START, PARITY_END = "<!-- parity-table: generated by tests/test_local_backend.py -->", "<!-- /parity-table -->"
# Why each call the local backend does not serve is not served (the error class and status come
# from the run). Calls absent here must be served.
NOT_SERVED_WHY = {
    "forward_backward(loss_fn='dro')": "skyrl 0.4.0 has no `dro` loss (request validation)",
    "forward_backward(loss_fn='stable_reinforce')": "Tinker publishes no formula (alpha; it uses stability data the "
                                                    "hosted sampler records with `record_stability_info=True`); skyrl 0.4.0 "
                                                    "has no such loss (request validation)",
    "sample(topk_prompt_logprobs=2)": "skyrl's JAX sampler has no top-k prompt logprobs",
    "TrainingClient.save_weights_external": "skyrl 0.4.0 has no external-weights route",
    "RestClient.get_external_weights_urls": "skyrl 0.4.0 has no external-weights route",
    "RestClient.list_user_checkpoints": "skyrl 0.4.0 has no `/api/v1/checkpoints`; list per run (`list_checkpoints`)",
    "RestClient.list_sessions": "skyrl 0.4.0 has no sessions list",
    "RestClient.get_session": "skyrl 0.4.0 has no session read route",
    "RestClient.export_session_trace": "skyrl 0.4.0 has no traces",
    "RestClient.assign_session_project": "no projects locally",
    "RestClient.get_billing_usage": "no billing locally",
    "RestClient.publish_checkpoint_from_tinker_path": "skyrl 0.4.0 has no publish route",
    "RestClient.unpublish_checkpoint_from_tinker_path": "skyrl 0.4.0 has no publish route",
    "RestClient.set_checkpoint_ttl_from_tinker_path": "skyrl 0.4.0 has no TTL route",
    "ServiceClient.copy_weights": "skyrl 0.4.0 has no copy route",
}


def parity_rows(local_tinker, tokenizer) -> list[tuple[str, str]]:
    """(call, outcome) for every SDK 0.38 call and loss the scripts and references use, run
    against the local backend; outcome is "served" or the error class and HTTP status."""
    import datetime

    import httpx
    import tinker
    from tinker import types

    rows: list[tuple[str, str]] = []

    def probe(name: str, call) -> object:
        try:
            value = call()
        except Exception as exc:  # noqa: BLE001 - the table records what a user gets
            status = getattr(exc, "status_code", None)
            rows.append((name, f"{type(exc).__name__}" + (f" ({status})" if status else "")))
            return None
        rows.append((name, "served"))
        return value

    service = tinker.ServiceClient()
    rest = tinker.RestClient()
    data = datums(tokenizer)[:2]
    n = len(data[0].loss_fn_inputs["target_tokens"].tolist())
    probe("RestClient.get_server_capabilities", lambda: rest.get_server_capabilities().result())
    tc = probe("ServiceClient.create_lora_training_client",
               lambda: service.create_lora_training_client(local_tinker.model, rank=8, seed=0).result())
    probe("TrainingClient.get_info", lambda: getattr(tc.get_info(), "result", lambda: None)())
    # get_tokenizer reads HF_HOME when transformers is first imported: check it in a fresh process
    tokenizers = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import tinker
        service = tinker.ServiceClient()
        tc = service.create_lora_training_client({local_tinker.model!r}, rank=8)
        sc = service.create_sampling_client(base_model={local_tinker.model!r}).result()
        print(tc.result().get_tokenizer().eos_token, sc.get_tokenizer().eos_token)
        service.close("success").result()
        """) + EXIT_WITHOUT_TEARDOWN], env=local_tinker.env, capture_output=True, text=True, timeout=600)
    got = tokenizers.stdout.split()[-2:] if tokenizers.returncode == 0 else [tokenizers.stderr.strip().splitlines()[-1]] * 2

    def tokenizer_check(value):
        if value != "<|im_end|>":
            raise RuntimeError(value)

    probe("TrainingClient.get_tokenizer", lambda: tokenizer_check(got[0]))
    probe("TrainingClient.forward", lambda: tc.forward(data, "cross_entropy").result())
    rl_inputs = {"logprobs": lambda k: [-1.0] * k, "advantages": lambda k: [0.5] * k}
    for loss in ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"):
        # gspo's own input: which tokens make the sequence ratio (Tinker's GSPO requires it)
        extra = {"sequence_ratio_mask": lambda k: [1.0] * k} if loss == "gspo" else {}
        batch = data if loss == "cross_entropy" else datums(tokenizer, TEXTS[:2], **rl_inputs, **extra)
        probe(f"forward_backward(loss_fn='{loss}')", lambda: tc.forward_backward(batch, loss).result(timeout=120))
    probe("TrainingClient.forward_backward_custom", lambda: tc.forward_backward_custom(
        data, lambda d, logprobs: (sum(-lp.sum() for lp in logprobs), {})).result())

    def neg_ll(logprobs, weights):  # a traced per-datum loss (SDK 0.38 alpha): torch ops only
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    probe("ServiceClient.create_custom_loss", lambda: tc.forward_backward_custom(
        data, service.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()).result())
    probe("TrainingClient.optim_step", lambda: tc.optim_step(types.AdamParams(learning_rate=1e-3)).result())
    state = probe("TrainingClient.save_state", lambda: tc.save_state("parity").result().path)
    sampler_path = probe("TrainingClient.save_weights_for_sampler",
                         lambda: tc.save_weights_for_sampler("parity").result().path)
    probe("TrainingClient.save_weights_and_get_sampling_client",
          lambda: tc.save_weights_and_get_sampling_client().result())
    probe("TrainingClient.save_weights_external", lambda: tc.save_weights_external("parity-ext").result(timeout=120))
    probe("ServiceClient.create_training_client_from_state",
          lambda: service.create_training_client_from_state(state).result())
    probe("ServiceClient.create_training_client_from_state_with_optimizer",
          lambda: service.create_training_client_from_state_with_optimizer(state).result())
    fresh = service.create_lora_training_client(local_tinker.model, rank=8, seed=0).result()
    probe("TrainingClient.load_state (deprecated; fresh client)", lambda: fresh.load_state(state).result())
    fresh_too = service.create_lora_training_client(local_tinker.model, rank=8, seed=0).result()
    probe("TrainingClient.load_state_with_optimizer (deprecated; fresh client)",
          lambda: fresh_too.load_state_with_optimizer(state).result())
    base = probe("ServiceClient.create_sampling_client(base_model=...)",
                 lambda: service.create_sampling_client(base_model=local_tinker.model).result())
    probe("ServiceClient.create_sampling_client(model_path=...)",
          lambda: service.create_sampling_client(model_path=sampler_path).result())
    prompt = types.ModelInput.from_ints(tokenizer.encode("Once upon a time"))
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=0, stop=["\n"])
    # the base sampler (slot 0): earlier tests in the same server may hold every adapter slot
    probe("SamplingClient.sample (n, stop, seed)", lambda: base.sample(prompt, 2, params).result())
    probe("sample(include_prompt_logprobs=True)", lambda: base.sample(
        prompt, 1, params, include_prompt_logprobs=True).result())
    probe("sample(topk_prompt_logprobs=2)", lambda: base.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=2).result(timeout=120))
    probe("SamplingClient.compute_logprobs", lambda: base.compute_logprobs(prompt).result())
    probe("SamplingClient.get_tokenizer", lambda: tokenizer_check(got[1]))
    probe("SamplingClient.get_base_model", lambda: base.get_base_model())
    run_id = (sampler_path or state or "tinker://no-checkpoint-was-saved/").split("/")[2]
    probe("RestClient.list_training_runs", lambda: rest.list_training_runs().result())
    probe("RestClient.get_training_run", lambda: rest.get_training_run(run_id).result())
    probe("RestClient.get_training_run_by_tinker_path", lambda: rest.get_training_run_by_tinker_path(state).result())
    probe("RestClient.list_checkpoints", lambda: rest.list_checkpoints(run_id).result())
    probe("RestClient.get_weights_info_by_tinker_path", lambda: rest.get_weights_info_by_tinker_path(state).result())
    probe("RestClient.get_external_weights_urls", lambda: rest.get_external_weights_urls(sampler_path).result())
    probe("RestClient.list_user_checkpoints", lambda: rest.list_user_checkpoints().result())
    probe("RestClient.list_sessions", lambda: rest.list_sessions().result())
    probe("RestClient.get_session", lambda: rest.get_session(service.holder.get_session_id()).result())
    probe("RestClient.export_session_trace", lambda: rest.export_session_trace(service.holder.get_session_id()).result())
    probe("RestClient.assign_session_project", lambda: rest.assign_session_project(
        service.holder.get_session_id(), "project-x").result())
    probe("RestClient.get_billing_usage", lambda: rest.get_billing_usage(
        datetime.date.today().isoformat(), (datetime.date.today() + datetime.timedelta(days=1)).isoformat()).result())
    probe("RestClient.publish_checkpoint_from_tinker_path", lambda: rest.publish_checkpoint_from_tinker_path(state).result())
    probe("RestClient.unpublish_checkpoint_from_tinker_path",
          lambda: rest.unpublish_checkpoint_from_tinker_path(state).result())
    probe("RestClient.set_checkpoint_ttl_from_tinker_path",
          lambda: rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result())
    probe("ServiceClient.copy_weights", lambda: service.copy_weights(state).result(timeout=120))
    archive = f"{local_tinker.base_url}/api/v1/training_runs/{run_id}/checkpoints/parity/archive"
    probe("GET training_runs/{run}/checkpoints/{ckpt}/archive (tinker_checkpoints.py export)",
          lambda: httpx.get(archive, headers={"X-API-Key": "tml-local"}, timeout=120,
                            follow_redirects=True).raise_for_status())
    probe("RestClient.delete_checkpoint_from_tinker_path", lambda: rest.delete_checkpoint_from_tinker_path(state).result())
    for route, body in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        probe(f"POST /oai/api/v1/{route} (tinker_infer.py --http)", lambda: httpx.post(
            f"{local_tinker.base_url}/oai/api/v1/{route}", json={"model": local_tinker.model, "max_tokens": 4, **body},
            headers={"Authorization": "Bearer tml-local"}, timeout=600).raise_for_status())
    probe("ServiceClient.close", lambda: service.close("success").result())
    return rows


def parity_markdown(rows: list[tuple[str, str]]) -> str:
    lines = [PARITY_START, "", "| SDK 0.38 call or loss | local backend | why not served |", "| --- | --- | --- |"]
    for name, outcome in rows:
        served = outcome == "served"
        lines.append(f"| `{name}` | {'served (tested)' if served else 'not served: ' + outcome} | "
                     f"{'' if served else NOT_SERVED_WHY.get(name, '?')} |")
    return "\n".join(lines + ["", PARITY_END])


@pytest.mark.e2e
def test_parity_table_in_developing_md_is_what_the_local_backend_serves(local_tinker, sdk, monkeypatch):
    """Regenerate with TINKER_WRITE_PARITY=1 (rewrites the table between the markers)."""
    local_tinker.apply(monkeypatch)
    rows = parity_rows(local_tinker, sdk[2])
    unexplained = [name for name, outcome in rows if outcome != "served" and name not in NOT_SERVED_WHY]
    assert not unexplained, f"not served and not explained: {unexplained} ({rows})"
    stale = [name for name in NOT_SERVED_WHY if (name, "served") in rows]
    assert not stale, f"now served, drop from NOT_SERVED_WHY: {stale}"
    table = parity_markdown(rows)
    doc = Path(__file__).resolve().parent.parent / "DEVELOPING.md"
    text = doc.read_text()
    current = text[text.index(PARITY_START):text.index(PARITY_END) + len(PARITY_END)] if PARITY_START in text else None
    if os.environ.get("TINKER_WRITE_PARITY") == "1" and current != table:
        doc.write_text(text.replace(current, table) if current else text)
        current = table
    assert current == table, "DEVELOPING.md parity table is stale; rerun with TINKER_WRITE_PARITY=1:\n" + table


def test_the_parity_table_covers_every_sdk_call_the_scripts_and_references_name():
    """A client method named in scripts/ or references/ (as `name(` or in backticks) is a row."""
    import re

    import tinker
    root = Path(__file__).resolve().parent.parent
    text = (root / "DEVELOPING.md").read_text()
    table = text[text.index(PARITY_START):text.index(PARITY_END)]
    # client-side only (no server call): a constructor, a handle string, a console URL
    ignored = {"create", "from_sampler_handle", "get_sampler_handle", "get_console_url"}
    named = set()
    sources = [*root.glob("scripts/tinker_*.py"), *root.glob("references/*.md"), root / "SKILL.md"]
    for cls in (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient):
        for name in dir(cls):
            if name.startswith("_") or name.endswith("_async") or not callable(getattr(cls, name)) or name in ignored:
                continue
            if any(re.search(rf"\b{name}\(|`[^`]*\b{name}\b", p.read_text()) for p in sources):
                named.add(name)
    missing = sorted(n for n in named if not re.search(rf"[.`]{n}\b", table))
    assert not missing, f"named in the bundle but not in the parity table: {missing}"


def test_a_tiny_model_cached_by_an_older_setup_is_not_served_until_setup_rebuilds_it(tmp_path):
    """The fingerprint covers the config and the final norm weight: a model built before the norm
    weight was 20 (fingerprint of the config alone) counts as not set up."""
    import hashlib
    venv, home = tmp_path / "venv", tmp_path / "home"
    venv.mkdir()
    (venv / "tinker-local-setup.json").write_text(json.dumps({"check shims": tinker_local.pins_fingerprint()}))
    marker = tinker_local.tiny_model_dir(home) / "tinker-local-model.json"
    marker.parent.mkdir(parents=True)
    old_key = hashlib.sha256(json.dumps(tinker_local.TINY_QWEN3, sort_keys=True).encode()).hexdigest()[:16]
    marker.write_text(json.dumps({"config": old_key}))
    assert not tinker_local.is_set_up(venv, home)
    with pytest.raises(tinker_local.LocalError, match=r"tinker_local.py setup` first"):
        tinker_local.start_server(venv=venv, home=home)
    marker.write_text(json.dumps({"config": tinker_local.tiny_model_spec()["key"]}))
    assert tinker_local.is_set_up(venv, home)
    assert tinker_local.tiny_model_spec()["final_norm_weight"] == 20.0
