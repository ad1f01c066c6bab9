"""checkpoints merge offline: a SkyRL-layout adapter merged into a tiny random Qwen3 gives exactly
W + (alpha / r) * B @ A on every targeted module, and leaves a tied output head unchanged."""
import json

import pytest

import tinker_infer

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

R, ALPHA, VOCAB, HIDDEN = 4, 32, 64, 16
LINEAR = {"self_attn.q_proj": (HIDDEN, 2 * 8), "self_attn.k_proj": (HIDDEN, 8), "self_attn.v_proj": (HIDDEN, 8),
          "self_attn.o_proj": (2 * 8, HIDDEN), "mlp.gate_proj": (HIDDEN, 32), "mlp.up_proj": (HIDDEN, 32),
          "mlp.down_proj": (32, HIDDEN)}  # module -> (in, out)


@pytest.fixture
def base_dir(tmp_path):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "tokenizer_config.json").write_text("{}")
    return tmp_path / "base"


def skyrl_adapter(path, with_embedding=True):
    """The layout SkyRL's JAX backend exports: no target_modules, embedding LoRA as [vocab, r] @ [r, hidden]."""
    torch.manual_seed(1)
    tensors = {}
    for module, (fan_in, fan_out) in LINEAR.items():
        prefix = f"base_model.model.model.layers.0.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(R, fan_in)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, R) * 0.1
    if with_embedding:
        tensors["base_model.model.model.embed_tokens.lora_A.weight"] = torch.randn(VOCAB, R)
        tensors["base_model.model.model.embed_tokens.lora_B.weight"] = torch.randn(R, HIDDEN) * 0.1
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": None, "base_model_name_or_path": "x"}))
    return tensors


def run(capsys, *argv):
    code = tinker_infer.main(list(argv))
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_merge_applies_every_lora_module_and_keeps_the_tied_head(base_dir, tmp_path, capsys):
    adapter = skyrl_adapter(tmp_path / "adapter")
    code, result = run(capsys, "checkpoints", "merge", str(tmp_path / "adapter"), "--base", str(base_dir),
                       "--out", str(tmp_path / "merged"), "--dtype", "float32")
    assert code == 0, result
    assert result["target_modules"] == sorted(["down_proj", "embed_tokens", "gate_proj", "k_proj", "o_proj",
                                               "q_proj", "up_proj", "v_proj"])
    assert result["untied_embeddings"] is True
    assert (tmp_path / "merged" / "tokenizer_config.json").exists()

    base = load_file(str(base_dir / "model.safetensors"))
    merged_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    merged = {k: v for k, v in merged_model.state_dict().items()}
    scale = ALPHA / R
    for module in LINEAR:
        key = f"model.layers.0.{module}"
        a, b = adapter[f"base_model.model.{key}.lora_A.weight"], adapter[f"base_model.model.{key}.lora_B.weight"]
        torch.testing.assert_close(merged[f"{key}.weight"], base[f"{key}.weight"] + scale * b @ a)
    a = adapter["base_model.model.model.embed_tokens.lora_A.weight"]
    b = adapter["base_model.model.model.embed_tokens.lora_B.weight"]
    torch.testing.assert_close(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"] + scale * a @ b)
    # The output head still projects with the base matrix, as the server computes it.
    torch.testing.assert_close(merged["lm_head.weight"], base["model.embed_tokens.weight"])
    assert merged_model.config.tie_word_embeddings is False


def test_merge_without_embedding_lora_keeps_embeddings_tied(base_dir, tmp_path, capsys):
    skyrl_adapter(tmp_path / "adapter", with_embedding=False)
    code, result = run(capsys, "checkpoints", "merge", str(tmp_path / "adapter"), "--base", str(base_dir),
                       "--out", str(tmp_path / "merged"), "--dtype", "float32")
    assert code == 0, result
    assert result["untied_embeddings"] is False and "embed_tokens" not in result["target_modules"]


def test_adapter_for_another_architecture_fails_loudly(base_dir, tmp_path, capsys):
    (tmp_path / "adapter").mkdir()
    save_file({"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight": torch.zeros(R, HIDDEN),
               "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight": torch.zeros(HIDDEN, R)},
              tmp_path / "adapter" / "adapter_model.safetensors")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj"]}))
    code, result = run(capsys, "checkpoints", "merge", str(tmp_path / "adapter"), "--base", str(base_dir),
                       "--out", str(tmp_path / "merged"))
    assert code == 1
    assert "match no module" in result["error"]
    assert not (tmp_path / "merged").exists()


def test_modules_come_from_the_tensors_when_the_config_names_fewer(base_dir, tmp_path, capsys):
    adapter = skyrl_adapter(tmp_path / "adapter", with_embedding=False)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
    code, result = run(capsys, "checkpoints", "merge", str(tmp_path / "adapter"), "--base", str(base_dir),
                       "--out", str(tmp_path / "merged"), "--dtype", "float32")
    assert code == 0, result
    assert "down_proj" in result["target_modules"]
    base = load_file(str(base_dir / "model.safetensors"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj"
    a, b = adapter[f"base_model.model.{key}.lora_A.weight"], adapter[f"base_model.model.{key}.lora_B.weight"]
    torch.testing.assert_close(merged[f"{key}.weight"], base[f"{key}.weight"] + ALPHA / R * b @ a)
