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
      rendered here, with the model's chat template (--format chat; --thinking for hybrid
      models such as Qwen3, off by default as tinker_sft.py trains) or as plain text
      (--format raw), or exactly as a training run recorded it (--run LOG_DIR: the final
      sampler path, template kwargs, frozen date and stop token ids from LOG_DIR/checkpoints.jsonl).
    HTTP (--http): Tinker's OpenAI-compatible endpoint, /chat/completions for chat and
      /completions for raw, Bearer $TINKER_API_KEY; base URL from --base-url, else
      $TINKER_BASE_URL + /oai/api/v1, else the hosted service. Retries 429 and 5xx with
      back-off. The server applies the model's own chat template: it cannot apply a run's
      recorded template kwargs, so use the SDK route to sample a run in its exact format.
    Before the first request: credentials, then one TCP connection to the service (3 s): a dead
      TINKER_BASE_URL or --base-url is exit 4 in seconds, not minutes of SDK retries.

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
                              Files land in a hidden folder beside DIR that becomes DIR only
                              when complete: a failed export leaves no half-written DIR.
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
    On failure: {"status": "error"|"interrupted", "exit_code", "error"} and one line on stderr.

Requires:
    TINKER_API_KEY (starts with tml-); TINKER_BASE_URL optional (local rehearsals).
    Exit codes: 0 ok, 1 Tinker or runtime failure, 2 bad input or usage (flags, data, wrong
    checkpoint kind, unknown model or checkpoint), 4 no credentials or cannot reach Tinker,
    130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
"""
from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
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
# Checked before anything is read or sent (common/flags.check_numbers): finite and in range.
SAMPLE_FLAG_RULES = {
    "n": dict(low=1), "max_tokens": dict(low=1), "temperature": dict(low=0),
    "top_p": dict(low=0, low_open=True, high=1), "top_k": dict(low=-1),
    "timeout": dict(low=0, low_open=True), "retries": dict(low=0),
}


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line with the next step, not argparse's usage block
        self.exit(2, f"error: {self.prog}: {message}; see {self.prog} --help\n")


def sample_parser() -> argparse.ArgumentParser:
    p = Parser(
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
    p.add_argument("--thinking", action="store_true", help="render hybrid models (Qwen3, DeepSeek V3.1) with thinking "
                                                           "on (default off, as tinker_sft.py trains; with --run, the "
                                                           "run's setting)")
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
    p = Parser(prog="tinker_infer.py checkpoints", description="Find, export and merge checkpoints.",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True, parser_class=Parser)
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


# ==== EDIT ME: render_prompt() / completion_text() ====
def render_prompt(row: dict, fmt: dict, tokenizer) -> list[int]:
    """One input row ({"prompt": str} or {"messages": [...]}) -> prompt token ids.

    The shared renderer tinker_sft.py and tinker_rl.py train with (common/render.py): chat is the
    tokenizer's chat template with the generation prompt, the format's template kwargs and its
    frozen date; raw is the text as is, or messages as "User: ...\\n\\nAssistant:", after BOS when
    the format has one.
    """
    return generation_prompt(row.get("messages") or row["prompt"], tokenizer, fmt)


def completion_text(tokens: list[int], tokenizer, stop_ids: list[int], stop_strings: list[str]) -> str:
    """Completion tokens -> text: drop a trailing stop token, cut at the first stop string
    (the OpenAI convention, so both routes print the same text)."""
    if tokens and tokens[-1] in stop_ids:
        tokens = tokens[:-1]
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    cuts = [text.find(s) for s in stop_strings if s and s in text]
    return text[: min(cuts)] if cuts else text


# ==== main flow ====
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run_cli(dispatch, argv, error_json=True, interrupted_hint="nothing was written; run the command again")
    except SystemExit as e:  # argparse: --help is 0, a bad flag is 2 (its usage line is on stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def dispatch(argv: list[str]) -> int:
    if argv and argv[0] == "checkpoints":
        args = checkpoints_parser().parse_args(argv[1:])
        args.json = getattr(args, "json", False)
        command = {"list": cmd_list, "resolve": cmd_resolve, "export": cmd_export, "merge": cmd_merge}[args.action]
        result = command(args)
    else:
        result = cmd_sample(sample_parser().parse_args(argv))
    print(json.dumps(result, ensure_ascii=False, default=str))
    return EXIT_OK


def cmd_sample(args) -> dict:
    """Every check that can refuse the call runs first: flags, inputs, run record, --out, then credentials
    and reachability; only then the first request."""
    check_numbers(args, SAMPLE_FLAG_RULES)
    rows = load_inputs(args)
    model, recorded, tokenizer_name = resolve_target(args)
    if args.out:
        check_writable_dir(Path(args.out).parent, "--out's folder")
        if Path(args.out).is_dir():
            raise DataError(f"--out {args.out} is a folder; expected a JSONL file path")
    if args.http:
        result = sample_http(args, rows, model, recorded)
    else:
        result = sample_sdk(args, rows, model, recorded, tokenizer_name)
    pricing_model = result.get("base_model") or (model if not model.startswith("tinker://") else None)
    usd = price_samples(pricing_model, result["samples"]) if pricing_model else None
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


def sample_sdk(args, rows: list[dict], model: str, recorded: dict | None, tokenizer_name: str | None) -> dict:
    is_path = model.startswith("tinker://")
    if is_path:
        check_sampler_path(model)
    # Credentials, reachability and (for a base model) the served-model check, then the tokenizer named by
    # the flags, the run record or the base model: all before the first sampling request.
    service, _ = connect(None if is_path else model, trainable=False, flag="--model")
    status = "errored"
    try:
        tokenizer = load_sampling_tokenizer(tokenizer_name or (None if is_path else model))
        try:
            future = (service.create_sampling_client(model_path=model) if is_path
                      else service.create_sampling_client(base_model=model))
            client = future.result()
        except Exception as e:
            raise tinker_failure(e, "creating the sampling client", model)
        base_model = client.get_base_model()
        if tokenizer is None:  # a bare tinker:// path: its base model names the tokenizer
            tokenizer_name = base_model
            tokenizer = load_sampling_tokenizer(base_model)
        fmt = recorded or resolve_format(args.format or "chat", base_model, tokenizer,
                                         tokenizer_record(tokenizer_name or base_model), thinking=args.thinking)
        result = sample_with(client, tokenizer, args, rows, model, fmt)
        result["base_model"] = base_model
        status = "success"
        return result
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        with contextlib.suppress(Exception):  # ends the session at once instead of letting it time out
            service.close(status).result(timeout=30)


def sample_with(client, tokenizer, args, rows, model, fmt) -> dict:
    import tinker

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
    return {"model": model, "format": {**fmt, "stop": stop_ids}, "template_matches_run": template_ok,
            "samples": samples}


def sample_http(args, rows: list[dict], model: str, recorded: dict | None) -> dict:
    import httpx

    if model.startswith("tinker://"):
        check_sampler_path(model)
    key = require_credentials()
    fmt = recorded or {"kind": args.format or "chat"}
    base = oai_base_url(args)
    check_reachable(base, setting="--base-url" if args.base_url else "TINKER_BASE_URL")
    chat = fmt["kind"] == "chat"
    if chat and fmt.get("template_kwargs"):
        say(f"warning: the endpoint renders with the model's own template; the run's template kwargs "
            f"{sorted(fmt['template_kwargs'])} are not applied (the SDK route applies them)")
    url = base + ("/chat/completions" if chat else "/completions")
    headers = {"Authorization": f"Bearer {key}"}

    def body_for(row: dict) -> dict:
        body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "n": args.n}
        if chat:
            body["messages"] = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        else:
            body["prompt"] = row["prompt"] if "prompt" in row else _role_colon_text(row["messages"])
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


# ==== helpers: inputs, run record, target, tokenizer, format ====
def load_inputs(args) -> list[dict]:
    given = [x for x in (args.prompt, args.messages, args.input) if x is not None]
    if len(given) != 1:
        raise DataError("give exactly one of --prompt TEXT, --messages JSON, --input FILE.jsonl")
    if args.prompt is not None:
        return [{"prompt": args.prompt}]
    if args.messages is not None:
        try:
            messages = json.loads(args.messages)
        except json.JSONDecodeError as e:
            raise DataError(f"--messages is not JSON ({e.msg}); expected '[{{\"role\": \"user\", \"content\": \"hi\"}}]'") from None
        return [{"messages": validate_messages(messages, "--messages", need_assistant=False)}]
    if not Path(args.input).exists():
        raise DataError(f"--input {args.input} not found; expected a JSONL file of {{\"prompt\": ...}} or "
                        "{\"messages\": [...]} rows")
    rows = []
    for n, row in read_jsonl(args.input, "--input"):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            rows.append({"prompt": row["prompt"]})
        elif isinstance(row, dict) and "messages" in row:
            rows.append({"messages": validate_messages(row["messages"], f"{args.input}:{n}", need_assistant=False)})
        else:
            raise DataError(f"{args.input}:{n} has neither a \"prompt\" string nor \"messages\"; expected one per row")
    return rows


def resolve_target(args) -> tuple[str, dict | None, str | None]:
    """(model or sampler path, the run's recorded format or None, tokenizer) from the flags and the run."""
    if not args.run:
        return args.model or DEFAULT_MODEL, None, args.tokenizer
    row = latest_row(read_run_record(args.run), "sampler", args.run)
    fmt = dict(row.get("format") or {})
    if fmt.get("kind") not in ("chat", "raw"):
        raise DataError(f"{args.run}/checkpoints.jsonl has no \"format\" with kind chat|raw; "
                        f"sample it with --model {row['sampler_path']} --format chat|raw")
    if args.format and args.format != fmt["kind"]:
        raise DataError(f"--format {args.format} contradicts the run, which trained in {fmt['kind']} format; "
                        "drop --format to sample as trained")
    if args.thinking and fmt["kind"] == "chat" and not fmt.get("template_kwargs", {}).get("enable_thinking"):
        raise DataError("--thinking contradicts the run, which trained with thinking off; drop --thinking to "
                        "sample as trained")
    if fmt["kind"] == "chat":  # records older than the shared renderer may lack these keys
        fmt.setdefault("template_kwargs", {})
        fmt.setdefault("template_sha256", "")
    return args.model or row["sampler_path"], fmt, args.tokenizer or fmt.get("tokenizer")


def read_run_record(log_dir: str) -> list[dict]:
    """The rows of LOG_DIR/checkpoints.jsonl (a torn last line from a kill is skipped, as on --resume)."""
    rows_file = Path(log_dir) / "checkpoints.jsonl"
    if not rows_file.is_file():
        raise DataError(f"{rows_file} not found; expected the log folder of a tinker_sft.py/tinker_rl.py run; "
                        f"next: ls {log_dir}")
    rows = Run(log_dir).rows("checkpoints.jsonl")
    if not rows:
        raise DataError(f"{rows_file} has no checkpoint yet; let the run save one (--save-every) and retry")
    return rows


def latest_row(rows: list[dict], kind: str, where: str) -> dict:
    key = "sampler_path" if kind == "sampler" else "state_path"
    for row in reversed(rows):
        if row.get(key):
            return row
    other = "state" if kind == "sampler" else "sampler"
    raise DataError(f"{where} records no {key}; it has only {other} checkpoints; next: "
                    f"tinker_infer.py checkpoints resolve {where} --kind {other}")


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


# ==== helpers: tinker:// paths and SDK errors ====
def parse_tinker_path(path: str) -> tuple[str, str, str] | None:
    """tinker://RUN/SEGMENT/NAME -> (run, segment, name); None if not a tinker path."""
    if not path.startswith("tinker://"):
        return None
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights", "external_weights") or not all(parts):
        raise DataError(f"{path} is not a checkpoint path; expected tinker://RUN_ID/sampler_weights/NAME "
                        "(or weights/, external_weights/); next: tinker_infer.py checkpoints list")
    return parts[0], parts[1], parts[2]


def run_checkpoints(run_id: str) -> list:
    """The server's checkpoints of one run, newest first ([] if it cannot list them)."""
    try:
        # Only a hint: never wait long for it (the SDK retries a dead server for minutes).
        require_credentials()
        check_reachable()
        listing = rest_client().list_checkpoints(run_id).result(timeout=20)
    except Exception:
        return []
    return sorted(listing.checkpoints, key=lambda c: c.time, reverse=True)


def check_sampler_path(path: str) -> None:
    """A weights/ or external_weights/ path cannot be sampled: say which path can."""
    run, segment, name = parse_tinker_path(path)
    if segment == "sampler_weights":
        return
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
    raise DataError(f"{path} is {kind}, which cannot be sampled; sampling needs a sampler_weights/ path; {hint}")


def tinker_failure(e: Exception, what: str, model: str | None = None) -> ScriptError:
    """An SDK exception as a one-line error with its exit code and the next step."""
    import tinker

    message = one_line(e)
    if isinstance(e, (tinker.AuthenticationError, tinker.PermissionDeniedError)):
        return AccessError(f"{what}: Tinker rejected the API key ({message}); next: check TINKER_API_KEY")
    if isinstance(e, tinker.APIConnectionError):
        return AccessError(f"{what}: cannot reach {service_url()} ({message}); next: check the network or "
                           "TINKER_BASE_URL")
    lowered = message.lower()
    if "not loaded" in lowered:
        return ScriptError(f"{what}: the server no longer has the model behind {model} loaded ({message}); "
                           "next: sample a sampler_weights/ checkpoint of it (tinker_infer.py checkpoints list), "
                           "or restore its last save_state path")
    if isinstance(e, tinker.NotFoundError) or "not found" in lowered or "expired" in lowered:
        hint = "tinker_infer.py checkpoints list"
        if model and model.startswith("tinker://"):
            hint += f" --run {parse_tinker_path(model)[0]}"
        return DataError(f"{what}: {model or 'the checkpoint'} is unknown or expired ({message}); next: {hint}")
    if isinstance(e, (tinker.BadRequestError, tinker.UnprocessableEntityError)):
        return DataError(f"{what}: the server rejected the request ({message})")
    if isinstance(e, tinker.RequestFailedError) and str(getattr(e, "category", "")).lower().endswith("user"):
        return DataError(f"{what}: the server rejected the request ({message})")
    return ScriptError(f"{what} failed: {message}")


# ==== helpers: HTTP route, pricing, output ====
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
                raise ScriptError(f"POST {url} timed out after {retries + 1} tries ({e}); next: raise --timeout") from None
        except httpx.TransportError as e:
            if attempt == retries:
                raise AccessError(f"cannot reach {url} ({e}); next: check --base-url and the network") from None
        else:
            if response.status_code < 400:
                return response.json()
            status = response.status_code
            if status in (401, 403):
                raise AccessError(f"{url} refused the API key ({status}: {server_message(response)}); "
                                  "next: check TINKER_API_KEY")
            if status != 429 and status < 500:
                raise DataError(f"{url} rejected the request ({status}: {server_message(response)})")
            if attempt == retries:
                raise ScriptError(f"{url} kept failing ({status}: {server_message(response)}) "
                                  f"after {retries + 1} tries; next: retry later")
            retry_after = response.headers.get("retry-after")
            if retry_after and retry_after.replace(".", "", 1).isdigit():
                delay = min(float(retry_after), 30.0)
            say(f"HTTP {status}; retrying in {delay:.1f}s ({attempt + 1}/{retries})")
        time.sleep(delay)
    raise AssertionError("unreachable")


def estimate_usd(model: str, prompt_tokens: int, completion_tokens: int) -> float | None:
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
    """Each sample's estimate (the n samples of one prompt share its prefill, charged with the first), and
    the total."""
    def prefill(s):
        return (s["prompt_tokens"] or 0) if s["sample_index"] == 0 else 0

    for s in samples:
        s["usd"] = estimate_usd(model, prefill(s), s["completion_tokens"] or 0)
    return estimate_usd(model, sum(prefill(s) for s in samples), sum(s["completion_tokens"] or 0 for s in samples))


def write_results(out: str, rows: list[dict], samples: list[dict]) -> None:
    """One row per input row, in input order; written beside --out and renamed, so never half-written."""
    by_prompt: dict[int, list] = {}
    for s in samples:
        by_prompt.setdefault(s["prompt_index"], []).append({k: v for k, v in s.items() if k != "prompt_index"})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    partial = Path(f"{out}.partial")
    with open(partial, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"index": i, **row, "samples": by_prompt.get(i, [])}, ensure_ascii=False) + "\n")
    os.replace(partial, out)


def show_samples(rows: list[dict], result: dict, usd: float | None) -> None:
    for s in result["samples"]:
        row = rows[s["prompt_index"]]
        prompt = row.get("prompt") or row["messages"][-1]["content"]
        cost = f" | est. ${s['usd']:.6f}" if s.get("usd") is not None else ""
        say(f"--- prompt {s['prompt_index']} sample {s['sample_index']} | stop: {s['stop_reason']} | "
            f"tokens: {s['prompt_tokens']} prompt + {s['completion_tokens']} completion{cost}")
        say(f"> {str(prompt)[:200]}")
        say(s["text"])
    cost = f"${usd:.6f}" if usd is not None else "no dollar estimate (tinker_pricing.py not beside this script, or model unpriced)"
    say(f"=== {len(result['samples'])} samples from {result['model']} ({result['format']['kind']} format) | est. cost {cost}")


# ==== checkpoints: list / resolve ====
def cmd_list(args) -> dict:
    check_numbers(args, {"limit": dict(low=0)})
    run = run_id_of(args.run) if args.run else None
    require_credentials()
    check_reachable()
    import tinker

    rest = rest_client()
    try:
        if run:
            checkpoints = list(rest.list_checkpoints(run).result().checkpoints)
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
                        say(f"warning: skipped run {r.training_run_id}: {one_line(e, 120)}")
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
        run = run_id_of(args.target)
        require_credentials()
        check_reachable()
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
            raise DataError(f"run {run} has no {wanted} checkpoint (it has: {', '.join(kinds)}); "
                            f"next: tinker_infer.py checkpoints list --run {run}")
        result = {"status": "ok", "path": found[0].tinker_path, "kind": args.kind, "source": "server",
                  "time": found[0].time.isoformat()}
    say(result["path"])
    return result


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


# ==== checkpoints: export (download + safe extraction) ====
def cmd_export(args) -> dict:
    run, segment, name = parse_tinker_path(args.path) or (None, None, None)
    if segment is None:
        raise DataError(f"{args.path} is not a tinker:// checkpoint path; next: tinker_infer.py checkpoints list")
    out = check_writable_dir(args.out, "--out")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise DataError(f"{out} exists and is not empty; pass --overwrite or another --out")
    key = require_credentials()
    check_reachable()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Everything lands in a hidden folder beside --out first: a failed export leaves no half-written --out.
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        if segment == "external_weights":
            result = export_external(args.path, staging)
        elif segment == "weights":
            result = export_state_with_cli(args.path, staging, out)
        else:
            result = export_sampler_archive(args.path, staging, out, key)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except UnsafeArchive as e:
        raise ScriptError(str(e)) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"exported {args.path} -> {out} ({len(result['files'])} files, {result['bytes']} bytes, via {result['route']})")
    return {"status": "ok", "path": args.path, "out": str(out), **result}


class UnsafeArchive(Exception):
    """An archive or file list that would write outside the target folder: nothing is written."""

    exit_code = 1  # a runtime failure (EXIT_FAILURE): the server sent it; the user's input was fine


class DownloadError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


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
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    hashes = {"md5": hashlib.md5(), "sha256": hashlib.sha256()}
    size = 0
    try:
        with httpx.stream("GET", url, headers=headers or {}, follow_redirects=True, timeout=HTTP_TIMEOUT_S) as response:
            if response.status_code >= 400:
                response.read()
                raise DownloadError(response.status_code, server_message(response))
            total = int(response.headers.get("content-length") or 0) or None
            digests = expected_digests(response.headers)
            with open(dest, "wb") as f, Progress("{task.description}", BarColumn(), DownloadColumn(),
                                                 TransferSpeedColumn(), console=Console(stderr=True),
                                                 transient=True) as progress:
                task = progress.add_task(label or dest.name, total=total)
                for chunk in response.iter_bytes(1 << 20):
                    f.write(chunk)
                    size += len(chunk)
                    for h in hashes.values():
                        h.update(chunk)
                    progress.update(task, advance=len(chunk))
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # DNS failure, refused: nothing was received
        host = httpx.URL(url).host
        raise AccessError(f"cannot download {label or dest.name}: cannot reach {host} ({one_line(e, 120)}); "
                          "check the network, then run the export again") from None
    except httpx.TransportError as e:  # cut off mid-transfer: the staging folder is discarded
        raise ScriptError(f"download of {label or dest.name} stopped at {size} bytes ({type(e).__name__}: "
                          f"{one_line(e, 120)}); next: run the export again") from None
    if total is not None and size != total:
        raise ScriptError(f"download of {label or url} stopped at {size} of {total} bytes; next: run the export again")
    for algo, want in digests.items():
        if hashes[algo].hexdigest() != want:
            raise ScriptError(f"{label or dest.name}: {algo} mismatch (got {hashes[algo].hexdigest()}, server said "
                              f"{want}); the download is corrupt; next: run the export again")
    return size


def export_sampler_archive(path: str, dest: Path, out: Path, key: str) -> dict:
    run, _, name = parse_tinker_path(path)
    url = f"{service_url()}/api/v1/training_runs/{run}/checkpoints/{name}/archive"
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        archive = Path(tmp) / "checkpoint.tar.gz"
        try:
            size = download(url, archive, headers={"X-API-Key": key}, label=f"{name}.tar.gz")
        except DownloadError as e:
            if e.status in (401, 403):
                raise AccessError(f"the server refused the API key for {url} ({e})") from None
            states = [c.tinker_path for c in run_checkpoints(run) if c.checkpoint_type == "training"]
            hint = (f"export the run's resumable state instead: tinker_infer.py checkpoints export {states[0]} --out {out}"
                    if states else "save_state() a weights/ checkpoint of the run and export that")
            raise DataError(f"{path} cannot be downloaded here ({e}): SDK 0.38 has no download route for "
                            f"sampler_weights/; {hint}") from None
        files = safe_extract(archive, dest)
    return {"route": "archive", "files": files, "bytes": size}


def export_external(path: str, dest: Path) -> dict:
    try:
        signed = rest_client().get_external_weights_urls(path).result()
    except Exception as e:
        raise tinker_failure(e, f"signing the download URLs of {path}", path)
    total, files = 0, []
    base = dest.resolve()
    for name, url in sorted(signed.urls.items()):
        target = (dest / name).resolve()
        if not target.is_relative_to(base):
            raise UnsafeArchive(f"refusing {path}: file name {name!r} leaves the --out folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            total += download(url, target, label=name)
        except DownloadError as e:
            raise ScriptError(f"downloading {name} of {path} failed ({e}); next: run the export again") from None
        files.append(name)
    return {"route": "external_weights_urls", "files": files, "bytes": total}


def export_state_with_cli(path: str, dest: Path, out: Path) -> dict:
    """The official CLI already does this right (export -> download -> delete the copy)."""
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "tinker.cli", "-f", "json", "checkpoint", "download", path, "-o", tmp]
        say("running: tinker -f json checkpoint download", path)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            run = parse_tinker_path(path)[0]
            samplers = [c.tinker_path for c in run_checkpoints(run) if c.checkpoint_type == "sampler"]
            hint = (f"; if this server has no external-weights export (the local backend has none), export "
                    f"the run's sampler checkpoint: tinker_infer.py checkpoints export {samplers[0]} --out {out}"
                    if samplers else "")
            raise ScriptError(f"`tinker checkpoint download {path}` failed: {last}{hint}")
        folders = [p for p in Path(tmp).iterdir() if p.is_dir()]
        if len(folders) != 1:
            raise ScriptError(f"`tinker checkpoint download` left {len(folders)} folders; expected one")
        files = []
        for f in sorted(folders[0].rglob("*")):
            if f.is_file():
                rel = f.relative_to(folders[0])
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(f), dest / rel)
                files.append(str(rel))
    return {"route": "tinker checkpoint download", "files": files,
            "bytes": sum((dest / f).stat().st_size for f in files)}


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
    adapter, base_dir = Path(args.adapter_dir), Path(args.base)
    config_file = adapter / "adapter_config.json"
    weights_file = adapter / "adapter_model.safetensors"
    if not config_file.is_file() or not (weights_file.is_file() or (adapter / "adapter_model.bin").is_file()):
        raise DataError(f"{adapter} is not a PEFT adapter (needs adapter_config.json and adapter_model.safetensors); "
                        f"next: tinker_infer.py checkpoints export PATH --out {adapter}")
    if not (base_dir / "config.json").is_file():
        raise DataError(f"--base {base_dir} has no config.json; expected the base model's Hugging Face folder")
    out = check_writable_dir(args.out, "--out")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise DataError(f"{out} exists and is not empty; pass --overwrite or another --out")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{config_file} is not JSON ({one_line(e, 120)}); export the adapter again") from None
    try:
        import torch
        import peft
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ScriptError(f"merge needs torch and peft ({e.name} is missing); next: install torch for your "
                          "machine first (pip install torch), then pip install 'peft>=0.13' safetensors") from None
    state = (load_file(str(weights_file)) if weights_file.is_file()
             else torch.load(adapter / "adapter_model.bin", map_location="cpu", weights_only=True))
    targets = adapter_target_modules(state)
    declared = config.get("target_modules")
    # The tensors say what was trained. SkyRL's exports (the local backend) name no
    # target_modules, and a pattern such as "all-linear" leaves out lm_head, which Tinker
    # trains by default: with either, PEFT would silently drop tensors.
    if not targets:
        raise DataError(f"{weights_file.name} holds no lora_A/lora_B tensors; expected a PEFT LoRA adapter")
    if declared != targets:
        say(f"target modules from the adapter's tensors: {', '.join(targets)} (adapter_config.json says {declared})")
    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    say(f"loading {base_dir} ({args.dtype}) ...")
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
        raise ScriptError(f"the adapter's modules ({', '.join(targets)}) match no module of {base_dir} "
                          f"({one_line(e, 150)}); is --base the model this adapter was trained on?") from None
    state = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()}
    loaded = peft.set_peft_model_state_dict(peft_model, state)
    unexpected = [k for k in getattr(loaded, "unexpected_keys", []) if "lora" in k]
    if unexpected:
        raise ScriptError(f"{len(unexpected)} adapter tensors match no module of {base_dir} (first: {unexpected[0]}); "
                          "is --base the model this adapter was trained on?")
    missing = [k for k in getattr(loaded, "missing_keys", []) if "lora_" in k]
    if missing:
        say(f"warning: {len(missing)} LoRA tensors absent from the adapter stay zero (first: {missing[0]})")
    merged = peft_model.merge_and_unload()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:  # saved beside --out and renamed: an interrupted merge leaves no half-written --out
        merged.save_pretrained(str(staging), safe_serialization=True)
        copied = []
        for f in sorted(base_dir.iterdir()):
            weights = f.suffix in (".safetensors", ".bin", ".pt", ".pth") or f.name.endswith(".index.json")
            if f.is_file() and not weights and f.name != "config.json" and not (staging / f.name).exists():
                shutil.copy2(f, staging / f.name)
                copied.append(f.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"merged {adapter} into {base_dir} -> {out} (r={lora_config.r}, alpha={lora_config.lora_alpha}, "
        f"modules: {', '.join(lora_config.target_modules)}{', untied embeddings' if untied else ''})")
    return {"status": "ok", "out": str(out), "target_modules": sorted(lora_config.target_modules),
            "lora_rank": lora_config.r, "lora_alpha": lora_config.lora_alpha, "untied_embeddings": untied,
            "copied_files": copied}


# ==== SHARED CODE (generated from common/: errors, flags, run_files, data, render, run_record, service) ====
# Edit the files in common/ of the tinker-training-inference bundle, then run `python tools/splice.py`;
# tests/test_shared_code.py fails when this copy differs from its source.


# ---- common/errors.py ----
# Errors and exit codes: every script fails with one line on stderr and a documented exit code.
import json
import signal
import sys

# 0 ok · 1 Tinker or runtime failure · 2 bad input or usage · 3 estimate above --max-usd ·
# 4 no credentials / Tinker unreachable · 130 interrupted (SIGINT) · 143 terminated (SIGTERM)
EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_OVER_BUDGET, EXIT_NO_ACCESS = 0, 1, 2, 3, 4


class ScriptError(Exception):
    """A failure explained in one line: what failed, what was expected, the next command."""

    exit_code = EXIT_FAILURE


class DataError(ScriptError):
    """Bad input or usage: data, flags, paths, unknown model, context overflow."""

    exit_code = EXIT_BAD_INPUT


class RenderError(DataError):
    """The chat template cannot produce a faithful datum for this example."""


class BudgetError(ScriptError):
    exit_code = EXIT_OVER_BUDGET


class AccessError(ScriptError):
    """No credentials, credentials refused, or the service cannot be reached."""

    exit_code = EXIT_NO_ACCESS


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the script is so `finally` blocks and the run record close cleanly."""


def _raise_terminated(signum, frame):
    raise Terminated()


def say(*parts) -> None:
    """Progress and warnings: stderr, so stdout carries only the final JSON object."""
    print(*parts, file=sys.stderr, flush=True)


def emit(obj: dict) -> None:
    """The one JSON object a script prints on stdout."""
    print(json.dumps(obj), flush=True)


def one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:limit]


RESUME_HINT = "the run record is saved; continue with the same command plus --resume"


def run_cli(main, argv=None, *, error_json: bool = False, interrupted_hint: str = RESUME_HINT) -> int:
    """Run main(argv) and turn every way it can end into an exit code and at most one stderr line.
    error_json: also print {"status": "error"|"interrupted", "exit_code", "error"} on stdout, for a script
    whose stdout always ends in one JSON object (tinker_infer.py); interrupted_hint: what to do after ^C."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return main(argv)
    except ScriptError as e:
        code, status, line = e.exit_code, "error", f"error: {one_line(e, 2000)}"
    except Terminated:
        code, status, line = 143, "interrupted", f"terminated: {interrupted_hint}"
    except KeyboardInterrupt:
        code, status, line = 130, "interrupted", f"interrupted: {interrupted_hint}"
    except Exception as e:  # Tinker or runtime failure: one line; the SDK's log has the details
        code, status, line = EXIT_FAILURE, "error", f"error: {type(e).__name__}: {one_line(e)}"
    say(line)
    if error_json:
        emit({"status": status, "exit_code": code, "error": line.split(": ", 1)[1] if status == "error" else line})
    return code


# ---- common/flags.py ----
# Flag checks shared by the dry run and the real run: run before any file changes or any paid call.
import math
import os
import shutil
from pathlib import Path


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_number(dest: str, value, *, low=None, high=None, low_open=False, high_open=False) -> None:
    """DataError unless value is a finite number within [low, high] (open ends where asked); None passes."""
    if value is None:
        return
    name = flag_name(dest)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{name} {value!r}: expected a finite number")
    bounds = (f"{'(' if low_open else '['}{'-inf' if low is None else low}, "
              f"{'inf' if high is None else high}{')' if high_open else ']'}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise DataError(f"{name} {value}: expected a value in {bounds}")


def check_numbers(args, rules: dict) -> None:
    """rules: {dest: dict(low=..., high=..., low_open=..., high_open=...)} checked against args.dest."""
    for dest, bounds in rules.items():
        check_number(dest, getattr(args, dest, None), **bounds)


def check_readable_file(path, what: str) -> Path:
    """An existing, readable file, or DataError naming the flag and the file."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{what} {path}: no such file")
    if p.is_dir():
        raise DataError(f"{what} {path} is a folder; expected a file")
    if not os.access(p, os.R_OK):
        raise DataError(f"{what} {path} is not readable (permissions)")
    return p


def check_writable_dir(path, what: str) -> Path:
    """A folder that exists and is writable, or can be created under a writable parent."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise DataError(f"{what} {path} is a file; expected a folder (choose another {what})")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise DataError(f"{what} {path}: {probe} is a file, so the folder cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise DataError(f"{what} {path}: {probe} is not writable (permissions)")
    return p


def check_free_space(path, need_bytes: int, what: str, fix: str) -> None:
    """DataError when the disk that holds `path` (or its nearest existing parent) has less than need_bytes
    free: checked before any paid call, so a full disk never stops a run midway."""
    probe = Path(path).expanduser()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # cannot tell: the write itself will say
    if free < need_bytes:
        raise DataError(f"{what} needs about {need_bytes / 2**20:,.0f} MiB on the disk of {path} and "
                        f"{free / 2**20:,.0f} MiB are free; {fix}")


# ---- common/run_files.py ----
# A run folder's files at the lowest level, carried by every script that reads or writes one (the report
# tool too): JSONL lines as editors save them, and the one-writer lock.
#
# The lock: an exclusive advisory POSIX record lock (lockf) on LOG/.lock, held for the writer's whole life.
# The kernel drops it when its process ends, however it ends (SIGKILL too), and forked workers (the render
# pool) do not inherit it. The file says who holds it (pid, host, script, start time) for the error a second
# writer prints and for readers (tinker_report.py), which never take the lock: they test it for an instant.
# A record left by a process that died holding the lock is taken over by the next writer, which says so.
# Within one process a POSIX lock never conflicts with itself and closing any descriptor of the file drops
# it: only the lock's own code opens LOG/.lock.
import errno
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the scripts run, unguarded
    fcntl = None

LOCK_FILE = ".lock"
# A reader tests the lock for microseconds and a writer records itself right after taking it: a refused
# writer that finds no live holder named in the file tries again for this long before giving up.
SETTLE_S = 2.0


def jsonl_lines(text: str):
    """(line number, line) of each non-blank line of JSONL text: a UTF-8 byte-order mark (Windows editors,
    also where files were concatenated) and CRLF endings are accepted, as pandas and datasets accept them;
    only a newline ends a line (U+2028 and other characters str.splitlines() splits on are valid inside a
    JSON string)."""
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.strip().lstrip("\ufeff")
        if line:
            yield n, line


class FolderBusy(Exception):
    """A live process holds the folder's lock; `holder` is its record ({} when unreadable)."""

    def __init__(self, holder: dict):
        super().__init__(describe_holder(holder))
        self.holder = holder


def describe_holder(holder: dict) -> str:
    if not holder.get("pid"):
        return "another process (it has not recorded itself yet)"
    return (f"{holder.get('script') or 'a script'} (pid {holder['pid']} on host {holder.get('host')}, "
            f"since {holder.get('started')})")


def read_holder(fd) -> dict:
    try:
        data = os.pread(fd, 65536, 0)
        record = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def holder_alive(holder: dict) -> bool | None:
    """Whether the recorded process still runs: True/False on this host, None for another host."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same_file(fd, path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def acquire_lock(folder) -> tuple[int | None, dict]:
    """(descriptor holding FOLDER/.lock, the record of a dead holder taken over or {}). Creates the folder.
    FolderBusy when a live process holds it. Release with release_lock(fd, folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        return None, {}
    path = folder / LOCK_FILE
    deadline = time.monotonic() + SETTLE_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            holder = read_holder(fd)
            os.close(fd)
            if holder_alive(holder) or time.monotonic() > deadline:
                raise FolderBusy(holder) from None
            time.sleep(0.05)
            continue
        if not _same_file(fd, path):  # released and removed between our open and lock: lock the new file
            os.close(fd)
            continue
        previous = read_holder(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "script": Path(sys.argv[0]).name if sys.argv and sys.argv[0] else None,
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        return fd, previous


def release_lock(fd, folder) -> None:
    """Remove FOLDER/.lock (if it is still ours) and drop the lock."""
    if fd is None:
        return
    path = Path(folder) / LOCK_FILE
    try:
        if _same_file(fd, path):
            path.unlink()
    except OSError:
        pass
    os.close(fd)


def lock_holder(folder) -> dict | None:
    """The record of the live process holding FOLDER/.lock, or None. Never waits and never blocks a writer
    for longer than an instant (a writer refused meanwhile tries again). Not for use by the holder itself."""
    if fcntl is None:
        return None
    try:
        fd = os.open(Path(folder) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return read_holder(fd) or {"pid": None}
        return None
    finally:
        os.close(fd)


# ---- common/data.py ----
# Reading and validating conversation data (JSONL of {"messages"} or {"prompt", "completion"}).
import json
import random
from pathlib import Path


def read_jsonl(path, what: str = "--data") -> list[tuple[int, object]]:
    """(line number, object) for each non-blank line; bad bytes or bad JSON is a DataError naming the line."""
    if not path:
        raise DataError(f"no data: pass {what} FILE.jsonl (or edit the EDIT ME loader)")
    try:
        raw = Path(path).read_bytes()
    except IsADirectoryError:
        raise DataError(f"{what} {path} is a folder; expected a JSONL file") from None
    except OSError as e:
        raise DataError(f"cannot read {what} {path}: {e.strerror}; expected a JSONL file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path} line {line} (byte {e.start}): not UTF-8 ({e.reason}); re-save the file as "
                        "UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    rows = []
    for n, line in jsonl_lines(text):  # a byte-order mark and CRLF endings are fine
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {n}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not rows:
        raise DataError(f"{path} has no examples; expected one JSON object per line")
    return rows


ROLES = {"system", "developer", "user", "assistant", "tool"}


def validate_messages(msgs, where: str, *, need_assistant: bool = True) -> list[dict]:
    """A checked copy of a conversation, or DataError naming the message and what is wrong."""
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"{where}: message {i} must be an object with 'role' and 'content'")
        role = m["role"]
        if role not in ROLES:
            raise DataError(f"{where}: message {i} has unknown role {role!r}; expected one of {sorted(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {i} ({role}) content must be a string, got {type(content).__name__}")
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise DataError(f"{where}: message {i} reasoning_content must be a string")
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function", {}).get("name"), str) for c in calls)):
            raise DataError(f"{where}: message {i} tool_calls must be a list of "
                            "{'type': 'function', 'function': {'name', 'arguments'}} objects")
        if role == "assistant" and not content.strip() and not (reasoning or "").strip() and not calls:
            raise DataError(f"{where}: message {i} (assistant) has empty content; nothing to train on")
        clean.append(dict(m))
    check_role_order(clean, where, need_assistant=need_assistant)
    return clean


def validate_example(obj, line_no) -> dict:
    """A checked copy of one example ({"messages"} or {"prompt", "completion"}) plus "line"; else DataError."""
    where = f"line {line_no}"
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with 'messages' or 'prompt'/'completion', "
                        f"got {type(obj).__name__}")
    if "messages" in obj:
        clean = validate_messages(obj["messages"], where)
        tools = obj.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise DataError(f"{where}: 'tools' must be a list of JSON-schema tool objects")
        return {"messages": clean, "line": line_no, **({"tools": tools} if tools else {})}
    if "prompt" in obj or "completion" in obj:
        prompt, completion = obj.get("prompt"), obj.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataError(f"{where}: 'prompt' and 'completion' must both be strings")
        if not completion.strip():
            raise DataError(f"{where}: empty completion; nothing to train on")
        return {"prompt": prompt, "completion": completion, "line": line_no}
    raise DataError(f"{where}: expected a 'messages' list or 'prompt'/'completion' strings, got keys {sorted(obj)}")


def check_role_order(msgs, where, *, need_assistant=True):
    roles = [m["role"] for m in msgs]
    if need_assistant and "assistant" not in roles:
        raise DataError(f"{where}: conversation has no assistant turn; add a {{'role': 'assistant'}} message to train on")
    prev = None
    for i, role in enumerate(roles):
        bad = None
        if role in ("system", "developer") and any(r not in ("system", "developer") for r in roles[:i]):
            bad = f"a {role} message may only open the conversation"
        elif role == "assistant" and prev not in ("user", "tool"):
            bad = "an assistant message must follow a user (or tool) message"
        elif role == "tool" and prev not in ("assistant", "tool"):
            bad = "a tool message must follow an assistant message"
        elif role == "user" and prev == "user":
            bad = "two user messages in a row"
        if bad:
            raise DataError(f"{where}: roles out of order at message {i} ({' -> '.join(roles)}): {bad}")
        prev = role


def normalise_items(items, source=None, validate=validate_example) -> list[dict]:
    """Validated examples from load_dataset()'s items: dicts or (where, dict) pairs."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2:
            where, obj = item
        else:
            where, obj = i + 1, item
        out.append(validate(obj, where if source is None else f"{where} of {source}"))
    return out


def split_examples(train, test, fraction, seed):
    """(train, held-out): `test` when given, else a seeded `fraction` of the training examples."""
    if test is not None or fraction == 0 or len(train) < 2:
        return train, test or []
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    held = set(order[:max(1, round(fraction * len(train)))])
    return [e for i, e in enumerate(train) if i not in held], [train[i] for i in sorted(held)]


# ---- common/render.py ----
# Tokenizer loading, the run record's "format", and rendering through the model's own chat template.
#
# The masking rule: a datum's weights are 1 exactly on what the model must produce after the generation
# prompt (the assistant's tokens, end-of-turn token included) and 0 on everything else. Rendering is
# deterministic: the date a template prints is frozen, so a resumed run renders the same datums.
import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import itertools
import json
import multiprocessing
import os
import re
from pathlib import Path


FROZEN_DATE = "2024-07-26"  # every datum renders the same on every day, so resume is exact
FROZEN_DATE_STRING = "26 Jul 2024"  # Llama 3.x templates print this when given


def has_reasoning(message):
    return bool((message.get("reasoning_content") or "").strip()) or "<think>" in message.get("content", "")


def tokenizer_record(name_or_path: str) -> str:
    """An existing folder as an absolute path, so tinker_infer.py --run finds it from any directory;
    a hub name unchanged."""
    return os.path.abspath(name_or_path) if os.path.isdir(name_or_path) else name_or_path


def load_tokenizer(name_or_path: str):
    """A local folder loads as is; a Tinker model id follows the SDK's get_tokenizer name rules.

    The Hugging Face cache is tried first with no network; then the hub once, only if one short connection
    to it succeeds: without that probe an offline machine spends ~50 s in huggingface_hub's retries."""
    from transformers import AutoTokenizer

    if os.path.isdir(name_or_path):
        return AutoTokenizer.from_pretrained(name_or_path)
    if name_or_path.startswith((".", "/", "~")):  # a folder, not a hub name: no cache or hub to try
        raise DataError(f"tokenizer folder {name_or_path} does not exist; pass --tokenizer PATH (a folder with "
                        "tokenizer.json) or a hub name")
    name = name_or_path.split(":", 1)[0]  # drop ':peft:131072'-style suffixes
    kwargs = {}
    if name.startswith("meta-llama/Llama-3"):
        name = "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"  # ungated copy the SDK uses
    elif name.count("/") == 2:
        name = name.rsplit("/", 1)[0]  # org/model/variant -> org/model
    if name.startswith("moonshotai/Kimi-K"):
        kwargs["trust_remote_code"] = True
    with contextlib.suppress(Exception):
        return AutoTokenizer.from_pretrained(name, local_files_only=True, **kwargs)
    failed = f"cannot load the tokenizer for {name_or_path!r}: {name} is not in the Hugging Face cache and "
    next_step = ("; pass --tokenizer PATH (a folder with tokenizer.json), or download it once and run with "
                 "HF_HUB_OFFLINE=1")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise DataError(failed + "HF_HUB_OFFLINE=1 forbids the hub" + next_step)
    unreachable = hub_unreachable()
    if unreachable:
        raise DataError(failed + f"the hub is unreachable ({unreachable})" + next_step)
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except Exception as e:  # gated, misspelt, network lost: all end the same way for the user
        raise DataError(f"cannot load the tokenizer for {name_or_path!r} from the hub ({type(e).__name__})"
                        + next_step) from None


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


def chat_format(tokenizer, *, name: str, thinking: bool = False) -> dict:
    """The run record's "format" for chat-template rendering (see DEVELOPING.md)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # some tokenizers ship named templates
        template = template.get("default") or next(iter(template.values()))
    if not template:
        raise DataError(f"tokenizer {name!r} has no chat template; use --format raw")
    fmt = {
        "kind": "chat",
        "template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "template_kwargs": {
            "enable_thinking": thinking,  # Qwen3
            "thinking": thinking,  # DeepSeek V3.1
            "date_string": FROZEN_DATE_STRING,  # Llama 3.x
            "strftime_now": FROZEN_DATE,  # gpt-oss prints strftime_now("%Y-%m-%d"); frozen while rendering
        },
        "stop": [],
        "tokenizer": name,
    }
    fmt["stop"] = stop_tokens(tokenizer, fmt)
    return fmt


def raw_format(tokenizer, *, name: str) -> dict:
    """The run record's "format" for plain text + explicit EOS (base models)."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {name!r} has no EOS token; raw format needs one to learn to stop")
    return {
        "kind": "raw",
        "stop": [tokenizer.eos_token_id],
        "bos": tokenizer.bos_token_id is not None,
        "conversation": "role-colon: 'User: ...\\n\\nAssistant: ...'",
        "tokenizer": name,
    }


@contextlib.contextmanager
def _frozen_clock(date_iso):
    # transformers builds strftime_now() on datetime.now() and rebuilds any callable kwarg into a
    # string, so the only way to freeze the date a template prints is its module's clock.
    mod = importlib.import_module("transformers.utils.chat_template_utils")
    real = getattr(mod, "datetime", None)
    if real is None or not date_iso:
        yield
        return

    class FrozenDatetime(real):
        @classmethod
        def now(cls, tz=None):
            return real.fromisoformat(date_iso)

    mod.datetime = FrozenDatetime
    try:
        yield
    finally:
        mod.datetime = real


def _tool_call_arguments(messages, as_text):
    """Copies of messages whose tool-call arguments are dicts (the transformers convention, which
    Qwen3, Qwen3.5, gpt-oss and Kimi templates expect) or JSON text (DeepSeek V3.1 concatenates)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[dict(c, function=_arguments(c["function"], as_text)) for c in m["tool_calls"]])
        out.append(m)
    return out


def _arguments(function, as_text):
    args = function.get("arguments", {})
    if as_text and not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    elif not as_text and isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise RenderError(f"tool call {function.get('name')!r} has arguments that are not JSON: {args[:80]!r}") from None
    return dict(function, arguments=args)


def _apply_template(tokenizer, messages, fmt, *, add_generation_prompt, thinking=None, tools=None):
    kwargs = dict(fmt["template_kwargs"])
    frozen = kwargs.pop("strftime_now", None)
    if thinking is not None:
        kwargs["enable_thinking"] = kwargs["thinking"] = thinking
    if tools:
        kwargs["tools"] = tools

    def render(msgs):
        with _frozen_clock(frozen):
            return tokenizer.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kwargs
            )

    try:
        try:
            ids = render(_tool_call_arguments(messages, as_text=False))
        except TypeError:  # a template that concatenates arguments as text (DeepSeek V3.1)
            ids = render(_tool_call_arguments(messages, as_text=True))
    except RenderError:
        raise
    except Exception as e:  # jinja errors: one line naming the template, never a traceback
        raise RenderError(
            f"chat template of {fmt.get('tokenizer')} failed on this conversation: {type(e).__name__}: {e}"
        ) from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older transformers ignore return_dict=False
        ids = ids["input_ids"]
    return list(ids)


def _role_colon_text(messages):
    """Raw-format rendering of a conversation: the prompt text ending in 'Assistant:'."""
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(parts + ["Assistant:"])


def _raw_assistant_text(message):
    reasoning = (message.get("reasoning_content") or "").strip()
    return f"<think>\n{reasoning}\n</think>\n\n{message['content']}" if reasoning else message["content"]


def generation_prompt(messages, tokenizer, fmt, *, thinking=None, tools=None) -> list[int]:
    """Token ids the sampler is given: messages (or a bare prompt string in raw format) + the
    assistant header."""
    if fmt["kind"] == "chat":
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return _apply_template(tokenizer, messages, fmt, add_generation_prompt=True, thinking=thinking, tools=tools)
    text = messages if isinstance(messages, str) else _role_colon_text(messages)
    bos = [tokenizer.bos_token_id] if fmt.get("bos") and tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(text, add_special_tokens=False)


@dataclasses.dataclass
class Rendered:
    """One datum before the shift: token ids and per-token loss weights (same length, unshifted)."""

    tokens: list[int]
    weights: list[float]


def _is_special(tokenizer, tok):
    return tok in tokenizer.all_special_ids or tok in getattr(tokenizer, "added_tokens_decoder", {})


def _render_chat_turn(messages, i, tokenizer, fmt, tools=None):
    """Rendered for assistant message i: weights 1 exactly on what the model must produce after the
    generation prompt, end-of-turn token included."""
    thinking = fmt["template_kwargs"].get("enable_thinking", False) or has_reasoning(messages[i])
    prompt = _apply_template(tokenizer, messages[:i], fmt, add_generation_prompt=True, thinking=thinking, tools=tools)
    full = _apply_template(tokenizer, messages[: i + 1], fmt, add_generation_prompt=False, thinking=thinking,
                           tools=tools)
    template_id = f"{fmt.get('tokenizer')} (template sha256 {fmt['template_sha256'][:12]})"
    if full[: len(prompt)] != prompt:
        raise RenderError(
            f"chat template of {template_id} renders message {i} so that the generation prompt is not a "
            "prefix of the conversation; training on it would not match sampling (try --format raw)"
        )
    completion = full[len(prompt):]
    # The template may append whitespace after the end-of-turn token (Qwen3: "<|im_end|>\n"): the
    # sampler stops at the end-of-turn token and never produces it, so it is not trained.
    while completion and not _is_special(tokenizer, completion[-1]) and not tokenizer.decode([completion[-1]]).strip():
        completion.pop()
    if not completion:
        raise RenderError(f"chat template of {template_id} renders assistant message {i} as nothing")
    if not _is_special(tokenizer, completion[-1]):
        raise RenderError(
            f"chat template of {template_id} ends assistant message {i} with "
            f"{tokenizer.decode(completion[-1:])!r}, not an end-of-turn special token; the model would never learn to stop"
        )
    reasoning = (messages[i].get("reasoning_content") or "").strip()
    if reasoning and reasoning not in tokenizer.decode(completion):
        raise RenderError(
            f"chat template of {template_id} drops the reasoning_content of assistant message {i} "
            "(Kimi K2 keeps it only before a tool call; DeepSeek V3.1 never renders it); "
            "remove reasoning_content to train the answer alone"
        )
    return Rendered(prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion))


def render_example(example, tokenizer, fmt, train_on="last-assistant") -> list[Rendered]:
    """The datums of one validated example.

    chat, last-assistant: one datum training the last assistant message.
    chat, all-assistant: every assistant message is trained; consecutive turns share one datum when
        the earlier datum's tokens are a prefix of the later one (the template has the extension
        property). Otherwise each turn is its own datum, rendered in the context the model really
        sees at that turn (Qwen3 drops earlier turns' <think> blocks, so its turns are separate).
    Reasoning: a message with reasoning_content (or <think> in its content) renders with thinking on
        and its reasoning is trained; other messages render with the format's thinking switch.
    raw: [bos] + prompt + completion + [eos], weights on completion + eos; a conversation becomes
        role-colon text ('User: ...\\n\\nAssistant:') with the assistant content as completion.
    """
    if fmt["kind"] == "chat":
        messages = example.get("messages") or [
            {"role": "user", "content": example["prompt"]},
            {"role": "assistant", "content": example["completion"]},
        ]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if train_on == "last-assistant":
            turns = turns[-1:]
        rendered = [_render_chat_turn(messages, i, tokenizer, fmt, example.get("tools")) for i in turns]
        return _merge_extensions(rendered)

    eos = tokenizer.eos_token_id
    if "messages" in example:
        messages = example["messages"]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if train_on == "last-assistant":
            turns = turns[-1:]
        pairs = [(messages[:i], " " + _raw_assistant_text(messages[i])) for i in turns]
    else:
        pairs = [(example["prompt"], example["completion"])]
    out = []
    for prompt_part, completion_text in pairs:
        prompt = generation_prompt(prompt_part, tokenizer, fmt)
        completion = tokenizer.encode(completion_text, add_special_tokens=False) + [eos]
        out.append(Rendered(prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion)))
    return _merge_extensions(out)


def _merge_extensions(rendered):
    merged = []
    for r in rendered:
        last = merged[-1] if merged else None
        if last is not None and r.tokens[: len(last.tokens)] == last.tokens:
            merged[-1] = Rendered(r.tokens, last.weights + r.weights[len(last.tokens):])
        else:
            merged.append(r)
    return merged


def stop_tokens(tokenizer, fmt) -> list[int]:
    """Token ids that end a sampled turn: the end-of-turn token the renderer trains (found by rendering
    a probe conversation), plus Harmony's <|call|> when the end-of-turn is <|return|>; raw: [eos]."""
    if fmt["kind"] != "chat":
        return [tokenizer.eos_token_id]
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    end = _render_chat_turn(probe, 1, tokenizer, fmt).tokens[-1]
    stops = [end]
    if tokenizer.convert_ids_to_tokens(end) == "<|return|>":
        call = tokenizer.convert_tokens_to_ids("<|call|>")
        if isinstance(call, int) and call != tokenizer.unk_token_id:
            stops.append(call)
    return stops


def to_datum(r: Rendered):
    """The shift by one: model_input = tokens[:-1], target_tokens = tokens[1:], weights = weights[1:]."""
    import tinker

    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(r.tokens[:-1]),
        loss_fn_inputs={"target_tokens": list(r.tokens[1:]), "weights": [float(w) for w in r.weights[1:]]},
    )


def weighted_spans(tokenizer, r: Rendered) -> list[str]:
    """Decoded text of each run of consecutive weighted tokens (what the audit shows a human)."""
    spans, current = [], []
    for tok, w in zip(r.tokens, r.weights):
        if w:
            current.append(tok)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tokenizer.decode(s) for s in spans]


def resolve_format(kind, model_name, tokenizer, tokenizer_name, thinking=False) -> dict:
    """--format auto|chat|raw: auto is raw for *-Base models or tokenizers without a template, else chat."""
    if kind == "auto":
        base = model_name.split(":", 1)[0].endswith("-Base")
        kind = "raw" if base or not tokenizer.chat_template else "chat"
    if kind == "chat":
        return chat_format(tokenizer, name=tokenizer_name, thinking=thinking)
    return raw_format(tokenizer, name=tokenizer_name)


POOL_MIN_EXAMPLES = 2000  # below this a process pool costs more than it saves
CACHE_MIN_EXAMPLES = 1000  # below this rendering takes about a second: not worth a file
_POOL_JOB = None  # (tokenizer, fmt, train_on, renderer), inherited by forked render workers


def render_all(examples, tokenizer, fmt, train_on, *, workers=None, cache_dir=None, fast=True) -> list:
    """[(line, Rendered)] for every validated example, equal to render_example's; a RenderError names the
    example's line.

    Chat conversations render through BatchRenderer (the template run once per conversation shape, the
    tokenizer over the pieces; checked against render_example, see there); fast=False renders each one
    with render_example. Large sets render in a process pool over every core (forked, so each worker
    inherits the tokenizer; the per-datum checks run unchanged in the workers). With cache_dir, the
    result is kept in a file keyed by (examples, tokenizer, format, train_on, rendering code), so a
    --resume or a real run after a dry run reads it back instead of rendering again."""
    path = None
    if cache_dir is not None and len(examples) >= CACHE_MIN_EXAMPLES:
        path = Path(cache_dir) / f"{render_cache_key(examples, tokenizer, fmt, train_on)}.json"
        cached = _read_render_cache(path)
        if cached is not None:
            return cached
        check_free_space(cache_dir, render_cache_bytes(examples), "the render cache (--render-cache)",
                         f"free some space, or pass --render-cache DIR on a disk with room, or --render-cache off "
                         "(a --resume then renders again)")
    workers = workers or os.cpu_count() or 1
    pooled = workers > 1 and len(examples) >= POOL_MIN_EXAMPLES and "fork" in multiprocessing.get_all_start_methods()
    # One renderer per call (inherited by forked workers): its caches never carry one call's work into another.
    renderer = BatchRenderer(tokenizer, fmt) if fast and fmt["kind"] == "chat" else None
    try:
        out = (_render_in_pool(examples, tokenizer, fmt, train_on, workers, renderer) if pooled
               else _unpack(_render_serial(examples, tokenizer, fmt, train_on, renderer)))
    except _FastPathMismatch:  # the template is not what BatchRenderer assumes: render it the slow, exact way
        out = (_render_in_pool(examples, tokenizer, fmt, train_on, workers, None) if pooled
               else _unpack(_render_serial(examples, tokenizer, fmt, train_on, None)))
    if path is not None:
        _write_render_cache(path, out)
    return out


def _render_serial(examples, tokenizer, fmt, train_on, renderer=None) -> list:
    """[(line, tokens, weight runs)]: the compact form the pool and the cache pass around. With a
    BatchRenderer, through it; else render_example per example."""
    if renderer is not None:
        return renderer.render(examples, train_on)
    out = []
    for ex in examples:
        try:
            out.extend((ex["line"], r.tokens, _runs(r.weights)) for r in render_example(ex, tokenizer, fmt, train_on))
        except RenderError as e:
            raise RenderError(f"line {ex['line']}: {e}") from None
    return out


def _runs(weights) -> list[int]:
    """Weights (0/1) as run lengths, starting with a run of zeros: [0, 0, 1, 1, 1, 0] -> [2, 3, 1]."""
    runs = [len(list(group)) for _, group in itertools.groupby(weights)]
    return [0, *runs] if weights and weights[0] else runs


def _weights(runs) -> list[float]:
    out = []
    for k, n in enumerate(runs):
        out += [float(k % 2)] * n
    return out


def _unpack(rows) -> list:
    return [(line, Rendered(tokens, _weights(runs))) for line, tokens, runs in rows]


def _render_chunk(chunk):
    tokenizer, fmt, train_on, renderer = _POOL_JOB
    return _render_serial(chunk, tokenizer, fmt, train_on, renderer)


def _render_in_pool(examples, tokenizer, fmt, train_on, workers, renderer=None) -> list:
    global _POOL_JOB
    import concurrent.futures
    import gc
    from concurrent.futures.process import BrokenProcessPool

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the Rust pool must not be shared over fork
    size = min(max(len(examples) // (workers * 8), 200), 5000)
    chunks = [examples[i:i + size] for i in range(0, len(examples), size)]
    _POOL_JOB = (tokenizer, fmt, train_on, renderer)
    gc.freeze()  # the workers' garbage collector then leaves the inherited objects (and their pages) alone
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                                    initializer=_pool_worker_start) as pool:
            try:  # in order, each chunk unpacked here while the workers render the next ones
                return [row for part in pool.map(_render_chunk, chunks) for row in _unpack(part)]
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    except BrokenProcessPool:  # a worker was killed (out of memory?): a plain pool would wait forever
        say("render: a worker process died (out of memory?); rendering in this process instead")
        return _unpack(_render_serial(examples, tokenizer, fmt, train_on, renderer))
    finally:
        gc.unfreeze()
        _POOL_JOB = None


def _pool_worker_start():
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the script's handler would wait for Python code to run
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


class _FastPathMismatch(Exception):
    """BatchRenderer and render_example disagreed on a conversation: render_all renders again without it."""


_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001|\ue002(\\d+)\ue003")  # private-use marks: message k's content / reasoning
_MESSAGE_KEYS = {"role", "content", "reasoning_content"}


class BatchRenderer:
    """render_example for many chat conversations at once, equal to it token for token.

    Why it is fast: the chat template (Jinja, about 1 ms a call) runs once per conversation *shape* (roles,
    which messages carry reasoning, the trained turn, thinking on or off) with marker strings in place of
    the contents; each conversation's text is that skeleton with its contents filled in. The text is cut
    at the tokenizer's added tokens (<|im_start|>, <think>, ...), which the fast tokenizer matches before
    anything else, so each piece between them tokenizes on its own exactly as inside the whole text; the
    pieces of a whole chunk go to the Rust tokenizer in one batch and repeated pieces (system prompts,
    headers) are tokenized once. The per-datum checks of _render_chat_turn (prompt is a prefix, trailing
    whitespace after the end-of-turn token untrained, ends on a special token, reasoning kept) run on
    every datum.

    When it applies: a message's content (and reasoning_content) is "inert": non-empty, no leading or
    trailing whitespace, no '<' or '>', no added token's text, and the message has no keys beyond role,
    content and reasoning_content; the example has no tools. Templates branch on content only through
    such things (Qwen3 looks for '</think>' and '<tool_response>', strips newlines; Llama trims), so an
    inert content renders as its marker did. Everything else goes through render_example. The assumption
    is checked, not trusted: the skeleton must come out the same with markers of another length, the
    first conversations of every shape and every VERIFY_EVERY-th one are also rendered by render_example
    and compared, and any difference raises _FastPathMismatch (render_all then renders the whole set
    with render_example)."""

    VERIFY_FIRST = 2  # conversations of each new shape also rendered the slow way
    VERIFY_EVERY = 64  # and every 64th fast-rendered conversation
    SEGMENT_CACHE_MAX = 200_000

    def __init__(self, tokenizer, fmt):
        self.tokenizer, self.fmt = tokenizer, fmt
        self.special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        added = {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.odd_added = [c for c in added if "<" not in c and ">" not in c]
        # Cutting at added tokens is exact when they match plain text (no stripping of neighbours,
        # no normalisation first); otherwise each whole text is tokenized.
        plain = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized)
                    for t in getattr(tokenizer, "added_tokens_decoder", {}).values())
        self.split_re = (re.compile("(" + "|".join(re.escape(c) for c in sorted(added, key=len, reverse=True)) + ")")
                         if plain and added and self.backend is not None else None)
        self.added = added
        self.skeletons, self.shape_seen = {}, {}
        self.segments, self.blank = {}, {}
        self.count = 0

    def render(self, examples, train_on) -> list:
        """[(line, tokens, weight runs)] of every example, in order."""
        jobs, texts = [], []
        for ex in examples:
            plan = self._plan(ex, train_on)
            jobs.append((ex, plan))
            if plan is not None:
                texts.extend(t for _, prompt, full in plan for t in (prompt, full))
        ids = self._tokenize(texts)
        out, k = [], 0
        for ex, plan in jobs:
            rendered = None
            if plan is not None:
                turns = []
                for (shape, _), _, _ in plan:
                    turns.append(self._turn(ex["messages"][len(shape) - 1], ids[k], ids[k + 1]))
                    k += 2
                if all(t is not None for t in turns):
                    rendered = _merge_extensions(turns)
                    self._verify(ex, train_on, plan, rendered)
            if rendered is None:  # the slow path, which also words any error
                try:
                    rendered = render_example(ex, self.tokenizer, self.fmt, train_on)
                except RenderError as e:
                    raise RenderError(f"line {ex['line']}: {e}") from None
            out.extend((ex["line"], r.tokens, _runs(r.weights)) for r in rendered)
        return out

    def _inert(self, text):
        return (isinstance(text, str) and text and text == text.strip() and "<" not in text and ">" not in text
                and not any(c in text for c in self.odd_added))

    def _plan(self, ex, train_on):
        """[(shape, prompt text, full text)] per trained turn, or None: render_example renders it."""
        messages = ex.get("messages")
        if not messages or ex.get("tools"):
            return None
        values, shape = [], []
        for k, m in enumerate(messages):
            if not m.keys() <= _MESSAGE_KEYS or not self._inert(m["content"]):
                return None
            reasoning = m.get("reasoning_content")
            if reasoning is not None and not self._inert(reasoning):
                return None
            values.append((m["content"], reasoning))
            shape.append((m["role"], reasoning is not None))
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if train_on == "last-assistant":
            turns = turns[-1:]
        plan = []
        thinking_on = self.fmt["template_kwargs"].get("enable_thinking", False)
        for i in turns:
            key = (tuple(shape[: i + 1]), thinking_on or values[i][1] is not None)
            skeleton = self.skeletons.get(key)
            if skeleton is None:
                skeleton = self.skeletons[key] = self._skeleton(key)
            if skeleton is False:
                return None
            plan.append((key, _fill(skeleton[0], values), _fill(skeleton[1], values)))
        return plan

    def _skeleton(self, key):
        """(prompt parts, full parts) of a shape, or False when the template cannot be compiled this way."""
        shape, thinking = key

        def text(offset, n, generation):
            msgs = []
            for k, (role, has_reasoning) in enumerate(shape[:n]):
                m = {"role": role, "content": f"\ue000{k + offset}\ue001"}
                if has_reasoning:
                    m["reasoning_content"] = f"\ue002{k + offset}\ue003"
                msgs.append(m)
            return _template_text(self.tokenizer, msgs, self.fmt, add_generation_prompt=generation, thinking=thinking)

        try:
            n = len(shape)
            parts = [_parts(text(0, n - 1, True), 0), _parts(text(0, n, False), 0)]
            again = [_parts(text(1000, n - 1, True), 1000), _parts(text(1000, n, False), 1000)]
        except Exception:  # the slow path renders it and words the error
            return False
        return tuple(parts) if parts == again else False

    def _tokenize(self, texts) -> list[list[int]]:
        if self.split_re is None:
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)] if self.backend \
                else [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        if len(self.segments) > self.SEGMENT_CACHE_MAX:
            self.segments.clear()
        if not self.segments:
            self.segments[""] = []
            self.segments.update({c: [i] for c, i in self.added.items()})
        segments = self.segments
        pieces = [self.split_re.split(t) for t in texts]
        new = list({p for ps in pieces for p in ps if p not in segments})  # added tokens are always known
        if new:
            for p, e in zip(new, self.backend.encode_batch(new, add_special_tokens=False)):
                segments[p] = e.ids
        out = []
        for ps in pieces:
            ids = []
            for p in ps:
                ids += segments[p]
            out.append(ids)
        return out

    def _is_blank(self, tok):
        blank = self.blank.get(tok)
        if blank is None:
            blank = self.blank[tok] = not self.tokenizer.decode([tok]).strip()
        return blank

    def _turn(self, message, prompt, full):
        """_render_chat_turn's datum and checks from token ids; None when a check fails (the slow path
        then raises the error with its wording)."""
        if full[: len(prompt)] != prompt:
            return None
        completion = full[len(prompt):]
        while completion and completion[-1] not in self.special and self._is_blank(completion[-1]):
            completion.pop()
        if not completion or completion[-1] not in self.special:
            return None
        reasoning = (message.get("reasoning_content") or "").strip()
        if reasoning and reasoning not in self.tokenizer.decode(completion):
            return None
        return Rendered(prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion))

    def _verify(self, ex, train_on, plan, rendered):
        self.count += 1
        seen = self.shape_seen[plan[-1][0]] = self.shape_seen.get(plan[-1][0], 0) + 1
        if seen <= self.VERIFY_FIRST or self.count % self.VERIFY_EVERY == 0:
            try:
                slow = render_example(ex, self.tokenizer, self.fmt, train_on)
            except RenderError:
                slow = None
            if slow != rendered:
                raise _FastPathMismatch(f"line {ex['line']}")


def _template_text(tokenizer, messages, fmt, *, add_generation_prompt, thinking):
    """The chat template's text for messages, with _apply_template's settings (untokenized)."""
    kwargs = dict(fmt["template_kwargs"])
    frozen = kwargs.pop("strftime_now", None)
    kwargs["enable_thinking"] = kwargs["thinking"] = thinking
    with _frozen_clock(frozen):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **kwargs)


def _parts(text, offset):
    """A rendered skeleton as [literal, (field, k), literal, ...]: field 0 content, 1 reasoning_content."""
    out, last = [], 0
    for m in _SENTINEL_RE.finditer(text):
        out.append(text[last:m.start()])
        out.append((0, int(m.group(1)) - offset) if m.group(1) else (1, int(m.group(2)) - offset))
        last = m.end()
    out.append(text[last:])
    return out


def _fill(parts, values) -> str:
    return "".join([p if p.__class__ is str else values[p[1]][p[0]] for p in parts])


def render_cache_bytes(examples) -> int:
    """An upper estimate of the cache file of `examples` in bytes: 5 per character of their JSON, plus 1 MiB.
    Measured with the Qwen3 tokenizer: 1.23 bytes per character for English chat (templates/sft_example.jsonl),
    3.46 for Japanese, 4.12 for emoji and math symbols (each a token or more)."""
    return 5 * sum(len(json.dumps(ex, ensure_ascii=False)) for ex in examples) + 2**20


def render_cache_key(examples, tokenizer, fmt, train_on) -> str:
    """sha256 of everything a rendered datum depends on: the examples, the tokenizer's vocabulary and
    special tokens, the format record (template hash, kwargs, stop), train_on and the rendering code."""
    h = hashlib.sha256()
    h.update(json.dumps([examples, fmt, train_on], sort_keys=True, default=str).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    with contextlib.suppress(OSError, TypeError):  # the code that renders and masks, as it runs now
        h.update("".join(inspect.getsource(f) for f in (render_example, _render_chat_turn, _apply_template,
                                                         generation_prompt, _merge_extensions, BatchRenderer,
                                                         _template_text, _write_render_cache)).encode())
    return h.hexdigest()[:32]


def _read_render_cache(path):
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        return _unpack(rows)
    except (OSError, ValueError, TypeError):
        return None


def _write_render_cache(path, rendered) -> None:
    """Atomic, and never fatal: a read-only or full disk only costs the next run a render. Rows are
    [line, tokens, weight runs] (the runs keep a 200k-conversation set at a third of its size)."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps([[line, r.tokens, _runs(r.weights)] for line, r in rendered]), encoding="utf-8")
        os.replace(tmp, path)


def apply_length_limit(rendered, limit, mode):
    """(kept, dropped lines) of [(line, Rendered)]. mode: 'error' | 'drop' | 'truncate'."""
    if not limit:
        return rendered, []
    long = [(line, r) for line, r in rendered if len(r.tokens) > limit]
    if not long:
        return rendered, []
    if mode == "error":
        shown = ", ".join(f"line {line} ({len(r.tokens)} tokens)" for line, r in long[:10])
        more = f" and {len(long) - 10} more" if len(long) > 10 else ""
        raise DataError(
            f"{len(long)} datum(s) exceed the {limit}-token limit: {shown}{more}; shorten them, "
            "or pass --drop-long or --truncate")
    kept, dropped = [], []
    for line, r in rendered:
        if len(r.tokens) <= limit:
            kept.append((line, r))
        elif mode == "truncate" and sum(r.weights[1:limit]) > 0:
            kept.append((line, Rendered(r.tokens[:limit], r.weights[:limit])))
        else:  # dropped, or truncation would leave nothing to train
            dropped.append(line)
    return kept, dropped


# ---- common/run_record.py ----
# The run record: every read and write of a run's log folder (DEVELOPING.md, "Run record").
#
# Nothing is lost on a crash: rows are appended and fsynced one at a time, config.json is replaced
# atomically, a torn last line (a kill mid-write) is ignored when read, and nothing in the folder
# changes until every check that can refuse the run (flags, data, budget) has passed.
import contextlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path


RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints.jsonl", "eval.jsonl")
# Free space a run folder needs before the first paid call: a row is small, but a full disk would stop the
# run midway, after it was paid for. A floor, not an estimate (RL's rollout trace grows with --trace-every).
RECORD_MIN_FREE = 64 * 2**20

# Our metric names -> the tinker-cookbook's, written side by side in metrics.jsonl so tools built for the
# cookbook's records (tinkerscope, dashboards) read our runs too (references/run-records.md). Only names
# that mean the same in every script: SFT's loss is the cookbook's train_mean_nll, DPO's is not, so
# tinker_sft.py writes that one itself.
COOKBOOK_METRIC_NAMES = {
    "tokens": "num_tokens", "trained_tokens": "num_loss_tokens", "eval_nll": "test/nll",
    "reward_mean": "env/all/reward/total", "kl_sample_train_v1": "optim/kl_sample_train_v1",
    "kl_sample_train_v2": "optim/kl_sample_train_v2",
}
# The cookbook renderer whose rendering a chat "format" matches (tests/test_chat_templates_oracle.py), by
# model-id prefix: (thinking off, thinking on). First match wins; a raw format is the cookbook's role_colon.
COOKBOOK_RENDERERS = (
    ("Qwen/Qwen3.5", ("qwen3_5_disable_thinking", "qwen3_5")),
    ("Qwen/Qwen3.6", ("qwen3_5_disable_thinking", "qwen3_5")),
    ("Qwen/Qwen3-", ("qwen3_disable_thinking", "qwen3")),
    ("meta-llama/Llama-3", ("llama3", "llama3")),
    ("deepseek-ai/DeepSeek-V3", ("deepseekv3", "deepseekv3_thinking")),
    ("openai/gpt-oss", ("gpt_oss_no_sysprompt", "gpt_oss_no_sysprompt")),
    ("moonshotai/Kimi-K2", ("kimi_k2", "kimi_k2")),
    ("nvidia/NVIDIA-Nemotron-3", ("nemotron3_disable_thinking", "nemotron3")),
)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Run:
    """A log folder. Checks (`resume_point`, `check_resume`) write nothing; `begin`, `append`,
    `rewind` and `checkpoint` are the only writers."""

    def __init__(self, path, extra_files=()):
        self.path = Path(path)
        self.files = RUN_FILES + tuple(extra_files)
        self._lock_fd, self._made_folders = None, []
        self.began = False  # this process started or resumed the record (begin(), or resume_point() with a row)

    def lock(self) -> Run:
        """Hold LOG/.lock until unlock() (a `with` block): one writer per run folder. Taken before anything in
        the folder is read for a decision, deleted or written; a second script on the folder (plain, --resume
        or --overwrite) stops here with exit 2 naming the holder. A lock left by a killed run is taken over."""
        check_free_space(self.path, RECORD_MIN_FREE, "the run record (--log-path)",
                         "free some space or pass a --log-path on a disk with room")
        self._made_folders = [self.path, *self.path.parents]  # those missing now, leaf first
        self._made_folders = self._made_folders[:next(i for i, d in enumerate(self._made_folders) if d.exists())]
        try:
            self._lock_fd, previous = acquire_lock(self.path)
        except FolderBusy as busy:
            alive = holder_alive(busy.holder)
            elsewhere = " (that pid is not running here: the lock is held from another machine or container)"
            how = f"wait for it to end (or stop it: kill {busy.holder['pid']})" if alive else "wait for it to end"
            raise DataError(f"{self.path} is being written by {busy}{elsewhere if alive is False else ''}; one run "
                            f"folder takes one writer at a time: {how}, then run this command again, or pass "
                            "another --log-path") from None
        if previous.get("pid"):
            say(f"note: {self.path / '.lock'} was left by {previous.get('script') or 'a script'} (pid "
                f"{previous['pid']} on host {previous.get('host')}, since {previous.get('started')}), which ended "
                "without releasing it (killed?); this run takes the folder over")
        return self

    def unlock(self) -> None:
        """Release LOG/.lock; folders this run created and left empty are removed (a refused run leaves nothing)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        release_lock(fd, self.path)
        for folder in self._made_folders:  # leaf first, each only when empty
            try:
                folder.rmdir()
            except OSError:
                break

    def __enter__(self) -> Run:
        return self if self._lock_fd is not None else self.lock()

    def __exit__(self, exc_type, exc, tb) -> None:
        """Release the lock; a runtime failure of a run this process began says where the record stands and
        the command that continues it (the SDK's own errors do not)."""
        self.unlock()
        if (not isinstance(exc, Exception) or isinstance(exc, (DataError, BudgetError)) or not self.began
                or "--resume" in str(exc) or any(r.get("name") == "final" for r in self.checkpoints())):
            return
        text = f"{exc if isinstance(exc, ScriptError) else f'{type(exc).__name__}: {one_line(exc)}'}; {self.resume_hint()}"
        try:  # the same exit code (a lost service stays 4)
            failure = type(exc)(text) if isinstance(exc, ScriptError) else ScriptError(text)
        except TypeError:
            failure = ScriptError(text)
        raise failure from exc

    def resume_hint(self) -> str:
        """What to run after a failure: --resume from the last checkpoint, or the same command if there is none."""
        rows = self.checkpoints()
        if rows:
            return (f"the run record in {self.path} is saved up to its last checkpoint ({rows[-1].get('name')}, "
                    "step " f"{rows[-1].get('step')}): continue with the same command plus --resume")
        return (f"no checkpoint was saved in {self.path} yet: run the same command again with --overwrite "
                "(--resume has nothing to continue from)")

    def file(self, name) -> Path:
        return self.path / name

    def rows(self, name) -> list[dict]:
        """Rows of a JSONL file; a torn line (a kill mid-write) is skipped, a missing file is []."""
        path = self.file(name)
        if not path.exists():
            return []
        rows = []
        for _, line in jsonl_lines(path.read_text(encoding="utf-8", errors="replace")):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def append(self, name, row: dict) -> dict:
        """One row, fsynced; a torn last line left by a kill is closed first so the new row stays whole.
        A metrics row also carries the cookbook's names for the values it has (COOKBOOK_METRIC_NAMES).
        Returns the row as written."""
        if name == "metrics.jsonl":
            row = {**row, **{theirs: row[ours] for ours, theirs in COOKBOOK_METRIC_NAMES.items() if ours in row}}
        path = self.file(name)
        with open(path, "ab+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write((json.dumps(row) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        return row

    def write_json(self, name, obj) -> None:
        """Atomic replace: a kill leaves the old file or the new one, never half of one."""
        path = self.file(name)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(obj, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def write_rows(self, name, rows) -> None:
        """Replace a JSONL file atomically (e.g. a dry run's datums.jsonl); creates the folder."""
        self.path.mkdir(parents=True, exist_ok=True)
        path = self.file(name)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def config(self) -> dict:
        try:
            return json.loads(self.file("config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def holds_run(self) -> bool:
        return any(self.file(n).exists() for n in ("metrics.jsonl", "checkpoints.jsonl"))

    def checkpoints(self) -> list[dict]:
        return [r for r in self.rows("checkpoints.jsonl") if r.get("state_path")]

    def resume_point(self, *, resume: bool, overwrite: bool, dry_run: bool = False) -> dict | None:
        """The checkpoint row --resume continues from (None for a new run). Refuses to mix two runs in
        one folder. Writes nothing."""
        if resume:
            rows = self.checkpoints()
            if not rows:
                raise DataError(f"--resume: no checkpoint in {self.file('checkpoints.jsonl')}; start a new run "
                                "without --resume (add --overwrite to replace what is there)")
            self.began = not dry_run
            return rows[-1]
        if self.holds_run() and not overwrite and not dry_run:
            raise DataError(f"{self.path} already holds a run; pass --resume to continue it or --overwrite to "
                            "replace it (or choose another --log-path)")
        return None

    def check_resume(self, config: dict, keys) -> None:
        """DataError naming every setting in `keys` (and the format) that differs from the saved run.
        config.json is never rewritten on resume: the saved settings stay the record of the run."""
        saved = self.config()
        if not saved:  # a folder holding only checkpoints.jsonl (copied, or written by other tools)
            say(f"warning: --resume: {self.file('config.json')} is missing or unreadable, so the settings of the "
                "saved run cannot be compared with these; continuing from its last checkpoint as asked")
            return
        diffs = [f"--{k.replace('_', '-')} {saved.get(k)!r} -> {config.get(k)!r}"
                 for k in keys if k in saved and saved.get(k) != config.get(k)]
        saved_fmt = dict(saved.get("format") or {})
        if saved_fmt.get("tokenizer"):  # runs recorded before tokenizer folders were made absolute
            saved_fmt["tokenizer"] = tokenizer_record(saved_fmt["tokenizer"])
        if saved_fmt and saved_fmt != config.get("format"):
            diffs.append("format (tokenizer, chat template or --format/--thinking)")
        if diffs:
            raise DataError(f"--resume with different settings than the saved run: {'; '.join(diffs)}; "
                            "resume with the original flags (or start a new --log-path)")

    def begin(self, config: dict) -> None:
        """A new run: the folder's old record removed, config.json written. Call after every check."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.began = True
        for name in self.files:
            self.file(name).unlink(missing_ok=True)
        self.write_json("config.json", {**config, **cookbook_config_fields(config)})

    def rewind(self, name, keep) -> None:
        """Keep only the rows where keep(row): rows past a resumed checkpoint will be produced again."""
        if not self.file(name).exists():
            return
        text = "".join(json.dumps(r) + "\n" for r in self.rows(name) if keep(r))
        tmp = self.file(name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.file(name))

    def checkpoint(self, *, name, step, position: dict, epoch, state_path, sampler_path, fmt, **extra) -> dict:
        """Append the checkpoints.jsonl row of a save whose paths are known; `position` is where a resume
        starts ({"next_batch": n} for SFT, {"next_iteration": n} for RL), so it neither replays nor skips."""
        row = {"name": name, "step": step, **position, "epoch": epoch, "state_path": state_path,
               "sampler_path": sampler_path, "format": fmt, "time": now_iso(), **extra,
               # the cookbook's names: `batch` is where training continues, `final` marks the last save
               "batch": next(iter(position.values())), "final": name == "final"}
        self.append("checkpoints.jsonl", row)
        return row


def cookbook_renderer_name(model_name: str, fmt: dict) -> str | None:
    """The tinker-cookbook renderer name matching how a run renders (None when no family matches)."""
    if (fmt or {}).get("kind") == "raw":
        return "role_colon"
    thinking = bool(((fmt or {}).get("template_kwargs") or {}).get("enable_thinking"))
    for prefix, names in COOKBOOK_RENDERERS:
        if model_name.startswith(prefix):
            return names[thinking]
    return None


def cookbook_config_fields(config: dict) -> dict:
    """config.json keys the cookbook's chz config has and tinkerscope reads (renderer, data file)."""
    renderer = cookbook_renderer_name(config.get("model_name", ""), config.get("format") or {})
    common = {"renderer_name": renderer, "model_name_for_tokenizer": (config.get("format") or {}).get("tokenizer")}
    if "batch_size" in config:
        common["batch_size"] = config["batch_size"]
    return {"renderer_name": renderer,
            "dataset_builder": {"common_config": common, "file_path": config.get("data")}}


# ---- common/service.py ----
# Reaching Tinker: credentials, a fast reachability check, the served-model check, checkpoint paths,
# and the optional cost preflight and per-step cost metering through tinker_pricing.py beside the script.
import contextlib
import importlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit


HOSTED_BASE_URL = "https://tinker.thinkingmachines.dev/services/tinker-prod"  # SDK 0.38 lib/base_url.py
REACH_TIMEOUT_S = 3.0
CAPABILITIES_TIMEOUT_S = 60.0  # once the TCP check passed, a server that never answers still ends
LOCAL_HINT = "for a free rehearsal start the local backend: python scripts/tinker_local.py run -- <this command>"
# A training run whose service refuses TCP connections for this long stops with exit 4, its record saved for
# --resume: the SDK alone retries a lost result forever. TINKER_UNREACHABLE_S changes it (the tests use 3).
UNREACHABLE_S = 600.0


class ServiceLost(AccessError):
    """The service stopped answering for longer than TINKER_UNREACHABLE_S (raised in the main thread)."""


_WATCH = {"active": False, "stop": None, "thread": None, "lost": None}


def _on_service_lost(signum, frame):
    if _WATCH["active"] and _WATCH["lost"]:
        raise ServiceLost(_WATCH["lost"])


@contextlib.contextmanager
def watch_service():
    """The span of a training run in which a lost service ends it: once connect() has reached Tinker, a
    daemon thread opens one TCP connection to it every few seconds, and after TINKER_UNREACHABLE_S (default
    UNREACHABLE_S) without one the main thread gets ServiceLost (exit 4) wherever it waits. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGUSR1, _on_service_lost)
    _WATCH.update(active=True, stop=threading.Event(), thread=None, lost=None)
    try:
        yield
    finally:
        _WATCH["stop"].set()
        _WATCH.update(active=False, thread=None)


def unreachable_limit() -> float:
    try:
        value = float(os.environ.get("TINKER_UNREACHABLE_S") or UNREACHABLE_S)
    except ValueError:
        raise DataError(f"TINKER_UNREACHABLE_S={os.environ['TINKER_UNREACHABLE_S']!r}: expected seconds, e.g. "
                        "600") from None
    return value if value > 0 else UNREACHABLE_S


def _start_watch(url: str) -> None:
    """Called by connect() once the service answered; nothing outside watch_service()."""
    import urllib.request

    parts = urlsplit(url)
    if not _WATCH["active"] or _WATCH["thread"] is not None or not parts.hostname:
        return
    if urllib.request.getproxies().get(parts.scheme) and not urllib.request.proxy_bypass(parts.hostname):
        return  # through an HTTP proxy a TCP connection proves nothing
    address = (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    limit, stop = unreachable_limit(), _WATCH["stop"]
    _WATCH["thread"] = threading.Thread(target=_watch, args=(url, address, limit, stop), daemon=True,
                                        name="tinker-service-watch")
    _WATCH["thread"].start()


def _watch(url, address, limit, stop):
    interval = min(10.0, max(0.2, limit / 6))
    answered = time.monotonic()
    while not stop.wait(interval):
        try:
            socket.create_connection(address, timeout=min(interval, REACH_TIMEOUT_S)).close()
            answered = time.monotonic()
        except OSError:
            if time.monotonic() - answered >= limit and not stop.is_set():
                _WATCH["lost"] = (f"lost Tinker at {url}: no TCP connection for {limit:g} s (TINKER_UNREACHABLE_S "
                                  "sets how long a run waits)")
                os.kill(os.getpid(), signal.SIGUSR1)
                return


def service_url() -> str:
    """Where the SDK will send requests: TINKER_BASE_URL, else hosted Tinker (as the SDK resolves it)."""
    return (os.environ.get("TINKER_BASE_URL") or HOSTED_BASE_URL).rstrip("/")


def check_reachable(url: str | None = None, timeout_s: float = REACH_TIMEOUT_S, setting: str = "TINKER_BASE_URL") -> None:
    """One TCP connection to the service within timeout_s, or AccessError. The SDK retries an unreachable
    first call for minutes; this turns a dead TINKER_BASE_URL into a one-line exit 4 in seconds. Once the
    service has answered, the SDK's own retries handle transient failures. setting: the flag or variable
    that chose url, named in the error."""
    import urllib.request

    url = url or service_url()
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        host, port = None, None
    if not host or parts.scheme not in ("http", "https"):
        raise AccessError(f"{setting} {url!r} is not an http(s) URL; expected e.g. http://127.0.0.1:8000"
                          + ("; unset it to use hosted Tinker" if setting == "TINKER_BASE_URL" else ""))
    if urllib.request.getproxies().get(parts.scheme) and not urllib.request.proxy_bypass(host):
        return  # through a proxy the TCP check proves nothing; the SDK reports the failure
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        if isinstance(e, socket.gaierror):
            reason = f"host {host} does not resolve"
        local = setting == "TINKER_BASE_URL" and os.environ.get("TINKER_BASE_URL")
        hint = LOCAL_HINT if local else "check the network"
        raise AccessError(f"cannot reach Tinker at {url} ({reason}, {host}:{port} within {timeout_s:g} s); "
                          f"{hint}, or fix {setting}") from None


def require_credentials() -> str:
    """The API key (or token) the SDK will send, or AccessError; never prints its value. Imports the SDK
    (seconds on a busy machine) only when TINKER_API_KEY is unset, to look for a stored login."""
    key = os.environ.get("TINKER_API_KEY", "")
    if key and not key.startswith(("tml-", "eyJ")):
        raise AccessError("TINKER_API_KEY does not start with tml-; expected a Tinker API key; copy it again "
                          "from the Tinker console")
    if key:
        return key
    import tinker

    if not tinker.auth.tinker_has_credentials():
        raise AccessError("no Tinker credentials: set TINKER_API_KEY (tml-...), or check for free with --dry-run, "
                          f"or {LOCAL_HINT}")
    return tinker.auth.get_tinker_token() or ""


def rest_client():
    """RestClient for the current environment. Explicit arguments, because RestClient() with none reuses
    the first one made in the process, whatever TINKER_BASE_URL says now."""
    import tinker

    return tinker.RestClient(base_url=os.environ.get("TINKER_BASE_URL") or None,
                             api_key=os.environ.get("TINKER_API_KEY") or None)


def connect(model_name: str | None, *, trainable: bool = True, flag: str = "--model-name"):
    """(ServiceClient, the model's context window) after credentials, reachability and the served-model
    check; AccessError / DataError before any paid call. model_name None (a tinker:// checkpoint is
    sampled): no served-model check, context window None."""
    import difflib

    require_credentials()
    check_reachable()
    import tinker

    _start_watch(service_url())
    if model_name is None:
        return tinker.ServiceClient(), None
    try:
        caps = rest_client().get_server_capabilities().result(timeout=CAPABILITIES_TIMEOUT_S)
    except (tinker.AuthenticationError, tinker.PermissionDeniedError) as e:
        raise AccessError(f"Tinker refused the credentials ({type(e).__name__}); check TINKER_API_KEY") from None
    except (tinker.APIConnectionError, tinker.APITimeoutError, TimeoutError, OSError) as e:
        raise AccessError(f"no answer from {service_url()} ({type(e).__name__}); check the network or "
                          "TINKER_BASE_URL") from None
    models = {m.model_name: m for m in caps.supported_models if m.model_name}
    model = models.get(model_name.split(":", 1)[0]) or models.get(model_name)
    if model is None:
        close = difflib.get_close_matches(model_name, list(models), n=5, cutoff=0.3)
        shown = ", ".join(close + [m for m in sorted(models) if m not in close][: max(0, 12 - len(close))])
        raise DataError(f"unknown model {model_name!r}: this Tinker serves {shown}; pass one with {flag}")
    if trainable and model.trainable is False:
        raise DataError(f"{model_name} is not trainable on this Tinker; pick another {flag}")
    return tinker.ServiceClient(), model.max_context_length


def check_tinker_path(path, need):
    """A tinker:// checkpoint path of the kind `need` ("weights" or "sampler_weights"); DataError otherwise."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights", "external_weights") or not all(parts):
        raise DataError(f"{path!r} is not a checkpoint path; expected tinker://RUN_ID/{need}/NAME")
    if parts[1] != need:
        if need == "weights":
            raise DataError(
                f"{path} is a {parts[1]}/ checkpoint: it cannot seed a training client; give the weights/ "
                "path saved by save_state (state_path in checkpoints.jsonl)")
        raise DataError(
            f"{path} is a {parts[1]}/ checkpoint: a sampler needs a sampler_weights/ path saved by "
            "save_weights_for_sampler (sampler_path in checkpoints.jsonl)")
    return path


def load_pricing():
    """tinker_pricing from beside this script, or None (then no dollar estimate)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        return importlib.import_module("tinker_pricing")
    except ImportError:
        return None


def estimate(model_name, tokens: dict, max_usd, *, label: str, context=None):
    """The pricing estimate dict, or None; BudgetError when --max-usd is exceeded or cannot be proven."""
    pricing = load_pricing()
    if pricing is None:
        note = "no dollar estimate: tinker_pricing.py is not beside this script"
        if max_usd is not None:
            raise BudgetError(f"cannot check --max-usd: {note}; copy it here or drop --max-usd")
        say(note)
        return None
    try:
        return pricing.preflight(model_name, tokens, max_usd, label=label, context=context)
    except pricing.BudgetExceeded as e:
        raise BudgetError(str(e)) from None
    except (pricing.UnknownModelError, ValueError, OverflowError) as e:
        if max_usd is not None:
            raise BudgetError(f"cannot check --max-usd: {e}") from None
        say(f"no dollar estimate: {e}")
        return None


def catalogue_context(model_name):
    """The model's context window from the price catalogue (for --dry-run), or None."""
    pricing = load_pricing()
    try:
        return pricing.resolve_model(model_name).get("context") if pricing else None
    except Exception:
        return None


def estimate_total(est):
    """The dollar total of an estimate() result (or of a bare number) for config.json's estimate_usd; None
    when there is no estimate (tinker_pricing.py absent, model or price unknown)."""
    if isinstance(est, dict):
        est = (est.get("usd") or {}).get("total")
    return est if isinstance(est, (int, float)) and not isinstance(est, bool) else None


def sample_call_tokens(prompt_len, num_samples, sampled, cached_prefix=0) -> dict:
    """What one sample call meters, as tinker_pricing.sample_tokens / rl_tokens count it: the prompt is
    prefilled once (minus a prefix the server saw before, `cached_prefix`), the other num_samples - 1
    copies are cache hits, and every generated token is sampled (`sampled`: their total)."""
    return {"prefill": prompt_len - cached_prefix, "cached_prefill": cached_prefix + (num_samples - 1) * prompt_len,
            "sample": sampled}


def rollout_tokens(groups) -> dict:
    """Sampling tokens of RL groups (objects with .episodes, each with .turns of .observation and .action
    token lists): one call of G for a group's first turn, then one call per later turn whose prompt is a
    cache hit up to what the server last saw of that episode (its previous prompt + sampled action), the
    rest (the new observation) prefilled, as tinker_pricing.rl_tokens assumes."""
    total = {"prefill": 0, "cached_prefill": 0, "sample": 0}
    for group in groups:
        if not group.episodes:
            continue
        calls = [sample_call_tokens(len(group.episodes[0].turns[0].observation), len(group.episodes),
                                    sum(len(e.turns[0].action) for e in group.episodes))]
        for episode in group.episodes:
            for prev, turn in zip(episode.turns, episode.turns[1:]):
                seen = list(prev.observation) + list(prev.action)
                shared = next((i for i, (a, b) in enumerate(zip(seen, turn.observation)) if a != b),
                              min(len(seen), len(turn.observation)))
                calls.append(sample_call_tokens(len(turn.observation), 1, len(turn.action), shared))
        for call in calls:
            for kind, count in call.items():
                total[kind] += count
    return total


class CostMeter:
    """Dollars of the tokens a run actually sends, for its metrics rows (cost/step_usd, cost/cumulative_usd).

    Each step is priced by tinker_pricing.estimate_cost with the catalogue and model row the pre-run
    estimate uses, so the last cost/cumulative_usd compares directly with config.json's estimate_usd:
    equal where the estimate counts exact tokens, below it where the estimate is an upper bound (sampled
    tokens counted at --max-tokens). add() the tokens of a call when it is sent (prefill, cached_prefill,
    sample, train; `model` for another base model, e.g. a teacher); row() prices everything added since
    the last row. --resume: pass the Run after its rewind and the sum continues from the last row kept.
    Without tinker_pricing.py beside the script, or a price for the model, row() returns {} (said once)."""

    FIELDS = ("cost/step_usd", "cost/cumulative_usd")

    def __init__(self, model_name, run=None, *, context=None):
        self.model_name, self.context, self.pending, self.cumulative = model_name, context, {}, 0.0
        self.pricing = load_pricing()
        self.catalogue = self.pricing.load_catalogue()[0] if self.pricing else None
        if self.pricing is None:
            self.off("tinker_pricing.py is not beside this script")
        rows = run.rows("metrics.jsonl") if run is not None else []
        kept = [r["cost/cumulative_usd"] for r in rows if isinstance(r.get("cost/cumulative_usd"), (int, float))]
        self.cumulative = float(kept[-1]) if kept else 0.0
        if rows and not kept and self.pricing is not None:
            say("note: the rows before this --resume carry no cost/cumulative_usd; the sum counts from here")

    def off(self, reason):
        say(f"no cost/step_usd or cost/cumulative_usd in metrics.jsonl: {reason}")
        self.pricing = None

    def add(self, model=None, **tokens):
        pending = self.pending.setdefault(model or self.model_name, {})
        for kind, count in tokens.items():
            pending[kind] = pending.get(kind, 0) + count

    def row(self, **tokens) -> dict:
        """The two cost fields of a metrics row: what was added since the last row plus `tokens`, and the sum."""
        self.add(**tokens)
        pending, self.pending = self.pending, {}
        if self.pricing is None:
            return {}
        step = 0.0
        for model, counts in pending.items():
            try:
                est = self.pricing.estimate_cost(model, context=self.context if model == self.model_name else None,
                                                 rows=self.catalogue, **counts)
            except ValueError as e:  # UnknownModelError is one; so are bad counts
                self.off(str(e))
                return {}
            if est["usd"]["total"] is None:
                self.off(est["warning"])
                return {}
            step += est["usd"]["total"]
        self.cumulative += step
        return {"cost/step_usd": round(step, 10), "cost/cumulative_usd": round(self.cumulative, 10)}
# ==== END SHARED CODE (sha256 8a1799cdb34a) ====


if __name__ == "__main__":
    sys.exit(main())
