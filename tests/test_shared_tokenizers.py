"""tests/shared_tokenizers.py: in a test process a tokenizer is parsed once and its Rust tokenizer lent to one
live Python tokenizer at a time, reset and checked before the next loan; never stale, never shared by two."""
import gc
import os
import shutil

import pytest

import shared_tokenizers

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]
TEXT = "<|im_start|>user\nHello, wörld! 1234<|im_end|>\n<think>\n\n</think>"


@pytest.fixture
def shared(monkeypatch):
    """AutoTokenizer.from_pretrained through the pool, whether or not the session turned it on."""
    monkeypatch.delenv("TINKER_TEST_SHARE_TOKENIZERS", raising=False)
    mine = shared_tokenizers.install()
    from transformers import AutoTokenizer
    yield AutoTokenizer
    if mine:
        shared_tokenizers.uninstall()


def looks(tok) -> tuple:
    """What a script sees of a tokenizer: tokens, template, special tokens, padding."""
    return (tok.encode(TEXT), tok.apply_chat_template(CHAT, tokenize=False), tok.apply_chat_template(CHAT),
            tok.all_special_ids, tok.pad_token, tok.eos_token, len(tok), tok.padding_side,
            tok(["a", "a b c"], padding=True)["input_ids"], tok.backend_tokenizer.padding, tok.chat_template)


def test_a_load_is_a_parsed_once_copy_that_behaves_as_a_real_load(shared, offline_tokenizer, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(offline_tokenizer("Qwen3-8B"), folder)
    real = shared_tokenizers.real_from_pretrained(str(folder))
    before = dict(shared_tokenizers.STATS)
    a = shared.from_pretrained(str(folder))
    b = shared.from_pretrained(str(folder))          # a is alive: b gets a Rust tokenizer of its own
    assert a is not b and a.backend_tokenizer is not b.backend_tokenizer
    assert shared_tokenizers.STATS["loaded"] - before["loaded"] == 2
    lent = a.backend_tokenizer
    del a
    gc.collect()
    c = shared.from_pretrained(str(folder))          # a is gone: its Rust tokenizer is lent again, no parse
    assert c.backend_tokenizer is lent and shared_tokenizers.STATS["loaded"] - before["loaded"] == 2
    assert looks(c) == looks(b) == looks(real)
    assert type(c) is type(real) and c.__dict__.keys() == real.__dict__.keys()


def test_nothing_one_user_changes_is_seen_by_the_next(shared, offline_tokenizer, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(offline_tokenizer("Qwen3-8B"), folder)
    expected = looks(shared_tokenizers.real_from_pretrained(str(folder)))
    first = shared.from_pretrained(str(folder))
    lent = first.backend_tokenizer
    first.chat_template = "{{ 'changed' }}"          # Python state: the copy's own
    first.padding_side = "left"
    first.pad_token = "<|im_end|>"
    first.backend_tokenizer.enable_padding(length=64)  # reset before the next loan
    first.backend_tokenizer.enable_truncation(8)
    del first
    gc.collect()
    second = shared.from_pretrained(str(folder))
    assert second.backend_tokenizer is lent and looks(second) == expected
    dropped = shared_tokenizers.STATS["dropped"]
    second.add_tokens(["<my_new_token>"])            # the Rust tokenizer's vocabulary: never lent again
    del second
    gc.collect()
    third = shared.from_pretrained(str(folder))
    assert third.backend_tokenizer is not lent and shared_tokenizers.STATS["dropped"] == dropped + 1
    assert looks(third) == expected and "<my_new_token>" not in third.get_vocab()


def test_edited_files_are_parsed_again(shared, offline_tokenizer, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(offline_tokenizer("Qwen3-8B"), folder)
    old = shared.from_pretrained(str(folder))
    old_looks = looks(old)
    del old
    gc.collect()
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    new = shared.from_pretrained(str(folder))
    assert new.apply_chat_template(CHAT, tokenize=False) == "[system]Be brief.[user]2+2?[assistant]4"
    assert looks(new) != old_looks


def test_keywords_are_part_of_the_key_and_remote_code_is_never_shared(shared, offline_tokenizer, monkeypatch):
    name = offline_tokenizer("Qwen3-8B")
    left = shared.from_pretrained(name, padding_side="left")
    right = shared.from_pretrained(name)
    assert left.padding_side == "left" and right.padding_side == "right"
    calls = []
    monkeypatch.setattr(shared_tokenizers, "_lend", lambda *a: calls.append(a))
    shared.from_pretrained(name, trust_remote_code=True)
    assert calls == [] and os.path.isdir(name)
