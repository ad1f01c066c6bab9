"""Every error text quoted in references/troubleshooting.md is what SDK 0.38 really raises.

Each probe makes the mistake the row describes against the local backend (or offline, for the
client-side checks) and asserts that the quoted text is a substring of the raised message, so
a changed text fails the build. One training client is shared to keep the file fast.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "references" / "troubleshooting.md"
TOKENS = list(range(100, 116))  # one 15-token datum shape for every training probe
# Quoted texts the suite does not re-raise, with why (each is named in the document itself).
# The value is the phrase the document's introduction must use to say so.
NOT_REPRODUCED = {
    "Checkpoint 'dup' already exists for model": "the 409 row is not re-raised",
    "the server rejected --loss-fn dro": "asserted by\n`tests/test_rl_e2e.py`",
    "the base policy ties every group": "asserted by\n`tests/test_rl_e2e.py`",
}


def quoted_texts() -> list[str]:
    """The second column's code spans of every table row: the exact texts the doc promises."""
    texts = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not line.startswith("|") or set(cells[0]) <= {"-", " "}:
            continue
        m = re.fullmatch(r"(`+)\s?(.*?)\s?\1", cells[1])
        if m:
            texts.append(m.group(2))
    return texts


def raised(fn) -> str:
    with pytest.raises(Exception) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"


def datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * 15})


def rl_datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(TOKENS[1:]),
                                       "logprobs": np.zeros(15, dtype=np.float32),
                                       "advantages": np.ones(15, dtype=np.float32)})


@pytest.fixture(scope="module")
def service(local_tinker):
    sc = tinker.ServiceClient(base_url=local_tinker.base_url, api_key="tml-local")
    yield sc
    sc.close("success").result()


@pytest.fixture(scope="module")
def trained(service):
    """One training client, with a weights/ and a sampler_weights/ checkpoint."""
    tc = service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
    state = tc.save_state("state").result().path
    sampler = tc.save_weights_for_sampler("sampler").result().path
    return tc, state, sampler


def test_every_quoted_text_is_reproduced_here_or_named_as_not(request):
    texts = quoted_texts()
    assert len(texts) >= 18
    probes = [v for k, v in globals().items() if k.startswith("test_") and hasattr(v, "texts")]
    proved = {t for p in probes for t in p.texts}
    missing = [t for t in texts if t not in proved and t not in NOT_REPRODUCED]
    assert missing == []
    assert set(NOT_REPRODUCED) <= set(texts)


def introduction() -> str:
    text = DOC.read_text()
    return text[:text.index("\n## ")]


def test_the_introduction_names_every_text_the_suite_does_not_reraise_and_nothing_more():
    intro = " ".join(introduction().split())
    for text, phrase in NOT_REPRODUCED.items():
        assert " ".join(phrase.split()) in intro, f"the introduction must say for {text!r}: {phrase}"
    assert "every quoted text" not in intro.lower() or "exceptions" in intro.lower()


def proves(*texts):
    """Marks a probe with the doc texts it asserts; each must be quoted in the document."""
    def wrap(fn):
        fn.texts = texts
        return fn
    return wrap


def check(message: str, text: str) -> None:
    assert text in quoted_texts(), f"not quoted in troubleshooting.md: {text}"
    assert text in message


# ------------------------------------------------------------------ client-side checks (offline)

@proves("The api_key client option must be set by passing api_key to the client, by setting the "
        "TINKER_API_KEY environment variable, or by storing a key with `tinker auth login`",
        "The api_key must start with the 'tml-' prefix")
def test_missing_key_and_key_without_tml_prefix_fail_before_any_request(monkeypatch, tmp_path):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.tinker/credentials.json
    url = "http://127.0.0.1:9"  # nothing listens: the check happens before any request
    msg = raised(lambda: tinker.ServiceClient(base_url=url).create_lora_training_client(
        base_model="Qwen/Qwen3-8B").result())
    assert msg.startswith("TinkerError: ")
    check(msg, test_missing_key_and_key_without_tml_prefix_fail_before_any_request.texts[0])
    msg = raised(lambda: tinker.ServiceClient(base_url=url, api_key="sk-abc").create_lora_training_client(
        base_model="Qwen/Qwen3-8B").result())
    check(msg, "The api_key must start with the 'tml-' prefix")


@proves("No progress made in 7200s. Requests appear to be stuck.")
def test_stuck_sampling_text_is_the_sdks_with_its_default_timeout():
    """The retry handler's own message, raised with a 0.2 s timeout, then read at the default."""
    import asyncio

    from tinker.lib.retry_handler import RetryConfig, RetryHandler

    async def never_finishes():
        await asyncio.sleep(3600)

    async def run():
        handler = RetryHandler(RetryConfig(progress_timeout=0.2))
        return await handler.execute(never_finishes)

    msg = raised(lambda: asyncio.run(run()))
    assert msg.startswith("APIConnectionError: ")
    assert "No progress made in 0.2s. Requests appear to be stuck." in msg
    default = RetryConfig().progress_timeout
    assert default == 7200 and isinstance(default, int)  # printed as "7200s", never "7200.0s"
    check(msg.replace("0.2s", f"{default}s"), "No progress made in 7200s. Requests appear to be stuck.")


@proves("apply_chat_template requires jinja2 to be installed")
def test_a_chat_template_render_without_jinja2_fails_with_the_quoted_text(monkeypatch):
    from transformers.utils import chat_template_utils

    monkeypatch.setattr(chat_template_utils, "is_jinja_available", lambda: False)
    template = "{{ messages[0]['content'] }} without jinja2 " + str(os.getpid())  # not in the compile cache
    msg = raised(lambda: chat_template_utils._compile_jinja_template(template))
    assert msg.startswith("ImportError: ")
    check(msg, "apply_chat_template requires jinja2 to be installed")


def jwt(exp: float) -> str:
    import base64
    import json

    def part(obj) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part({'exp': exp})}.sig"


def test_sdk_accepts_tml_keys_jwts_and_a_credential_command_but_nothing_else(monkeypatch, tmp_path):
    """setup.md and the key row above: the three credential forms of SDK 0.38."""
    import time

    from tinker.lib._auth_token_provider import ApiKeyAuthProvider

    assert ApiKeyAuthProvider("tml-abc").api_key == "tml-abc"
    token = jwt(time.time() + 3600)
    assert token.startswith("eyJ") and ApiKeyAuthProvider(token).api_key == token
    check(raised(lambda: ApiKeyAuthProvider("sk-abc")), "The api_key must start with the 'tml-' prefix")
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no stored key
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD", raising=False)
    assert tinker.auth.tinker_has_credentials() is False
    monkeypatch.setenv("TINKER_CREDENTIAL_CMD", "echo tml-from-a-command")
    assert tinker.auth.tinker_has_credentials() is True


# ------------------------------------------------------------------ against the local backend

@pytest.mark.e2e
@proves("model_path must start with 'tinker://'")
def test_sampling_a_path_that_is_not_a_tinker_path(service):
    msg = raised(lambda: service.create_sampling_client(model_path="runs/my-sft").result())
    assert msg.startswith("ValueError: ")
    check(msg, "model_path must start with 'tinker://'")


@pytest.mark.e2e
@proves("Input should be 'cross_entropy', 'importance_sampling', 'ppo', 'gspo', 'cispo', 'ppo_critic' or 'dppo'",
        "loss_fn='gspo' needs loss_fn_inputs ['sequence_ratio_mask']",
        "'ForwardBackwardOutput' object has no attribute 'loss'",
        "A previous request failed; this TrainingClient is poisoned and cannot accept further requests.")
def test_rejected_losses_leave_the_client_usable_but_a_failed_custom_loss_poisons_it(service, trained):
    tc, _, _ = trained
    msg = raised(lambda: tc.forward_backward([rl_datum()], "dro", {"beta": 0.05}).result())
    assert msg.startswith("UnprocessableEntityError: ") and "422" in msg
    check(msg, "Input should be 'cross_entropy', 'importance_sampling', 'ppo', 'gspo', 'cispo', 'ppo_critic' or 'dppo'")
    msg = raised(lambda: tc.forward_backward([rl_datum()], "gspo").result())
    assert msg.startswith("BadRequestError: ")
    check(msg, "loss_fn='gspo' needs loss_fn_inputs ['sequence_ratio_mask']")
    out = tc.forward_backward([datum()], "cross_entropy").result()  # not poisoned by either
    assert out.metrics["loss:sum"] > 0
    check(raised(lambda: out.loss), "'ForwardBackwardOutput' object has no attribute 'loss'")

    # A separate client: poisoning is permanent.
    doomed = service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()

    def failing_loss(data, logprobs):
        raise ValueError("bug in my loss")

    assert raised(lambda: doomed.forward_backward_custom([datum()], failing_loss).result()) == \
        "ValueError: bug in my loss"
    msg = raised(lambda: doomed.forward_backward([datum()], "cross_entropy").result())
    assert msg.startswith("RuntimeError: ")
    check(msg, "A previous request failed; this TrainingClient is poisoned and cannot accept further requests.")


@pytest.mark.e2e
@proves("LoRA rank 64 must be between 1 and 32")
def test_lora_rank_above_the_servers_maximum(service):
    msg = raised(lambda: service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=64).result())
    check(msg, "LoRA rank 64 must be between 1 and 32")


@pytest.mark.e2e
@proves("model_path must be tinker://model_id/checkpoint_id or tinker://model_id/sampler_weights/checkpoint_id",
        "path must be tinker://<model_id>/weights/<name>")
def test_each_checkpoint_kind_given_where_the_other_is_needed(service, trained):
    _, state, sampler = trained
    assert "/weights/" in state and "/sampler_weights/" in sampler
    msg = raised(lambda: service.create_sampling_client(model_path=state).result().sample(
        types.ModelInput.from_ints(TOKENS), 1, types.SamplingParams(max_tokens=4)).result())
    assert msg.startswith("BadRequestError: ")
    check(msg, "model_path must be tinker://model_id/checkpoint_id or tinker://model_id/sampler_weights/checkpoint_id")
    msg = raised(lambda: service.create_training_client_from_state_with_optimizer(sampler).result())
    check(msg, "path must be tinker://<model_id>/weights/<name>")


@pytest.mark.e2e
@proves("max_tokens is currently required",
        "topk_prompt_logprobs is not supported by the JAX backend",
        "Engine is configured for 'Qwen/Qwen3-8B' but request specified",
        "RESOURCE_EXHAUSTED: Out of memory allocating")
def test_sampling_mistakes(service, trained):
    _, _, sampler_path = trained
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    prompt = types.ModelInput.from_ints(TOKENS)
    msg = raised(lambda: sampler.sample(prompt, 1, types.SamplingParams()).result())
    check(msg, "max_tokens is currently required")
    msg = raised(lambda: sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4), include_prompt_logprobs=True,
                                        topk_prompt_logprobs=5).result())
    check(msg, "topk_prompt_logprobs is not supported by the JAX backend")
    other = service.create_sampling_client(base_model="meta-llama/Llama-3.1-8B").result()
    msg = raised(lambda: other.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result())
    check(msg, "Engine is configured for 'Qwen/Qwen3-8B' but request specified")
    # 40,000 tokens: the tiny model's attention would need ~125 GB, so XLA refuses before allocating.
    msg = raised(lambda: sampler.sample(types.ModelInput.from_ints([100] * 40000), 1,
                                        types.SamplingParams(max_tokens=4)).result())
    check(msg, "RESOURCE_EXHAUSTED: Out of memory allocating")


# ------------------------------------------------------------------ the bundle's scripts

@pytest.mark.e2e
@proves("is unknown or expired")
def test_sampling_a_checkpoint_the_server_does_not_have_names_the_listing_command(local_tinker, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "tinker_infer.py"), "--model",
                          "tinker://model_0badc0de/sampler_weights/final", "--prompt", "hi", "--max-tokens", "4"],
                         capture_output=True, text=True, env=local_tinker.env, timeout=300, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    error = json.loads(out.stdout)["error"]
    check(error, "is unknown or expired")
    assert "tinker_checkpoints.py list --run model_0badc0de" in error and "store" in error


@pytest.mark.e2e
@proves("error: no Tinker credentials: set TINKER_API_KEY (tml-...), or check for free with --dry-run, "
        "or for a free rehearsal start the local backend:",
        "error: TINKER_API_KEY does not start with tml-; expected a Tinker API key; copy it again from the "
        "Tinker console")
def test_sft_without_a_key_or_with_a_malformed_one_exits_4_with_the_documented_line(local_tinker, tmp_path):
    texts = test_sft_without_a_key_or_with_a_malformed_one_exits_4_with_the_documented_line.texts
    base = {k: v for k, v in {**os.environ, **local_tinker.env}.items()
            if k not in ("TINKER_API_KEY", "TINKER_CREDENTIAL_CMD")}
    base["HOME"] = str(tmp_path)
    for key, text in ((None, texts[0]), ("sk-abc", texts[1])):
        env = dict(base) if key is None else {**base, "TINKER_API_KEY": key}
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "tinker_sft.py"),
                              "--data", str(ROOT / "templates" / "sft_example.jsonl"), "--max-steps", "1",
                              "--tokenizer", str(local_tinker.tokenizer_dir), "--log-path", str(tmp_path / "run")],
                             capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
        assert out.returncode == 4, out.stderr[-2000:]
        check(out.stderr.strip().splitlines()[-1], text)
        if key is None:  # the rehearsal hint is this very command, wrapped in the launcher that exists
            launcher = str(ROOT / "scripts" / "tinker_local.py")
            assert f"{sys.executable} {launcher} run -- {sys.executable} {ROOT / 'scripts' / 'tinker_sft.py'} --data " in out.stderr


# ------------------------------------------------------------------ one writer, lost service, preconditions

@proves("is being written by")
def test_a_second_writer_on_a_live_run_folder(tmp_path):
    import tinker_sft

    hold = "import sys, tinker_sft; tinker_sft.Run(sys.argv[1]).lock(); print('held', flush=True); sys.stdin.read()"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "run")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT / "scripts")
    try:
        assert holder.stdout.readline().strip() == "held"
        msg = raised(lambda: tinker_sft.Run(tmp_path / "run").lock())
        check(msg, "is being written by")
        assert f"pid {holder.pid}" in msg and f"kill {holder.pid}" in msg
    finally:
        holder.kill()
        holder.wait(timeout=30)


@proves("error: lost Tinker at")
def test_a_lost_service_interrupts_the_main_thread_where_it_waits(monkeypatch):
    """The watch a training run holds: once connect() reached the service, TINKER_UNREACHABLE_S seconds
    without a TCP answer raise ServiceLost (exit 4) in the main thread, even inside a blocking wait."""
    import socket
    import threading

    import tinker_sft

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nothing listens there now: connections are refused
    monkeypatch.setenv("TINKER_UNREACHABLE_S", "0.5")
    with pytest.raises(tinker_sft.ServiceLost) as lost:
        with tinker_sft.watch_service():
            tinker_sft._start_watch(url)
            threading.Event().wait(60)  # what .result() on a future does: the signal ends it
    assert tinker_sft.run_cli(lambda argv: (_ for _ in ()).throw(lost.value)) == 4
    check(f"error: {lost.value}", "error: lost Tinker at")
    assert "TINKER_UNREACHABLE_S" in str(lost.value)


@proves("torch is not importable")
def test_dpo_names_the_torch_install_before_any_call(monkeypatch):
    import tinker_dpo

    monkeypatch.setitem(sys.modules, "torch", None)
    msg = raised(lambda: tinker_dpo.check_torch(False))
    check(msg, "torch is not importable")
    assert "pip install torch" in msg


@proves("MiB are free")
def test_a_full_disk_is_refused_before_any_call(monkeypatch, tmp_path):
    import tinker_sft

    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(tinker_sft.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 2**20))
    check(raised(lambda: tinker_sft.Run(tmp_path / "run").lock()), "MiB are free")


@pytest.mark.e2e
@proves("cannot be sampled on this Tinker")
def test_a_distill_teacher_checkpoint_that_is_gone(service, local_tinker, monkeypatch):
    import types as pytypes

    local_tinker.apply(monkeypatch)  # the served-model check asks the service of the environment

    import tinker_distill

    teacher = tinker_distill.Teacher(label="gone", base="Qwen/Qwen3-8B", path="tinker://model_gone/sampler_weights/final")
    msg = raised(lambda: tinker_distill.open_teacher(service, teacher, pytypes.SimpleNamespace(teacher_tokenizer=None)))
    check(msg, "cannot be sampled on this Tinker")
    assert msg.startswith("DataError")
    unserved = tinker_distill.Teacher(label="Qwen/Qwen3-32B", base="Qwen/Qwen3-32B", path=None)
    msg = raised(lambda: tinker_distill.open_teacher(service, unserved, pytypes.SimpleNamespace(teacher_tokenizer=None)))
    assert msg.startswith("DataError: the teacher Qwen/Qwen3-32B is not served for sampling by this Tinker"), msg
