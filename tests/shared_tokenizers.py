"""`AutoTokenizer.from_pretrained` in a pytest process, parsed once: test infrastructure only.

Why: loading Qwen3's tokenizer costs ~0.6 s of CPU (transformers `json.load`s the whole tokenizer.json for its
added tokens, then `tokenizers` parses it again), and the tests load tokenizers in-process a few hundred times per
worker (scripts' `load_tokenizer` called by unit tests, in-process `main()` runs): ~210 s of the suite's CPU in
the 6 December profile. `copy.deepcopy` of a tokenizer costs as much as a load (it serialises the Rust tokenizer
to JSON and parses it back), so a cache must not deep-copy, and it must not hand two tests one object either.

How: a load of (name, keywords) returns a new tokenizer object whose Python state (special tokens, chat template,
init keywords, padding side ...) is a deep copy of a pristine one loaded earlier (~0.2 ms), and whose Rust
tokenizer (`backend_tokenizer`) is *lent*: one Rust tokenizer serves at most one live Python tokenizer at a time.
When that object is garbage (a weak reference tells), its Rust tokenizer goes back to the pool; before it is lent
again its padding and truncation are reset to the pristine ones (transformers sets both before every encode
anyway) and the rest of its state is compared with the pristine state (`backend_state`: added tokens, normalizer,
pre-tokenizer, post-processor, decoder, the model's type, size and settings); one that differs is dropped, never
lent again. While a loan is out (a session fixture's tokenizer, or two loads in one test), the next load of the
same key gets another pristine Rust tokenizer: the pool grows to the most that are alive at once.

A pristine entry is used only while the files it was loaded from (the folder, or the hub cache's snapshot: names,
sizes, modification times) are unchanged. Not shared: `trust_remote_code`, positional arguments beyond the name,
keywords that are not plain data. Off: TINKER_TEST_SHARE_TOKENIZERS=0. Forked script runs share tokenizers their
own way (tests/forked_scripts.py: the fork gives each child its own copy).
"""
from __future__ import annotations

import copy
import gc
import inspect
import json
import os
import threading
import weakref

import forked_scripts

STATS = {"loaded": 0, "lent": 0, "dropped": 0}
_POOLS: dict[str, list["_Entry"]] = {}
_LOCK = threading.RLock()
_ORIGINAL = None


class _Entry:
    """One pristine tokenizer: its files' fingerprint, its Rust tokenizer's state, and the live loan if any."""

    def __init__(self, files, tokenizer):
        self.files, self.tokenizer = files, tokenizer
        backend = tokenizer.backend_tokenizer
        self.padding, self.truncation = backend.padding, backend.truncation
        self.state = backend_state(backend)
        self.loan: weakref.ref | None = None

    def free(self) -> bool:
        return self.loan is None or self.loan() is None

    def restored(self) -> bool:
        """Back to its state at load: padding and truncation reset, the rest compared (False: never lend it)."""
        backend = self.tokenizer.backend_tokenizer
        if backend.padding != self.padding:
            if self.padding is None:
                backend.no_padding()
            else:
                backend.enable_padding(**self.padding)
        if backend.truncation != self.truncation:
            if self.truncation is None:
                backend.no_truncation()
            else:
                backend.enable_truncation(**self.truncation)
        return backend.padding == self.padding and backend.truncation == self.truncation \
            and backend_state(backend) == self.state


def backend_state(backend) -> str:
    """Everything of a Rust tokenizer a test could change, but padding and truncation and the model's vocabulary
    itself (not changeable in place): added tokens, the pipeline's parts, the model's type, size and settings."""
    model = backend.model
    settings = {name: repr(getattr(model, name, None)) for name in sorted(dir(type(model)))
                if not name.startswith("_") and inspect.isdatadescriptor(getattr(type(model), name, None))}
    parts = {name: _part_state(getattr(backend, name)) for name in ("normalizer", "pre_tokenizer",
                                                                    "post_processor", "decoder")}
    added = sorted((i, repr(t)) for i, t in backend.get_added_tokens_decoder().items())
    return json.dumps([type(model).__name__, settings, parts, added, backend.get_vocab_size(with_added_tokens=False),
                       backend.get_vocab_size(with_added_tokens=True),
                       repr(getattr(backend, "encode_special_tokens", None))], sort_keys=True, default=repr)


def _part_state(part) -> str | None:
    if part is None:
        return None
    state = part.__getstate__()
    return state.decode() if isinstance(state, bytes) else repr(state)


def _clone(entry: _Entry):
    """A new tokenizer object: the pristine Python state deep-copied, the Rust tokenizer lent."""
    pristine = entry.tokenizer
    tokenizer = object.__new__(type(pristine))
    tokenizer.__dict__.update({k: v if k == "_tokenizer" else copy.deepcopy(v) for k, v in pristine.__dict__.items()})
    entry.loan = weakref.ref(tokenizer)
    STATS["lent"] += 1
    return tokenizer


def _lend(key: str, name: str, load):
    files = forked_scripts.tokenizer_files(name)
    if files is None:
        return None
    with _LOCK:
        pool = _POOLS.setdefault(key, [])
        pool[:] = [e for e in pool if e.files == files]
        for attempt in range(2):
            for entry in [e for e in pool if e.free()]:
                if entry.restored():
                    return _clone(entry)
                pool.remove(entry)
                STATS["dropped"] += 1
            if attempt == 0 and pool:
                gc.collect()  # a tokenizer in a reference cycle is garbage only after a collection
        tokenizer = load()
        if getattr(tokenizer, "backend_tokenizer", None) is None or not hasattr(tokenizer, "__dict__"):
            return tokenizer  # a slow (pure Python) tokenizer: not shared
        entry = _Entry(files, tokenizer)
        pool.append(entry)
        STATS["loaded"] += 1
        return _clone(entry)


def install() -> bool:
    """Patch AutoTokenizer.from_pretrained in this process; False when TINKER_TEST_SHARE_TOKENIZERS=0."""
    global _ORIGINAL
    if os.environ.get("TINKER_TEST_SHARE_TOKENIZERS", "1") == "0" or _ORIGINAL is not None:
        return False
    from transformers import AutoTokenizer
    _ORIGINAL = AutoTokenizer.__dict__["from_pretrained"]
    original = _ORIGINAL.__func__

    def from_pretrained(cls, *args, **kwargs):
        key = forked_scripts.tokenizer_key(args, kwargs)
        if key is not None:
            shared = _lend(key, os.fspath(args[0]), lambda: original(cls, *args, **kwargs))
            if shared is not None:
                return shared
        return original(cls, *args, **kwargs)

    AutoTokenizer.from_pretrained = classmethod(from_pretrained)
    return True


def real_from_pretrained(*args, **kwargs):
    """A load that bypasses the pool (for tests of it)."""
    from transformers import AutoTokenizer
    loader = _ORIGINAL.__func__ if _ORIGINAL is not None else AutoTokenizer.from_pretrained.__func__
    return loader(AutoTokenizer, *args, **kwargs)


def uninstall() -> None:
    global _ORIGINAL
    if os.environ.get("TINKER_TEST_SHARE_TOKENIZERS_STATS"):
        with open(os.environ["TINKER_TEST_SHARE_TOKENIZERS_STATS"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **STATS}) + "\n")
    if _ORIGINAL is not None:
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained = _ORIGINAL
        _ORIGINAL = None
    _POOLS.clear()
