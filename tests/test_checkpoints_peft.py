"""An exported adapter loads in PEFT as it is and computes what the merged model computes (issue 44).

Tiny random Llama and Qwen3 bases built here with transformers (no hub), adapters written as the servers write
them (the local backend's SkyRL export: "target_modules": null; hosted Tinker's: the output head named
`unembed_tokens`), served through the export test's 127.0.0.1 archive route. Each check compares, token by
token, the log-probabilities of the base with the exported adapter loaded by PEFT against the model
`tinker_checkpoints.py merge` writes."""
import json
import logging
import re
import warnings

import pytest

import tinker_checkpoints
from test_checkpoints_export import RUN, run, server, tar_bytes  # noqa: F401 (server is a fixture)

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config,  # noqa: E402
                          Qwen3ForCausalLM)

R, ALPHA, VOCAB, HIDDEN, FFN, HEAD_DIM = 4, 32, 64, 16, 32, 8
LINEAR = {"self_attn.q_proj": (HIDDEN, 2 * HEAD_DIM), "self_attn.k_proj": (HIDDEN, HEAD_DIM),
          "self_attn.v_proj": (HIDDEN, HEAD_DIM), "self_attn.o_proj": (2 * HEAD_DIM, HIDDEN),
          "mlp.gate_proj": (HIDDEN, FFN), "mlp.up_proj": (HIDDEN, FFN), "mlp.down_proj": (FFN, HIDDEN)}
ALL_LINEAR = sorted(m.split(".")[1] for m in LINEAR)
TOKENS = [3, 17, 42, 5, 60, 11, 29, 8, 33, 50, 1, 24]
HEAD = "base_model.model.model.unembed_tokens"


def tiny_base(path, family, tied=False):
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM, tie_word_embeddings=tied)
    model = LlamaForCausalLM(LlamaConfig(**shape)) if family == "llama" else Qwen3ForCausalLM(Qwen3Config(**shape))
    model.save_pretrained(path)
    return path


def adapter_tensors(head=False):
    """Every linear layer of both blocks, LoRA B far from zero (the update is large, as after training)."""
    torch.manual_seed(1)
    tensors = {}
    for layer in range(2):
        for module, (fan_in, fan_out) in LINEAR.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(R, fan_in) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, R) * 0.5
    if head:  # hosted Tinker's output head (train_unembed, the SDK's default)
        tensors[f"{HEAD}.lora_A.weight"] = torch.randn(R, HIDDEN) * 0.5
        tensors[f"{HEAD}.lora_B.weight"] = torch.randn(VOCAB, R) * 0.5
    return tensors


def write_adapter(path, tensors):
    """As SkyRL's save_lora_checkpoint writes it: peft.LoraConfig(r, lora_alpha) and no target_modules."""
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": None, "task_type": None,
         "base_model_name_or_path": "Qwen/Qwen3-8B"}))
    return path


def serve(server, adapter):  # noqa: F811
    server.archive = tar_bytes([(f.name, f.read_bytes()) for f in sorted(adapter.iterdir())])


def logprobs(model):
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return torch.tensor([logp[i - 1, TOKENS[i]].item() for i in range(1, len(TOKENS))])


def peft_loaded(base, adapter, caplog):
    """The base with the adapter as PEFT loads it, and what PEFT and transformers warned about the adapter:
    missing or unexpected keys, target modules, tied weights (not the deprecation notices one version of
    transformers gives another's PEFT; PEFT says nothing of unexpected keys, which every_tensor_loaded checks)."""
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        loaded = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    return loaded, [m for m in said if re.search(r"key|missing|unexpected|target|tie", m, re.IGNORECASE)]


def merged(capsys, adapter, base, out):
    code, result = run(capsys, "merge", str(adapter), "--base", str(base), "--out", str(out), "--dtype", "float32")
    assert code == 0, result
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


def every_tensor_loaded(model, adapter):
    """Each tensor of the adapter file is a parameter of the PEFT model, with its values (none dropped)."""
    params = {k.replace(".default", ""): v for k, v in model.state_dict().items()}
    for key, value in load_file(str(adapter / "adapter_model.safetensors")).items():
        assert key in params, key
        torch.testing.assert_close(params[key], value)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_export_lists_every_target_module_and_peft_then_matches_the_merged_model(
        server, tmp_path, capsys, caplog, family):  # noqa: F811
    base = tiny_base(tmp_path / "base", family)
    original = write_adapter(tmp_path / "server-side", adapter_tensors())
    serve(server, original)
    code, result = run(capsys, "export", f"tinker://{RUN}/sampler_weights/final", "--out", str(tmp_path / "adapter"))
    assert code == 0, result
    assert result["target_modules"] == ALL_LINEAR and result["peft_ready"] is True
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ALL_LINEAR  # was null: PEFT then took q_proj and v_proj only

    loaded, said = peft_loaded(base, tmp_path / "adapter", caplog)
    assert said == []
    every_tensor_loaded(loaded, tmp_path / "adapter")
    reference = logprobs(merged(capsys, original, base, tmp_path / "merged"))
    gap = (logprobs(loaded) - reference).abs().max().item()
    assert gap < 1e-3
    base_gap = (logprobs(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)) - reference).abs().max()
    assert base_gap > 0.1  # the adapter moves the model: a dropped module would show


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_peft_export_maps_tinkers_unembed_tokens_to_lm_head_and_matches_the_merged_model(
        server, tmp_path, capsys, caplog, family):  # noqa: F811
    base = tiny_base(tmp_path / "base", family)
    original = write_adapter(tmp_path / "server-side", adapter_tensors(head=True))
    serve(server, original)
    out = tmp_path / "adapter"
    code, result = run(capsys, "export", f"tinker://{RUN}/sampler_weights/final", "--out", str(out), "--peft")
    assert code == 0, result
    assert result["target_modules"] == sorted(ALL_LINEAR + ["lm_head"]) and result["renamed"] == [HEAD]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == result["target_modules"] and config["task_type"] == "CAUSAL_LM"
    names = load_file(str(out / "adapter_model.safetensors"))
    assert "base_model.model.lm_head.lora_B.weight" in names and not any("unembed_tokens" in k for k in names)
    torch.testing.assert_close(names["base_model.model.lm_head.lora_B.weight"],
                               load_file(str(original / "adapter_model.safetensors"))[f"{HEAD}.lora_B.weight"])

    loaded, said = peft_loaded(base, out, caplog)
    assert said == []
    every_tensor_loaded(loaded, out)
    reference = logprobs(merged(capsys, original, base, tmp_path / "merged"))
    assert (logprobs(loaded) - reference).abs().max().item() < 1e-3


def test_plain_export_of_tinker_names_says_it_is_not_peft_ready(server, tmp_path, capsys):  # noqa: F811
    serve(server, write_adapter(tmp_path / "server-side", adapter_tensors(head=True)))
    code = tinker_checkpoints.main(["export", f"tinker://{RUN}/sampler_weights/final", "--out", str(tmp_path / "a")])
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert code == 0, result
    # the tensors as the server wrote them, listed truthfully; the note on stderr names --peft
    assert result["peft_ready"] is False and "unembed_tokens" in result["target_modules"]
    assert "Tinker's names: base_model.model.model.unembed_tokens); next: export it again with --peft" in err


@pytest.mark.parametrize("extra, what", [
    ({"base_model.model.model.embed_tokens.lora_A.weight": (VOCAB, R),
      "base_model.model.model.embed_tokens.lora_B.weight": (R, HIDDEN)}, "an input-embedding LoRA"),
    ({"base_model.model.model.layers.0.mlp.experts.w1.lora_A.weight": (4, R, HIDDEN),
      "base_model.model.model.layers.0.mlp.experts.w1.lora_B.weight": (4, FFN, R)}, "Tinker's own layout (3-D expert"),
], ids=["embedding", "moe-experts"])
def test_peft_export_refuses_what_peft_or_vllm_cannot_take_and_names_the_merge(
        server, tmp_path, capsys, extra, what):  # noqa: F811
    tensors = {**adapter_tensors(), **{k: torch.zeros(shape) for k, shape in extra.items()}}
    serve(server, write_adapter(tmp_path / "server-side", tensors))
    out = tmp_path / "adapter"
    code, result = run(capsys, "export", f"tinker://{RUN}/sampler_weights/final", "--out", str(out), "--peft")
    assert code == 2
    assert what in result["error"] and "--peft: not written" in result["error"]
    assert f"tinker_checkpoints.py export tinker://{RUN}/sampler_weights/final --out {out} && " in result["error"]
    assert f"tinker_checkpoints.py merge {out} --base BASE_DIR --out merged/" in result["error"]
    assert not out.exists() and list(tmp_path.glob(".adapter.partial-*")) == []


def test_on_a_tied_base_peft_warns_about_the_adapted_head(server, tmp_path, capsys, caplog):  # noqa: F811
    """What checkpoints.md says of Qwen3-0.6B-like bases: PEFT warns of a LoRA on a tied lm_head (merge unties)."""
    base = tiny_base(tmp_path / "base", "qwen3", tied=True)
    serve(server, write_adapter(tmp_path / "server-side", adapter_tensors(head=True)))
    code, result = run(capsys, "export", f"tinker://{RUN}/sampler_weights/final", "--out", str(tmp_path / "a"),
                       "--peft")
    assert code == 0, result
    _, said = peft_loaded(base, tmp_path / "a", caplog)
    assert any("`tie_word_embeddings=True` and a tied layer is part of the adapter" in m for m in said), said
