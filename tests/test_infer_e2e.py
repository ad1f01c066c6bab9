"""tinker_infer.py and tinker_checkpoints.py end to end on the local backend (real SDK, real server, tiny Qwen3).

Everything that talks to the server runs in a subprocess: the SDK keeps one client per
process, and other test modules point it at other servers.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_local import EXIT_WITHOUT_TEARDOWN

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tinker_infer.py"
CHECKPOINTS = SCRIPT.with_name("tinker_checkpoints.py")
TRAIN_TEXT = "The quick brown fox jumps over the lazy dog. " * 4

TRAIN = r"""
import json, sys, tinker
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok.encode(sys.argv[3])[:32]
datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
with tinker.ServiceClient() as service:
    tc = service.create_lora_training_client(base_model=sys.argv[2], rank=8, seed=0).result()
    for _ in range(4):
        fb = tc.forward_backward([datum], "cross_entropy")
        opt = tc.optim_step(tinker.AdamParams(learning_rate=5e-2))
        fb.result(); opt.result()
    state = tc.save_state("final").result().path
    sampler = tc.save_weights_for_sampler("final").result().path
    print(json.dumps({"state_path": state, "sampler_path": sampler, "model_id": tc.model_id}), flush=True)
"""

LOGPROBS = r"""
import json, sys, tinker
with tinker.ServiceClient() as service:
    sc = service.create_sampling_client(model_path=sys.argv[1]).result()
    print(json.dumps(sc.compute_logprobs(tinker.ModelInput.from_ints(json.loads(sys.argv[2]))).result()))
"""


def python(local_tinker, code, *args, timeout=600):
    proc = subprocess.run([sys.executable, "-c", code + EXIT_WITHOUT_TEARDOWN, *args],
                          env={**os.environ, **local_tinker.env},
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def infer(local_tinker, *args, timeout=600, script=SCRIPT):
    proc = subprocess.run([sys.executable, str(script), *args], env={**os.environ, **local_tinker.env},
                          capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no JSON on stdout; stderr: {proc.stderr[-3000:]}"
    return proc.returncode, json.loads(lines[-1])


def checkpoints(local_tinker, *args, timeout=600):
    return infer(local_tinker, *args, timeout=timeout, script=CHECKPOINTS)


@pytest.fixture(scope="module")
def trained(local_tinker):
    """One LoRA run trained 4 steps on the local backend with the raw SDK: both checkpoint kinds.
    The process has ended (its session closed) before any test samples its checkpoints, as
    after a finished training run."""
    return python(local_tinker, TRAIN, str(local_tinker.tokenizer_dir), local_tinker.model, TRAIN_TEXT)


@pytest.fixture(scope="module")
def tokenizer(local_tinker):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(local_tinker.tokenizer_dir))


def run_id(trained):
    return trained["sampler_path"].split("/")[2]


def sample(local_tinker, trained, *args):
    code, result = infer(local_tinker, "--model", trained["sampler_path"], "--json", *args)
    assert code == 0, result
    return result


def test_same_seed_gives_the_same_tokens_and_another_seed_does_not(local_tinker, trained):
    args = ("--prompt", "Tell me a story.", "--max-tokens", "12", "--temperature", "1.0")
    first = sample(local_tinker, trained, *args, "--seed", "7")["samples"][0]
    again = sample(local_tinker, trained, *args, "--seed", "7")["samples"][0]
    other = sample(local_tinker, trained, *args, "--seed", "8")["samples"][0]
    assert first["completion_tokens"] > 0
    assert first["tokens"] == again["tokens"] and first["text"] == again["text"]
    assert other["tokens"] != first["tokens"]


def test_a_stop_string_ends_the_completion_before_it(local_tinker, trained):
    args = ("--format", "raw", "--prompt", "Once upon a time", "--max-tokens", "16", "--seed", "11")
    full = sample(local_tinker, trained, *args)["samples"][0]
    text = full["text"]
    # A 2-character piece from the middle of what this seed generates becomes the stop string.
    start = next(i for i in range(len(text) // 3, len(text) - 1)
                 if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    cut = sample(local_tinker, trained, *args, "--stop", stop)["samples"][0]
    assert cut["stop_reason"] == "stop"
    assert cut["text"] == text[: text.find(stop)]
    assert cut["completion_tokens"] < full["completion_tokens"]
    assert cut["tokens"] == full["tokens"][: cut["completion_tokens"]]


def write_run(log_dir, sampler_path, state_path, fmt):
    log_dir.mkdir(parents=True)
    (log_dir / "checkpoints.jsonl").write_text(json.dumps({
        "name": "final", "step": 4, "next_batch": 4, "epoch": 0, "state_path": state_path,
        "sampler_path": sampler_path, "format": fmt, "time": "2026-12-02T12:00:00+00:00"}) + "\n")
    return log_dir


def test_run_folder_samples_its_checkpoint_in_its_recorded_format(local_tinker, trained, tokenizer, tmp_path):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat_fmt = {"kind": "chat", "template_sha256": __import__("hashlib").sha256(
                    tokenizer.chat_template.encode()).hexdigest(),
                "template_kwargs": {"enable_thinking": False, "strftime_now": "2024-07-26"},
                "stop": [tokenizer.convert_tokens_to_ids("<|im_end|>")], "tokenizer": str(local_tinker.tokenizer_dir)}
    chat_run = write_run(tmp_path / "chat", trained["sampler_path"], trained["state_path"], chat_fmt)
    raw_fmt = {"kind": "raw", "stop": [tokenizer.eos_token_id], "bos": False, "tokenizer": str(local_tinker.tokenizer_dir)}
    raw_run = write_run(tmp_path / "raw", trained["sampler_path"], trained["state_path"], raw_fmt)

    code, chat = infer(local_tinker, "--run", str(chat_run), "--messages", json.dumps(messages),
                       "--max-tokens", "4", "--seed", "1", "--json")
    assert code == 0, chat
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert expected.endswith("<think>\n\n</think>\n\n")  # the recorded kwarg changed the prompt
    assert chat["model"] == trained["sampler_path"]
    assert chat["format"]["kind"] == "chat" and chat["template_matches_run"] is True
    assert chat["samples"][0]["prompt_tokens"] == len(tokenizer.encode(expected, add_special_tokens=False))
    code, dry = infer(local_tinker, "--run", str(chat_run), "--messages", json.dumps(messages), "--dry-run", "--json")
    assert code == 0, dry  # the dry run shows exactly the prompt that was sent
    assert [(p["prompt_tokens"], p["text"]) for p in dry["prompts"]] == [(chat["samples"][0]["prompt_tokens"], expected)]

    code, raw = infer(local_tinker, "--run", str(raw_run), "--prompt", "What is 2+2?", "--max-tokens", "4",
                      "--seed", "1", "--json")
    assert code == 0, raw
    assert raw["format"]["kind"] == "raw"
    assert raw["samples"][0]["prompt_tokens"] == len(tokenizer.encode("What is 2+2?", add_special_tokens=False))
    assert raw["sampling"]["temperature"] == 0.0  # --run samples greedily, as the run's probes did
    # Same checkpoint, flags instead of the record: the same tokens.
    flags = sample(local_tinker, trained, "--format", "raw", "--tokenizer", str(local_tinker.tokenizer_dir),
                   "--prompt", "What is 2+2?", "--max-tokens", "4", "--seed", "1", "--temperature", "0")
    assert flags["samples"][0]["tokens"] == raw["samples"][0]["tokens"]


def test_batch_mode_keeps_input_order(local_tinker, trained, tokenizer, tmp_path):
    prompts = ["one", "one two three four five six seven", "one two", "one two three four"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    result = sample(local_tinker, trained, "--format", "raw", "--input", str(tmp_path / "in.jsonl"),
                    "--out", str(out), "--max-tokens", "4", "--seed", "0", "--n", "2")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    assert [r["samples"][0]["prompt_tokens"] for r in rows] == [len(tokenizer.encode(p)) for p in prompts]
    assert [len(r["samples"]) for r in rows] == [2, 2, 2, 2]
    assert [(s["prompt_index"], s["sample_index"]) for s in result["samples"]] == [
        (i, j) for i in range(4) for j in range(2)]


def test_weights_path_for_sampling_names_the_runs_sampler_path(local_tinker, trained):
    code, result = infer(local_tinker, "--model", trained["state_path"], "--prompt", "hi")
    assert code == 2
    assert trained["sampler_path"] in result["error"]


def test_unknown_checkpoint_is_reported_with_the_list_command(local_tinker, trained):
    missing = trained["sampler_path"].rsplit("/", 1)[0] + "/no-such-checkpoint"
    code, result = infer(local_tinker, "--model", missing, "--prompt", "hi", "--max-tokens", "2")
    assert code == 2, result
    assert f"tinker_checkpoints.py list --run {run_id(trained)}" in result["error"]


def test_unserved_model_lists_close_names(local_tinker):
    code, result = infer(local_tinker, "--model", "Qwen/Qwen3-8X", "--prompt", "hi")
    assert code == 2
    assert local_tinker.model in result["error"]


def test_checkpoints_list_and_resolve_on_the_server(local_tinker, trained):
    code, listing = checkpoints(local_tinker, "list", "--run", run_id(trained), "--json")
    assert code == 0, listing
    assert {(c["path"], c["type"]) for c in listing["checkpoints"]} >= {
        (trained["state_path"], "training"), (trained["sampler_path"], "sampler")}
    code, everything = checkpoints(local_tinker, "list", "--json")  # no account-wide listing here
    assert code == 0 and trained["sampler_path"] in [c["path"] for c in everything["checkpoints"]]
    assert checkpoints(local_tinker, "resolve", run_id(trained))[1]["path"] == trained["sampler_path"]
    assert checkpoints(local_tinker, "resolve", run_id(trained), "--kind", "state")[1]["path"] == \
        trained["state_path"]


@pytest.fixture(scope="module")
def exported(local_tinker, trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "adapter"
    code, result = checkpoints(local_tinker, "export", trained["sampler_path"], "--out", str(out))
    assert code == 0, result
    return out, result


def test_export_of_a_sampler_checkpoint_yields_a_peft_adapter(exported):
    out, result = exported
    assert result["route"] == "archive"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["files"])
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8


def test_a_local_export_lists_its_linear_layers_and_has_no_head_although_train_unembed_was_asked(exported):
    """TRAIN asks for the SDK's default, train_unembed=True; the local backend (SkyRL 0.4.0) keeps only the
    rank and seed of a LoRA config, so neither the output head nor the embedding is trained or exported."""
    out, result = exported
    linear = sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert result["target_modules"] == linear and result["peft_ready"] is True
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == linear  # SkyRL wrote null


def test_merged_model_matches_the_servers_logprobs(local_tinker, trained, exported, tokenizer, tmp_path):
    torch = pytest.importorskip("torch", reason="the merge extra needs torch")
    from transformers import AutoModelForCausalLM

    merged_dir = tmp_path / "merged"
    code, result = checkpoints(local_tinker, "merge", str(exported[0]), "--base",
                         str(local_tinker.tokenizer_dir), "--out", str(merged_dir), "--dtype", "float32")
    assert code == 0, result
    ids = tokenizer.encode("The quick brown fox jumps over the lazy cat, and then it sleeps.")
    server = python(local_tinker, LOGPROBS, trained["sampler_path"], json.dumps(ids))
    # One entry per prompt token with None first, as on Tinker (the local backend's shim adds it).
    assert len(server) == len(ids) and server[0] is None
    server = server[1:]
    assert None not in server

    def local_logprobs(model_dir):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]

    merged = local_logprobs(merged_dir)
    max_diff = max(abs(a - b) for a, b in zip(merged, server))
    import peft  # the export as PEFT loads it (its target_modules listed from the tensors) computes the same
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(local_tinker.tokenizer_dir), dtype=torch.float32)
        logp = torch.log_softmax(peft.PeftModel.from_pretrained(base, str(exported[0])).eval()(
            torch.tensor([ids])).logits[0].float(), dim=-1)
    peft_diff = max(abs(logp[i - 1, ids[i]].item() - server[i - 1]) for i in range(1, len(ids)))
    assert peft_diff < 1e-2
    base_diff = max(abs(a - b) for a, b in zip(local_logprobs(local_tinker.tokenizer_dir), server))
    print(f"\nmerge: max |merged - server| logprob = {max_diff:.3e} over {len(ids) - 1} tokens; "
          f"PEFT-loaded export vs server = {peft_diff:.3e}; base model vs server = {base_diff:.3e}")
    assert max_diff < 1e-2
    assert base_diff > 10 * max_diff  # the adapter really changed the model, and the merge carried it
