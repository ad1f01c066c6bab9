#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "tinker>=0.38,<0.39",
#     "transformers>=4.51",
#     "jinja2>=3.1",
# ]
# ///
"""Base model vs a training run's checkpoint on your held-out file, scored by your score(): side by side.

Run:
    python tinker_eval.py --run runs/my-sft --data heldout.jsonl                 # greedy, as the run's probes
    python tinker_eval.py --run runs/my-sft --data heldout.jsonl --out eval.jsonl --limit 200
    python tinker_eval.py --run runs/my-sft --data heldout.jsonl --dry-run       # prompts and cost; no key
    Free rehearsal: python tinker_local.py run -- python tinker_eval.py --run runs/sft-rehearsal --data ...

What it does:
    Reads the run record (LOG_DIR/config.json and checkpoints.jsonl): the base model, the run's newest
    sampler checkpoint and the format it trained in (chat template, its kwargs and frozen date, stop
    tokens), the system prompt every training example shared, and greedy sampling, as tinker_infer.py
    --run samples. Every held-out example is rendered ONCE, up to its last assistant turn, in that format,
    and the same prompt tokens are sampled from the base model and from the checkpoint (all prompts of
    both submitted before any is awaited). score(example, completion) grades each completion; the table
    shows both scores per example, and the summary the mean of each, their paired difference (checkpoint
    minus base) with its standard error and a 95% interval (mean +- 1.96 SE: a normal approximation,
    optimistic below about 30 examples), wins/ties/losses, and what the sampling cost.

Edit:
    score(example, completion) in the EDIT ME block: your task's metric, a float (higher is better).
    The same convention as tinker_sft.py's score(): `example` is a validated example
    ({"messages": [...]} or {"prompt", "completion"}), `completion` the sampled text, stop token removed.

Outputs:
    stderr: one line per example (base score, checkpoint score, the two completions cut short), then the summary.
    stdout: exactly one JSON object: {"status": "ok", "run", "base_model", "checkpoint", "n", "sampling",
      "base": {"mean"}, "trained": {"mean"}, "difference": {"mean", "stderr", "ci95": [low, high],
      "wins", "ties", "losses"}, "usd", "out"}. --dry-run: {"status": "dry_run", ..., "prompts",
      "estimate_usd"}. On failure: {"status": "error"|"interrupted", "exit_code", "error"}.
    --out FILE.jsonl: one row per example, in file order: {"index", "line", "prompt" or "messages" (as
      sent), "reference", "base": {"text", "score", "stop_reason", "completion_tokens"}, "trained": {...}}.

Requires:
    TINKER_API_KEY (starts with tml-); TINKER_BASE_URL optional (local rehearsals). tinker_pricing.py
    beside this script for dollar figures and --max-usd.
    Exit codes: 0 ok, 1 Tinker or runtime failure, 2 bad input or usage, 3 over --max-usd, 4 no credentials
    or cannot reach Tinker, 130 interrupted, 143 terminated.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import math
import sys
from pathlib import Path

# ==== SETTINGS (defaults; every one is a flag) ====
DEFAULT_MAX_TOKENS = 256
Z95 = 1.96  # the 95% interval of the paired difference: mean +- Z95 * standard error


def parse_args(argv):
    p = Parser(prog="tinker_eval.py", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=__doc__.split("\n\n", 1)[1].split("Edit:")[0])
    p.add_argument("--run", metavar="LOG_DIR", required=True,
                   help="a training run's folder (tinker_sft.py, tinker_rl.py, tinker_dpo.py, tinker_distill.py)")
    p.add_argument("--data", metavar="FILE.jsonl", required=True,
                   help="held-out examples: {\"messages\": [...]} (the last assistant turn is the reference) or "
                        "{\"prompt\", \"completion\"}; never the training file")
    p.add_argument("--checkpoint", metavar="TINKER_PATH",
                   help="another sampler checkpoint of the run (default: its newest, from checkpoints.jsonl)")
    p.add_argument("--limit", type=int, help="only the first N examples")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help=f"default {DEFAULT_MAX_TOKENS}")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the run's probe temperature (greedy, 0); above 0 add --seed")
    p.add_argument("--seed", type=int, help="sampling seed: both models get the same")
    p.add_argument("--system", metavar="TEXT", default=None,
                   help="system prompt (default: the one every training example shared; '' for none)")
    p.add_argument("--tokenizer", metavar="NAME_OR_DIR", help="tokenizer (default: the run record's)")
    p.add_argument("--out", metavar="FILE.jsonl", help="write one row per example (both completions and scores)")
    p.add_argument("--max-usd", type=float, help="refuse to start when the most the sampling can cost is more")
    p.add_argument("--dry-run", action="store_true", help="render the prompts and price the sampling; no key, no call")
    return p.parse_args(argv)


# ==== EDIT ME: score() ====
def score(example, completion):
    """Your task's metric for one completion of one held-out example: a float, higher is better.

    Default: 1.0 when the completion equals the reference answer (the last assistant message, or
    "completion") after stripping whitespace, else 0.0 (as tinker_sft.py's default). Replace it with your
    check: a number parsed from the text, a unit test run, a judge model's grade."""
    return float(completion.strip() == reference_answer(example).strip())
# ==== END EDIT ME ====


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_cli(evaluate_run, argv, error_json=True, interrupted_hint="nothing was written; run the command again")


def evaluate_run(argv) -> int:
    args = parse_args(argv)
    check_numbers(args, {"limit": dict(low=1), "max_tokens": dict(low=1), "temperature": dict(low=0),
                         "max_usd": dict(low=0)})
    if not Path(args.data).is_file():
        raise DataError(f"--data {args.data} not found; expected a held-out JSONL file of {{\"messages\": [...]}} "
                        "or {\"prompt\", \"completion\"} rows")
    examples = normalise_items(read_jsonl(args.data))[: args.limit]
    sampler_path, fmt = run_format(args.run)
    checkpoint = args.checkpoint or sampler_path
    if not checkpoint.startswith("tinker://"):
        raise DataError(f"--checkpoint {checkpoint} is not a tinker:// path; expected "
                        f"tinker://RUN_ID/sampler_weights/NAME; next: "
                        + script_command("tinker_checkpoints.py", "list", "--run", args.run))
    check_sampler_path(checkpoint, "--checkpoint")
    base = Run(args.run).config().get("model_name")
    if not base:
        raise DataError(f"{args.run}/config.json names no model_name; expected the folder a training script wrote")
    temperature, system = run_sampling(args.run, args.temperature, args.system)
    tokenizer = load_sampling_tokenizer(args.tokenizer or fmt.get("tokenizer")) or load_sampling_tokenizer(base)
    check_template(fmt, tokenizer)
    stop_ids = format_stop_ids(fmt, tokenizer)
    sent = [prompt_of(ex, system, fmt) for ex in examples]
    prompts = [generation_prompt(s, tokenizer, fmt, tools=ex.get("tools")) for s, ex in zip(sent, examples)]
    sampling = {"max_tokens": args.max_tokens, "temperature": temperature, "seed": args.seed, "system": system}
    tokens = sum(len(p) for p in prompts)
    est = estimate(base, {"prefill": 2 * tokens, "cached_prefill": 0, "sample": 2 * len(prompts) * args.max_tokens},
                   args.max_usd, label="sampling both models at most (every sample to --max-tokens)")
    head = {"run": args.run, "base_model": base, "checkpoint": checkpoint, "n": len(examples), "sampling": sampling}
    if args.dry_run:
        say(f"{len(examples)} held-out examples, {tokens} prompt tokens; first prompt as rendered:")
        say(tokenizer.decode(prompts[0], skip_special_tokens=False) if prompts else "(none)")
        emit({"status": "dry_run", **head, "format": {**fmt, "stop": stop_ids},
              "prompts": [{"index": i, "prompt_tokens": len(p)} for i, p in enumerate(prompts)],
              "estimate_usd": estimate_total(est)})
        return EXIT_OK
    if args.out:
        check_writable_dir(Path(args.out).parent, "--out's folder")
    service, _ = connect(base, trainable=False, flag="the run's model_name")
    status = "errored"
    try:
        completions = sample_both(service, base, checkpoint, prompts, args, temperature, stop_ids, tokenizer)
        status = "success"
    finally:
        with contextlib.suppress(Exception):  # ends the session at once instead of letting it time out
            service.close(status).result(timeout=30)
    rows = [{"index": i, "line": ex.get("line"), **sent_row(s), "reference": reference_answer(ex),
             **{who: {**c, "score": float(score(ex, c["text"]))} for who, c in zip(("base", "trained"), pair)}}
            for i, (ex, s, pair) in enumerate(zip(examples, sent, zip(*completions)))]
    usd = [price_samples(base, [{"sample_index": 0, "prompt_tokens": len(p), "completion_tokens":
                                 r[who]["completion_tokens"]} for p, r in zip(prompts, rows)])
           for who in ("base", "trained")]
    result = {"status": "ok", **head, **summary(rows),
              "usd": None if None in usd else round(sum(usd), 6), "out": args.out}
    show(rows, result)
    if args.out:
        write_jsonl(args.out, rows)
        say(f"wrote {args.out} ({len(rows)} rows)")
    emit(result)
    return EXIT_OK


def prompt_of(example, system, fmt):
    """What the models are given: the conversation up to its last assistant turn (with the run's system
    prompt first when it has none), or the prompt string."""
    if "messages" not in example:
        return example["prompt"]
    msgs = example["messages"]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    msgs = msgs[:last]
    if system and fmt["kind"] == "chat" and msgs[0]["role"] != "system":
        msgs = [{"role": "system", "content": system}, *msgs]
    return msgs


def sent_row(sent):
    return {"prompt": sent} if isinstance(sent, str) else {"messages": sent}


def sample_both(service, base, checkpoint, prompts, args, temperature, stop_ids, tokenizer):
    """([base completions], [checkpoint completions]), each {"text", "stop_reason", "completion_tokens"}; both
    models' prompts are all in flight before any answer is awaited."""
    import tinker

    params = tinker.SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=args.seed,
                                   stop=sampling_stop(stop_ids, [], tokenizer))
    clients = [sampling_client(service, base), sampling_client(service, checkpoint)]
    say(f"sampling {len(prompts)} prompts from {base} and from {checkpoint} ...")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda cm: sample_prompts(cm[0], prompts, params, 1, cm[1]),
                                zip(clients, (base, checkpoint))))
    return [[{"text": decode_completion(list(seqs[0].tokens), tokenizer, stop_ids, []),
              "stop_reason": seqs[0].stop_reason, "completion_tokens": len(seqs[0].tokens)} for seqs in per_model]
            for per_model in answers]


def summary(rows):
    """Both means and the paired difference (trained - base): mean, standard error, 95% interval, wins/ties/losses."""
    n = len(rows)
    diffs = [r["trained"]["score"] - r["base"]["score"] for r in rows]
    mean = sum(diffs) / n if n else 0.0
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    se = sd / math.sqrt(n) if n else 0.0
    return {"base": {"mean": sum(r["base"]["score"] for r in rows) / n if n else None},
            "trained": {"mean": sum(r["trained"]["score"] for r in rows) / n if n else None},
            "difference": {"mean": mean, "stderr": se, "ci95": [mean - Z95 * se, mean + Z95 * se],
                           "wins": sum(d > 0 for d in diffs), "ties": sum(d == 0 for d in diffs),
                           "losses": sum(d < 0 for d in diffs)}}


def show(rows, result):
    def cut(text):
        text = " ".join(text.split())
        return text if len(text) <= 40 else text[:37] + "..."

    say(f"{'#':>4}  {'base':>6}  {'trained':>7}  base completion | trained completion")
    for r in rows:
        say(f"{r['index']:>4}  {r['base']['score']:>6.3f}  {r['trained']['score']:>7.3f}  "
            f"{cut(r['base']['text'])!r} | {cut(r['trained']['text'])!r}")
    d = result["difference"]
    cost = f"${result['usd']:.4f}" if result["usd"] is not None else "unknown (tinker_pricing.py is not beside this script)"
    say(f"base {result['base']['mean']:.3f}  trained {result['trained']['mean']:.3f}  difference {d['mean']:+.3f} "
        f"(SE {d['stderr']:.3f}; 95% {d['ci95'][0]:+.3f} to {d['ci95'][1]:+.3f}; {d['wins']} wins, {d['ties']} ties, "
        f"{d['losses']} losses over {result['n']} examples); sampling cost {cost}")


# ==== SHARED CODE (generated from common/: rehearsal, errors, flags, render, run_files, data, run_record, service, checkpoints, sampling) ====
# Edit the files in common/ of the tinker-training-inference bundle, then run `python tools/splice.py`;
# tests/test_shared_code.py fails when this copy differs from its source. Only the definitions the code
# above uses (directly or through each other) are copied.


# ---- common/rehearsal.py ----
# The free rehearsal (--rehearse) on the local backend: which model stands in, each script's preset for it, and the
# shape of the rehearsal's checks.
#
# `tinker_local.py run` exports TINKER_LOCAL_STAND_IN, the model standing in for the named one:
# - the tiny random Qwen3 (default): the named model's exact tokenizer and chat template, so masks, token counts and
#   datums are Qwen3's; it memorises a few short answers and nothing more;
# - SmolLM2-135M-Instruct (`tinker_local.py run --real`): a real, weak instruct model with its own tokenizer and ChatML
#   template; it follows a prompt, learns a user's answers, earns a user's reward and calls a tool after a warm-up.
# Each preset below was measured on its model (references/setup.md, "Which model to rehearse on").
import os
from urllib.parse import urlsplit

STAND_IN_ENV = "TINKER_LOCAL_STAND_IN"
TINY_STAND_IN = "tiny-qwen3"


def stand_in() -> str | None:
    """The model standing in on the local backend (from the launcher), or None (Tinker, or an unknown server)."""
    return os.environ.get(STAND_IN_ENV) or None


def real_stand_in() -> bool:
    """True when a real model (`tinker_local.py run --real`) stands in: the rehearsal judges the user's task."""
    return stand_in() not in (None, TINY_STAND_IN)


def on_local_backend() -> bool:
    """TINKER_BASE_URL points at this machine: the local backend (scripts/tinker_local.py), not Tinker."""
    return urlsplit(os.environ.get("TINKER_BASE_URL") or "").hostname in ("127.0.0.1", "localhost", "::1")


def backend_record() -> dict:
    """What config.json says about where a run trained: {"kind": "local"|"tinker", "stand_in", "stand_in_kind"}.
    A loopback TINKER_BASE_URL without the launcher's variable is local with an unknown stand-in."""
    name = stand_in()
    local = name is not None or on_local_backend()
    return {"kind": "local" if local else "tinker", "stand_in": name,
            "stand_in_kind": None if name is None else "real" if real_stand_in() else "tiny"}


# ---- common/errors.py ----
# Errors and exit codes: every script fails with one line on stderr and a documented exit code.
import argparse
import atexit
import json
import os
import signal
import sys
from pathlib import Path


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

# ---- next commands: printed as the user can run them, from where they stand

LOCAL_HINT = "for a free rehearsal start the local backend:"


def short_path(path) -> str:
    """A path to type from the working directory: relative when it climbs at most one folder, else absolute."""
    path = Path(path).resolve()
    rel = os.path.relpath(path)
    return rel if not rel.startswith(os.path.join("..", "..")) else str(path)


def sibling_script(name: str) -> str | None:
    """The path to type, from where the user stands, for `name` (another script of this bundle) beside this
    script; None when it is not beside it. Built on the script's path as the user typed it (sys.argv[0]), so a
    script copied into a project names its neighbours there, not the bundle's scripts/ folder."""
    here = Path(__file__).resolve()
    if not (here.parent / name).exists():
        return None
    folder = script_folder()
    return os.path.join(folder, name) if folder not in ("", ".") else name


def local_launcher() -> str | None:
    """The path to type for tinker_local.py: the one that started the local backend this script talks to
    (TINKER_LOCAL_LAUNCHER, set by `tinker_local.py run|serve`), else one beside this script, else None."""
    launcher = os.environ.get("TINKER_LOCAL_LAUNCHER")
    if launcher and Path(launcher).exists():
        return short_path(launcher)
    return sibling_script("tinker_local.py")


def python_command(script, *args) -> str:
    """The shell command that runs `script` (a path) with `args` under the interpreter running this script
    (sys.executable), shell-quoted: it works as printed with no venv activated, where a bare `python` may be
    another interpreter without the SDK (No module named 'tinker')."""
    import shlex

    return shlex.join([sys.executable or "python3", str(script), *map(str, args)])


def script_command(name: str, *args, server: bool = True) -> str:
    """The command that runs `name` (a bundle script) with ARGS: this interpreter, and the script beside this one,
    else beside the local backend's launcher (the bundle's scripts/), else where it belongs beside this one (copy
    it there from the bundle's scripts/ folder). On the local backend it is wrapped in `tinker_local.py run --`,
    which reaches the same checkpoint store, unless server=False (a command that never calls Tinker, e.g.
    `tinker_pricing.py list`)."""
    path = sibling_script(name)
    launcher = local_launcher()
    if path is None and launcher and (Path(launcher).parent / name).exists():
        path = os.path.join(os.path.dirname(launcher), name)
    command = python_command(path or os.path.join(script_folder(), name), *args)
    return under_launcher(command) if server else command


def under_launcher(command: str) -> str:
    """`command` wrapped in `tinker_local.py run [--real] --` when this script runs under the launcher: the
    same model stands in again and the same checkpoint store answers."""
    launcher = local_launcher()
    if launcher and os.environ.get("TINKER_LOCAL_LAUNCHER"):
        return f"{python_command(launcher, 'run', *(['--real'] if real_stand_in() else []), '--')} {command}"
    return command


def script_folder() -> str:
    """This script's folder as the user typed it (sys.argv[0]), else as a path to type from here."""
    here = Path(__file__).resolve()
    typed = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return os.path.dirname(typed) if typed and Path(typed).resolve() == here else short_path(here.parent)


def this_command(argv=None) -> str:
    """The command line that started this script (or `argv`, an edited copy of it), as the user typed it, under
    this interpreter."""
    argv = sys.argv if argv is None else argv
    return python_command(*argv) if argv and argv[0].endswith(".py") else "<this command>"


def local_hint() -> str:
    """How to rehearse this very command for free: wrapped in the local backend's launcher. A script copied
    without tinker_local.py says so, and names the command that works once the launcher is copied beside it."""
    launcher = local_launcher()
    if launcher is None:
        folder = script_folder()
        return (f"{LOCAL_HINT} tinker_local.py is not beside this script; copy tinker_local.py and "
                f"tinker_local_server.py from the tinker-training-inference bundle's scripts/ folder into "
                f"{os.path.abspath(folder or '.')}, then run "
                f"{python_command(os.path.join(folder, 'tinker_local.py'), 'run', '--')} {this_command()}")
    return f"{LOCAL_HINT} {python_command(launcher, 'run', '--')} {this_command()}"


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


def teardown_can_abort() -> bool:
    """Whether interpreter teardown can abort this process: the SDK's HTTP transport (pyqwest) is loaded and
    CPython is older than 3.14 (see exit_process)."""
    return "pyqwest" in sys.modules and sys.version_info < (3, 14)


def exit_process(code: int | None):
    """End the script with `code`: sys.exit, except when the SDK's HTTP transport is loaded on CPython < 3.14,
    where the atexit handlers run, stdout and stderr are flushed and the process ends without interpreter
    teardown (os._exit). Why: tinker 0.38 sends its requests through pyqwest, whose Rust threads hand each
    response chunk to Python; one that lands while CPython < 3.14 tears the interpreter down makes glibc abort
    the process (exit 134, -6 from subprocess, nothing on stderr) after all the work is done and reported
    [pyqwest issue 164, PyO3 issue 6084]. A Ctrl-C during a request or a heartbeat in flight at the end
    hits it; seen in 2 of 1,127 test runs."""
    if not teardown_can_abort():
        sys.exit(code)
    if code is not None and not isinstance(code, int):  # as sys.exit("message") does: the message, then 1
        print(code, file=sys.stderr)
    try:
        atexit._run_exitfuncs()  # logging.shutdown and every other atexit handler, as a normal exit would
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0 if code is None else code if isinstance(code, int) else EXIT_FAILURE)


class Parser(argparse.ArgumentParser):
    """argparse whose usage error is one line naming --help (exit 2), not the usage block."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"error: {self.prog}: {message}; see {self.prog} --help\n")


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
import json
import os


FROZEN_DATE = "2024-07-26"  # every datum renders the same on every day, so resume is exact
FROZEN_DATE_STRING = "26 Jul 2024"  # Llama 3.x templates print this when given


def has_reasoning(message):
    return bool((message.get("reasoning_content") or "").strip()) or "<think>" in message.get("content", "")


def tokenizer_record(name_or_path: str) -> str:
    """An existing folder as an absolute path, so tinker_infer.py --run finds it from any directory;
    a hub name unchanged."""
    return os.path.abspath(name_or_path) if os.path.isdir(name_or_path) else name_or_path


def load_tokenizer(name_or_path: str, flag: str = "--tokenizer"):
    """A local folder loads as is; a Tinker model id follows the SDK's get_tokenizer name rules. `flag` is
    the option the user passes a tokenizer with (tinker_distill.py's teacher: --teacher-tokenizer).

    The Hugging Face cache is tried first with no network; then the hub once, only if one short connection
    to it succeeds: without that probe an offline machine spends ~50 s in huggingface_hub's retries."""
    # The install leaves torch out on purpose (tokenizers need none), so transformers' import-time advice
    # "PyTorch was not found. Models won't be available..." is noise; transformers' own switch for its advisory
    # warnings (logger.warning_advice) silences it, unless the user set it.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    if os.path.isdir(name_or_path):
        return AutoTokenizer.from_pretrained(name_or_path)
    if name_or_path.startswith((".", "/", "~")):  # a folder, not a hub name: no cache or hub to try
        raise DataError(f"tokenizer folder {name_or_path} does not exist; pass {flag} PATH (a folder with "
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
    next_step = (f"; pass {flag} PATH (a folder with tokenizer.json), or download it once and run with "
                 "HF_HUB_OFFLINE=1")
    launcher, command = local_launcher(), this_command()
    # The local backend resolves the name it serves offline (not a name the SDK maps to another repository).
    if launcher and not command.startswith("<") and name == name_or_path.split(":", 1)[0]:
        next_step += (f"; or, for a rehearsal, run it under the local backend, which serves {name} offline: "
                      f"{python_command(launcher, 'run', '--model', name, '--')} {command}")
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


# ---- common/data.py ----
# Reading and validating conversation data (JSONL of {"messages"} or {"prompt", "completion"}).
import json
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
    """Validated examples from load_dataset()'s items: dicts or (where, dict) pairs. With a `source` (a
    --test-data file, a built-in set) an example's "line" stays its line number (an int, as in datums.jsonl and
    eval.jsonl) and "source" names the file for messages (render.example_where)."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2:
            where, obj = item
        else:
            where, obj = i + 1, item
        example = validate(obj, where if source is None else f"{where} of {source}")
        if source is not None and isinstance(where, int):
            example.update(line=where, source=str(source))
        out.append(example)
    return out


def reference_answer(example):
    """The answer a held-out example expects: its last assistant message, or its "completion"."""
    if "messages" in example:
        return [m for m in example["messages"] if m["role"] == "assistant"][-1]["content"]
    return example["completion"]


# ---- common/run_record.py ----
# The run record: every read and write of a run's log folder (DEVELOPING.md, "Run record").
#
# Nothing is lost on a crash: rows are appended and fsynced one at a time, config.json is replaced
# atomically, a torn last line (a kill mid-write) is ignored when read, and nothing in the folder
# changes until every check that can refuse the run (flags, data, budget) has passed.
import json
import math
import os
import sys
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


class NonFiniteError(ScriptError):
    """A loss, KL or reward that is NaN or inf: what follows it would train on garbage (exit 1)."""


def non_finite(row: dict) -> dict:
    """The numeric values of a metrics row (one level of nesting, as "outer/inner") that are NaN or inf."""
    bad = {}
    for key, value in row.items():
        if isinstance(value, dict):
            bad.update({f"{key}/{k}": v for k, v in non_finite(value).items()})
        elif isinstance(value, float) and not math.isfinite(value):
            bad[key] = value
    return bad


def edited_command(sets: dict, drop=()) -> str:
    """This script's command line with each flag in `sets` given that value in place (None: a bare flag), added
    at the end when absent, and the flags in `drop` (bare flags) removed: a command to paste after a failure."""
    argv, out, i, todo = list(sys.argv), [], 1, dict(sets)
    while i < len(argv):
        flag, eq, _ = argv[i].partition("=")
        if flag in drop or flag in sets:
            takes_value = not eq and flag not in drop and sets.get(flag) is not None
            i += 2 if takes_value and i + 1 < len(argv) else 1
            if flag in todo:
                value = todo.pop(flag)
                out += [flag] if value is None else [flag, str(value)]
            continue
        out.append(argv[i])
        i += 1
    for flag, value in todo.items():
        out += [flag] if value is None else [flag, str(value)]
    return under_launcher(this_command([argv[0], *out]))


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# Settings a flag turns off: config.json keeps the setting (train_unembed: false), the user types the flag.
OFF_FLAGS = {"train_unembed": "--no-train-unembed"}


def resume_diff(key: str, saved, now) -> str:
    """One setting that differs on --resume, named as the user types it."""
    if key in OFF_FLAGS:
        given = {False: "given"}  # the setting is off only when the flag was given
        return f"{OFF_FLAGS[key]} {given.get(saved, 'not given')} -> {given.get(now, 'not given')}"
    return f"--{key.replace('_', '-')} {saved!r} -> {now!r}"


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
        bad = non_finite(row) if name == "metrics.jsonl" else {}
        if name == "metrics.jsonl":
            row = {**row, **{theirs: row[ours] for ours, theirs in COOKBOOK_METRIC_NAMES.items() if ours in row}}
            if bad:  # JSON has no NaN: the row stays valid JSON and says which values were not finite
                row = {k: (None if k in bad or COOKBOOK_METRIC_NAMES.get(k) in bad else v) for k, v in row.items()}
                row.update({theirs: None for ours, theirs in COOKBOOK_METRIC_NAMES.items() if ours in bad})
                row["non_finite"] = {k: repr(v) for k, v in bad.items()}
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
        if bad:
            raise NonFiniteError(self.diverged_message(row, bad))
        return row

    def diverged_message(self, row: dict, bad: dict) -> str:
        """Why a run stopped on a NaN or inf metric: which values, the likely cause, where to continue from."""
        where = next((f"{k} {row[k]}" for k in ("step", "iteration") if k in row), "the last row")
        values = ", ".join(f"{k} = {v!r}" for k, v in bad.items())
        config = self.config()
        lr = config.get("learning_rate")
        # (a reward that is not finite is refused where it is returned: checked_reward, before any training)
        cause = ("the learning rate is the usual cause" + (f" (--learning-rate {lr:g} on {config.get('model_name')})"
                                                            if isinstance(lr, (int, float)) else ""))
        lower = {"--learning-rate": f"{lr / 4:g}"} if isinstance(lr, (int, float)) else {}
        # A checkpoint is sound when a finite row evaluated its weights: the row at step s+1 (SFT, DPO) or
        # iteration s (RL, distillation) was computed with the weights after s optimizer steps.
        evaluated = row["step"] - 1 if "step" in row else row.get("iteration", 0)
        ckpt = [c for c in self.checkpoints() if (c.get("step") or 0) < evaluated]
        if ckpt:
            new_log = f"{self.path}-lr{lower.get('--learning-rate', 'lower')}"
            again = edited_command({**lower, "--init-from": ckpt[-1]["state_path"], "--log-path": new_log},
                                   drop=("--resume", "--overwrite"))
            resume = (f"the last sound checkpoint is {ckpt[-1].get('name')} ({ckpt[-1]['state_path']}): continue "
                      f"from it at a lower rate in a new folder: {again} (--resume would repeat the same settings)")
        else:
            again = edited_command({**lower, "--overwrite": None}, drop=("--resume",))
            resume = f"no checkpoint was saved before it (nothing sound to --resume from): start again: {again}"
        return (f"training diverged at {where}: {values} (metrics.jsonl in {self.path}, the run stops here, "
                f"exit 1, no later checkpoint is saved); {cause}; {resume}")

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
        diffs = [resume_diff(k, saved.get(k), config.get(k)) for k in keys if k in saved and saved.get(k) != config.get(k)]
        saved_fmt = dict(saved.get("format") or {})
        if saved_fmt.get("tokenizer"):  # runs recorded before tokenizer folders were made absolute
            saved_fmt["tokenizer"] = tokenizer_record(saved_fmt["tokenizer"])
        if saved_fmt and saved_fmt != config.get("format"):
            diffs.append("format (tokenizer, chat template or --format/--thinking)")
        trained_on, now = (saved.get("backend") or {}).get("stand_in"), backend_record()
        here = now["stand_in"]
        # unknown: a local server started without the launcher, or no service at all (a --dry-run with no key)
        known = here is not None or (now["kind"] == "tinker" and bool(os.environ.get("TINKER_API_KEY")))
        if saved.get("backend") and known and trained_on != here:  # a checkpoint of one model restored into another
            diffs.append(f"the model standing in ({trained_on or 'Tinker itself'} -> {here or 'Tinker itself'}: resume "
                         "under the launcher it trained with, `tinker_local.py run" +
                         (" --real" if (saved["backend"].get("stand_in_kind") == "real") else "") + " -- ...`)")
        if diffs:
            raise DataError(f"--resume with different settings than the saved run: {'; '.join(diffs)}; "
                            "resume with the original flags (or start a new --log-path)")

    def begin(self, config: dict) -> None:
        """A new run: the folder's old record removed, config.json written. Call after every check."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.began = True
        for name in self.files:
            self.file(name).unlink(missing_ok=True)
        self.write_json("config.json", {**config, "backend": backend_record(), **cookbook_config_fields(config)})

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
# A training run whose service refuses TCP connections for this long stops with exit 4, its record saved for
# --resume: the SDK alone retries a lost result forever. TINKER_UNREACHABLE_S changes it (the tests use 3).
UNREACHABLE_S = 600.0


_WATCH = {"active": False, "stop": None, "thread": None, "lost": None}


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
        hint = local_hint() if local else "check the network"
        raise AccessError(f"cannot reach Tinker at {url} ({reason}, {host}:{port} within {timeout_s:g} s); "
                          f"{hint}, or fix {setting}") from None


def require_credentials(dry_run_hint: bool = True) -> str:
    """The API key (or token) the SDK will send, or AccessError; never prints its value. Imports the SDK
    (seconds on a busy machine) only when TINKER_API_KEY is unset, to look for a stored login.
    dry_run_hint: the script has --dry-run, so the error may offer it."""
    key = os.environ.get("TINKER_API_KEY", "")
    if key and not key.startswith(("tml-", "eyJ")):
        raise AccessError("TINKER_API_KEY does not start with tml-; expected a Tinker API key; copy it again "
                          "from the Tinker console")
    if key:
        return key
    import tinker

    if not tinker.auth.tinker_has_credentials():
        raise AccessError("no Tinker credentials: set TINKER_API_KEY (tml-...), "
                          + ("or check for free with --dry-run, " if dry_run_hint else "") + f"or {local_hint()}")
    return tinker.auth.get_tinker_token() or ""


def rest_client():
    """RestClient for the current environment. Explicit arguments, because RestClient() with none reuses
    the first one made in the process, whatever TINKER_BASE_URL says now."""
    import tinker

    return tinker.RestClient(base_url=os.environ.get("TINKER_BASE_URL") or None,
                             api_key=os.environ.get("TINKER_API_KEY") or None)


def connect(model_name: str | None, *, trainable: bool = True, flag: str = "--model-name", dry_run_hint: bool = True):
    """(ServiceClient, the model's context window) after credentials, reachability and the served-model
    check; AccessError / DataError before any paid call. model_name None (a tinker:// checkpoint is
    sampled): no served-model check, context window None."""
    import difflib

    require_credentials(dry_run_hint)
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
        pricing = load_pricing()
        retired = getattr(pricing, "retired_note", lambda _: None)(model_name) if pricing else None
        retired = f"{retired}; " if retired else ""
        raise DataError(f"unknown model {model_name!r}: {retired}this Tinker serves {shown}; pass one with {flag}")
    if trainable and model.trainable is False:
        raise DataError(f"{model_name} is not trainable on this Tinker; pick another {flag}")
    return tinker.ServiceClient(), model.max_context_length


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
        # A dry run refuses --max-usd exactly as the real run does: a dry run that passes is an audit.
        if max_usd is not None:
            raise BudgetError(f"cannot check --max-usd: tinker_pricing.py (the prices) is not beside this script; "
                              f"{copy_pricing_command()}, or drop --max-usd")
        say("no dollar estimate: tinker_pricing.py is not beside this script")
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


def copy_pricing_command() -> str:
    """How to put the prices beside this script: a `cp` from the bundle when the local backend's launcher
    shows where the bundle is, else the words."""
    import shlex

    here = str(Path(__file__).resolve().parent)
    launcher = local_launcher()
    if launcher and (Path(launcher).parent / "tinker_pricing.py").exists():
        return f"copy it: cp {shlex.quote(os.path.join(os.path.dirname(launcher), 'tinker_pricing.py'))} {shlex.quote(here)}"
    return f"copy the bundle's scripts/tinker_pricing.py into {here}"


def estimate_total(est):
    """The dollar total of an estimate() result (or of a bare number) for config.json's estimate_usd; None
    when there is no estimate (tinker_pricing.py absent, model or price unknown)."""
    if isinstance(est, dict):
        est = (est.get("usd") or {}).get("total")
    return est if isinstance(est, (int, float)) and not isinstance(est, bool) else None


# ---- common/checkpoints.py ----
# Checkpoints by path and by run: tinker:// paths, the server's listing of one run, the run record's checkpoint
# rows, and an SDK failure about a checkpoint as one line with the command that shows what exists.
import os
from pathlib import Path


CHECKPOINT_SEGMENTS = ("weights", "sampler_weights", "external_weights")


def parse_tinker_path(path: str) -> tuple[str, str, str] | None:
    """tinker://RUN/SEGMENT/NAME -> (run, segment, name); None if not a tinker path; DataError if malformed."""
    if not path.startswith("tinker://"):
        return None
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in CHECKPOINT_SEGMENTS or not all(parts):
        raise DataError(f"{path} is not a checkpoint path; expected tinker://RUN_ID/sampler_weights/NAME "
                        "(or weights/, external_weights/); next: " + script_command("tinker_checkpoints.py", "list"))
    return parts[0], parts[1], parts[2]


def run_checkpoints(run_id: str) -> list:
    """The server's checkpoints of one run, newest first ([] if it cannot list them: only ever a hint)."""
    try:
        # Never wait long for a hint (the SDK retries a dead server for minutes).
        require_credentials(dry_run_hint=False)
        check_reachable()
        listing = rest_client().list_checkpoints(run_id).result(timeout=20)
    except Exception:
        return []
    return sorted(listing.checkpoints, key=lambda c: c.time, reverse=True)


def check_sampler_path(path: str, flag: str = "--model") -> None:
    """A weights/ or external_weights/ path cannot be sampled: DataError naming the path that can, as this
    command with `flag` (the flag that gave `path`) set to it."""
    run, segment, name = parse_tinker_path(path)
    if segment == "sampler_weights":
        return
    samplers = [c.tinker_path for c in run_checkpoints(run) if c.checkpoint_type == "sampler"]
    same_name = f"tinker://{run}/sampler_weights/{name}"
    if same_name in samplers:
        hint = f"sample the same run's sampler path {same_name}; next: {edited_command({flag: same_name})}"
    elif samplers:
        hint = f"this run's newest sampler path is {samplers[0]}; next: {edited_command({flag: samplers[0]})}"
    else:
        hint = ("save one with training_client.save_weights_for_sampler(name) and pass its "
                "tinker://.../sampler_weights/... path")
    kind = "resumable training state (save_state)" if segment == "weights" else "an export for download"
    raise DataError(f"{path} is {kind}, which cannot be sampled; sampling needs a sampler_weights/ path; {hint}")


def tinker_failure(e: Exception, what: str, model: str | None = None) -> ScriptError:
    """An SDK exception as a one-line error with its exit code and the next step (model: the base model or
    tinker:// path the call was about, named in the message)."""
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
                           f"next: sample a sampler_weights/ checkpoint of it ({script_command('tinker_checkpoints.py', 'list')}), "
                           "or restore its last save_state path")
    if isinstance(e, tinker.NotFoundError) or "not found" in lowered or "expired" in lowered:
        run = parse_tinker_path(model)[0] if model and model.startswith("tinker://") else None
        hint = script_command("tinker_checkpoints.py", "list", *(["--run", run] if run else []))
        if os.environ.get("TINKER_LOCAL_LAUNCHER"):  # the local backend: what keeps a checkpoint there
            hint += (" (local backend: checkpoints stay in the store of its cache folder for "
                     "30 days, the oldest pruned beyond 2 GB; a server started with --run-dir sees only that "
                     "folder's; `tinker_local.py prune --all` deletes them)")
        return DataError(f"{what}: {model or 'the checkpoint'} is unknown or expired ({message}); next: {hint}")
    if isinstance(e, (tinker.BadRequestError, tinker.UnprocessableEntityError)):
        return DataError(f"{what}: the server rejected the request ({message})")
    if isinstance(e, tinker.RequestFailedError) and str(getattr(e, "category", "")).lower().endswith("user"):
        return DataError(f"{what}: the server rejected the request ({message})")
    return ScriptError(f"{what} failed: {message}")


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
    """The newest run-record row with a path of `kind` ("sampler": sampler_path, "state": state_path)."""
    key = "sampler_path" if kind == "sampler" else "state_path"
    for row in reversed(rows):
        if row.get(key):
            return row
    other = "state" if kind == "sampler" else "sampler"
    raise DataError(f"{where} records no {key}; it has only {other} checkpoints; next: "
                    + script_command("tinker_checkpoints.py", "resolve", where, "--kind", other))


# ---- common/sampling.py ----
# Sampling a base model or a training run as it was trained: the run's recorded format, system prompt and greedy
# default, the tokenizer that renders and decodes, stop tokens, the sampling client, every prompt submitted before
# any is awaited, completions as text, the result rows (--out) and the dollar estimate of what was sampled.
import json
import os
from pathlib import Path


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


def write_jsonl(out: str, rows: list[dict]) -> None:
    """One JSON line per row, written beside `out` and renamed into place: never half-written."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    partial = Path(f"{out}.partial")
    with open(partial, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(partial, out)
# ==== END SHARED CODE (sha256 e60ce0ff7116) ====


if __name__ == "__main__":
    exit_process(main())
