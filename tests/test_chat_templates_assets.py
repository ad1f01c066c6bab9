"""The offline tokenizer builder (tests/assets/build_tokenizers.py): folders load offline, carry the
real vocabularies (known ids), are reused, and a wrong vocabulary or template never gets published."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from assets import build_tokenizers as bt

VOCAB_SIZES = {"Qwen3-8B": 151669, "Qwen3-8B-Base": 151669, "Qwen3.5-4B": 248077,
               "Llama-3.1-8B-Instruct": 128256, "DeepSeek-V3.1": 128815, "gpt-oss-20b": 201088,
               "Kimi-K2-Thinking": 163840, "Nemotron-3-Nano-30B-A3B": 131072}
EOS = {"Qwen3-8B": "<|im_end|>", "Qwen3-8B-Base": "<|endoftext|>", "Qwen3.5-4B": "<|im_end|>",
       "Llama-3.1-8B-Instruct": "<|eot_id|>", "DeepSeek-V3.1": "<｜end▁of▁sentence｜>",
       "gpt-oss-20b": "<|return|>", "Kimi-K2-Thinking": "[EOS]", "Nemotron-3-Nano-30B-A3B": "<|im_end|>"}


@pytest.mark.parametrize("name", bt.NAMES)
def test_folder_loads_offline_with_the_real_vocabulary(offline_tokenizer, name):
    from transformers import AutoTokenizer

    folder = Path(offline_tokenizer(name))
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == VOCAB_SIZES[name]
    assert tok.eos_token == EOS[name]
    for text, ids in bt.KNOWN_IDS[name]:
        assert tok.encode(text, add_special_tokens=False) == ids
        assert tok.decode(ids) == text
    record = json.loads((folder / "BUILD.json").read_text())
    assert record["builder_version"] == bt.BUILDER_VERSION and record["checked"] >= len(bt.KNOWN_IDS[name]) + 12
    assert (tok.chat_template is None) == (name == "Qwen3-8B-Base")


def test_llama_encode_adds_bos_like_meta_hf_tokenizer(offline_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(offline_tokenizer("Llama-3.1-8B-Instruct"))
    assert tok.encode("hi") == [128000, 6151]


def test_a_built_folder_is_reused_without_touching_the_network(offline_tokenizer, monkeypatch):
    folder = offline_tokenizer("Qwen3-8B")
    monkeypatch.setattr(bt, "fetch_sources", lambda root: pytest.fail("rebuilt a folder that exists"))
    assert str(bt.build("Qwen3-8B")) == folder


def test_verification_rejects_a_folder_with_the_wrong_vocabulary(offline_tokenizer, tmp_path):
    impostor = tmp_path / "Qwen3-8B"
    shutil.copytree(offline_tokenizer("Qwen3-8B"), impostor)
    shutil.copyfile(Path(offline_tokenizer("Qwen3.5-4B")) / "tokenizer.json", impostor / "tokenizer.json")
    with pytest.raises(RuntimeError, match=r"Qwen3-8B: 'Hello world' -> \[9419, 1814\], expected \[9707, 1879\]"):
        bt.verify("Qwen3-8B", impostor, bt.cache_root() / "src")


def test_deepseek_template_patch_restores_the_hf_think_markers(offline_tokenizer):
    offline_tokenizer("DeepSeek-V3.1")  # the sources are unpacked by the first build
    src = bt.cache_root() / "src"
    original = bt.template(src, "deepseek-ai-DeepSeek-V3.1.jinja")
    patched = bt.patch_deepseek_v31_template(original)
    assert original.count("<think></think>") == 3 and "<think></think>" not in patched
    assert patched.count("{{'<｜Assistant｜></think>'}}") == 1
    assert "| tojson" not in patched
    with pytest.raises(RuntimeError, match="the sdist copy changed"):
        bt.patch_deepseek_v31_template(patched)


def test_cli_rejects_an_unknown_name_with_exit_2():
    script = Path(bt.__file__)
    done = subprocess.run([sys.executable, str(script), "Mistral-7B"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "unknown tokenizer(s) ['Mistral-7B']" in done.stderr and done.stdout == ""
