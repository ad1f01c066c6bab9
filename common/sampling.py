"""Sampling a base model or a training run as it was trained: the run's recorded format, system prompt and greedy
default, the tokenizer that renders and decodes, stop tokens, the sampling client, every prompt submitted before
any is awaited, completions as text, the result rows (--out) and the dollar estimate of what was sampled."""
from __future__ import annotations

import json
import os
from pathlib import Path

from checkpoints import latest_row, read_run_record, tinker_failure  # splice: drop
from errors import DataError, local_hint, say  # splice: drop
from rehearsal import backend_record  # splice: drop
from render import chat_format, load_tokenizer, stop_tokens  # splice: drop
from run_record import Run  # splice: drop
from service import load_pricing  # splice: drop


def run_format(log_dir: str, *, kind: str | None = None, thinking: bool = False) -> tuple[str, dict]:
    """(the run's newest sampler path, the format it trained in) from LOG_DIR/checkpoints.jsonl. DataError when
    the record has no format, or when `kind` (--format) or `thinking` (--thinking) contradicts it."""
    row = latest_row(read_run_record(log_dir), "sampler", log_dir)
    check_same_backend(log_dir, Run(log_dir).config().get("backend"))
    fmt = dict(row.get("format") or {})
    if fmt.get("kind") not in ("chat", "raw"):
        raise DataError(f"{log_dir}/checkpoints.jsonl has no \"format\" with kind chat|raw; "
                        f"sample it with --model {row['sampler_path']} --format chat|raw")
    if kind and kind != fmt["kind"]:
        raise DataError(f"--format {kind} contradicts the run, which trained in {fmt['kind']} format; "
                        "drop --format to sample as trained")
    if thinking and fmt["kind"] == "chat" and not fmt.get("template_kwargs", {}).get("enable_thinking"):
        raise DataError("--thinking contradicts the run, which trained with thinking off; drop --thinking to "
                        "sample as trained")
    if fmt["kind"] == "chat":  # records older than the shared renderer may lack these keys
        fmt.setdefault("template_kwargs", {})
        fmt.setdefault("template_sha256", "")
    return row["sampler_path"], fmt


def check_same_backend(log_dir: str, trained: dict | None) -> None:
    """A run's checkpoints load only where it trained: a local rehearsal's on the local backend with the same model
    standing in (the tiny model's adapter does not fit the real model, nor either on Tinker). DataError otherwise,
    naming the launcher command. Records without "backend" (older runs) are not checked."""
    if not trained or trained.get("kind") != "local":
        return
    here = backend_record()
    if here["kind"] == "local" and here["stand_in"] in (None, trained.get("stand_in")):
        return
    real = trained.get("stand_in_kind") == "real"
    where = f"the local backend's {'real model' if real else 'tiny model'} ({trained.get('stand_in')})"
    now = "Tinker" if here["kind"] == "tinker" else f"a local server of {here['stand_in']}"
    hint = local_hint()
    if real and " run -- " in hint:
        hint = hint.replace(" run -- ", " run --real -- ", 1)
    raise DataError(f"{log_dir} was trained on {where}, and this command talks to {now}: its checkpoints load only "
                    f"there ({hint})")


def run_sampling(log_dir: str, temperature: float | None, system: str | None) -> tuple[float, str | None]:
    """(temperature, system prompt) to sample a run with: the given ones, else as the run's probes sampled
    (LOG_DIR/config.json: probe_sampling's temperature, greedy when absent) and the system prompt every training
    example shared (none when they differ or had none). system '' means none."""
    config = Run(log_dir).config()
    if temperature is None:
        temperature = (config.get("probe_sampling") or {}).get("temperature", 0.0)
        say(f"sampling at temperature {temperature:g}, as the run's probes (--temperature changes it)")
    if system is not None:
        return temperature, system or None
    kind = config.get("system_prompts")
    if kind == "shared":
        shown = config["system_prompt"]
        say(f"system prompt: the one every training example of {log_dir} carried ({shown[:60]!r}"
            f"{'...' if len(shown) > 60 else ''}); --system '' samples without it")
        return temperature, shown
    if kind == "differ":
        say(f"note: the training examples of {log_dir} carry different system prompts, so none is added; pass "
            "--system TEXT (or --messages with a system turn) to prompt as one of them did")
    return temperature, None


def with_system_prompt(rows: list[dict], system: str | None, kind: str) -> list[dict]:
    """The rows as sent: in chat format, `system` first in every row that has no system turn of its own."""
    if not system:
        return rows
    if kind != "chat":
        say("note: --system applies to the chat format only; this run samples raw text, so it is not used")
        return rows
    out = []
    for row in rows:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        if messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system}, *messages]
        out.append({"messages": messages})
    return out


def load_sampling_tokenizer(name_or_path: str | None):
    """The tokenizer to render and decode with, or None when only the sampling client can name it."""
    if name_or_path and name_or_path.startswith((".", "/", "~")) and not Path(name_or_path).expanduser().is_dir():
        # A run recorded a folder that is not here; the base model's tokenizer is next best, and
        # check_template() warns if its template is not the run's.
        say(f"warning: tokenizer folder {name_or_path} not found from here; using the base model's tokenizer "
            "(pass --tokenizer DIR to choose)")
        return None
    return load_tokenizer(name_or_path) if name_or_path else None


def format_stop_ids(fmt: dict, tokenizer) -> list[int]:
    """The format's stop token ids: as recorded, else the end-of-turn token the shared renderer trains."""
    recorded = [int(t) for t in fmt.get("stop") or [] if isinstance(t, int) or str(t).isdigit()]
    if recorded:
        return sorted(set(recorded))
    if fmt.get("kind") == "chat" and "template_kwargs" not in fmt:  # a model by name: its default chat format
        fmt = chat_format(tokenizer, name=fmt.get("tokenizer") or "the tokenizer")
    return stop_tokens(tokenizer, fmt)


def check_template(fmt: dict, tokenizer) -> bool | None:
    """Whether the tokenizer's chat template is the one the run recorded (None: nothing recorded)."""
    recorded = fmt.get("template_sha256")
    if not recorded or fmt["kind"] != "chat":
        return None
    actual = chat_format(tokenizer, name=fmt.get("tokenizer") or "?")["template_sha256"]
    if actual != recorded:
        say(f"warning: this tokenizer's chat template (sha256 {actual[:12]}) is not the one the run trained with "
            f"({recorded[:12]}); pass --tokenizer with the run's tokenizer")
    return actual == recorded


def sampling_client(service, model: str):
    """A SamplingClient for a base model name or a tinker://RUN/sampler_weights/NAME path."""
    try:
        future = (service.create_sampling_client(model_path=model) if model.startswith("tinker://")
                  else service.create_sampling_client(base_model=model))
        return future.result()
    except Exception as e:
        raise tinker_failure(e, "creating the sampling client", model)


def sampling_stop(stop_ids: list[int], stop_strings: list[str], tokenizer) -> list:
    """SamplingParams.stop: the format's stop token ids; with stop strings, those strings plus each stop token as
    its text (one SamplingParams.stop holds strings or token ids, never both)."""
    if not stop_strings:
        return list(stop_ids)
    return list(stop_strings) + [tokenizer.decode([t], skip_special_tokens=False) for t in stop_ids]


def sample_prompts(client, prompts: list[list[int]], params, num_samples: int, model: str) -> list[list]:
    """Each prompt's sampled sequences (tokens, stop_reason), in prompt order. Every prompt is submitted before
    any is awaited, so the server batches them."""
    import tinker

    futures = [client.sample(tinker.ModelInput.from_ints(p), num_samples=num_samples, sampling_params=params)
               for p in prompts]
    out = []
    for i, future in enumerate(futures):
        try:
            out.append(list(future.result().sequences))
        except Exception as e:
            raise tinker_failure(e, f"sampling prompt {i}", model)
    return out


def decode_completion(tokens: list[int], tokenizer, stop_ids: list[int], stop_strings: list[str]) -> str:
    """Completion tokens -> text: drop a trailing stop token, cut at the first stop string (the OpenAI
    convention, so the SDK route and the OpenAI-compatible endpoint give the same text)."""
    if tokens and tokens[-1] in stop_ids:
        tokens = tokens[:-1]
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    cuts = [text.find(s) for s in stop_strings if s and s in text]
    return text[: min(cuts)] if cuts else text


def sample_usd(model: str, prompt_tokens: int, completion_tokens: int) -> float | None:
    """Dollars for one sampling of `model` (tinker_pricing.py beside the script), or None when unknown."""
    pricing = load_pricing()
    if pricing is None:
        return None
    try:
        est = pricing.estimate_cost(model, prefill=prompt_tokens, cached_prefill=0, sample=completion_tokens)
    except Exception:  # unknown or unpriced model: no estimate, never a failure
        return None
    usd = est.get("usd", est) if isinstance(est, dict) else est
    total = usd.get("total") if isinstance(usd, dict) else usd
    return float(total) if isinstance(total, (int, float)) else None


def price_samples(model: str, samples: list[dict]) -> float | None:
    """Each sample's estimate in s["usd"] (the n samples of one prompt share its prefill, charged with the first),
    and the total."""
    def prefill(s):
        return (s["prompt_tokens"] or 0) if s["sample_index"] == 0 else 0

    for s in samples:
        s["usd"] = sample_usd(model, prefill(s), s["completion_tokens"] or 0)
    return sample_usd(model, sum(prefill(s) for s in samples), sum(s["completion_tokens"] or 0 for s in samples))


def write_results(out: str, rows: list[dict], samples: list[dict]) -> None:
    """--out: one JSONL row per input row, in input order, {"index", "prompt"|"messages", "samples": [each
    sample without its prompt_index]}; written beside `out` and renamed, so never half-written."""
    by_prompt: dict[int, list] = {}
    for s in samples:
        by_prompt.setdefault(s["prompt_index"], []).append({k: v for k, v in s.items() if k != "prompt_index"})
    write_jsonl(out, [{"index": i, **row, "samples": by_prompt.get(i, [])} for i, row in enumerate(rows)])


def write_jsonl(out: str, rows: list[dict]) -> None:
    """One JSON line per row, written beside `out` and renamed into place: never half-written."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    partial = Path(f"{out}.partial")
    with open(partial, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(partial, out)
