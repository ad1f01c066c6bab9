"""tinker_checkpoints.py merge offline: a SkyRL-layout adapter merged into a tiny random Qwen3 gives exactly
W + (alpha / r) * B @ A on every targeted module, and leaves a tied output head unchanged."""
import json

import pytest

import tinker_checkpoints

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
    code = tinker_checkpoints.main(list(argv))
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_merge_applies_every_lora_module_and_keeps_the_tied_head(base_dir, tmp_path, capsys):
    adapter = skyrl_adapter(tmp_path / "adapter")
    code, result = run(capsys, "merge", str(tmp_path / "adapter"), "--base", str(base_dir),
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
    code, result = run(capsys, "merge", str(tmp_path / "adapter"), "--base", str(base_dir),
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
    code, result = run(capsys, "merge", str(tmp_path / "adapter"), "--base", str(base_dir),
                       "--out", str(tmp_path / "merged"))
    assert code == 1
    assert "match no module" in result["error"]
    assert not (tmp_path / "merged").exists()


def test_modules_come_from_the_tensors_when_the_config_names_fewer(base_dir, tmp_path, capsys):
    adapter = skyrl_adapter(tmp_path / "adapter", with_embedding=False)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
    code, result = run(capsys, "merge", str(tmp_path / "adapter"), "--base", str(base_dir),
                       "--out", str(tmp_path / "merged"), "--dtype", "float32")
    assert code == 0, result
    assert "down_proj" in result["target_modules"]
    base = load_file(str(base_dir / "model.safetensors"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj"
    a, b = adapter[f"base_model.model.{key}.lora_A.weight"], adapter[f"base_model.model.{key}.lora_B.weight"]
    torch.testing.assert_close(merged[f"{key}.weight"], base[f"{key}.weight"] + ALPHA / R * b @ a)


# ---- Tinker's own names (hosted Tinker exports): the output head is `unembed_tokens`


def untied_base(tmp_path):
    torch.manual_seed(2)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "untied")
    return tmp_path / "untied"


def tinker_named_adapter(path):
    """Dense layers as PEFT names them, plus the head as hosted Tinker names it (train_unembed, the SDK's default)."""
    tensors = skyrl_adapter(path, with_embedding=False)
    torch.manual_seed(3)
    tensors["base_model.model.model.unembed_tokens.lora_A.weight"] = torch.randn(R, HIDDEN)
    tensors["base_model.model.model.unembed_tokens.lora_B.weight"] = torch.randn(VOCAB, R) * 0.1
    save_file(tensors, path / "adapter_model.safetensors")
    return tensors


@pytest.mark.parametrize("tied", [True, False], ids=["tied-base", "untied-base"])
def test_tinkers_unembed_tokens_merges_into_the_output_head_only(base_dir, tmp_path, capsys, tied):
    base_path = base_dir if tied else untied_base(tmp_path)
    adapter = tinker_named_adapter(tmp_path / "adapter")
    code, result = run(capsys, "merge", str(tmp_path / "adapter"), "--base", str(base_path),
                       "--out", str(tmp_path / "merged"), "--dtype", "float32")
    assert code == 0, result
    assert result["renamed"] == ["base_model.model.model.unembed_tokens"]
    assert "lm_head" in result["target_modules"] and "unembed_tokens" not in result["target_modules"]
    assert result["untied_embeddings"] is tied
    base = load_file(str(base_path / "model.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).state_dict()
    a = adapter["base_model.model.model.unembed_tokens.lora_A.weight"]
    b = adapter["base_model.model.model.unembed_tokens.lora_B.weight"]
    head = base["model.embed_tokens.weight"] if tied else base["lm_head.weight"]
    torch.testing.assert_close(merged["lm_head.weight"], head + ALPHA / R * b @ a)
    # The head's update stays out of the input embedding (a tied base is untied, not merged into the shared matrix).
    torch.testing.assert_close(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    key = "model.layers.0.self_attn.q_proj"
    a, b = adapter[f"base_model.model.{key}.lora_A.weight"], adapter[f"base_model.model.{key}.lora_B.weight"]
    torch.testing.assert_close(merged[f"{key}.weight"], base[f"{key}.weight"] + ALPHA / R * b @ a)


@pytest.mark.parametrize("layout, tensors", [
    ("3-D expert tensors", {"base_model.model.model.layers.0.mlp.experts.w1.lora_A.weight": (4, R, HIDDEN),
                            "base_model.model.model.layers.0.mlp.experts.w1.lora_B.weight": (4, 32, R)}),
    ("gpt-oss's .attn", {"base_model.model.model.layers.0.attn.q_proj.lora_A.weight": (R, HIDDEN),
                         "base_model.model.model.layers.0.attn.q_proj.lora_B.weight": (16, R)}),
    ("split in_proj_q/k/v", {"base_model.model.model.layers.0.linear_attn.in_proj_q.lora_A.weight": (R, HIDDEN),
                             "base_model.model.model.layers.0.linear_attn.in_proj_q.lora_B.weight": (16, R)}),
], ids=["moe-experts", "gpt-oss-attn", "qwen3.5-split-qkv"])
def test_tinkers_other_layouts_name_the_cookbook_converter_not_the_base(base_dir, tmp_path, capsys, layout, tensors):
    (tmp_path / "adapter").mkdir()
    save_file({k: torch.zeros(shape) for k, shape in tensors.items()}, tmp_path / "adapter" / "adapter_model.safetensors")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": R,
                                                                          "lora_alpha": ALPHA}))
    code, result = run(capsys, "merge", str(tmp_path / "adapter"), "--base", str(base_dir),
                       "--out", str(tmp_path / "merged"))
    assert code == 1
    assert f"Tinker's own layout ({layout}, first " in result["error"]
    assert "weights.build_hf_model" in result["error"] and "is --base" not in result["error"]
    assert not (tmp_path / "merged").exists()
