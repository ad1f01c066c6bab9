#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "tinker>=0.38,<0.39",
#     "transformers>=4.51",
#     "jinja2>=3.1",
#     "httpx>=0.27",
#     "rich>=13",
# ]
# ///
"""Sample from a Tinker model or checkpoint, and find, export and merge checkpoints.

Run:
    python tinker_infer.py --model Qwen/Qwen3-8B --prompt "What is 2+2?" --max-tokens 64
    python tinker_infer.py --run logs/my-sft --input prompts.jsonl --out answers.jsonl --seed 0
    python tinker_infer.py --http --model tinker://RUN/sampler_weights/final --prompt "Hi" --stop "\\n"
    python tinker_infer.py checkpoints list --run RUN_ID
    python tinker_infer.py checkpoints resolve logs/my-sft --kind sampler
    python tinker_infer.py checkpoints export tinker://RUN/sampler_weights/final --out adapter/
    python tinker_infer.py checkpoints merge adapter/ --base path/to/hf-base-model --out merged/

Routes:
    SDK (default): tinker.ServiceClient -> create_sampling_client -> sample(); the prompt is
      rendered here, with the model's chat template (--format chat) or as plain text
      (--format raw), or exactly as a training run recorded it (--run LOG_DIR: the final
      sampler path, template kwargs and stop token ids from LOG_DIR/checkpoints.jsonl).
    HTTP (--http): Tinker's OpenAI-compatible endpoint, /chat/completions for chat and
      /completions for raw, Bearer $TINKER_API_KEY; base URL from --base-url, else
      $TINKER_BASE_URL + /oai/api/v1, else the hosted service. Retries 429 and 5xx with
      back-off. The server applies the model's own chat template: it cannot apply a run's
      recorded template kwargs, so use the SDK route to sample a run in its exact format.

Checkpoints:
    list [--run ID|LOG_DIR]   newest first: path, type, size, expiry (server listing; the
                              local backend has no account-wide listing, so every run's
                              checkpoints are listed instead)
    resolve RUN_ID|LOG_DIR|PATH [--kind sampler|state]   the latest path of that kind (from a
                              tinker:// path: the same save of that kind first)
    export PATH --out DIR     external_weights/: the signed URLs from
                              RestClient.get_external_weights_urls (SDK 0.38's route);
                              weights/: the official `tinker checkpoint download` (it exports
                              through save_weights_external and deletes the copy);
                              sampler_weights/: SDK 0.38 has no route, so the server's
                              archive route GET /api/v1/training_runs/{run}/checkpoints/{name}/archive
                              is tried (the local backend serves it: a tar.gz PEFT adapter),
                              else the error names the same run's weights/ path. Downloads
                              show progress, check Content-Length and any MD5/SHA-256 the
                              server sends, and extract safely (absolute paths, `..` and
                              links leaving DIR are refused before anything is written).
    merge ADAPTER_DIR --base BASE_DIR --out DIR   merge a PEFT LoRA adapter into the base
                              model's Hugging Face weights (needs torch + peft, an optional
                              extra; install torch first, then `pip install peft safetensors`).
                              Local backend caveats: checkpoints live in that server's run
                              folder (a new server starts empty); weights/ export is unavailable.

Edit:
    Nothing for the common case. To post-process completions, edit `render_prompt()` (turns
    one input row into prompt tokens) or `completion_text()` (turns tokens into text).

Outputs:
    stdout: exactly one JSON object. Sampling: {"status", "route", "model", "base_model",
      "format", "sampling", "samples": [{"prompt_index", "sample_index", "text", "tokens",
      "stop_reason", "prompt_tokens", "completion_tokens", "usd"}], "usd", "out"}. `--json` only
      silences the human-readable display on stderr. With --input FILE.jsonl and --out,
      one JSONL row per input row, in input order: {"index", "prompt"|"messages", "samples"}.
    checkpoints list -> {"checkpoints": [...]}; resolve -> {"path", "kind", "source"};
    export -> {"out", "files", "bytes", "route"}; merge -> {"out", "target_modules", ...}.

Requires:
    TINKER_API_KEY (starts with tml-); TINKER_BASE_URL optional (local rehearsals).
    Exit codes: 0 ok, 1 Tinker or runtime failure, 2 bad input or usage (flags, data, wrong
    checkpoint kind, unknown model or checkpoint), 4 no credentials or cannot reach Tinker,
    130 interrupted.
"""
from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import datetime as dt
import difflib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# ==== SETTINGS (defaults; every one is a flag) ====
DEFAULT_MODEL = "Qwen/Qwen3-8B"
DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0  # Tinker's own default; lower it for more deterministic answers
HOSTED_OAI_BASE_URL = "https://tinker.thinkingmachines.dev/services/tinker-prod/oai/api/v1"
HTTP_TIMEOUT_S = 120.0
HTTP_RETRIES = 4
# End-of-turn tokens of the chat families Tinker serves; used as stop ids for --format chat
# when no run record says otherwise (gpt-oss's <|end|> closes analysis messages, so it is
# deliberately not here).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|return|>", "<|call|>", "<｜end▁of▁sentence｜>")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NO_ACCESS, EXIT_INTERRUPTED = 0, 1, 2, 4, 130


class Fail(Exception):
    """A failure with a documented exit code and a one-line message (what, expected, next)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ==== EDIT ME: render_prompt() / completion_text() ====
def render_prompt(row: dict, fmt: dict, tokenizer) -> list[int]:
    """One input row ({"prompt": str} or {"messages": [...]}) -> prompt token ids.

    Chat: the tokenizer's chat template with the generation prompt and the recorded
    template kwargs. Raw: the text as is, or messages as "User: ...\n\nAssistant:" (as
    tinker_sft.py trains base models), after BOS when the format (or tokenizer) has one.
    """
    if fmt["kind"] == "raw":
        bos_id = tokenizer.bos_token_id
        bos = [bos_id] if bos_id is not None and fmt.get("bos", True) else []
        return bos + tokenizer.encode(raw_text(row), add_special_tokens=False)
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    if getattr(tokenizer, "chat_template", None) is None:
        raise Fail(EXIT_USAGE, "this tokenizer has no chat template; pass --format raw for a base model, "
                               "or --tokenizer DIR with a chat_template")
    text = apply_chat_template(tokenizer, messages, template_kwargs(fmt))
    # The rendered text already holds BOS and every special token the template wants.
    return tokenizer.encode(text, add_special_tokens=False)


def apply_chat_template(tokenizer, messages: list[dict], kwargs: dict) -> str:
    """Render with the generation prompt; a frozen strftime_now replaces the template global.

    transformers 5 turns callables passed as template kwargs into inert strings, so the
    frozen date is installed in the compiled template's own globals for this one render.
    """
    frozen = kwargs.pop("strftime_now", None)
    if frozen is None:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    from transformers.utils import chat_template_utils
    compiled = chat_template_utils._compile_jinja_template(tokenizer.get_chat_template())
    had, previous = "strftime_now" in compiled.globals.maps[0], compiled.globals.maps[0].get("strftime_now")
    compiled.globals.maps[0]["strftime_now"] = frozen
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    finally:
        if had:
            compiled.globals.maps[0]["strftime_now"] = previous
        else:
            del compiled.globals.maps[0]["strftime_now"]


def raw_text(row: dict) -> str:
    if "prompt" in row:
        return row["prompt"]
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in row["messages"]]
    return "\n\n".join(parts + ["Assistant:"])


def completion_text(tokens: list[int], tokenizer, stop_ids: list[int], stop_strings: list[str]) -> str:
    """Completion tokens -> text: drop a trailing stop token, cut at the first stop string
    (the OpenAI convention, so both routes print the same text)."""
    if tokens and tokens[-1] in stop_ids:
        tokens = tokens[:-1]
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    cuts = [text.find(s) for s in stop_strings if s and s in text]
    return text[: min(cuts)] if cuts else text


# ==== run record and format ====
def template_kwargs(fmt: dict) -> dict:
    """The recorded template kwargs, with a frozen `strftime_now` rebuilt as a callable.

    Templates call strftime_now(format) (gpt-oss prints today's date); a run records the
    frozen date as an ISO string so the prompt never changes with the calendar.
    """
    kwargs = dict(fmt.get("template_kwargs") or {})
    frozen = kwargs.get("strftime_now")
    if isinstance(frozen, str):
        try:
            moment = dt.datetime.fromisoformat(frozen)
            kwargs["strftime_now"] = lambda f, _m=moment: _m.strftime(f)
        except ValueError:
            kwargs["strftime_now"] = lambda f, _s=frozen: _s
    return kwargs


def read_run_record(log_dir: str) -> list[dict]:
    rows_file = Path(log_dir) / "checkpoints.jsonl"
    if not rows_file.is_file():
        raise Fail(EXIT_USAGE, f"{rows_file} not found; expected the log folder of a tinker_sft.py/tinker_rl.py "
                               f"run; next: ls {log_dir}")
    rows = []
    for n, line in enumerate(rows_file.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise Fail(EXIT_USAGE, f"{rows_file}:{n} is not JSON ({e.msg}); fix or remove that line")
    if not rows:
        raise Fail(EXIT_USAGE, f"{rows_file} has no checkpoint yet; let the run save one (--save-every) and retry")
    return rows


def latest_row(rows: list[dict], kind: str, where: str) -> dict:
    key = "sampler_path" if kind == "sampler" else "state_path"
    for row in reversed(rows):
        if row.get(key):
            return row
    other = "state" if kind == "sampler" else "sampler"
    raise Fail(EXIT_USAGE, f"{where} records no {key}; it has only {other} checkpoints; next: "
                           f"tinker_infer.py checkpoints resolve {where} --kind {other}")


# ==== tinker:// paths ====
def parse_tinker_path(path: str) -> tuple[str, str, str] | None:
    """tinker://RUN/SEGMENT/NAME -> (run, segment, name); None if not a tinker path."""
    if not path.startswith("tinker://"):
        return None
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights", "external_weights") or not all(parts):
        raise Fail(EXIT_USAGE, f"{path} is not a checkpoint path; expected tinker://RUN_ID/sampler_weights/NAME "
                               f"(or weights/, external_weights/); next: tinker_infer.py checkpoints list")
    return parts[0], parts[1], parts[2]


def rest_client():
    """RestClient for the current environment. Passed explicitly because RestClient() with no
    arguments reuses the first one made in the process, whatever TINKER_BASE_URL says now."""
    import tinker
    return tinker.RestClient(base_url=os.environ.get("TINKER_BASE_URL") or None,
                             api_key=os.environ.get("TINKER_API_KEY") or None)


def run_checkpoints(run_id: str) -> list:
    """The server's checkpoints of one run, newest first ([] if it cannot list them)."""
    try:
        # Only a hint: never wait long for it (the SDK retries a dead server for minutes).
        listing = rest_client().list_checkpoints(run_id).result(timeout=20)
    except Exception:
        return []
    return sorted(listing.checkpoints, key=lambda c: c.time, reverse=True)


def require_sampler_path(path: str) -> None:
    """A weights/ or external_weights/ path cannot be sampled: say which path can."""
    parsed = parse_tinker_path(path)
    if parsed is None or parsed[1] == "sampler_weights":
        return
    run, segment, name = parsed
    samplers = [c.tinker_path for c in run_checkpoints(run) if c.checkpoint_type == "sampler"]
    same_name = f"tinker://{run}/sampler_weights/{name}"
    if same_name in samplers:
        hint = f"sample the same run's sampler path: --model {same_name}"
    elif samplers:
        hint = f"this run's newest sampler path is {samplers[0]}; pass it as --model"
    else:
        hint = ("save one with training_client.save_weights_for_sampler(name) and pass its "
                "tinker://.../sampler_weights/... path")
    kind = "resumable training state (save_state)" if segment == "weights" else "an export for download"
    raise Fail(EXIT_USAGE, f"{path} is {kind}, which cannot be sampled; sampling needs a sampler_weights/ path; {hint}")


# ==== credentials and errors ====
def require_credentials() -> str:
    key = os.environ.get("TINKER_API_KEY", "")
    if key:
        if not (key.startswith("tml-") or key.startswith("eyJ")):
            raise Fail(EXIT_NO_ACCESS, "TINKER_API_KEY does not start with tml-; expected a Tinker API key; "
                                       "next: copy it again from the Tinker console")
        return key
    import tinker.auth
    if tinker.auth.tinker_has_credentials():
        return tinker.auth.get_tinker_token() or ""
    raise Fail(EXIT_NO_ACCESS, "no Tinker credentials: TINKER_API_KEY is not set and `tinker auth login` was not run; "
                               "next: export TINKER_API_KEY=tml-... (or run tinker_local.py for a free rehearsal)")


def tinker_failure(e: Exception, what: str, model: str | None = None) -> Fail:
    """Map an SDK exception to an exit code and a message with the next step."""
    import tinker
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    base = os.environ.get("TINKER_BASE_URL") or "the hosted Tinker service"
    if isinstance(e, (tinker.AuthenticationError, tinker.PermissionDeniedError)):
        return Fail(EXIT_NO_ACCESS, f"{what}: Tinker rejected the API key ({message}); next: check TINKER_API_KEY")
    if isinstance(e, tinker.APIConnectionError):
        return Fail(EXIT_NO_ACCESS, f"{what}: cannot reach {base} ({message}); next: check the network or TINKER_BASE_URL")
    lowered = message.lower()
    if "not loaded" in lowered:
        return Fail(EXIT_FAILURE, f"{what}: the server no longer has the model behind {model} loaded ({message}); "
                                  f"next: sample a sampler_weights/ checkpoint of it (tinker_infer.py checkpoints "
                                  f"list), or restore its last save_state path")
    if isinstance(e, tinker.NotFoundError) or "not found" in lowered or "expired" in lowered:
        hint = "tinker_infer.py checkpoints list"
        parsed = parse_tinker_path(model) if model and model.startswith("tinker://") else None
        if parsed:
            hint += f" --run {parsed[0]}"
        return Fail(EXIT_USAGE, f"{what}: {model or 'the checkpoint'} is unknown or expired ({message}); next: {hint}")
    if isinstance(e, (tinker.BadRequestError, tinker.UnprocessableEntityError)):
        return Fail(EXIT_USAGE, f"{what}: the server rejected the request ({message})")
    if isinstance(e, tinker.RequestFailedError) and str(getattr(e, "category", "")).lower().endswith("user"):
        return Fail(EXIT_USAGE, f"{what}: the server rejected the request ({message})")
    return Fail(EXIT_FAILURE, f"{what} failed: {message}")


def check_model_served(model: str) -> None:
    """A base model name must be one the server samples; list close names if not."""
    import tinker
    try:
        caps = rest_client().get_server_capabilities().result(timeout=60)
    except TimeoutError:
        base = os.environ.get("TINKER_BASE_URL") or "the hosted Tinker service"
        raise Fail(EXIT_NO_ACCESS, f"no answer from {base} within 60 s; next: check the network or TINKER_BASE_URL")
    except Exception as e:  # capabilities are advisory; the sampling call reports real errors
        if isinstance(e, (tinker.AuthenticationError, tinker.APIConnectionError)):
            raise tinker_failure(e, "listing the served models")
        return
    names = [m.model_name for m in caps.supported_models if m.model_name]
    if not names or model in names:
        return
    close = difflib.get_close_matches(model, names, n=5, cutoff=0.3) or names[:5]
    raise Fail(EXIT_USAGE, f"{model} is not served here; close names: {', '.join(close)}; next: tinker model list")


# ==== inputs ====
def load_inputs(args) -> list[dict]:
    given = [x for x in (args.prompt, args.messages, args.input) if x is not None]
    if len(given) != 1:
        raise Fail(EXIT_USAGE, "give exactly one of --prompt TEXT, --messages JSON, --input FILE.jsonl")
    if args.prompt is not None:
        return [{"prompt": args.prompt}]
    if args.messages is not None:
        try:
            messages = json.loads(args.messages)
        except json.JSONDecodeError as e:
            raise Fail(EXIT_USAGE, f"--messages is not JSON ({e.msg}); expected '[{{\"role\": \"user\", \"content\": \"hi\"}}]'")
        return [{"messages": check_messages(messages, "--messages")}]
    path = Path(args.input)
    if not path.is_file():
        raise Fail(EXIT_USAGE, f"--input {path} not found; expected a JSONL file of {{\"prompt\": ...}} or {{\"messages\": [...]}} rows")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise Fail(EXIT_USAGE, f"{path}:{n} is not JSON ({e.msg}); fix that line")
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            rows.append({"prompt": row["prompt"]})
        elif isinstance(row, dict) and "messages" in row:
            rows.append({"messages": check_messages(row["messages"], f"{path}:{n}")})
        else:
            raise Fail(EXIT_USAGE, f"{path}:{n} has neither a \"prompt\" string nor \"messages\"; expected one per row")
    if not rows:
        raise Fail(EXIT_USAGE, f"{path} has no rows")
    return rows


def check_messages(messages, where: str) -> list[dict]:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages)
    if not ok:
        raise Fail(EXIT_USAGE, f"{where}: messages must be a non-empty list of {{\"role\", \"content\"}} objects")
    return messages


def resolve_target(args) -> tuple[str, dict, str | None]:
    """(model or sampler path, format, tokenizer) from the flags and the run record."""
    if args.run:
        row = latest_row(read_run_record(args.run), "sampler", args.run)
        fmt = dict(row.get("format") or {})
        if fmt.get("kind") not in ("chat", "raw"):
            raise Fail(EXIT_USAGE, f"{args.run}/checkpoints.jsonl has no \"format\" with kind chat|raw; "
                                   f"sample it with --model {row['sampler_path']} --format chat|raw")
        if args.format and args.format != fmt["kind"]:
            raise Fail(EXIT_USAGE, f"--format {args.format} contradicts the run, which trained in {fmt['kind']} format; "
                                   f"drop --format to sample as trained")
        return args.model or row["sampler_path"], fmt, args.tokenizer or fmt.get("tokenizer")
    return args.model or DEFAULT_MODEL, {"kind": args.format or "chat"}, args.tokenizer


# ==== pricing (optional, from this script's folder) ====
def estimate_usd(model: str, prompt_tokens: int, completion_tokens: int) -> float | None:
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        import tinker_pricing
    except ImportError:
        return None
    try:
        est = tinker_pricing.estimate_cost(model, prefill=prompt_tokens, cached_prefill=0, sample=completion_tokens)
    except Exception:  # unknown or unpriced model: no estimate, never a failure
        return None
    if isinstance(est, (int, float)):
        return float(est)
    if isinstance(est, dict):
        usd = est.get("usd", est)
        total = usd.get("total") if isinstance(usd, dict) else usd
        return float(total) if isinstance(total, (int, float)) else None
    return None


# ==== SDK route ====
def load_tokenizer(name_or_path: str | None, sampling_client):
    if name_or_path and name_or_path.startswith((".", "/")) and not Path(name_or_path).is_dir():
        # A run recorded a folder relative to where it ran; the base model's tokenizer is next best,
        # and check_template() warns if its template is not the run's.
        log(f"warning: tokenizer folder {name_or_path} not found from here; using the base model's tokenizer "
            f"(pass --tokenizer DIR to choose)")
        name_or_path = None
    from transformers import AutoTokenizer

    name = name_or_path or sampling_client.get_base_model()
    next_step = ("next: pass --tokenizer DIR (a folder with tokenizer.json and the chat template), or download "
                 "it once and run with HF_HUB_OFFLINE=1")
    if Path(name).is_dir():
        try:
            return AutoTokenizer.from_pretrained(name)
        except Exception as e:
            raise Fail(EXIT_USAGE, f"cannot load the tokenizer {name} ({first_line(e)}); {next_step}")
    # The SDK's get_tokenizer() name rules, then the Hugging Face cache with no network, then the hub once
    # if one short connection to it opens: an offline machine otherwise spends ~50 s in retries.
    hub_id, kwargs = name.split(":", 1)[0], {}
    if hub_id.startswith("meta-llama/Llama-3"):
        hub_id = "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"  # the ungated copy the SDK uses
    elif hub_id.count("/") == 2:
        hub_id = hub_id.rsplit("/", 1)[0]
    if hub_id.startswith("moonshotai/Kimi-K"):
        kwargs["trust_remote_code"] = True
    with contextlib.suppress(Exception):
        return AutoTokenizer.from_pretrained(hub_id, local_files_only=True, **kwargs)
    failed = f"cannot load the tokenizer {hub_id}: not in the Hugging Face cache and "
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise Fail(EXIT_USAGE, failed + f"HF_HUB_OFFLINE=1 forbids the hub; {next_step}")
    unreachable = hub_unreachable()
    if unreachable:
        raise Fail(EXIT_USAGE, failed + f"the hub is unreachable ({unreachable}); {next_step}")
    try:
        return AutoTokenizer.from_pretrained(hub_id, **kwargs)
    except Exception as e:
        raise Fail(EXIT_USAGE, f"cannot load the tokenizer {hub_id} from the hub ({first_line(e)}); {next_step}")


def first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def hub_unreachable(timeout_s: float = 5.0) -> str | None:
    """Why one TCP connection to the hub (HF_ENDPOINT, or the proxy for it) fails, or None if it opens."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(url.hostname):
        url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        return f"{url.hostname}:{port}: {e.strerror or type(e).__name__}"
    return None


def format_stop_ids(fmt: dict, tokenizer) -> list[int]:
    if fmt.get("stop"):
        return [int(t) for t in fmt["stop"] if isinstance(t, int) or str(t).isdigit()]
    ids = []
    if fmt["kind"] == "chat":
        vocab = tokenizer.get_vocab()
        ids = [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
    if tokenizer.eos_token_id is not None and (fmt["kind"] == "raw" or not ids):
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def check_template(fmt: dict, tokenizer) -> bool | None:
    recorded = fmt.get("template_sha256")
    if not recorded or fmt["kind"] != "chat":
        return None
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default one renders (as in tinker_sft.py)
        template = template.get("default") or next(iter(template.values()))
    same = hashlib.sha256(template.encode()).hexdigest() == recorded
    if not same:
        log(f"warning: this tokenizer's chat template (sha256 {hashlib.sha256(template.encode()).hexdigest()[:12]}) is not "
            f"the one the run trained with ({recorded[:12]}); pass --tokenizer with the run's tokenizer")
    return same


def sample_sdk(args, rows: list[dict], model: str, fmt: dict, tokenizer_name: str | None) -> dict:
    import tinker

    require_credentials()
    require_sampler_path(model)
    is_path = parse_tinker_path(model) is not None
    if not is_path:
        check_model_served(model)
    service = tinker.ServiceClient()
    status = "errored"
    try:
        result = sample_with(service, args, rows, model, fmt, tokenizer_name, is_path)
        status = "success"
        return result
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        try:  # ends the session at once instead of letting it time out on the server
            service.close(status).result(timeout=30)
        except Exception:
            pass


def sample_with(service, args, rows, model, fmt, tokenizer_name, is_path) -> dict:
    import tinker

    try:
        future = (service.create_sampling_client(model_path=model) if is_path
                  else service.create_sampling_client(base_model=model))
        client = future.result()
    except Exception as e:
        raise tinker_failure(e, "creating the sampling client", model)
    base_model = client.get_base_model()
    tokenizer = load_tokenizer(tokenizer_name, client)
    template_ok = check_template(fmt, tokenizer)
    stop_ids = format_stop_ids(fmt, tokenizer)
    # One SamplingParams.stop holds either strings or token ids, never both: with --stop,
    # the format's stop tokens travel as their token strings.
    if args.stop:
        stop = list(args.stop) + [tokenizer.decode([t], skip_special_tokens=False) for t in stop_ids]
    else:
        stop = stop_ids
    params = tinker.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                   top_k=args.top_k, seed=args.seed, stop=stop)
    prompts = [render_prompt(row, fmt, tokenizer) for row in rows]
    # Submit every prompt before awaiting any: the server batches them.
    futures = [client.sample(tinker.ModelInput.from_ints(p), num_samples=args.n, sampling_params=params)
               for p in prompts]
    samples = []
    for i, (prompt, fut) in enumerate(zip(prompts, futures)):
        try:
            response = fut.result()
        except Exception as e:
            raise tinker_failure(e, f"sampling prompt {i}", model)
        for j, seq in enumerate(response.sequences):
            tokens = list(seq.tokens)
            samples.append({"prompt_index": i, "sample_index": j,
                            "text": completion_text(tokens, tokenizer, stop_ids, list(args.stop or [])),
                            "tokens": tokens, "stop_reason": seq.stop_reason,
                            "prompt_tokens": len(prompt), "completion_tokens": len(tokens)})
    return {"model": model, "base_model": base_model, "format": {**fmt, "stop": stop_ids},
            "template_matches_run": template_ok, "samples": samples}


# ==== HTTP route (OpenAI-compatible) ====
def oai_base_url(args) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    if os.environ.get("TINKER_BASE_URL"):
        return os.environ["TINKER_BASE_URL"].rstrip("/") + "/oai/api/v1"
    return HOSTED_OAI_BASE_URL


def server_message(response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300]
    return str(body)[:300]


def post_with_retries(client, url: str, body: dict, headers: dict, retries: int) -> dict:
    """POST JSON; retry 429, 5xx and connection errors with back-off (Retry-After honoured)."""
    import httpx
    for attempt in range(retries + 1):
        delay = min(0.5 * 2 ** attempt, 8.0)
        try:
            response = client.post(url, json=body, headers=headers)
        except httpx.TimeoutException as e:
            if attempt == retries:
                raise Fail(EXIT_FAILURE, f"POST {url} timed out after {retries + 1} tries ({e}); next: raise --timeout")
        except httpx.TransportError as e:
            if attempt == retries:
                raise Fail(EXIT_NO_ACCESS, f"cannot reach {url} ({e}); next: check --base-url and the network")
        else:
            if response.status_code < 400:
                return response.json()
            status = response.status_code
            if status in (401, 403):
                raise Fail(EXIT_NO_ACCESS, f"{url} refused the API key ({status}: {server_message(response)}); "
                                           f"next: check TINKER_API_KEY")
            if status != 429 and status < 500:
                raise Fail(EXIT_USAGE, f"{url} rejected the request ({status}: {server_message(response)})")
            if attempt == retries:
                raise Fail(EXIT_FAILURE, f"{url} kept failing ({status}: {server_message(response)}) "
                                         f"after {retries + 1} tries; next: retry later")
            retry_after = response.headers.get("retry-after")
            if retry_after and retry_after.replace(".", "", 1).isdigit():
                delay = min(float(retry_after), 30.0)
            log(f"HTTP {status}; retrying in {delay:.1f}s ({attempt + 1}/{retries})")
        time.sleep(delay)
    raise AssertionError("unreachable")


def sample_http(args, rows: list[dict], model: str, fmt: dict) -> dict:
    import httpx

    key = require_credentials()
    if parse_tinker_path(model) is not None:
        require_sampler_path(model)
    base = oai_base_url(args)
    chat = fmt["kind"] == "chat"
    if chat and fmt.get("template_kwargs"):
        log(f"warning: the endpoint renders with the model's own template; the run's template kwargs "
            f"{sorted(fmt['template_kwargs'])} are not applied (the SDK route applies them)")
    url = base + ("/chat/completions" if chat else "/completions")
    headers = {"Authorization": f"Bearer {key}"}

    def body_for(row: dict) -> dict:
        body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "n": args.n}
        if chat:
            body["messages"] = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        else:
            body["prompt"] = raw_text(row)
        if args.stop:
            body["stop"] = list(args.stop)
        if args.seed is not None:
            body["seed"] = args.seed
        if args.top_k != -1:
            body["top_k"] = args.top_k
        return body

    bodies = [body_for(row) for row in rows]
    with httpx.Client(timeout=args.timeout) as client:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(bodies))) as pool:
            responses = list(pool.map(lambda b: post_with_retries(client, url, b, headers, args.retries), bodies))
    samples = []
    for i, response in enumerate(responses):
        usage = response.get("usage") or {}
        choices = sorted(response.get("choices") or [], key=lambda c: c.get("index", 0))
        for j, choice in enumerate(choices):
            text = choice["message"].get("content") or "" if chat else choice.get("text", "")
            finish = choice.get("finish_reason")
            samples.append({"prompt_index": i, "sample_index": j, "text": text, "tokens": None,
                            "stop_reason": "length" if finish == "length" else "stop",
                            "prompt_tokens": usage.get("prompt_tokens"),
                            # usage counts all n choices together; per choice only when n == 1
                            "completion_tokens": usage.get("completion_tokens") if len(choices) == 1 else None})
    return {"model": model, "base_model": None, "format": fmt, "endpoint": url, "samples": samples}


# ==== sampling command ====
def cmd_sample(args) -> dict:
    if args.n < 1 or args.max_tokens < 1:
        raise Fail(EXIT_USAGE, "--n and --max-tokens must be at least 1")
    if not 0 < args.top_p <= 1 or args.temperature < 0:
        raise Fail(EXIT_USAGE, "--top-p must be in (0, 1] and --temperature >= 0")
    rows = load_inputs(args)
    model, fmt, tokenizer_name = resolve_target(args)
    if args.http:
        result = sample_http(args, rows, model, fmt)
    else:
        result = sample_sdk(args, rows, model, fmt, tokenizer_name)
    pricing_model = result.get("base_model") or (model if parse_tinker_path(model) is None else None)
    usd = None
    if pricing_model:
        # The n samples of one prompt share its prefill: it is charged with the first sample.
        for s in result["samples"]:
            s["usd"] = estimate_usd(pricing_model, (s["prompt_tokens"] or 0) if s["sample_index"] == 0 else 0,
                                    s["completion_tokens"] or 0)
        usd = estimate_usd(pricing_model, sum(s["prompt_tokens"] or 0 for s in result["samples"] if s["sample_index"] == 0),
                           sum(s["completion_tokens"] or 0 for s in result["samples"]))
    result.update(status="ok", route="http" if args.http else "sdk", usd=usd,
                  sampling={"n": args.n, "max_tokens": args.max_tokens, "temperature": args.temperature,
                            "top_p": args.top_p, "top_k": args.top_k, "stop": args.stop or [], "seed": args.seed},
                  out=None)
    if args.out:
        write_results(args.out, rows, result["samples"])
        result["out"] = str(args.out)
    if not args.json:
        show_samples(rows, result, usd)
    return result


def write_results(out: str, rows: list[dict], samples: list[dict]) -> None:
    by_prompt: dict[int, list] = {}
    for s in samples:
        by_prompt.setdefault(s["prompt_index"], []).append(
            {k: v for k, v in s.items() if k not in ("prompt_index",)})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"index": i, **row, "samples": by_prompt.get(i, [])}, ensure_ascii=False) + "\n")


def show_samples(rows: list[dict], result: dict, usd: float | None) -> None:
    for s in result["samples"]:
        row = rows[s["prompt_index"]]
        prompt = row.get("prompt") or row["messages"][-1]["content"]
        cost = f" | est. ${s['usd']:.6f}" if s.get("usd") is not None else ""
        log(f"--- prompt {s['prompt_index']} sample {s['sample_index']} | stop: {s['stop_reason']} | "
            f"tokens: {s['prompt_tokens']} prompt + {s['completion_tokens']} completion{cost}")
        log(f"> {str(prompt)[:200]}")
        log(s["text"])
    cost = f"${usd:.6f}" if usd is not None else "no dollar estimate (tinker_pricing.py not beside this script, or model unpriced)"
    log(f"=== {len(result['samples'])} samples from {result['model']} ({result['format']['kind']} format) | est. cost {cost}")


# ==== checkpoints: list / resolve ====
def checkpoint_row(c) -> dict:
    return {"path": c.tinker_path, "type": c.checkpoint_type, "time": c.time.isoformat() if c.time else None,
            "size_bytes": c.size_bytes, "expires_at": c.expires_at.isoformat() if c.expires_at else None,
            "public": c.public}


def run_id_of(arg: str) -> str:
    """A run id from a run id, a tinker:// path or a log folder's run record."""
    if arg.startswith("tinker://"):
        return parse_tinker_path(arg)[0]
    if Path(arg).is_dir():
        row = read_run_record(arg)[-1]
        return parse_tinker_path(row.get("state_path") or row["sampler_path"])[0]
    return arg


def cmd_list(args) -> dict:
    import tinker
    require_credentials()
    rest = rest_client()
    try:
        if args.run:
            checkpoints = list(rest.list_checkpoints(run_id_of(args.run)).result().checkpoints)
        else:
            try:
                checkpoints = list(rest.list_user_checkpoints(limit=args.limit).result().checkpoints)
            except tinker.NotFoundError:
                # Servers without the account-wide listing (the local backend): walk the runs.
                runs = rest.list_training_runs(limit=100).result().training_runs
                checkpoints = []
                for r in runs:
                    try:
                        checkpoints += rest.list_checkpoints(r.training_run_id).result().checkpoints
                    except tinker.APIStatusError as e:  # one unreadable run must not hide the rest
                        log(f"warning: skipped run {r.training_run_id}: {str(e).splitlines()[0][:120]}")
    except Fail:
        raise
    except Exception as e:
        raise tinker_failure(e, "listing checkpoints", args.run if args.run and args.run.startswith("tinker://") else None)
    checkpoints.sort(key=lambda c: c.time, reverse=True)
    rows = [checkpoint_row(c) for c in checkpoints[: args.limit or None]]
    if not args.json:
        from rich.console import Console
        from rich.table import Table
        table = Table("path", "type", "size", "created", "expires")
        for r in rows:
            size = f"{r['size_bytes'] / 1e6:.1f} MB" if r["size_bytes"] else "-"
            table.add_row(r["path"], r["type"], size, (r["time"] or "-")[:19], (r["expires_at"] or "never")[:19])
        # Paths are what people copy: never cut them to the terminal's width.
        width = max([len(r["path"]) for r in rows] + [4]) + 70
        Console(stderr=True, width=max(width, shutil.get_terminal_size().columns)).print(table)
    return {"status": "ok", "checkpoints": rows}


def cmd_resolve(args) -> dict:
    if Path(args.target).is_dir():
        row = latest_row(read_run_record(args.target), args.kind, args.target)
        path = row["sampler_path"] if args.kind == "sampler" else row["state_path"]
        result = {"status": "ok", "path": path, "kind": args.kind, "source": "run record",
                  "step": row.get("step"), "name": row.get("name"), "format": row.get("format")}
    else:
        require_credentials()
        run = run_id_of(args.target)
        wanted = "sampler" if args.kind == "sampler" else "training"
        try:
            checkpoints = rest_client().list_checkpoints(run).result().checkpoints
        except Exception as e:
            raise tinker_failure(e, f"listing the checkpoints of run {run}")
        found = sorted((c for c in checkpoints if c.checkpoint_type == wanted), key=lambda c: c.time, reverse=True)
        if args.target.startswith("tinker://"):  # the other kind of the same save first
            name = parse_tinker_path(args.target)[2]
            found.sort(key=lambda c: c.tinker_path.rsplit("/", 1)[-1] != name)
        if not found:
            kinds = sorted({c.checkpoint_type for c in checkpoints}) or ["none"]
            raise Fail(EXIT_USAGE, f"run {run} has no {wanted} checkpoint (it has: {', '.join(kinds)}); "
                                   f"next: tinker_infer.py checkpoints list --run {run}")
        result = {"status": "ok", "path": found[0].tinker_path, "kind": args.kind, "source": "server",
                  "time": found[0].time.isoformat()}
    log(result["path"])
    return result


# ==== checkpoints: export (download + safe extraction) ====
class UnsafeArchive(Fail):
    def __init__(self, message: str):
        super().__init__(EXIT_FAILURE, message)


def safe_extract(archive: str | Path, target: str | Path) -> list[str]:
    """Extract a tar archive into target, refusing it whole if any entry would land outside.

    Refused before anything is written: absolute names, names that climb out with `..`,
    symbolic or hard links whose target leaves `target`, devices and FIFOs.
    """
    target = Path(target).resolve()
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for m in members:
            name = m.name
            if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
                raise UnsafeArchive(f"refusing archive {archive}: absolute path {name!r}")
            dest = (target / name).resolve()
            if not dest.is_relative_to(target):
                raise UnsafeArchive(f"refusing archive {archive}: {name!r} leaves the target folder")
            if m.issym():
                link = Path(m.linkname)
                resolved = link.resolve() if link.is_absolute() else (dest.parent / link).resolve()
                if not resolved.is_relative_to(target):
                    raise UnsafeArchive(f"refusing archive {archive}: link {name!r} -> {m.linkname!r} points outside")
            elif m.islnk():
                if os.path.isabs(m.linkname) or not (target / m.linkname).resolve().is_relative_to(target):
                    raise UnsafeArchive(f"refusing archive {archive}: hard link {name!r} -> {m.linkname!r} points outside")
            elif not (m.isfile() or m.isdir()):
                raise UnsafeArchive(f"refusing archive {archive}: {name!r} is a device or FIFO")
        target.mkdir(parents=True, exist_ok=True)
        # The "data" filter repeats these checks inside tarfile and drops unsafe modes.
        tar.extractall(target, filter="data")
        return sorted(m.name for m in members if m.isfile())


def expected_digests(headers) -> dict[str, str]:
    """Checksums a server may send: Content-MD5, x-goog-hash md5=, Digest sha-256=, x-checksum-sha256."""
    digests = {}
    if headers.get("content-md5"):
        digests["md5"] = base64.b64decode(headers["content-md5"]).hex()
    for part in (headers.get("x-goog-hash") or "").split(","):
        if part.strip().startswith("md5="):
            digests["md5"] = base64.b64decode(part.strip()[4:]).hex()
    for part in (headers.get("digest") or "").split(","):
        if part.strip().lower().startswith("sha-256="):
            digests["sha256"] = base64.b64decode(part.strip()[8:]).hex()
    if headers.get("x-checksum-sha256"):
        digests["sha256"] = headers["x-checksum-sha256"].lower()
    return digests


def download(url: str, dest: Path, headers: dict | None = None, label: str = "") -> int:
    """Stream url to dest with a progress bar; verify length and any checksum offered."""
    import httpx
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
    hashes = {"md5": hashlib.md5(), "sha256": hashlib.sha256()}
    size = 0
    with httpx.stream("GET", url, headers=headers or {}, follow_redirects=True, timeout=HTTP_TIMEOUT_S) as response:
        if response.status_code >= 400:
            response.read()
            raise DownloadError(response.status_code, server_message(response))
        total = int(response.headers.get("content-length") or 0) or None
        digests = expected_digests(response.headers)
        with open(dest, "wb") as f, Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                             console=_stderr_console(), transient=True) as progress:
            task = progress.add_task(label or dest.name, total=total)
            for chunk in response.iter_bytes(1 << 20):
                f.write(chunk)
                size += len(chunk)
                for h in hashes.values():
                    h.update(chunk)
                progress.update(task, advance=len(chunk))
    if total is not None and size != total:
        raise Fail(EXIT_FAILURE, f"download of {label or url} stopped at {size} of {total} bytes; next: run the export again")
    for algo, want in digests.items():
        if hashes[algo].hexdigest() != want:
            raise Fail(EXIT_FAILURE, f"{label or dest.name}: {algo} mismatch (got {hashes[algo].hexdigest()}, server said "
                                     f"{want}); the download is corrupt; next: run the export again")
    return size


class DownloadError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


def _stderr_console():
    from rich.console import Console
    return Console(stderr=True)


def export_sampler_archive(path: str, out: Path, key: str) -> dict:
    run, _, name = parse_tinker_path(path)
    base = (os.environ.get("TINKER_BASE_URL") or "https://tinker.thinkingmachines.dev/services/tinker-prod").rstrip("/")
    url = f"{base}/api/v1/training_runs/{run}/checkpoints/{name}/archive"
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "checkpoint.tar.gz"
        try:
            size = download(url, archive, headers={"X-API-Key": key}, label=f"{name}.tar.gz")
        except DownloadError as e:
            states = [c.tinker_path for c in run_checkpoints(run) if c.checkpoint_type == "training"]
            hint = (f"export the run's resumable state instead: tinker_infer.py checkpoints export {states[0]} --out {out}"
                    if states else "save_state() a weights/ checkpoint of the run and export that")
            if e.status in (401, 403):
                raise Fail(EXIT_NO_ACCESS, f"the server refused the API key for {url} ({e})")
            raise Fail(EXIT_USAGE, f"{path} cannot be downloaded here ({e}): SDK 0.38 has no download route for "
                                   f"sampler_weights/; {hint}")
        files = safe_extract(archive, out)
    return {"route": "archive", "files": files, "bytes": size}


def export_external(path: str, out: Path) -> dict:
    try:
        signed = rest_client().get_external_weights_urls(path).result()
    except Exception as e:
        raise tinker_failure(e, f"signing the download URLs of {path}", path)
    total, files = 0, []
    out.mkdir(parents=True, exist_ok=True)
    base = out.resolve()
    for name, url in sorted(signed.urls.items()):
        dest = (out / name).resolve()
        if not dest.is_relative_to(base):
            raise UnsafeArchive(f"refusing {path}: file name {name!r} leaves {out}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            total += download(url, dest, label=name)
        except DownloadError as e:
            raise Fail(EXIT_FAILURE, f"downloading {name} of {path} failed ({e}); next: run the export again")
        files.append(name)
    return {"route": "external_weights_urls", "files": files, "bytes": total}


def export_state_with_cli(path: str, out: Path) -> dict:
    """The official CLI already does this right (export -> download -> delete the copy)."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        cmd = [sys.executable, "-m", "tinker.cli", "-f", "json", "checkpoint", "download", path, "-o", tmp]
        log("running: tinker -f json checkpoint download", path)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            run = parse_tinker_path(path)[0]
            samplers = [c.tinker_path for c in run_checkpoints(run) if c.checkpoint_type == "sampler"]
            hint = (f"; if this server has no external-weights export (the local backend has none), export "
                    f"the run's sampler checkpoint: tinker_infer.py checkpoints export {samplers[0]} --out {out}"
                    if samplers else "")
            raise Fail(EXIT_FAILURE, f"`tinker checkpoint download {path}` failed: {last}{hint}")
        folders = [p for p in Path(tmp).iterdir() if p.is_dir()]
        if len(folders) != 1:
            raise Fail(EXIT_FAILURE, f"`tinker checkpoint download` left {len(folders)} folders; expected one")
        out.mkdir(parents=True, exist_ok=True)
        files = []
        for f in sorted(folders[0].rglob("*")):
            if f.is_file():
                rel = f.relative_to(folders[0])
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(f), out / rel)
                files.append(str(rel))
    return {"route": "tinker checkpoint download", "files": files,
            "bytes": sum((out / f).stat().st_size for f in files)}


def cmd_export(args) -> dict:
    run, segment, name = parse_tinker_path(args.path) or (None, None, None)
    if segment is None:
        raise Fail(EXIT_USAGE, f"{args.path} is not a tinker:// checkpoint path; next: tinker_infer.py checkpoints list")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        if not args.overwrite:
            raise Fail(EXIT_USAGE, f"{out} exists and is not empty; pass --overwrite or another --out")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    key = require_credentials()
    if segment == "external_weights":
        result = export_external(args.path, out)
    elif segment == "weights":
        result = export_state_with_cli(args.path, out)
    else:
        result = export_sampler_archive(args.path, out, key)
    log(f"exported {args.path} -> {out} ({len(result['files'])} files, {result['bytes']} bytes, via {result['route']})")
    return {"status": "ok", "path": args.path, "out": str(out), **result}


# ==== checkpoints: merge (optional extra: torch + peft) ====
def adapter_target_modules(keys) -> list[str]:
    """Module names a PEFT LoRA state dict touches, e.g. ...self_attn.q_proj.lora_A.weight -> q_proj."""
    names = set()
    for key in keys:
        parts = key.split(".")
        for i, p in enumerate(parts):
            if p in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B") and i > 0:
                names.add(parts[i - 1])
    return sorted(names)


def peft_embedding_layout(state: dict, model, torch) -> dict:
    """Embedding LoRA saved like a linear layer (SkyRL: `embed_tokens.lora_A.weight` [vocab, r],
    `lora_B.weight` [r, hidden]) -> PEFT's `lora_embedding_A` [r, vocab] / `lora_embedding_B`
    [hidden, r]. Both give the same update: delta[token] = A[token] @ B * alpha / r."""
    embeddings = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)}
    converted = {}
    for key, tensor in state.items():
        head, _, tail = key.rpartition(".lora_")
        module = head.removeprefix("base_model.model.")
        if module in embeddings and tail in ("A.weight", "B.weight"):
            key, tensor = f"{head}.lora_embedding_{tail[0]}", tensor.T.contiguous()
        converted[key] = tensor
    return converted


def cmd_merge(args) -> dict:
    try:
        import torch
        import peft
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise Fail(EXIT_FAILURE, f"merge needs torch and peft ({e.name} is missing); next: install torch for your "
                                 f"machine first (pip install torch), then pip install 'peft>=0.13' safetensors")
    adapter, base_dir, out = Path(args.adapter_dir), Path(args.base), Path(args.out)
    config_file = adapter / "adapter_config.json"
    weights_file = adapter / "adapter_model.safetensors"
    if not config_file.is_file() or not (weights_file.is_file() or (adapter / "adapter_model.bin").is_file()):
        raise Fail(EXIT_USAGE, f"{adapter} is not a PEFT adapter (needs adapter_config.json and adapter_model.safetensors); "
                               f"next: tinker_infer.py checkpoints export PATH --out {adapter}")
    if not (base_dir / "config.json").is_file():
        raise Fail(EXIT_USAGE, f"--base {base_dir} has no config.json; expected the base model's Hugging Face folder")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise Fail(EXIT_USAGE, f"{out} exists and is not empty; pass --overwrite or another --out")
    config = json.loads(config_file.read_text())
    state = (load_file(str(weights_file)) if weights_file.is_file()
             else torch.load(adapter / "adapter_model.bin", map_location="cpu", weights_only=True))
    targets = adapter_target_modules(state)
    declared = config.get("target_modules")
    # The tensors say what was trained. SkyRL's exports (the local backend) name no
    # target_modules, and a pattern such as "all-linear" leaves out lm_head, which Tinker
    # trains by default: with either, PEFT would silently drop tensors.
    if not targets:
        raise Fail(EXIT_USAGE, f"{weights_file.name} holds no lora_A/lora_B tensors; expected a PEFT LoRA adapter")
    if declared != targets:
        log(f"target modules from the adapter's tensors: {', '.join(targets)} (adapter_config.json says {declared})")
    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    log(f"loading {base_dir} ({args.dtype}) ...")
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype)
    untied = False
    embed_names = {"embed_tokens", "wte", "word_embeddings"}
    if getattr(model.config, "tie_word_embeddings", False) and embed_names & set(targets) and "lm_head" not in targets:
        # Tinker-style LoRA on the input embedding does not change a tied output head, but a
        # merge into the shared matrix would: give the head its own copy of the base matrix.
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
        model.config.tie_word_embeddings = False
        untied = True
    lora_config = peft.LoraConfig(
        r=int(config.get("r", 8)), lora_alpha=float(config.get("lora_alpha", 8)), lora_dropout=0.0,
        target_modules=targets, bias=config.get("bias", "none"),
        use_rslora=bool(config.get("use_rslora", False)), fan_in_fan_out=bool(config.get("fan_in_fan_out", False)))
    state = peft_embedding_layout(state, model, torch)  # before PEFT wraps the embedding
    try:
        peft_model = peft.get_peft_model(model, lora_config)
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
        raise Fail(EXIT_FAILURE, f"the adapter's modules ({', '.join(targets)}) match no module of {base_dir} "
                                 f"({str(e).splitlines()[0][:150]}); is --base the model this adapter was trained on?")
    state = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()}
    loaded = peft.set_peft_model_state_dict(peft_model, state)
    unexpected = [k for k in getattr(loaded, "unexpected_keys", []) if "lora" in k]
    if unexpected:
        raise Fail(EXIT_FAILURE, f"{len(unexpected)} adapter tensors match no module of {base_dir} (first: {unexpected[0]}); "
                                 f"is --base the model this adapter was trained on?")
    missing = [k for k in getattr(loaded, "missing_keys", []) if "lora_" in k]
    if missing:
        log(f"warning: {len(missing)} LoRA tensors absent from the adapter stay zero (first: {missing[0]})")
    merged = peft_model.merge_and_unload()
    if out.exists():
        shutil.rmtree(out)
    merged.save_pretrained(str(out), safe_serialization=True)
    copied = []
    for f in sorted(base_dir.iterdir()):
        weights = f.suffix in (".safetensors", ".bin", ".pt", ".pth") or f.name.endswith(".index.json")
        if f.is_file() and not weights and f.name != "config.json" and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    log(f"merged {adapter} into {base_dir} -> {out} (r={lora_config.r}, alpha={lora_config.lora_alpha}, "
        f"modules: {', '.join(lora_config.target_modules)}{', untied embeddings' if untied else ''})")
    return {"status": "ok", "out": str(out), "target_modules": sorted(lora_config.target_modules),
            "lora_rank": lora_config.r, "lora_alpha": lora_config.lora_alpha, "untied_embeddings": untied,
            "copied_files": copied}


# ==== command line ====
def sample_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tinker_infer.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Checkpoint commands: tinker_infer.py checkpoints {list,resolve,export,merge} --help\n\n"
               + __doc__.split("\n\n", 1)[1].split("Edit:")[0])
    p.add_argument("--model", help=f"base model name or tinker://RUN/sampler_weights/NAME (default {DEFAULT_MODEL}, "
                                   f"or the run's final sampler path with --run)")
    p.add_argument("--run", metavar="LOG_DIR", help="sample a training run's latest sampler checkpoint in its recorded format")
    p.add_argument("--prompt", help="one prompt (user message in chat format, plain text in raw format)")
    p.add_argument("--messages", help="one conversation as JSON: [{\"role\": \"user\", \"content\": \"...\"}]")
    p.add_argument("--input", metavar="FILE.jsonl", help="a batch: one {\"prompt\"} or {\"messages\"} per line; sent concurrently")
    p.add_argument("--out", metavar="FILE.jsonl", help="write one result row per input row, in input order")
    p.add_argument("--format", choices=["chat", "raw"], help="chat template of the model, or raw text (default chat; "
                                                             "with --run, the run's format)")
    p.add_argument("--tokenizer", metavar="NAME_OR_DIR", help="tokenizer to render and decode with (default: the run "
                                                              "record's, else the base model's)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help=f"default {DEFAULT_MAX_TOKENS}")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help=f"default {DEFAULT_TEMPERATURE}")
    p.add_argument("--top-p", type=float, default=1.0, help="default 1.0 (off)")
    p.add_argument("--top-k", type=int, default=-1, help="default -1 (off)")
    p.add_argument("--stop", action="append", metavar="STRING", help="stop string, repeatable (the format's own "
                                                                     "end-of-turn token always stops too)")
    p.add_argument("--seed", type=int, help="sampling seed: same seed, same tokens")
    p.add_argument("--http", action="store_true", help="use the OpenAI-compatible endpoint instead of the SDK")
    p.add_argument("--base-url", help="OpenAI-compatible base URL for --http (default $TINKER_BASE_URL/oai/api/v1, "
                                      "else the hosted service)")
    p.add_argument("--timeout", type=float, default=HTTP_TIMEOUT_S, help=f"--http request timeout in s (default {HTTP_TIMEOUT_S:g})")
    p.add_argument("--retries", type=int, default=HTTP_RETRIES, help=f"--http retries on 429/5xx (default {HTTP_RETRIES})")
    p.add_argument("--json", action="store_true", help="print only the JSON object (stdout), no display on stderr")
    return p


def checkpoints_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinker_infer.py checkpoints", description="Find, export and merge checkpoints.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("list", help="checkpoints, newest first: path, type, size, expiry")
    ls.add_argument("--run", metavar="RUN_ID|LOG_DIR", help="only this run's checkpoints")
    ls.add_argument("--limit", type=int, default=100, help="at most this many rows (default 100; 0 = all)")
    ls.add_argument("--json", action="store_true", help="no table on stderr")
    rs = sub.add_parser("resolve", help="the latest checkpoint path of a kind, from a run id or a log folder")
    rs.add_argument("target", metavar="RUN_ID|LOG_DIR|PATH",
                    help="a run id, a log folder, or a tinker:// path (then the same save of --kind comes first)")
    rs.add_argument("--kind", choices=["sampler", "state"], default="sampler",
                    help="sampler: sampler_weights/ (for sampling); state: weights/ (for --resume); default sampler")
    ex = sub.add_parser("export", help="download a checkpoint's files into a folder",
                        description="Routes: external_weights/ via signed URLs (SDK 0.38); weights/ via the official "
                                    "`tinker checkpoint download`; sampler_weights/ via the server's archive route when "
                                    "it offers one (the local backend does), a tar.gz extracted safely.")
    ex.add_argument("path", metavar="PATH", help="tinker://RUN/{weights,sampler_weights,external_weights}/NAME")
    ex.add_argument("--out", required=True, metavar="DIR")
    ex.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    mg = sub.add_parser("merge", help="merge a PEFT LoRA adapter into Hugging Face base weights (needs torch, peft)")
    mg.add_argument("adapter_dir", metavar="ADAPTER_DIR", help="folder with adapter_config.json + adapter_model.safetensors")
    mg.add_argument("--base", required=True, metavar="BASE_DIR", help="the base model's Hugging Face folder")
    mg.add_argument("--out", required=True, metavar="DIR")
    mg.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                    help="dtype to merge and save in (default auto: the base model's)")
    mg.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] == "checkpoints":
            args = checkpoints_parser().parse_args(argv[1:])
            args.json = getattr(args, "json", False)
            result = {"list": cmd_list, "resolve": cmd_resolve, "export": cmd_export, "merge": cmd_merge}[args.action](args)
        else:
            result = cmd_sample(sample_parser().parse_args(argv))
    except Fail as e:
        log(f"error: {e}")
        print(json.dumps({"status": "error", "exit_code": e.code, "error": str(e)}))
        return e.code
    except KeyboardInterrupt:
        log("interrupted")
        print(json.dumps({"status": "interrupted", "exit_code": EXIT_INTERRUPTED}))
        return EXIT_INTERRUPTED
    except SystemExit as e:  # argparse: --help is 0, a bad flag is 2
        return int(e.code or 0)
    print(json.dumps(result, ensure_ascii=False, default=str))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
