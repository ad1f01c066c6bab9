#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = ["httpx>=0.27"]
# ///
"""Tinker prices, a TINKER_PRICING.md for your project, and cost estimates that match Tinker's metering.

**Run:**
    python tinker_pricing.py init --out . && python tinker_pricing.py list --family qwen
    python tinker_pricing.py estimate-rl --model Qwen/Qwen3-8B --iterations 50 --tasks-per-iter 32 \\
        --group-size 8 --avg-prompt 300 --avg-completion 400 --max-usd 25

**Edit:** nothing for the common case. Prices live in `SNAPSHOT` below (dated `CATALOGUE_DATE`);
`refresh` stores the live models.json as an override instead of editing code.

**Outputs:** human tables and warnings on stderr; one JSON object on stdout (`--json` silences stderr).
`init` writes `TINKER_PRICING.md`; `refresh` writes the price override file (`TINKER_PRICES_FILE`,
default `~/.cache/tinker-training-inference/models-prices.json`). `list --markdown` prints the
catalogue as a markdown table instead of JSON.

**Requires:** nothing but the standard library for the catalogue and estimates; `httpx` for
`refresh`, `transformers` for `estimate-sft --data`. No environment variables (no API key).

**Import:** tinker_sft.py / tinker_rl.py load this file from their own folder and call
`preflight(model, tokens, max_usd)`; see also `resolve_model`, `estimate_cost`, `rl_tokens`,
`sft_tokens`, `sample_tokens`.

Exit codes: 0 ok · 1 runtime failure (e.g. a malformed live models.json) · 2 bad input or unknown
model · 3 estimate above --max-usd · 4 cannot reach the price table · 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

# ==== SETTINGS ====
DEFAULT_MODEL = "Qwen/Qwen3-8B"
CATALOGUE_DATE = "2026-10-07"  # newest source behind the snapshot (billed prices incl. promotions)
STORAGE_USD_PER_GB_MONTH = 0.10
# What an estimate's total leaves out, said in its `not_counted` (a 0.0 would read as free).
NOT_COUNTED_STORAGE = (f"storage: checkpoints are billed ${STORAGE_USD_PER_GB_MONTH:.2f} per GB-month for as long as "
                       "they are kept, which an estimate cannot know (tinker_pricing.py estimate* --storage-gb-months X adds it)")
NOT_COUNTED_CHECKPOINTS = "checkpoint saves: Tinker meters checkpoint operations per checkpoint, at no published rate"
MODELS_JSON_URL = "https://tinker-docs.thinkingmachines.ai/tinker/models.json"
PRICING_PAGE_URL = "https://tinker-docs.thinkingmachines.ai/tinker/models/"
REFRESH_TIMEOUT_S = 10.0
# The docs host answers 403 to urllib's default User-Agent, so every fetch names itself.
USER_AGENT = "tinker-training-inference-pricing/0.1 (+https://tinker-docs.thinkingmachines.ai)"
PRICE_KINDS = ("prefill", "cached_prefill", "sample", "train")

# ==== EDIT ME: SNAPSHOT, the dated price catalogue (or run `refresh` instead) ====
# USD per 1M tokens as billed (promotions included): the 29 training rows of the Models & Pricing
# table as reconstructed from the sources below, the beta serverless rows, and the cookbook-0.6.1
# models with no published price. `None` means "not found in any source": never fill it with a
# guess. Where sources disagree, the row keeps one value and says so in `note`.
SOURCES = {  # ids used in each row's `sources`, with the date of their data
    "S3": "Leanmcp skill, eff. 2026-07-17", "S4": "sundial skill, eff. 2026-07-17",
    "S5": "dense-vs-MoE registry, 2026-07..09-04", "S6": "tinker-rl sweep, 2026-09-01",
    "S7": "Rust provider table, 2026-09", "S8": "api-evangelist pricing, 2026-10-07",
    "S9": "cameron.stream pricing.ts, 2026-10-07", "S10": "tinker-cookbook 0.6.1, ~2026-11",
}


def _row(id, family, params, type, context, prices, *, date, sources, list_price=None,
         promo=None, note=None, kind="training"):
    total, active = params if params else (None, None)
    prefill, cached, sample, train = prices if prices else (None, None, None, None)
    return {
        "id": id, "name": id.split("/", 1)[-1], "family": family, "kind": kind, "type": type,
        "arch": None if total is None else ("MoE" if active != total else "Dense"),
        "params_total_b": total, "params_active_b": active, "context": context,
        "prefill": prefill, "cached_prefill": cached, "sample": sample, "train": train,
        "list_price": list_price, "promo": promo, "source_date": date, "sources": sources,
        "note": note, "catalogue_date": CATALOGUE_DATE,
    }


_HALF = "Limited-time 50% discount"
_INK = "thinkingmachines/Inkling"
_NEMO = "nvidia/NVIDIA-Nemotron-3"
_NO_PRICE = "price unknown: in tinker-cookbook 0.6.1 but in no stored price table; check the pricing page"
SNAPSHOT = [
    _row(_INK, "Inkling", (975, 41), "Hybrid + Audio + Vision", 65536, (1.87, 0.374, 4.68, 5.61),
         date="2026-10-07", sources="S6 S7 S8 S4", promo=_HALF,
         list_price={"prefill": 3.74, "sample": 9.36, "train": 11.22}),
    _row(_INK + ":peft:262144", "Inkling", (975, 41), "Hybrid + Audio + Vision", 262144,
         (3.74, 0.748, 9.36, 11.22), date="2026-09", sources="S7 S4 S5 S9", promo=_HALF,
         list_price={"prefill": 7.48, "sample": 18.72, "train": 22.44},
         note="train 11.22 (S5 list/2) vs 11.23 (S4); 11.22 kept"),
    _row(_INK + "-Small", "Inkling", (276, 12), "Hybrid + Audio + Vision", 65536,
         (0.58, 0.116, 1.44, 1.73), date="2026-09", sources="S7 S5", promo=_HALF,
         list_price={"prefill": 1.16, "sample": 2.88, "train": 3.46},
         note="params 276B (cookbook) vs 266B (a leaderboard)"),
    _row(_INK + "-Small:peft:262144", "Inkling", (276, 12), "Hybrid + Audio + Vision", 262144,
         (1.16, 0.232, 2.89, None), date="2026-09", sources="S7 S9", promo=_HALF,
         list_price={"prefill": 2.32, "sample": 5.78, "train": None},
         note="train price not found in any source (3.46 only if the 2x list rule holds; not used)"),
    _row("nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16", "Nemotron 3.5", (30, 3), "Hybrid", 65536,
         (0.195, 0.039, 0.495, None), date="2026-09", sources="S7 S6",
         note="train price not found in any source"),
    _row("nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16:peft:262144", "Nemotron 3.5", (30, 3),
         "Hybrid", 262144, (0.26, 0.052, 0.66, None), date="2026-09", sources="S7",
         note="train price not found in any source"),
    _row(_NEMO + "-Ultra-550B-A55B-BF16", "Nemotron 3", (550, 55), "Hybrid", 65536,
         (2.49, 0.498, 6.225, 5.478), date="2026-09", sources="S3 S4 S5 S6 S7", promo=_HALF),
    _row(_NEMO + "-Ultra-550B-A55B-BF16:peft:262144", "Nemotron 3", (550, 55), "Hybrid", 262144,
         (3.32, 0.664, 8.30, 9.96), date="2026-09", sources="S3 S4 S7", promo=_HALF),
    _row(_NEMO + "-Super-120B-A12B-BF16", "Nemotron 3", (120, 12), "Hybrid", 65536,
         (0.57, 0.114, 1.44, 1.276), date="2026-09", sources="S3 S4 S5 S7", promo=_HALF),
    _row(_NEMO + "-Super-120B-A12B-BF16:peft:262144", "Nemotron 3", (120, 12), "Hybrid", 262144,
         (0.76, 0.152, 1.92, 2.32), date="2026-09", sources="S3 S4 S7", promo=_HALF),
    _row(_NEMO + "-Nano-30B-A3B-BF16", "Nemotron 3", (30, 3), "Hybrid", 65536,
         (0.195, 0.039, 0.495, 0.44), date="2026-09", sources="S3 S4 S7", promo=_HALF,
         note="S5 (2026-07-30) says the promotion ended: 0.39 / 0.99 / 0.88; S7 (Sep) still bills 0.195"),
    _row("zai-org/GLM-5.3:peft:262144", "GLM", (744, 40), "Reasoning", 262144,
         (4.86, 0.972, 12.15, 14.58), date="2026-09-04", sources="S5 S6 S7",
         note="256K is the only GLM-5.3 id; params 744B/40B (cookbook) vs 753B (S5, S6)"),
    _row("moonshotai/Kimi-K2.6", "Kimi", (1000, 32), "Reasoning + Vision", 32768,
         (2.205, 0.441, 5.49, 4.84), date="2026-09", sources="S3 S4 S6 S7",
         note="type Reasoning + Vision (models.json) vs Hybrid + Vision (cookbook)"),
    _row("moonshotai/Kimi-K2.6:peft:131072", "Kimi", (1000, 32), "Reasoning + Vision", 131072,
         (5.15, 1.03, 12.81, 15.40), date="2026-09", sources="S3 S4 S6 S7"),
    _row("Qwen/Qwen3.8-27B", "Qwen 3.8", (27, 27), "Hybrid + Vision", 65536,
         (1.86, 0.372, 5.595, 4.103), date="2026-10-07", sources="S5 S7 S9"),
    _row("Qwen/Qwen3.8-27B:peft:262144", "Qwen 3.8", (27, 27), "Hybrid + Vision", 262144,
         (2.48, 0.496, 7.46, 7.46), date="2026-10-07", sources="S5 S7 S9"),
    _row("Qwen/Qwen3.6-35B-A3B", "Qwen 3.6", (35, 3), "Hybrid + Vision", 65536,
         (0.54, 0.108, 1.335, 1.177), date="2026-10-07", sources="S3 S4 S5 S7 S9"),
    _row("Qwen/Qwen3.6-27B", "Qwen 3.6", (27, 27), "Hybrid + Vision", 65536,
         (1.86, 0.372, 5.595, 4.103), date="2026-10-07", sources="S3 S4 S5 S7 S9",
         note="announced to retire 2026-09-02 (S5, S6) yet still priced in S7/S9"),
    _row("Qwen/Qwen3.5-397B-A17B", "Qwen 3.5", (397, 17), "Hybrid + Vision", 65536,
         (3.00, 0.60, 7.50, 6.60), date="2026-10-07", sources="S3 S4 S5 S6 S7 S9"),
    _row("Qwen/Qwen3.5-397B-A17B:peft:262144", "Qwen 3.5", (397, 17), "Hybrid + Vision", 262144,
         (4.00, 0.80, 10.00, 12.00), date="2026-09", sources="S3 S4 S7"),
    _row("Qwen/Qwen3.5-35B-A3B-Base", "Qwen 3.5", (35, 3), "Base", 65536,
         (0.54, 0.108, 1.335, 1.177), date="2026-09", sources="S3 S4 S7"),
    _row("Qwen/Qwen3.5-9B", "Qwen 3.5", (9, 9), "Hybrid + Vision", 65536,
         (0.66, 0.132, 1.995, 1.463), date="2026-09", sources="S3 S4 S5 S7"),
    _row("Qwen/Qwen3.5-9B-Base", "Qwen 3.5", (9, 9), "Base", 65536,
         (0.66, 0.132, 1.995, 1.463), date="2026-09", sources="S3 S4 S7"),
    _row("Qwen/Qwen3.5-4B", "Qwen 3.5", (4, 4), "Hybrid + Vision", 65536,
         (0.33, 0.066, 1.005, 0.737), date="2026-09-01", sources="S3 S4 S5 S6",
         note="sample 1.005 (S3 S4 S5 S6) vs 1.00 (S7); 1.005 kept"),
    _row("Qwen/Qwen3-8B", "Qwen 3", (8, 8), "Hybrid", 32768,
         (0.195, 0.039, 0.60, 0.44), date="2026-10-07", sources="S3 S4 S6 S7 S8"),
    _row("openai/gpt-oss-120b", "gpt-oss", (117, 5.1), "Reasoning", 32768,
         (0.33, 0.066, 0.84, 0.737), date="2026-09", sources="S3 S4 S7"),
    _row("openai/gpt-oss-120b:peft:131072", "gpt-oss", (117, 5.1), "Reasoning", 131072,
         (0.78, 0.156, 1.94, 2.33), date="2026-09", sources="S3 S4 S7"),
    _row("openai/gpt-oss-20b", "gpt-oss", (21, 3.6), "Reasoning", 32768,
         (0.18, 0.036, 0.45, 0.396), date="2026-09", sources="S3 S4 S7"),
    _row("deepseek-ai/DeepSeek-V3.1", "DeepSeek", (671, 37), "Hybrid", 32768,
         (1.695, 0.339, 4.215, 3.718), date="2026-09", sources="S3 S4 S6 S7"),
    # Beta serverless inference (NVFP4): sampling only, its own cheaper rates; train not offered.
    _row(_INK + ":peft:262144:sampling-nvfp4", "Inkling", (975, 41), "Hybrid + Audio + Vision",
         262144, (1.00, 0.17, 4.05, None), date="2026-10-07", sources="S7 S8", kind="serverless",
         note="serverless inference only: no training on this id"),
    _row(_INK + "-Small:peft:262144:sampling-nvfp4", "Inkling", (276, 12), "Hybrid + Audio + Vision",
         262144, (0.30, 0.06, 1.20, None), date="2026-10-07", sources="S7 S8", kind="serverless",
         note="serverless inference only: no training on this id"),
    _row("zai-org/GLM-5.3:peft:262144:sampling-nvfp4", "GLM", (744, 40), "Reasoning", 262144, None,
         date="2026-10-07", sources="S7 (later version)", kind="serverless",
         note="serverless inference only; price not found in any source; context from the id suffix"),
    # In tinker-cookbook 0.6.1 (~Nov 2026) but in no stored price table.
    _row("deepseek-ai/DeepSeek-V4.1-Flash:peft:262144", "DeepSeek", (552, 16), None, 262144, None,
         date="2026-11", sources="S10", note=_NO_PRICE),
    _row("deepseek-ai/DeepSeek-V4.1-Flash-1017:peft:262144", "DeepSeek", (552, 16), None, 262144,
         None, date="2026-11", sources="S10", note=_NO_PRICE),
    _row("zai-org/GLM-5.3-Flash:peft:262144", "GLM", (320, 18), None, 262144, None,
         date="2026-11", sources="S10", note=_NO_PRICE),
    _row("nvidia/NVIDIA-Nemotron-3.5-Super-VL-120B-A12B-BF16", "Nemotron 3.5", (120, 12), "Vision (rest unknown)",
         65536, None, date="2026-11", sources="S10", note=_NO_PRICE),
    _row("nvidia/NVIDIA-Nemotron-3.5-Super-VL-120B-A12B-BF16:peft:262144", "Nemotron 3.5", (120, 12),
         "Vision (rest unknown)", 262144, None, date="2026-11", sources="S10", note=_NO_PRICE),
    _row(_INK + "-2-Small", "Inkling", (594, 17), "Vision (rest unknown)", 65536, None, date="2026-11",
         sources="S10", note=_NO_PRICE),
    _row(_INK + "-2-Small:peft:262144", "Inkling", (594, 17), "Vision (rest unknown)", 262144, None, date="2026-11",
         sources="S10", note=_NO_PRICE),
    _row("moonshotai/Kimi-K3.1-Pro", "Kimi", (2800, 104), "Vision (rest unknown)", None, None, date="2026-11",
         sources="S10", note=_NO_PRICE + "; context window not found either"),
]


# Models Tinker retired: id -> (retirement date, recommended replacement or None when no source names one).
# S12 = Tinker docs "Model Deprecations" page (its "Recommended replacements" table); S5/S6 dated the rest.
RETIRED = {
    "Qwen/Qwen3.5-35B-A3B": ("2026-06-12", "Qwen/Qwen3.6-35B-A3B"),
    "Qwen/Qwen3.5-27B": ("2026-06-12", "Qwen/Qwen3.6-27B"),
    "Qwen/Qwen3-30B-A3B": ("2026-06-12", "Qwen/Qwen3.6-35B-A3B"),
    "Qwen/Qwen3-30B-A3B-Instruct-2507": ("2026-06-12", "Qwen/Qwen3.6-35B-A3B (non-thinking mode)"),
    "Qwen/Qwen3-30B-A3B-Base": ("2026-06-12", None),
    "Qwen/Qwen3-32B": ("2026-06-12", None),
    "Qwen/Qwen3-8B-Base": ("2026-06-12", None),
    "Qwen/Qwen3-4B-Instruct-2507": ("2026-06-12", None),
    "Qwen/Qwen3-235B-A22B-Instruct-2507": ("2026-06-12", None),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": ("2026-06-12", None),
    "meta-llama/Llama-3.1-8B": ("2026-06-12", None),
    "meta-llama/Llama-3.1-8B-Instruct": ("2026-06-12", None),
    "meta-llama/Llama-3.1-70B": ("2026-06-12", None),
    "meta-llama/Llama-3.3-70B-Instruct": ("2026-06-12", None),
    "meta-llama/Llama-3.2-1B": ("2026-06-12", None),
    "meta-llama/Llama-3.2-3B": ("2026-06-12", None),
    "moonshotai/Kimi-K2-Thinking": ("2026-06-12", None),
    "deepseek-ai/DeepSeek-V3.1-Base": ("2026-06-12", None),
    "moonshotai/Kimi-K2.5": ("2026-07-12", None),
}


def pricing_command(*args) -> str:
    """`tinker_pricing.py ARGS` as a command that runs as printed from anywhere: the interpreter running it and
    this file's path, shell-quoted (this file has no shared-code region; common/errors.py python_command is the
    same rule for the other scripts)."""
    import shlex

    return shlex.join([sys.executable or "python3", str(Path(__file__).resolve()), *map(str, args)])


def cheaper_command(est) -> str:
    """The `list` command that shows the models training at most at this estimate's rate."""
    rate = (est.get("rates") or {}).get("train")
    return pricing_command("list", *(["--max-train", f"{rate:g}"] if rate else []))


def retired_note(name: str) -> str | None:
    """'<id> was retired from Tinker on DATE; its recommended replacement is X' for a retired model (full
    id or the name after the organisation, any case, any ':peft:' suffix), else None."""
    asked = (name or "").strip().split(":", 1)[0].lower()
    for model_id, (date, replacement) in RETIRED.items():
        if asked in (model_id.lower(), model_id.split("/", 1)[1].lower()):
            note = f"{model_id} was retired from Tinker on {date}"
            return note + (f"; its recommended replacement is {replacement}" if replacement
                           else f"; no replacement is named (see `{pricing_command('list')}`)")
    return None


class UnknownModelError(ValueError):
    """A model name that matches no catalogue id, or more than one; the message lists the closest ids."""


class BudgetExceeded(RuntimeError):
    """The estimate is above --max-usd, or cannot be proven below it (unknown prices)."""


# ==== PRICE OVERRIDE (refresh) ====

def default_override_path() -> Path:
    if os.environ.get("TINKER_PRICES_FILE"):
        return Path(os.environ["TINKER_PRICES_FILE"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "tinker-training-inference" / "models-prices.json"


def _parse_price(value, where):
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "-", "—", "n/a", "tbd")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"{where}: price {value!r} is not a number")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip().lstrip("$").replace(",", ""))
        except ValueError:
            raise ValueError(f"{where}: price {value!r} is not like \"$1.87\"") from None
    else:
        raise ValueError(f"{where}: price {value!r} is not like \"$1.87\"")
    if not number >= 0 or number > 10_000:
        raise ValueError(f"{where}: price {value!r} is out of range")
    return number


def _parse_context(value, where):
    if value is None or value == "":
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        text = value.strip().upper()
        scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1:], 1)
        try:
            tokens = int(float(text[:-1] if scale > 1 else text) * scale)
        except ValueError:
            tokens = 0
        if tokens > 0:
            return tokens
    raise ValueError(f"{where}: context {value!r} is not like \"64K\"")


def parse_models_json(data) -> list[dict]:
    """Validate a models.json array (or a stored override) and return its entries with parsed values.

    Raises ValueError naming the first problem; an entry is kept only if its prices all parse.
    """
    if isinstance(data, dict) and isinstance(data.get("models"), list):
        data = data["models"]
    if not isinstance(data, list) or not data:
        raise ValueError("expected a non-empty JSON array of models (the models.json format)")
    entries = []
    for i, raw in enumerate(data):
        if not isinstance(raw, dict):
            raise ValueError(f"entry {i} is not an object")
        model_id = raw.get("tinker_id")
        if not isinstance(model_id, str) or "/" not in model_id:
            raise ValueError(f"entry {i} has no tinker_id like \"org/model\"")
        where = f"entry {i} ({model_id})"
        entry = {"id": model_id, "raw": raw, "context": _parse_context(raw.get("context"), where)}
        for kind in PRICE_KINDS:
            entry[kind] = _parse_price(raw.get(kind), f"{where} {kind}")
        entries.append(entry)
    if not any(e["train"] is not None and e["sample"] is not None for e in entries):
        raise ValueError("no entry has both a train and a sample price; this is not a price table")
    return entries


def _base_of(model_id: str) -> str:
    return model_id.split("/", 1)[-1].split(":", 1)[0]


def merge_override(snapshot: list[dict], entries: list[dict], fetched: str, source: str) -> list[dict]:
    """Rows priced from a refreshed models.json; snapshot rows it lacks stay, flagged."""
    by_id = {row["id"]: dict(row) for row in snapshot}
    seen = set()
    for e in entries:
        seen.add(e["id"])
        row = by_id.get(e["id"])
        if row is None:
            kin = next((r for r in snapshot if _base_of(r["id"]) == _base_of(e["id"])), None)
            row = _row(e["id"], kin["family"] if kin else (e["raw"].get("name") or _base_of(e["id"])),
                       (kin["params_total_b"], kin["params_active_b"]) if kin else None,
                       None, None, None, date=fetched, sources="")
            row["kind"] = "serverless" if ":sampling" in e["id"] else "training"
        notes = []
        for kind in PRICE_KINDS:
            if e[kind] is None and kind not in e["raw"] and row[kind] is not None:
                notes.append(f"{kind} kept from the {CATALOGUE_DATE} snapshot (absent in models.json)")
            else:
                row[kind] = e[kind]
        row["context"] = e["context"] or row["context"]
        row["type"] = e["raw"].get("type") or row["type"]
        raw_note = e["raw"].get("note")
        row["promo"] = raw_note if raw_note and "discount" in raw_note.lower() else None
        if raw_note and not row["promo"]:
            notes.append(raw_note)
        if row["train"] is None and row["kind"] == "training":
            notes.append("models.json gives no train price")
        row.update(note="; ".join(notes) or None, list_price=None, source_date=fetched,
                   sources=f"models.json {source}", catalogue_date=fetched)
        by_id[e["id"]] = row
    for model_id, row in by_id.items():
        if model_id not in seen:
            flag = f"absent from models.json fetched {fetched} (retired or renamed?)"
            row["note"] = f"{row['note']}; {flag}" if row["note"] else flag
    return list(by_id.values())


def load_catalogue(prices_file: str | os.PathLike | None = None) -> tuple[list[dict], dict]:
    """(rows, meta). Uses `prices_file`, else the refresh override if present, else the snapshot."""
    path = Path(prices_file).expanduser() if prices_file else default_override_path()
    if not path.is_file():
        if prices_file:
            raise ValueError(f"price file {path} does not exist")
        return [dict(r) for r in SNAPSHOT], {"date": CATALOGUE_DATE, "source": "snapshot"}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = parse_models_json(data)
    except (OSError, ValueError) as exc:
        if prices_file:
            raise ValueError(f"price file {path} is unusable: {exc}") from None
        print(f"warning: ignoring the price override {path} ({exc}); using the {CATALOGUE_DATE} snapshot",
              file=sys.stderr)
        return [dict(r) for r in SNAPSHOT], {"date": CATALOGUE_DATE, "source": "snapshot"}
    fetched = str(data.get("fetched_at", ""))[:10] if isinstance(data, dict) else ""
    fetched = fetched or _file_date(path)
    source = data.get("source", str(path)) if isinstance(data, dict) else str(path)
    rows = merge_override(SNAPSHOT, entries, fetched, source)
    return rows, {"date": fetched, "source": f"override {path} ({source})"}


def _file_date(path: Path) -> str:
    from datetime import datetime, timezone
    return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).strftime("%Y-%m-%d")


# ==== NAME RESOLUTION ====

def _price_key(row):
    inf = float("inf")
    return tuple(inf if row[k] is None else row[k] for k in ("train", "sample", "prefill"))


def _closest(name: str, rows: list[dict], n: int = 5) -> list[str]:
    import difflib
    lowered = {r["id"].lower(): r["id"] for r in rows}
    lowered.update({r["name"].lower(): r["id"] for r in rows})
    hits = difflib.get_close_matches(name.lower(), list(lowered), n=n * 2, cutoff=0.4)
    ids = list(dict.fromkeys(lowered[h] for h in hits))
    return ids[:n]


def _pick_variant(group: list[dict], context: int | None, asked: str) -> dict:
    if context is None:
        return min(group, key=lambda r: (r["context"] or 0, _price_key(r)))
    wide = [r for r in group if r["context"] is not None and r["context"] >= context]
    if not wide:
        windows = ", ".join(f"{r['id']} ({r['context'] or 'unknown'})" for r in group)
        raise UnknownModelError(f"no variant of {asked!r} has a context window >= {context}: {windows}")
    return min(wide, key=_price_key)


def resolve_model(name: str, context: int | None = None, rows: list[dict] | None = None) -> dict:
    """Catalogue row for `name`: exact id, then an unambiguous short name (`Qwen3.5-9B`).

    `context` picks the cheapest variant (`:peft:<n>` ids) whose window is at least `context`;
    an exactly named id that is wide enough is kept. Raises UnknownModelError listing close ids.
    """
    rows = rows if rows is not None else load_catalogue()[0]
    name = (name or "").strip()
    lowered = name.lower()
    exact = [r for r in rows if r["id"] == name] or [r for r in rows if r["id"].lower() == lowered] \
        or [r for r in rows if r["name"].lower() == lowered]
    if len(exact) == 1:
        row = exact[0]
        if context is None or (row["context"] or 0) >= context:
            return dict(row)
        group = [r for r in rows if _base_of(r["id"]) == _base_of(row["id"]) and r["kind"] == row["kind"]]
        return dict(_pick_variant(group, context, name))
    retired = retired_note(name)
    if retired:  # never a silent stand-in (Qwen3.5-35B-A3B is not Qwen3.5-35B-A3B-Base)
        raise UnknownModelError(f"unknown model {name!r}: {retired}; closest ids: "
                                f"{', '.join(_closest(name, rows)) or 'none'} (see `{pricing_command('list')}`)")
    trainable = [r for r in rows if r["kind"] == "training"]
    group = [r for r in trainable if _base_of(r["id"]).lower() == lowered.split("/", 1)[-1]]
    if not group and lowered:
        matching = [r for r in trainable if lowered in r["id"].lower()]
        bases = sorted({_base_of(r["id"]) for r in matching})
        if len(bases) > 1:
            raise UnknownModelError(f"model {name!r} is ambiguous; it matches: "
                                    + ", ".join(r["id"] for r in matching[:8]))
        group = matching
    if group:
        return dict(_pick_variant(group, context, name))
    close = _closest(name, rows)
    raise UnknownModelError(f"unknown model {name!r}; closest ids: {', '.join(close) or 'none'}"
                            f" (see `{pricing_command('list')}`)")


# ==== TOKEN COUNTS (shared with tinker_sft.py / tinker_rl.py) ====

def _tokens(prefill=0, cached_prefill=0, sample=0, train=0) -> dict:
    counts = {"prefill": prefill, "cached_prefill": cached_prefill, "sample": sample, "train": train}
    return {kind: round(_finite(kind, value)) for kind, value in counts.items()}


def _finite(kind: str, value):
    """value if it is a finite count a float can hold, else ValueError (never OverflowError)."""
    try:
        finite = math.isfinite(float(value))
    except OverflowError:  # an int beyond float range
        finite = False
    if not finite:
        raise ValueError(f"the {kind} token count overflows (sizes multiply to more than 1e308); "
                         "expected the sizes of a real run: lower the counts and lengths you passed")
    return value


def sft_tokens(examples: int, avg_tokens: float, epochs: float = 1) -> dict:
    """SFT bills every datum's full length at the train rate: train = examples x avg_tokens x epochs."""
    return _tokens(train=examples * avg_tokens * epochs)


def sample_tokens(prompts: int, avg_prompt: float, max_tokens: int, n: int = 1) -> dict:
    """One sample call per prompt with num_samples=n; sampled tokens assume every sample hits max_tokens.

    prefill = prompts x P, cached_prefill = prompts x (n-1) x P, sample = prompts x n x max_tokens.
    """
    return _tokens(prompts * avg_prompt, prompts * (n - 1) * avg_prompt, prompts * n * max_tokens)


def rl_tokens(iterations: int, tasks_per_iter: int, group_size: int, avg_prompt: float,
              avg_completion: float, turns: int = 1, avg_observation: float = 0) -> dict:
    """Tokens billed by group-sampled RL (one sample call of G per task, one datum per trajectory).

    Per group of G with first prompt P, completion C per turn, new observation O per later turn,
    T turns (turn k's prompt is P + (k-1)(C+O); its prefix up to the last completion is a cache hit):
      prefill = P + G(T-1)O
      cached  = (G-1)P + G[(T-1)(P+C) + (C+O)(T-1)(T-2)/2]
      sample  = G*T*C
      train   = G[P + T*C + (T-1)O]         (the whole merged datum, prompt included)
    Totals multiply by iterations x tasks_per_iter. T=1 gives prefill IBP, cached IB(G-1)P,
    sample IBGC, train IBG(P+C).
    """
    g, t, p, c, o = group_size, turns, avg_prompt, avg_completion, avg_observation
    per_group = {
        "prefill": p + g * (t - 1) * o,
        "cached_prefill": (g - 1) * p + g * ((t - 1) * (p + c) + (c + o) * (t - 1) * (t - 2) / 2),
        "sample": g * t * c,
        "train": g * (p + t * c + (t - 1) * o),
    }
    groups = iterations * tasks_per_iter
    try:
        totals = {kind: groups * count for kind, count in per_group.items()}
    except OverflowError:  # an int product beyond float range meets a float factor
        totals = {kind: math.inf for kind in per_group}
    return _tokens(**totals)


def count_sft_tokens(path: str | os.PathLike, tokenizer, max_length: int | None = None) -> dict:
    """Billed SFT tokens of a JSONL file for one epoch: the sum of datum lengths.

    Rows hold `messages`, or `prompt` + `completion` (rendered as a user/assistant exchange with the
    tokenizer's chat template, or concatenated when it has none), or `text`. A datum's model_input is
    the rendered tokens minus the last one (targets are shifted by one), after truncation to
    `max_length`. The SFT script's own renderer may differ by a few tokens per example (thinking
    blocks, template kwargs). Returns {"examples", "train_tokens", "max"}.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    examples = total = longest = 0
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path} line {line} (byte {exc.start}): not UTF-8 ({exc.reason}); re-save the file as "
                         "UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    for line_no, line in enumerate(text.split("\n"), 1):  # a byte-order mark and CRLF endings are fine
        line = line.strip().lstrip("\ufeff")
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{line_no} is not JSON ({exc.msg})") from None
        row = row if isinstance(row, dict) else {}
        messages = row.get("messages")
        if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
            if has_template:
                messages = [{"role": "user", "content": row["prompt"]},
                            {"role": "assistant", "content": row["completion"]}]
            else:
                row = {"text": row["prompt"] + row["completion"]}
        if isinstance(messages, list):
            ids = tokenizer.apply_chat_template(messages, tokenize=True)
            ids = ids if isinstance(ids, list) else ids["input_ids"]
        elif isinstance(row.get("text"), str):
            ids = tokenizer.encode(row["text"])
        else:
            raise ValueError(f"{path}:{line_no} needs \"messages\", \"prompt\"+\"completion\" or \"text\"")
        length = min(len(ids), max_length) if max_length else len(ids)
        examples += 1
        total += max(length - 1, 0)
        longest = max(longest, length)
    if not examples:
        raise ValueError(f"{path} has no examples")
    return {"examples": examples, "train_tokens": total, "max": longest}


# ==== COST ====

def estimate_cost(model: str, *, prefill=0, cached_prefill=0, sample=0, train=0,
                  storage_gb_months=None, context: int | None = None, rows: list[dict] | None = None) -> dict:
    """Dollar estimate: tokens of each kind x the row's rate / 1e6, plus storage at $/GB-month.

    A kind with tokens but no known rate gives None there and in `total`, with a `warning`. What the total
    leaves out is named in `not_counted` (never priced as 0): storage when `storage_gb_months` is None (not
    given; 0 counts it as none), and the per-checkpoint meter, which has no published rate.
    """
    counts = {"prefill": prefill, "cached_prefill": cached_prefill, "sample": sample, "train": train}
    for kind, value in [*counts.items(), ("storage_gb_months", storage_gb_months)]:
        if kind == "storage_gb_months" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{kind} must be a finite number >= 0, got {value!r}")
        _finite(kind, value)
    row = resolve_model(model, context, rows)
    if train and row["kind"] == "serverless":
        raise ValueError(f"{row['id']} is a serverless inference id: it cannot be trained; "
                         f"estimate training on {row['id'].split(':', 1)[0]} instead")
    usd, missing = {}, []
    for kind, count in counts.items():
        rate = row[kind]
        if count and rate is None:
            usd[kind] = None
            missing.append(kind)
        else:
            usd[kind] = round(count * (rate or 0) / 1e6, 10)
    usd["storage"] = None if storage_gb_months is None else round(storage_gb_months * STORAGE_USD_PER_GB_MONTH, 10)
    usd["total"] = None if missing else round(sum(v for v in usd.values() if v is not None), 10)
    not_counted = ([] if storage_gb_months is not None else [NOT_COUNTED_STORAGE]) + [NOT_COUNTED_CHECKPOINTS]
    result = {"model": row["id"], "catalogue_date": row["catalogue_date"],
              "tokens": {k: round(v) for k, v in counts.items()}, "usd": usd,
              "rates": {k: row[k] for k in PRICE_KINDS} | {"storage_per_gb_month": STORAGE_USD_PER_GB_MONTH},
              "not_counted": not_counted}
    if row["note"]:
        result["note"] = row["note"]
    if missing:
        why = row["note"] or "price not found"
        result["warning"] = (f"no {' / '.join(missing)} price for {row['id']} in the catalogue of "
                             f"{row['catalogue_date']} ({why}); total unknown")
    return result


def _tok(n: int) -> str:
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return str(n)


def _usd(x) -> str:
    return "unknown" if x is None else (f"${x:,.2f}" if x >= 0.01 or x == 0 else f"${x:.4f}")


def summary_line(est: dict, label: str = "") -> str:
    head = f"cost estimate ({label + ': ' if label else ''}{est['model']}, catalogue {est['catalogue_date']})"
    parts = [f"{kind.replace('_', ' ')} {_tok(est['tokens'][kind])} tok {_usd(est['usd'][kind])}"
             for kind in ("train", "prefill", "cached_prefill", "sample") if est["tokens"][kind]]
    if est["usd"]["storage"] is not None:
        parts.append(f"storage {_usd(est['usd']['storage'])}")
    line = f"{head}: {_usd(est['usd']['total'])} = {' + '.join(parts) or 'nothing billed'}"
    left_out = [item.split(":", 1)[0] for item in est.get("not_counted") or []]
    line += f" | not counted: {', '.join(left_out)}" if left_out else ""
    return line + (f" | warning: {est['warning']}" if est.get("warning") else "")


def preflight(model: str, tokens: dict, max_usd: float | None = None, *, label: str = "",
              context: int | None = None) -> dict:
    """Print one estimate line on stderr and return the estimate; stop before a paid call if over budget.

    `tokens` holds any of prefill / cached_prefill / sample / train (+ storage_gb_months).
    Raises BudgetExceeded when the total is above `max_usd`, or unknown while `max_usd` is set.
    Raises UnknownModelError / ValueError for an unknown model or bad counts.
    """
    unknown = set(tokens) - {*PRICE_KINDS, "storage_gb_months"}
    if unknown:
        raise ValueError(f"unknown token kinds {sorted(unknown)}; use {', '.join(PRICE_KINDS)}, storage_gb_months")
    est = estimate_cost(model, context=context, **tokens)
    print(summary_line(est, label), file=sys.stderr)
    total = est["usd"]["total"]
    if max_usd is not None and total is None:
        raise BudgetExceeded(
            f"cannot check --max-usd {max_usd:g}: {est['warning']}; set TINKER_PRICES_FILE to a models.json "
            f"with its prices (or run {pricing_command('refresh')}), or drop --max-usd")
    if max_usd is not None and total > max_usd:
        raise BudgetExceeded(
            f"estimated {_usd(total)} for {est['model']} (catalogue {est['catalogue_date']}) exceeds "
            f"--max-usd {max_usd:g}; reduce steps/batch/group/tokens, pick a cheaper model "
            f"({cheaper_command(est)}), or raise --max-usd")
    return est


# ==== OUTPUT ====

def _fmt(value) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _rate(value) -> str:
    """A $/1M rate as the pricing page writes it: at least two decimals (3.00, 0.195)."""
    return "unknown" if value is None else (f"{value:.2f}" if round(value, 2) == value else f"{value:g}")


def _ctx(n) -> str:
    return "unknown" if n is None else f"{n // 1024}K"


def _params(row) -> str:
    if row["params_total_b"] is None:
        return "unknown"
    if row["arch"] == "Dense":
        return f"{_fmt(row['params_total_b'])}B dense"
    return f"{_fmt(row['params_total_b'])}B / {_fmt(row['params_active_b'])}B"


_COLUMNS = ("model (short name)", "params", "ctx", "prefill", "cached", "sample", "train")


def _cells(row) -> list[str]:
    flags = ("*" if row["note"] else "") + ("%" if row["promo"] else "")
    return [row["name"] + flags, _params(row), _ctx(row["context"]),
            *(_rate(row[k]) for k in PRICE_KINDS[:3]), _train_cell(row)]


def _train_cell(row) -> str:
    return "not offered" if row["kind"] == "serverless" and row["train"] is None else _rate(row["train"])


def markdown_table(rows: list[dict]) -> str:
    """Catalogue rows as a markdown table (USD per 1M tokens, as billed) plus their notes."""
    out = ["| id | family | params (total / active) | type | context | prefill | cached prefill "
           "| sample | train | list price (prefill / sample / train) | source date (sources) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for row in rows:
        lp = row["list_price"]
        lp_text = " / ".join(_rate(lp.get(k)) for k in ("prefill", "sample", "train")) if lp else ""
        mark = ""
        if row["note"] or row["promo"]:
            notes.append(row)
            mark = f" [{len(notes)}]"
        out.append(f"| `{row['id']}`{mark} | {row['family']} | {_params(row)} | {_fmt(row['type'])} | "
                   f"{_ctx(row['context'])} | {_rate(row['prefill'])} | {_rate(row['cached_prefill'])} | "
                   f"{_rate(row['sample'])} | {_train_cell(row)} | {lp_text} | "
                   f"{row['source_date']} ({row['sources']}) |")
    if notes:
        out.append("")
        for i, row in enumerate(notes, 1):
            text = "; ".join(x for x in (row["promo"], row["note"]) if x)
            out.append(f"{i}. `{row['id']}`: {text}.")
    return "\n".join(out)


def print_table(title: str, header: list[str], body: list[list[str]], footer: str = "") -> None:
    """Aligned plain-text table on stderr. Not rich: importing it costs more than the whole
    `list` command may take (the issue's budget is 150 ms), and agents read plain text best."""
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    right = [i >= 1 and all(_numeric(line[i]) for line in body) for i in range(len(header))]
    lines = [title] if title else []
    for cells in [header, *body]:
        lines.append("  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip())
    if footer:
        lines.append(footer)
    print("\n".join(lines), file=sys.stderr)


def _numeric(cell: str) -> bool:
    return cell in ("", "unknown", "not offered") or cell.lstrip("$").replace(",", "").replace(".", "", 1) \
        .rstrip("KMBk").replace(" GB-mo", "").isdigit()


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


# ==== COMMANDS ====

def _catalogue(args):
    rows, meta = load_catalogue(args.prices)
    return rows, meta


def cmd_list(args) -> int:
    rows, meta = _catalogue(args)
    if args.family:
        rows = [r for r in rows if args.family.lower() in r["family"].lower()]
    if args.min_context:
        rows = [r for r in rows if r["context"] is not None and r["context"] >= args.min_context]
    if args.max_train is not None:
        rows = [r for r in rows if r["train"] is not None and r["train"] <= args.max_train]
    if args.markdown:
        sys.stdout.write(markdown_table(rows) + "\n")
        return 0
    if not args.json:
        print_table(f"Tinker prices, USD per 1M tokens as billed (catalogue {meta['date']}, {meta['source']})",
                    list(_COLUMNS), [_cells(r) for r in rows],
                    f"{len(rows)} models. * see `show` for a note · % promotional price · storage "
                    f"${STORAGE_USD_PER_GB_MONTH:.2f}/GB-month · verify: {PRICING_PAGE_URL}")
    emit({"catalogue_date": meta["date"], "source": meta["source"], "count": len(rows),
          "storage_usd_per_gb_month": STORAGE_USD_PER_GB_MONTH, "models": rows})
    return 0


def cmd_show(args) -> int:
    rows, meta = _catalogue(args)
    row = resolve_model(args.model, args.context, rows)
    variants = [r["id"] for r in rows if _base_of(r["id"]) == _base_of(row["id"])]
    if not args.json:
        for key, value in row.items():
            if key == "sources":
                value = "; ".join(f"{s} {SOURCES[s]}" if s in SOURCES else s for s in value.split())
            elif value is None and key in ("list_price", "promo", "note"):
                value = "-"  # none, as opposed to a figure nobody published
            print(f"{key:>16}: {_fmt(value)}", file=sys.stderr)
        print(f"{'variants':>16}: {', '.join(variants)}", file=sys.stderr)
    emit(row | {"variants": variants})
    return 0


def _run_estimate(args, tokens: dict, inputs: dict, formula: str) -> int:
    rows, _ = _catalogue(args)
    est = estimate_cost(args.model, context=args.context, rows=rows,
                        storage_gb_months=args.storage_gb_months, **tokens)
    est["inputs"] = inputs | {"storage_gb_months": args.storage_gb_months}
    est["formula"] = formula
    if not args.json:
        body = [[kind, f"{est['tokens'][kind]:,}", _rate(est["rates"][kind]), _usd(est["usd"][kind])]
                for kind in PRICE_KINDS]
        storage = args.storage_gb_months
        body.append(["storage", "not counted" if storage is None else f"{storage:g} GB-mo",
                     _rate(STORAGE_USD_PER_GB_MONTH), "not counted" if storage is None else _usd(est["usd"]["storage"])])
        body.append(["total", "", "", _usd(est["usd"]["total"])])
        print_table(f"{est['model']} (catalogue {est['catalogue_date']})",
                    ["meter", "tokens", "$/1M", "usd"], body, f"formula: {formula}")
        key = "warning" if est.get("warning") else "note"  # a warning already quotes the note
        if est.get(key):
            print(f"{key}: {est[key]}", file=sys.stderr)
        for item in est["not_counted"]:
            print(f"not counted: {item}", file=sys.stderr)
    emit(est)
    total = est["usd"]["total"]
    if args.max_usd is not None and (total is None or total > args.max_usd):
        reason = "is unknown" if total is None else f"{_usd(total)} exceeds it"
        print(f"error: --max-usd {args.max_usd:g}: the estimate {reason}; lower the counts, pick a cheaper "
              f"model ({cheaper_command(est)}), or raise --max-usd", file=sys.stderr)
        return 3
    return 0


def cmd_estimate(args) -> int:
    tokens = {"prefill": args.prefill_tokens, "cached_prefill": args.cached_prefill_tokens,
              "sample": args.sample_tokens, "train": args.train_tokens}
    return _run_estimate(args, tokens, dict(tokens), "tokens x rate / 1e6 per meter")


def cmd_estimate_sft(args) -> int:
    inputs = {"epochs": args.epochs}
    if args.data:
        if not args.tokenizer:
            raise ValueError("--data needs --tokenizer DIR (a Hugging Face tokenizer folder or name)")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" notice
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError("--data needs transformers: pip install transformers") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the tokenizer {args.tokenizer!r}: {str(exc).splitlines()[0]}") from None
        counted = count_sft_tokens(args.data, tokenizer, args.max_length)
        inputs |= {"data": str(args.data), "tokenizer": str(args.tokenizer), "max_length": args.max_length,
                   "examples": counted["examples"], "train_tokens_per_epoch": counted["train_tokens"],
                   "longest_example": counted["max"]}
        tokens = sft_tokens(1, counted["train_tokens"], args.epochs)
        formula = "train = sum(datum length) x epochs"
    else:
        if args.examples is None or args.avg_tokens is None:
            raise ValueError("estimate-sft needs --examples and --avg-tokens, or --data FILE --tokenizer DIR")
        inputs |= {"examples": args.examples, "avg_tokens": args.avg_tokens}
        tokens = sft_tokens(args.examples, args.avg_tokens, args.epochs)
        formula = "train = examples x avg_tokens x epochs"
    return _run_estimate(args, tokens, inputs, formula)


def cmd_estimate_rl(args) -> int:
    inputs = {k: getattr(args, k) for k in ("iterations", "tasks_per_iter", "group_size", "turns",
                                            "avg_prompt", "avg_completion", "avg_observation")}
    formula = ("I*B groups: prefill P+G(T-1)O, cached (G-1)P+G[(T-1)(P+C)+(C+O)(T-1)(T-2)/2], "
               "sample GTC, train G[P+TC+(T-1)O]")
    return _run_estimate(args, rl_tokens(**inputs), inputs, formula)


def cmd_estimate_sample(args) -> int:
    inputs = {"prompts": args.prompts, "avg_prompt": args.avg_prompt, "max_tokens": args.max_tokens, "n": args.n}
    formula = "prefill N*P, cached N*(n-1)*P, sample N*n*max_tokens (upper bound)"
    return _run_estimate(args, sample_tokens(**inputs), inputs, formula)


def write_new_file(path: Path, text: str, force: bool) -> None:
    """Atomic write; without `force` an existing file is left untouched (FileExistsError)."""
    import tempfile
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a project file is read by others like any (0644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if the file exists, even if it appeared a moment ago
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# The TINKER_PRICING.md that `init` writes: {{field}} marks are filled by render_pricing_doc(). It lives here, not
# in a file beside the script, so a copy of this script alone writes the same document as the bundle.
PRICING_DOC_TEMPLATE = r"""# Tinker pricing for this project

Written by `tinker_pricing.py init` from the price catalogue of **{{catalogue_date}}**
({{catalogue_source}}). Prices are USD per 1M tokens **as billed**, promotions included; where a
promotion applies the list price is shown too, and promotions end. Verify before a large run:

- Models & Pricing page: {{pricing_page}}
- the same table as JSON: {{models_json}}
  (`python tinker_pricing.py refresh` stores it and every estimate then uses it)
- what you actually spent: `tinker billing usage START END` (lags by up to a few hours)
- which models and context windows your key can use: `tinker model list`

## Training models

{{catalogue_table}}

A `:peft:<n>` suffix is a separate Tinker id with an `n`-token context window and its own prices.
Pass the exact id, or `--context N` to let the estimator pick the cheapest id whose window is at
least `N`.

## Serverless inference (beta, sampling only)

{{serverless_table}}

## Models without a published price

In the newest tinker-cookbook but in no price table we could find. Never budget with a guess for
these (nor for an `unknown` cell above): check the pricing page, then `refresh` or pass
`--prices FILE`; estimates for them say "unknown" and `--max-usd` refuses to pass them.

{{unpriced_table}}

## What each operation meters

| meter | what is counted | rate column |
|---|---|---|
| training | every token of every datum sent to `forward_backward` (prompt and completion alike; zero loss weights do not reduce it) | train |
| sampling prefill | prompt tokens of a sample call not served from the prefix cache | prefill |
| cached prefill | prompt tokens served from the prefix cache: the `num_samples - 1` extra copies of a prompt, and the re-sent prefix of a multi-turn conversation | cached prefill (20% of prefill) |
| sampled tokens | generated tokens | sample |
| storage | checkpoints, in GB-months | ${{storage_rate}} per GB-month |

Prefill is a sampling meter only: `forward_backward` bills training tokens, not prefill.
Reference-model KL scoring and `compute_logprobs` are sample calls with `max_tokens=1`, billed as
prefill. A resumable `weights/` checkpoint (weights + Adam moments) is about 3x the size of its
`sampler_weights/` copy; checkpoints never expire unless you set a TTL.

## Formulas

`cost = (prefill x p + cached_prefill x c + sample x s + train x t) / 1e6 + GB-months x {{storage_rate}}`

- **SFT**: `train = examples x mean rendered length x epochs` (exact count:
  `estimate-sft --data FILE.jsonl --tokenizer DIR`, which sums each datum's length).
- **Sampling / evaluation**, `N` prompts of `P` tokens, `n` samples each:
  `prefill = N x P`, `cached_prefill = N x (n - 1) x P`, `sample = N x n x max_tokens` (upper bound).
- **RL, single turn**, `I` iterations x `B` tasks per iteration x group size `G`, prompt `P`,
  completion `C`: `prefill = I·B·P`, `cached_prefill = I·B·(G-1)·P`, `sample = I·B·G·C`,
  `train = I·B·G·(P+C)`.
- **RL, multi-turn** (`T` turns, new observation `O` tokens per later turn; turn `k` re-sends
  `P + (k-1)(C+O)` and all of it but the new observation is a cache hit), per group:
  - `prefill = P + G(T-1)O`
  - `cached_prefill = (G-1)P + G[(T-1)(P+C) + (C+O)(T-1)(T-2)/2]`
  - `sample = G·T·C`
  - `train = G[P + T·C + (T-1)O]` (one merged datum per trajectory)

  then multiply by `I·B`. With `T = 1` this is the single-turn line. If the renderer breaks the
  prefix between turns (for example it drops earlier thinking), each turn is its own datum and
  `train = G·Σ_k (P + (k-1)(C+O) + C)`; price that with `estimate --train-tokens`.

A datum is its rendered tokens minus one (targets are shifted by one), so these train counts run
at most one token per datum high. Not included unless you add them: reference-KL scoring (billed
as prefill), evaluation sampling, and storage (`--storage-gb-months`).

Estimate before launching:

```bash
python tinker_pricing.py estimate-rl --model Qwen/Qwen3-8B --iterations 50 --tasks-per-iter 32 \
    --group-size 8 --avg-prompt 300 --avg-completion 400
python tinker_pricing.py estimate-sft --model Qwen/Qwen3-8B --examples 10000 --avg-tokens 800 --epochs 3
python tinker_pricing.py estimate-sample --model Qwen/Qwen3-8B --prompts 500 --avg-prompt 400 --max-tokens 1024 --n 4
```

## Pre-launch checklist

1. The model id is exact (case-sensitive, `:peft:<n>` suffix included) and its context window
   covers your longest prompt plus `max_tokens` (`tinker_pricing.py show MODEL`).
2. The prices above are still current: open the pricing page, or run `tinker_pricing.py refresh`.
3. The estimate uses measured lengths: mean rendered prompt and completion from a few real
   examples, not guesses; multi-turn runs pass `--turns` and `--avg-observation`.
4. RL counts every sampled group, including groups discarded for constant reward: they are billed.
5. The run has a ceiling: `--max-usd` on the training script stops it before the first paid call.
6. Checkpoint cadence and retention are chosen: `--save-every`, and a TTL or cleanup for old
   `weights/` checkpoints (`tinker checkpoint set-ttl`, `tinker checkpoint delete`).
7. After the first hour, compare `tinker billing usage` with the estimate before letting it run on.

## Sources behind the snapshot

The snapshot was built offline: no first-party copy of the current table was at hand, so each
row is reconstructed from the dated copies below (most quote Tinker's models.json; the newest
tinker-cookbook supplies the models with no price). Where they disagree, the row keeps one value
and its note names the other. `refresh` replaces all of this with the live table.

{{sources}}
"""


def render_pricing_doc(rows: list[dict], meta: dict) -> str:
    template = PRICING_DOC_TEMPLATE
    unpriced = [r for r in rows if all(r[k] is None for k in PRICE_KINDS)]
    training = [r for r in rows if r["kind"] == "training" and r not in unpriced]
    serverless = [r for r in rows if r["kind"] == "serverless" and r not in unpriced]
    fields = {
        "catalogue_date": meta["date"], "catalogue_source": meta["source"],
        "pricing_page": PRICING_PAGE_URL, "models_json": MODELS_JSON_URL,
        "storage_rate": f"{STORAGE_USD_PER_GB_MONTH:.2f}",
        "catalogue_table": markdown_table(training), "serverless_table": markdown_table(serverless),
        "unpriced_table": markdown_table(unpriced),
        "sources": "\n".join(f"- {key}: {text}" for key, text in SOURCES.items()),
    }
    for key, value in fields.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def cmd_init(args) -> int:
    rows, meta = _catalogue(args)
    out = Path(args.out)
    target = out / "TINKER_PRICING.md"
    if out.exists() and not out.is_dir():
        print(f"error: --out {out} is a file; expected a folder for TINKER_PRICING.md (e.g. --out .)", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_new_file(target, render_pricing_doc(rows, meta), args.force)
    except FileExistsError:
        print(f"error: {target} exists and was left untouched; pass --force to overwrite it", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write {target}: {exc.strerror or exc}; choose a folder you can write "
              "(e.g. --out .)", file=sys.stderr)
        return 2
    if not args.json:
        print(f"wrote {target} (catalogue {meta['date']}, {len(rows)} models)", file=sys.stderr)
    emit({"path": str(target), "catalogue_date": meta["date"], "models": len(rows)})
    return 0


def cmd_refresh(args) -> int:
    from datetime import datetime, timezone
    dest = Path(args.out) if args.out else default_override_path()
    if args.from_file:
        try:
            text = Path(args.from_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read {args.from_file}: {exc.strerror or exc}") from None
        source, failure_code = str(Path(args.from_file).resolve()), 2
    else:
        try:
            import httpx
        except ImportError:
            raise ValueError("refresh needs httpx: pip install httpx (or use --from-file)") from None
        source, failure_code = args.url, 1
        try:
            response = httpx.get(args.url, timeout=args.timeout, headers={"User-Agent": USER_AGENT},
                                 follow_redirects=True)
            response.raise_for_status()
            text = response.text
        except httpx.HTTPError as exc:
            detail = (str(exc).splitlines() or [type(exc).__name__])[0]  # httpx adds a help URL line
            kind = "timed out" if isinstance(exc, httpx.TimeoutException) else f"failed: {detail}"
            print(f"error: fetching {args.url} {kind}; kept the current prices ({_current_prices(dest)}); "
                  "retry, or save the file in a browser and run refresh --from-file PATH", file=sys.stderr)
            return 4
    try:
        entries = parse_models_json(json.loads(text))
    except (ValueError, json.JSONDecodeError) as exc:  # JSONDecodeError is a ValueError; kept for clarity
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        print(f"error: {source} is not a valid models.json ({msg}); kept the current prices "
              f"({_current_prices(dest)})", file=sys.stderr)
        return failure_code
    fetched = datetime.now(timezone.utc).isoformat(timespec="seconds")
    stored = {"fetched_at": fetched, "source": source, "models": json.loads(text)}
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_new_file(dest, json.dumps(stored, indent=1) + "\n", force=True)
    except OSError as exc:
        raise ValueError(f"cannot write {dest}: {exc.strerror or exc}") from None
    snapshot = {r["id"]: r for r in SNAPSHOT}
    changed = [e["id"] for e in entries if e["id"] in snapshot
               and any(e[k] is not None and e[k] != snapshot[e["id"]][k] for k in PRICE_KINDS)]
    added = [e["id"] for e in entries if e["id"] not in snapshot]
    if not args.json:
        print(f"stored {len(entries)} models from {source} in {dest} (fetched {fetched[:10]}); "
              f"{len(changed)} price changes and {len(added)} new ids vs the {CATALOGUE_DATE} snapshot",
              file=sys.stderr)
    emit({"path": str(dest), "fetched_at": fetched, "source": source, "models": len(entries),
          "changed": changed, "added": added})
    return 0


def _current_prices(dest: Path) -> str:
    return f"override {dest}" if dest.is_file() else f"snapshot {CATALOGUE_DATE}"


# ==== CLI ====

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"error: {self.prog}: {message}; see {self.prog} --help\n")


def _number(kind, minimum):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if not minimum <= value < math.inf:
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= {minimum}")
        return value
    return parse


_HELP = f"""
metering (what Tinker bills, per 1M tokens of each kind):
  train           every token of every datum sent to forward_backward (prompt AND completion)
  prefill         prompt tokens of a sample call not served from the prefix cache
  cached_prefill  prompt tokens served from the cache (num_samples-1 copies; re-sent prefixes)
  sample          generated tokens
  storage         checkpoints at ${STORAGE_USD_PER_GB_MONTH:.2f} per GB-month

formulas (I iterations, B tasks/iter, G group size, T turns, P prompt, C completion, O observation):
  SFT        train = examples x avg_tokens x epochs   (exact: --data + --tokenizer)
  sampling   prefill = N*P, cached = N*(n-1)*P, sample = N*n*max_tokens (upper bound)
  RL, T=1    prefill = I*B*P, cached = I*B*(G-1)*P, sample = I*B*G*C, train = I*B*G*(P+C)
  RL, T>1    per group: prefill = P + G(T-1)O
                        cached  = (G-1)P + G[(T-1)(P+C) + (C+O)(T-1)(T-2)/2]
                        sample  = G*T*C,  train = G[P + T*C + (T-1)O]   (x I*B groups)
             turn k re-sends P+(k-1)(C+O); all but the new observation is assumed cached.
  A datum is its tokens minus one (targets shift by one): these train counts run <= 1 token per
  datum high. If the renderer breaks the prefix between turns (e.g. it drops earlier thinking),
  each turn is its own datum and train = G * sum_k(P + (k-1)(C+O) + C): use `estimate`.
  Not included unless you add them: reference-KL scoring (prefill), evaluation sampling, storage.

catalogue {CATALOGUE_DATE} (billed prices incl. promotions); verify at {PRICING_PAGE_URL}.
exit codes: 0 ok, 1 runtime failure, 2 bad input / unknown model, 3 above --max-usd,
4 price table unreachable, 130 interrupted.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tinker_pricing.py", description=__doc__.split("\n", 1)[0], epilog=_HELP,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="JSON on stdout only (no tables on stderr)")
    common.add_argument("--prices", metavar="FILE", help="models.json or refresh output to price from "
                        "(default: TINKER_PRICES_FILE / the refresh override / the snapshot)")
    est = argparse.ArgumentParser(add_help=False, parents=[common])
    est.add_argument("--model", "--model-name", dest="model", default=DEFAULT_MODEL,
                     help=f"Tinker id or short name (default {DEFAULT_MODEL})")
    est.add_argument("--context", type=_number(int, 1), metavar="N",
                     help="pick the cheapest variant with a window >= N tokens")
    est.add_argument("--storage-gb-months", type=_number(float, 0), default=None, metavar="X",
                     help="checkpoint storage to add, in GB-months (default: not counted, and said so)")
    est.add_argument("--max-usd", type=_number(float, 0), metavar="USD", help="exit 3 if the estimate is above this")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("list", parents=[common], help="the catalogue, filtered")
    p.add_argument("--family", help="substring of the family, e.g. qwen, nemotron, inkling")
    p.add_argument("--min-context", type=_number(int, 1), metavar="N")
    p.add_argument("--max-train", type=_number(float, 0), metavar="USD", help="max train $/1M (drops unknown)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table instead of JSON")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", parents=[common], help="one model's row and its context variants")
    p.add_argument("model")
    p.add_argument("--context", type=_number(int, 1))
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("init", parents=[common], help="write TINKER_PRICING.md into a project folder")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--force", "--overwrite", dest="force", action="store_true", help="replace an existing file")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("estimate", parents=[est], help="price token counts by kind",
                       epilog=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    for kind in ("prefill", "cached-prefill", "sample", "train"):
        p.add_argument(f"--{kind}-tokens", type=_number(int, 0), default=0, metavar="N")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("estimate-sft", parents=[est], help="supervised fine-tuning",
                       epilog=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=_number(int, 0), metavar="N")
    p.add_argument("--avg-tokens", type=_number(float, 0), metavar="L", help="mean rendered example length")
    p.add_argument("--epochs", type=_number(float, 0), default=1.0, metavar="E", help="passes over the data (1)")
    p.add_argument("--data", metavar="FILE.jsonl", help="count with the tokenizer's chat template (messages, "
                   "prompt+completion or text rows); tinker_sft.py --dry-run counts with its own renderer")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (or hub name if cached) for --data")
    p.add_argument("--max-length", type=_number(int, 2), metavar="N", help="truncate each example like the trainer")
    p.set_defaults(func=cmd_estimate_sft)

    p = sub.add_parser("estimate-rl", parents=[est], help="group-sampled RL (GRPO-style), multi-turn aware",
                       epilog=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=_number(int, 0), required=True, metavar="I")
    p.add_argument("--tasks-per-iter", type=_number(int, 0), required=True, metavar="B",
                   help="groups (prompts) per iteration")
    p.add_argument("--group-size", type=_number(int, 1), required=True, metavar="G", help="samples per task")
    p.add_argument("--turns", type=_number(int, 1), default=1, metavar="T", help="model turns per episode (1)")
    p.add_argument("--avg-prompt", type=_number(float, 0), required=True, metavar="P",
                   help="first prompt tokens, rendered")
    p.add_argument("--avg-completion", type=_number(float, 0), required=True, metavar="C",
                   help="tokens sampled per turn")
    p.add_argument("--avg-observation", type=_number(float, 0), default=0.0, metavar="O",
                   help="new tokens (tool output, user reply) per later turn (0)")
    p.set_defaults(func=cmd_estimate_rl)

    p = sub.add_parser("estimate-sample", parents=[est], help="sampling / evaluation",
                       epilog=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=_number(int, 0), required=True, metavar="N")
    p.add_argument("--avg-prompt", type=_number(float, 0), required=True, metavar="P", help="rendered prompt tokens")
    p.add_argument("--max-tokens", type=_number(int, 0), required=True, metavar="M",
                   help="every sample is priced as if it reached M")
    p.add_argument("--n", type=_number(int, 1), default=1, help="num_samples per prompt (1)")
    p.set_defaults(func=cmd_estimate_sample)

    p = sub.add_parser("refresh", parents=[common], help="store the live models.json as a price override")
    p.add_argument("--url", default=MODELS_JSON_URL)
    p.add_argument("--from-file", metavar="PATH", help="a saved models.json instead of fetching")
    p.add_argument("--timeout", type=_number(float, 0.1), default=REFRESH_TIMEOUT_S, metavar="S")
    p.add_argument("--out", metavar="FILE", help="override file (default TINKER_PRICES_FILE or the cache)")
    p.set_defaults(func=cmd_refresh)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BudgetExceeded as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except (ValueError, OverflowError) as exc:  # includes UnknownModelError; overflow: absurd sizes
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug or an environment problem: still one line, never a traceback
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
