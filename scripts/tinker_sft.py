#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "tinker>=0.38,<0.39",
#     "transformers",
#     "jinja2>=3.1.6",  # transformers renders chat templates with jinja2 but does not declare it
#     "rich",
# ]
# ///
"""Supervised LoRA fine-tuning on Tinker: rendered by the model's own chat template, audited, resumable.

Run:
    # audit for free (no Tinker call): renders, masks, counts tokens, estimates the cost
    uv run tinker_sft.py --data sft_example.jsonl --dry-run    # offline: add --tokenizer DIR (a saved tokenizer)
    # train: aim for about 100 steps or more (1,000 examples at the default --batch-size 32 make 31 an
    # epoch, so --epochs 3); with fewer, the dry run prints --batch-size/--epochs values that reach it
    uv run tinker_sft.py --data my_data.jsonl --epochs 3 --model-name Qwen/Qwen3-8B --log-path runs/sft1 --max-usd 5
    # free rehearsal on the local backend: the tiny model memorises the built-in set, then checks it
    python tinker_local.py run -- python tinker_sft.py --rehearse --overwrite
    # ... or rehearse your own data: masks, datums, checkpoints, sampling and a falling training loss
    python tinker_local.py run -- python tinker_sft.py --rehearse --data my_data.jsonl --log-path runs/rehearsal

Edit:
    load_dataset(path) -> list of examples, each {"messages": [{"role", "content"}, ...]} or
    {"prompt": str, "completion": str} (a (line, example) pair is also accepted so errors name the
    line). The default reads JSONL in either shape. score(example, completion) -> float in [0, 1]: the
    task metric --eval-every reports on held-out prompts (default: exact match after stripping).
    Nothing else needs editing for the common case.

Outputs:
    LOG/config.json       every setting (never the API key) and the "format" used to render
    LOG/metrics.jsonl     one row per step: loss (NLL per trained token), learning_rate, tokens, seconds
                          (+ eval_nll, eval_score on --eval-every steps)
    LOG/checkpoints.jsonl one row per save: step, next_batch, epoch, state_path, sampler_path, format
    LOG/eval.jsonl        held-out NLL and scored greedy samples before, every --eval-every steps and
                          after; probe samples before/after
    LOG/datums.jsonl      (--dry-run) per datum: token ids, weights, decoded text of each weighted span
    stdout                one JSON object: status, log_path, steps, state_path, sampler_path,
                          eval {nll_before, nll_after, probes}, score, tokens, format, sampling, cost
                          (+ rehearsal {passed, checks} with --rehearse)

Requires:
    TINKER_API_KEY (not for --dry-run); TINKER_BASE_URL to point at a local rehearsal backend
    (scripts/tinker_local.py). --tokenizer PATH, or HF_HUB_OFFLINE=1 with a warm cache, to run offline.

Exit codes: 0 ok, 1 Tinker or runtime failure (or a --rehearse check failed), 2 bad input or usage
(data, flags, unknown model, context overflow, no checkpoint to resume), 3 cost estimate above
--max-usd, 4 no credentials or Tinker unreachable, 130 interrupted / 143 terminated (resume with --resume).

Loss: every datum's weights are 1/(its trained tokens), so the summed loss is the mean over datums of
each datum's mean NLL (the cookbook default since its issue 271: long answers do not dominate a batch).
The logged "loss" is the plain NLL per trained token of the batch, comparable across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "Qwen/Qwen3-8B"
DEFAULT_RENDER_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "tinker-training-inference", "rendered")
# Settings that must match for --resume to continue the same run exactly.
RESUME_KEYS = ("model_name", "data", "test_data", "test_fraction", "train_on", "batch_size", "epochs",
               "max_steps", "seed", "learning_rate", "lr_schedule", "warmup_steps", "lora_rank", "train_unembed",
               "max_length", "drop_long", "truncate", "init_from")

# --rehearse: the settings of SFT_REHEARSAL (in the shared code below: one for the local backend's tiny model, one
# for the real model of `tinker_local.py run --real`; figures measured on each). It trains on REHEARSAL_TRAIN
# (below) unless --data is given.
# The default held-out split (--test-fraction 0.1) stops at this many examples: its forward pass runs before
# and after training (and every --eval-every steps), and at 50,000 conversations 10% cost a sixth of the run.
MAX_HELD_OUT = 500


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(
        description="Supervised LoRA fine-tuning on Tinker (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # data
    p.add_argument("--data", help="training JSONL: {'messages': [...]} or {'prompt', 'completion'} per line "
                                  "(--dry-run and --rehearse without it: the built-in rehearsal set)")
    p.add_argument("--test-data", help="held-out JSONL; default: a --test-fraction split of --data")
    p.add_argument("--test-fraction", type=float, default=None,
                   help=f"held-out share when no --test-data (default 0.1, at most {MAX_HELD_OUT} examples)")
    p.add_argument("--train-on", choices=["last-assistant", "all-assistant"], default="last-assistant")
    p.add_argument("--format", choices=["auto", "chat", "raw"], default="auto",
                   help="chat: the tokenizer's chat template; raw: text + explicit EOS (base models); "
                        "auto: raw for *-Base models or tokenizers without a template, else chat")
    p.add_argument("--thinking", action="store_true",
                   help="render prompts with thinking on (Qwen3 enable_thinking, DeepSeek thinking); "
                        "messages with reasoning_content always render with it on")
    p.add_argument("--max-length", type=int, help="token limit per datum (default: the model's context window)")
    p.add_argument("--drop-long", action="store_true", help="drop datums over the limit instead of failing")
    p.add_argument("--truncate", action="store_true", help="cut datums over the limit instead of failing")
    p.add_argument("--render-cache", default=DEFAULT_RENDER_CACHE,
                   help="folder keeping rendered datums of large sets, so --resume and a run after --dry-run do "
                        "not render again ('off': never)")
    # model
    p.add_argument("--model-name", default=DEFAULT_MODEL, help="Tinker base model id")
    p.add_argument("--tokenizer", help="tokenizer folder or hub name (default: from --model-name)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--no-train-unembed", dest="train_unembed", action="store_false",
                   help="leave the output head out of the LoRA (the SDK's train_unembed=False; its default "
                        "trains it): an export then has no lm_head LoRA, which some vLLM versions and models "
                        "refuse; ignored with --init-from (the checkpoint's layers)")
    p.add_argument("--init-from", help="start from a tinker://.../weights/NAME state (fresh optimizer)")
    # optimisation
    p.add_argument("--learning-rate", type=float, help="default: the cookbook LoRA formula for the family")
    p.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default="linear")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="datums per step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, help="stop after this many steps in total")
    p.add_argument("--seed", type=int, default=0, help="data order, test split and LoRA init")
    # evaluation and checkpoints
    p.add_argument("--eval-every", type=int, default=0,
                   help="every N steps: held-out NLL and --eval-samples greedy samples scored by score() "
                        "(0: NLL before/after only)")
    p.add_argument("--eval-samples", type=int, default=8, help="held-out prompts sampled and scored per eval")
    p.add_argument("--num-probes", type=int, default=3, help="greedy probe samples before and after")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="max tokens per probe or eval sample (--rehearse --data: the longest trained answer)")
    p.add_argument("--save-every", type=int, default=20, help="save_state every N steps (0: only at the end)")
    p.add_argument("--log-path", default="runs/sft")
    # run control
    p.add_argument("--max-usd", type=float, help="stop before any paid call if the estimate exceeds this")
    p.add_argument("--dry-run", action="store_true", help="render, check and estimate; no Tinker call")
    p.add_argument("--rehearse", action="store_true",
                   help="free rehearsal preset for the local backend (SFT_REHEARSAL, by the model standing in; any flag you "
                        "pass wins): the built-in set, probes on training prompts, then checks the model learnt")
    p.add_argument("--resume", action="store_true", help="continue from the last row of LOG/checkpoints.jsonl")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run record in --log-path")
    if "--rehearse" in argv:
        p.set_defaults(**preset(SFT_REHEARSAL))  # defaults only: a flag given on the command line still wins
    args = p.parse_args(argv)
    if args.rehearse and args.data and not any(a == "--max-tokens" or a.startswith("--max-tokens=") for a in argv):
        args.max_tokens = None  # own data: probes as long as the longest trained answer (plan() sets it)
    if args.drop_long and args.truncate:
        p.error("choose one of --drop-long and --truncate")
    if args.resume and args.overwrite:
        p.error("choose one of --resume and --overwrite")
    return args


def check_settings(args):
    """Every numeric flag finite and in range, and a --log-path that can be written: the same checks for
    --dry-run and the real run, before any file is read or written (a dry run that passes settings the
    real run cannot use is no audit)."""
    check_numbers(args, {
        "learning_rate": dict(low=0, low_open=True), "test_fraction": dict(low=0, high=1, high_open=True),
        "batch_size": dict(low=1), "epochs": dict(low=1), "max_steps": dict(low=1), "lora_rank": dict(low=1),
        "warmup_steps": dict(low=0), "eval_every": dict(low=0), "eval_samples": dict(low=0),
        "num_probes": dict(low=0), "max_tokens": dict(low=1), "save_every": dict(low=0),
        "max_length": dict(low=2), "max_usd": dict(low=0)})
    check_writable_dir(args.log_path, "--log-path")


# ==== EDIT ME: load_dataset() ====
def load_dataset(path):
    """Return the examples in `path`: a list of dicts, each either

        {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}
            (an assistant message may carry "reasoning_content": str; it is trained too), or
        {"prompt": str, "completion": str}.

    Items may also be (where, example) pairs; `where` (a line number or label) names the example in
    error messages. Replace the body to read from anywhere else (a Hugging Face dataset, a database).
    """
    return read_jsonl(path)


def score(example, completion):
    """The task metric of one greedy sample on a held-out example: a float in [0, 1], higher is better.

    `example` is a validated example ({"messages": [...]} or {"prompt", "completion"}); `completion` is
    the sampled text with the stop token removed. Default: 1.0 when it equals the reference answer (the
    last assistant message, or "completion") after stripping whitespace, else 0.0. Replace it with your
    task's check (a number parsed from the text, a unit test run, a judge model's grade)."""
    return float(completion.strip() == reference_answer(example).strip())
# ==== END EDIT ME ====


def main(argv=None):
    args = parse_args(argv)
    check_settings(args)
    # Every read and write of the log folder goes through `run`, which holds the folder's lock until the end:
    # a second script on the same --log-path stops with exit 2 before it reads, deletes or writes anything.
    # watch_service(): a service lost for TINKER_UNREACHABLE_S ends the run with exit 4, not a hang.
    with Run(args.log_path) as run, watch_service():
        return train_run(args, run)


def train_run(args, run):
    resume_row = run.resume_point(resume=args.resume, overwrite=args.overwrite, dry_run=args.dry_run)
    if args.init_from:
        check_tinker_path(args.init_from, "weights")
    started = time.monotonic()

    # 1. Data: read, validate, split, render and mask. Bad data stops here (exit 2), before any call.
    job = prepare(args)
    if args.rehearse:
        check_masks(job, args.train_on)  # a wrong loss mask fails the rehearsal before anything is trained

    # 2. The context window (from Tinker, or the price catalogue for --dry-run), then the plan and its cost.
    service, context = (None, catalogue_context(args.model_name)) if args.dry_run else connect(args.model_name)
    plan(job, args, context)
    config = settings_record(args, job)
    if resume_row is not None:
        run.check_resume(config, RESUME_KEYS)
    start = min(resume_row["next_batch"], job.total_steps) if resume_row is not None else 0
    print_plan(job, args)
    label = "sft" if not start else f"sft, remaining {job.total_steps - start} of {job.total_steps} steps after --resume"
    cost = estimate(args.model_name, cost_tokens(job, args, start), args.max_usd, label=label)
    config["estimate_usd"] = estimate_total(cost)  # what the metrics rows' cost/cumulative_usd is compared with

    # 3. Only now may the log folder change: every check that can refuse the run has passed.
    if args.dry_run:
        run.write_rows("datums.jsonl", datum_rows(job))
        emit({"status": "dry_run", "log_path": str(run.path), **job.summary, "cost": cost, "format": job.fmt})
        return 0
    if resume_row is not None:
        if resume_row.get("name") == "final" and resume_row["next_batch"] >= job.total_steps:
            emit(result_record("complete", run, job, resume_row))
            return 0
        # Rows past the checkpoint were produced by the killed process and will be produced again.
        next_batch = resume_row["next_batch"]
        run.rewind("metrics.jsonl", lambda r: r.get("step", 0) <= next_batch)
        run.rewind("eval.jsonl", lambda r: r.get("step", 0) <= next_batch and r.get("when") != "after")
    else:
        run.begin(config)

    # 4. Train, then report.
    final = train(args, job, run, service, resume_row)
    with contextlib.suppress(Exception):  # the run is saved; a failed session close changes nothing
        service.close("success").result()
    report = result_record("ok", run, job, final)
    report["cost"] = cost
    report["seconds"] = round(time.monotonic() - started, 1)
    if args.rehearse:
        report["rehearsal"] = sft_rehearsal_checks(report, run, len(job.train), job.total_steps, own_data=bool(args.data))
        report["status"] = "ok" if report["rehearsal"]["passed"] else "failed"  # as the exit code (1) says
    run.unlock()  # the record is complete: the report page written next shows a finished run
    print_outcome(args, job, report)
    return judge_rehearsal(report, report.get("rehearsal"), run.path / "eval.jsonl")


def train(args, job, run, service, resume_row):
    """The training loop: a LoRA training client, held-out eval before, the steps, the final save and
    the eval after. Returns the final checkpoints.jsonl row."""
    start = resume_row["next_batch"] if resume_row is not None else 0
    job.cost = CostMeter(args.model_name, run)  # prices what each step sends; a resume continues the sum
    tc = training_client(service, args.model_name, args.lora_rank, args.seed, resume_from=resume_row,
                         position=f"batch {start}", init_from=args.init_from,
                         train_unembed=args.train_unembed)

    if resume_row is None:  # before training; a fresh LoRA is the identity, so the base model samples
        base = service.create_sampling_client(base_model=args.model_name).result() if samples_wanted(args, job) else None
        evaluate(args, job, run, "before", 0, held_out_forward(tc, job), base, args.model_name)

    last_time = time.time()
    pending = submit_step(tc, args, job, start) if start < job.total_steps else None
    for step in range(start, job.total_steps):
        # Queue step k+1 before waiting for step k: the server always holds the next forward_backward
        # + optim_step and never idles on our round trip.
        upcoming = submit_step(tc, args, job, step + 1) if step + 1 < job.total_steps else None
        result = pending["fb"].result()
        pending["opt"].result()
        done = step + 1
        masks = [trained_mask(r) for r in pending["batch"]]
        now = time.time()
        row = {"step": done, "epoch": step // job.per_epoch, "loss": batch_nll(result, masks),
               "loss_per_datum": (result.metrics["loss:sum"] / len(pending["batch"])
                                  if "loss:sum" in result.metrics else None),
               "learning_rate": pending["lr"], "tokens": sum(len(r.tokens) - 1 for r in pending["batch"]),
               "trained_tokens": int(sum(sum(m) for m in masks)), "seconds": round(now - last_time, 3)}
        row["train_mean_nll"] = row["loss"]  # the cookbook's names for these, so cookbook tools read this run
        row["progress"] = done / job.total_steps
        last_time = now
        if pending["eval"] is not None:  # queued right after this step: it sees the weights after `done` steps
            sampler = pending["eval"]["sampler"].result() if pending["eval"]["sampler"] is not None else None
            ev = evaluate(args, job, run, "during", done, pending["eval"]["forward"], sampler, f"step {done}")
            row.update(eval_nll=ev["nll"], **({"eval_score": ev["score"]} if "score" in ev else {}))
        row.update(job.cost.row(train=row["tokens"]))  # this step, and the evals billed since the last row
        run.append("metrics.jsonl", row)
        say(f"step {done}/{job.total_steps} | loss {row['loss']:.4f} | lr {row['learning_rate']:.1e} | "
            f"{row['tokens']} tok | {row['seconds']:.1f}s")
        if pending["save"] is not None:  # recorded once its path is known, after the step's metrics row
            run.checkpoint(name=f"{done:06d}", step=done, position={"next_batch": done}, epoch=done // job.per_epoch,
                           state_path=pending["save"].result().path, sampler_path=None, fmt=job.fmt)
        pending = upcoming

    state = tc.save_state("final")
    sampler_save = tc.save_weights_for_sampler("final")
    final = run.checkpoint(name="final", step=job.total_steps, position={"next_batch": job.total_steps},
                           epoch=job.total_steps // job.per_epoch, state_path=state.result().path,
                           sampler_path=sampler_save.result().path, fmt=job.fmt)
    sampler = service.create_sampling_client(model_path=final["sampler_path"]).result() if samples_wanted(args, job) else None
    evaluate(args, job, run, "after", job.total_steps, held_out_forward(tc, job), sampler, final["sampler_path"])
    return final


def submit_step(tc, args, job, step):
    """Queue training step `step` (0-based) and what follows it on the server; nothing here waits.
    forward_backward and optim_step go back to back; a periodic save and an --eval-every evaluation
    (held-out forward + a sampler of these weights) are queued right behind them."""
    import tinker

    batch = [job.train[i] for i in job.order(step)]
    rate = job.lr * lr_multiplier(step, job.total_steps, args.lr_schedule, args.warmup_steps)
    fb = tc.forward_backward(training_datums(batch), "cross_entropy")
    opt = tc.optim_step(tinker.AdamParams(learning_rate=rate, **ADAM))
    done = step + 1
    save = evaluation = None
    if args.save_every and done % args.save_every == 0 and done < job.total_steps:
        save = tc.save_state(f"{done:06d}", ttl_seconds=PERIODIC_TTL_SECONDS)
    if args.eval_every and done % args.eval_every == 0 and done < job.total_steps:
        evaluation = {"forward": held_out_forward(tc, job),
                      "sampler": tc.save_weights_and_get_sampling_client() if job.eval_prompts else None}
    return {"step": step, "batch": batch, "lr": rate, "fb": fb, "opt": opt, "save": save, "eval": evaluation}


# ---------------------------------------------------------------------------------------------
# Helpers, in the order main() calls them.


@dataclasses.dataclass
class Job:
    """What main() derives from the settings before training: tokenizer, format, data, plan."""

    tokenizer: object
    fmt: dict
    train_examples: list
    test_examples: list
    train_pairs: list  # [(line, Rendered)]
    test_pairs: list
    dropped: list = dataclasses.field(default_factory=list)
    limit: int | None = None
    lr: float = 0.0
    lr_source: str = ""
    per_epoch: int = 1
    total_steps: int = 0
    order: object = None  # BatchOrder: the datum indices of each step
    train: list = dataclasses.field(default_factory=list)  # Rendered, in train_pairs order
    test: list = dataclasses.field(default_factory=list)
    step_tokens: list = dataclasses.field(default_factory=list)
    probes: list = dataclasses.field(default_factory=list)
    cost: object = None  # CostMeter, set by train()
    eval_prompts: list = dataclasses.field(default_factory=list)
    summary: dict = dataclasses.field(default_factory=dict)


def read_examples(path, what, args):
    """Validated examples of --data / --test-data through load_dataset(); the built-in set without --data."""
    if path:
        return normalise_items(load_dataset(path), None if what == "--data" else path)
    if args.dry_run or args.rehearse:
        say("no --data: using the built-in rehearsal set (a memorisable toy; pass --data for your own)")
        return normalise_items(REHEARSAL_TRAIN, "the built-in set")
    raise DataError("no training data: pass --data FILE.jsonl (or edit load_dataset()), or --rehearse for "
                    "the built-in rehearsal set")


def prepare(args):
    train = read_examples(args.data, "--data", args)
    test = normalise_items(load_dataset(args.test_data), args.test_data) if args.test_data else None
    if test is None and not args.data:  # the built-in set comes with its own held-out questions
        test = normalise_items(REHEARSAL_TEST, "the built-in held-out set")
    if args.test_fraction is None:  # the default: 10%, capped so a large set's evaluation stays cheap
        args.test_fraction = 0.1 if len(train) * 0.1 <= MAX_HELD_OUT else MAX_HELD_OUT / len(train)
        if args.test_fraction < 0.1 and test is None:
            say(f"held-out split: {MAX_HELD_OUT} of {len(train)} examples (the default 10% capped at {MAX_HELD_OUT}; "
                "--test-fraction sets it)")
    train, test = split_examples(train, test, args.test_fraction, args.seed)
    tokenizer_name = tokenizer_record(args.tokenizer or args.model_name)
    tokenizer = load_tokenizer(tokenizer_name)
    fmt = resolve_format(args.format, args.model_name, tokenizer, tokenizer_name, args.thinking)
    cache = None if args.render_cache == "off" else Path(args.render_cache).expanduser()
    return Job(tokenizer=tokenizer, fmt=fmt, train_examples=train, test_examples=test,
               train_pairs=render_all(train, tokenizer, fmt, args.train_on, cache_dir=cache),
               test_pairs=render_all(test, tokenizer, fmt, args.train_on, cache_dir=cache))


def check_masks(job, train_on="last-assistant"):
    """Rehearsal check 1: every training datum trains exactly one assistant answer (after its reasoning, when
    the message has reasoning_content) and the end-of-turn token; with --train-on all-assistant, each assistant
    turn of the conversation in order, each ending in the end-of-turn token."""
    stop = job.tokenizer.decode(job.fmt["stop"][:1])
    by_line = {ex["line"]: ex for ex in job.train_examples}
    for line, r in job.train_pairs:
        spans = weighted_spans(job.tokenizer, r)
        if train_on == "all-assistant":
            answers = [a for a, _ in trained_answers(by_line[line])]
            if len(spans) == len(answers) and all(t.endswith(stop) and t[: -len(stop)].strip().endswith(a)
                                                  for t, a in zip(spans, answers)):
                continue
            raise ScriptError(f"rehearsal check failed: the loss mask of {example_where(by_line[line])} trains "
                              f"{spans!r}, expected its {len(answers)} assistant turns, each followed by {stop!r}")
        trained = spans[0][: -len(stop)].strip() if len(spans) == 1 and spans[0].endswith(stop) else None
        if trained is None or not r.weights[-1] or not any(
                trained == answer or (reasoning and trained.endswith(answer) and reasoning in trained)
                for answer, reasoning in trained_answers(by_line[line])):
            raise ScriptError(
                f"rehearsal check failed: the loss mask of {example_where(by_line[line])} trains {spans!r}, expected "
                f"only the answer {reference_answer(by_line[line])!r} followed by {stop!r}; the renderer's masking is "
                "wrong (see "
                "render_example())")


def trained_answers(example):
    """(answer, reasoning) of each assistant turn a datum of `example` may train, stripped."""
    if "messages" not in example:
        return [(example["completion"].strip(), "")]
    return [(m["content"].strip(), (m.get("reasoning_content") or "").strip())
            for m in example["messages"] if m["role"] == "assistant"]


def plan(job, args, context):
    """Length limit, learning rate, steps and batch order, token counts: filled into `job`."""
    limit = min(x for x in (args.max_length, context) if x) if (args.max_length or context) else None
    mode = "drop" if args.drop_long else "truncate" if args.truncate else "error"
    job.train_pairs, dropped = apply_length_limit(job.train_pairs, limit, mode)
    job.test_pairs, dropped_test = apply_length_limit(job.test_pairs, limit, mode)
    job.dropped, job.limit = dropped + dropped_test, limit
    if job.dropped:
        say(f"dropped {len(job.dropped)} datum(s) over {limit} tokens: lines {', '.join(map(str, job.dropped[:20]))}")
    if not job.train_pairs:
        raise DataError("no training datum left after the length limit; raise --max-length or shorten the data")
    job.train, job.test = [r for _, r in job.train_pairs], [r for _, r in job.test_pairs]

    job.lr, job.lr_source = args.learning_rate, "--learning-rate"
    if job.lr is None:
        job.lr, job.lr_source = recommended_learning_rate(args.model_name), "cookbook LoRA formula"
        if job.lr is None:
            job.lr, job.lr_source = 1e-4, "fallback (family not calibrated: pass --learning-rate)"
        say(f"learning rate {job.lr:.3e} ({job.lr_source}, {args.model_name})")

    n = len(job.train)
    job.per_epoch, job.total_steps = plan_steps(n, args.batch_size, args.epochs, args.max_steps)
    sizing = sizing_advice(n, args.batch_size, args.epochs, job.lr) if not args.rehearse and not args.max_steps else None
    if sizing:
        say(sizing["message"])
    job.order = BatchOrder(n, args.batch_size, job.per_epoch, args.seed)
    if n < args.batch_size:
        say(f"warning: {n} training datums < --batch-size {args.batch_size}; one batch of {n} per epoch")
    job.step_tokens = [sum(len(job.train[i].tokens) - 1 for i in job.order(s)) for s in range(job.total_steps)]
    trained = sum(sum(1 for w in job.train[i].weights[1:] if w) for s in range(job.total_steps) for i in job.order(s))
    # Probes show memorisation in a rehearsal (training prompts) and generalisation otherwise (held-out).
    probe_source = job.train_examples if args.rehearse else (job.test_examples or job.train_examples)
    job.probes = probe_prompts(probe_source, job, args.num_probes)
    if args.max_tokens is None:  # --rehearse on own data: room for the longest trained answer (stop included)
        args.max_tokens = max(preset(SFT_REHEARSAL)["max_tokens"], max(sum(1 for w in r.weights if w) for r in job.train))
        say(f"probes sample up to {args.max_tokens} tokens: the longest trained answer")
    job.eval_prompts = probe_prompts(job.test_examples, job, args.eval_samples) if args.eval_every else []
    longest_line, longest = max(job.train_pairs + job.test_pairs, key=lambda p: len(p[1].tokens))
    n_evals = 2 + (job.total_steps - 1) // args.eval_every if args.eval_every else 2
    job.summary = {
        "examples": {"train": len(job.train_examples), "test": len(job.test_examples), "dropped": len(job.dropped)},
        "datums": {"train": n, "test": len(job.test)},
        "steps": job.total_steps, "batch_size": min(args.batch_size, n), "batches_per_epoch": job.per_epoch,
        "tokens": {"model_input": sum(job.step_tokens), "trained": int(trained),
                   "eval_forward": n_evals * held_out_tokens(job), "per_epoch": sum(len(r.tokens) - 1 for r in job.train)},
        "longest": {"line": longest_line, "tokens": len(longest.tokens)},
        "max_length": limit, "learning_rate": job.lr,
        "held_out": {"datums": len(job.test), "tokens_per_eval": held_out_tokens(job), "evals": n_evals,
                     "usd": held_out_usd(args.model_name, n_evals * held_out_tokens(job))},
    }
    if sizing:
        job.summary["sizing"] = {k: v for k, v in sizing.items() if k != "message"}


def held_out_usd(model_name, tokens):
    """Dollars of the held-out forward passes (billed at the train rate), or None without a price."""
    pricing = load_pricing()
    if pricing is None or not tokens:
        return None if pricing is None else 0.0
    try:
        return pricing.estimate_cost(model_name, train=tokens)["usd"]["total"]
    except Exception:  # an unknown model or price: the plan simply shows no figure
        return None


def held_out_tokens(job):
    return sum(len(r.tokens) - 1 for r in job.test)  # one eval's forward pass


def cost_tokens(job, args, start):
    """Tokens left to pay for from step `start`: a --resume pays only its steps, its evals and no
    "before" eval or probes."""
    evals = (start == 0) + 1 + ((job.total_steps - 1) // args.eval_every - start // args.eval_every
                                if args.eval_every else 0)
    probe_rounds = 2 if start == 0 else 1
    prefill = probe_rounds * sum(len(p["tokens"]) for p in job.probes) + evals * sum(len(p["tokens"]) for p in job.eval_prompts)
    return {"train": sum(job.step_tokens[start:]) + evals * held_out_tokens(job), "prefill": prefill,
            "sample": (probe_rounds * len(job.probes) + evals * len(job.eval_prompts)) * args.max_tokens}


def settings_record(args, job):
    config = {k: v for k, v in vars(args).items() if k not in ("resume", "overwrite", "dry_run")}
    config.update(learning_rate=job.lr, learning_rate_source=job.lr_source, max_length=job.limit, format=job.fmt,
                  adam=ADAM, loss="cross_entropy; weights 1/(trained tokens) per datum",
                  **system_prompt_record(job.train_examples),
                  probe_sampling={"temperature": 0.0, "max_tokens": args.max_tokens})
    return config


def print_plan(job, args):
    """The audit as a table on stderr: what will be trained, on what, at which rate."""
    from rich.console import Console
    from rich.table import Table

    s, fmt = job.summary, job.fmt
    table = Table(title="tinker_sft plan", show_header=False, title_justify="left")
    fmt_text = (f"chat template {fmt['template_sha256'][:12]}, kwargs {fmt['template_kwargs']}"
                if fmt["kind"] == "chat" else "raw text + EOS")
    for key, value in [
        ("model", args.model_name), ("format", f"{fmt_text}, stop {fmt['stop']}"),
        ("datums", f"{s['datums']['train']} train / {s['datums']['test']} held-out "
                   f"({s['examples']['dropped']} dropped over the limit)"),
        ("steps", f"{s['steps']} of {s['batch_size']} datums ({s['batches_per_epoch']} per epoch)"),
        ("tokens", f"{s['tokens']['model_input']} model-input, {s['tokens']['trained']} trained, "
                   f"{s['tokens']['eval_forward']} held-out forward"),
        ("longest", f"{s['longest']['tokens']} tokens (line {s['longest']['line']}), limit {s['max_length'] or 'unknown'}"),
        ("held-out", f"{s['held_out']['datums']} datums, {s['held_out']['tokens_per_eval']} tokens per evaluation x "
                     f"{s['held_out']['evals']}" + (f" = ${s['held_out']['usd']:.4f}" if s['held_out']['usd'] is not None
                                                    else "")),
        ("learning rate", f"{s['learning_rate']:.3e}, {args.lr_schedule}, warmup {args.warmup_steps}"),
    ] + ([("sizing", f"{s['sizing']['steps']} steps < {s['sizing']['min_steps']}: try --batch-size "
                     f"{s['sizing']['suggested']['batch_size']} --epochs {s['sizing']['suggested']['epochs']} "
                     f"--learning-rate {s['sizing']['suggested']['learning_rate']:.2e}")] if "sizing" in s else []):
        table.add_row(key, str(value))
    Console(stderr=True, highlight=False, soft_wrap=True).print(table)


def datum_rows(job):
    for split, pairs in (("train", job.train_pairs), ("test", job.test_pairs)):
        for line, r in pairs:
            yield {"split": split, "line": line, "tokens": r.tokens, "weights": r.weights,
                   "trained_text": weighted_spans(job.tokenizer, r)}


def probe_prompts(examples, job, n):
    """Greedy-sample prompts of the first n examples: the conversation up to its last assistant turn."""
    probes = []
    for ex in examples[:n]:
        if "messages" in ex:
            msgs = ex["messages"]
            last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            tokens = generation_prompt(msgs[:last], job.tokenizer, job.fmt, tools=ex.get("tools"))
            text = msgs[last - 1]["content"]
        else:
            tokens, text = generation_prompt(ex["prompt"], job.tokenizer, job.fmt), ex["prompt"]
        probes.append({"line": ex["line"], "prompt": text, "expected": reference_answer(ex), "tokens": tokens,
                       "example": ex})
    return probes


def samples_wanted(args, job):
    return bool(job.probes) or bool(args.eval_every and job.eval_prompts)


def held_out_forward(tc, job):
    """Queue a forward pass over the held-out datums (weights = the loss mask); None if there are none."""
    if not job.test:
        return None
    return tc.forward([to_datum(Rendered(r.tokens, [1.0 if w else 0.0 for w in r.weights])) for r in job.test],
                      "cross_entropy")


def greedy_samples(sampler, prompts, job, max_tokens):
    """(text without stop tokens, sampled token count) per prompt; all requests in flight at once."""
    import tinker

    params = tinker.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=job.fmt["stop"])
    futures = [sampler.sample(tinker.ModelInput.from_ints(p["tokens"]), 1, params) for p in prompts]
    outs = []
    for f in futures:
        seq = f.result().sequences[0]
        toks = [t for t in seq.tokens if t not in job.fmt["stop"]]
        outs.append((job.tokenizer.decode(toks, skip_special_tokens=False), len(seq.tokens)))
    return outs


def evaluate(args, job, run, when, step, forward, sampler, sampled_from):
    """Held-out NLL (from a queued forward), probes (before/after) and score() on --eval-samples held-out
    prompts (with --eval-every); one row in LOG/eval.jsonl, returned."""
    nll = batch_nll(forward.result(), [trained_mask(r) for r in job.test]) if forward is not None else None
    row = {"step": step, "when": when, "nll": nll,
           "test_tokens": int(sum(sum(trained_mask(r)) for r in job.test))}
    probes = job.probes if when != "during" else []
    scored = job.eval_prompts if args.eval_every else []
    texts = []
    if sampler is not None and (probes or scored):
        texts = greedy_samples(sampler, probes + scored, job, args.max_tokens)
        row["sampled_from"] = sampled_from
        for p, (text, n) in zip(probes, texts):
            p[when], p[f"{when}_sampled_tokens"], p[f"{when}_score"] = text, n, score(p["example"], text)
        if probes:
            row["probes"] = [{k: v for k, v in p.items() if k not in ("tokens", "example")} for p in probes]
        if scored:
            marks = [float(score(p["example"], text)) for p, (text, _) in zip(scored, texts[len(probes):])]
            row["score"], row["scored"] = sum(marks) / len(marks), len(marks)
            row["samples"] = [{"line": p["line"], "completion": text, "score": m}
                              for p, (text, _), m in zip(scored, texts[len(probes):], marks)]
    if job.cost is not None:  # billed: the held-out forward (train rate) and one greedy sample call per prompt
        job.cost.add(train=held_out_tokens(job) if forward is not None else 0,
                     prefill=sum(len(p["tokens"]) for p in (probes + scored if texts else [])),
                     sample=sum(n for _, n in texts))
        if when == "after":  # past the last metrics row, so the run's total is recorded here
            row.update(job.cost.row())
    run.append("eval.jsonl", row)
    nll_text = "n/a" if nll is None else f"{nll:.4f}"
    score_text = f" | score {row['score']:.3f} on {row['scored']} held-out samples" if "score" in row else ""
    say(f"eval {when} (step {step}) | held-out nll {nll_text} per token{score_text}")
    return row


def result_record(status, run, job, final):
    evals = run.rows("eval.jsonl")
    before = next((r for r in evals if r.get("when") == "before"), {})
    after = next((r for r in reversed(evals) if r.get("when") == "after"), {})
    probes = after.get("probes") or before.get("probes") or []
    sampler = final.get("sampler_path")
    record = {
        "status": status, "log_path": str(run.path), "steps": job.total_steps,
        "state_path": final.get("state_path"), "sampler_path": sampler,
        "eval": {"nll_before": before.get("nll"), "nll_after": after.get("nll"), "probes": probes},
        "tokens": {"model_input": job.summary["tokens"]["model_input"], "trained": job.summary["tokens"]["trained"]},
        "format": job.fmt,
        "sampling": {"model_path": sampler, "stop": job.fmt["stop"],
                     "hint": script_command("tinker_infer.py", "--run", run.path, "--prompt", sample_prompt(probes, job)),
                     "hint_note": "renders the prompt in this run's format, with its system prompt, greedy"},
    }
    scores = [(r["when"], r["step"], r["score"]) for r in evals if "score" in r]
    if scores:
        record["score"] = [{"when": w, "step": s, "score": v} for w, s, v in scores]
    return record


def sample_prompt(probes, job):
    """The --prompt of the printed sample command: the first probe's, else the first training example's question."""
    prompts = [p["prompt"] for p in probes or probe_prompts(job.train_examples, job, 1)]
    return prompts[0] if prompts and isinstance(prompts[0], str) else "Hello"


def print_outcome(args, job, report):
    """A few lines a newcomer can read: what was trained, what it learnt, where it is, what it costs."""
    ev, log = report["eval"], report["log_path"]
    data = args.data or "the built-in rehearsal set"
    nll = (f"{ev['nll_before']:.3f} -> {ev['nll_after']:.3f}" if ev["nll_before"] is not None
           and ev["nll_after"] is not None else "n/a (no held-out data)")
    usd = ((report.get("cost") or {}).get("usd") or {}).get("total")
    lines = ["", "==== what happened ====",
             f"trained  a LoRA (rank {args.lora_rank}) on {model_label(args.model_name)}: {job.total_steps} steps of "
             f"{job.summary['batch_size']} examples from {data}; the loss covers only the assistant's answer "
             "and its end-of-turn token",
             f"held-out NLL per token  {nll}"]
    for p in ev["probes"][:4]:
        lines.append(f"probe    {p['prompt'][:50]!r}  expected {p['expected'][:40]!r}  before {p.get('before', '')[:40]!r}"
                     f"  after {p.get('after', '')[:40]!r}")
    for c in (report.get("rehearsal") or {}).get("checks", []):
        lines.append(f"check    {'ok  ' if c['passed'] else 'FAIL'} {c['check']}")
    for note in (report.get("rehearsal") or {}).get("reported", []):
        lines.append(f"report   {note}")
    lines += [f"record   {log}/ (config.json, metrics.jsonl, checkpoints.jsonl, eval.jsonl); "
              f"final sampler {report['sampler_path']}",
              f"on Tinker this run would cost about ${usd:.4f} ({args.model_name}, the estimate above{stand_in_cost_note()})"
              if usd is not None
              else f"on Tinker: no dollar estimate ({no_estimate_reason(args.model_name)})",
              "next     sample it: " + report["sampling"]["hint"],
              f"took     {report.get('seconds', 0):.0f} s"]
    page = write_report(log)
    if page:
        lines.insert(-1, f"report   {page} (loss, held-out NLL and learning-rate curves, probes, checkpoints)")
    say("\n".join(lines))


# ==== SHARED CODE (generated from common/: rehearsal, errors, flags, render, run_files, data, run_record, service, checkpoints, training) ====
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
import math
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


def model_label(model_name: str) -> str:
    """The model a run trained, as a summary names it: with the local model that stood in for it, if one did."""
    return f"{model_name} (the local backend's {stand_in()} standing in)" if stand_in() else model_name


def stand_in_cost_note() -> str:
    """What a rehearsal's dollar figure means: on the real model the tokens were counted by its tokenizer."""
    return ("; counted in SmolLM2's tokens, which differ from the named model's: a --dry-run without --real counts "
            "those" if real_stand_in() else "")


def preset(presets: dict) -> dict:
    """The rehearsal preset for the model standing in now: presets["real"] on the real model, else presets["tiny"]
    (also on the real model while a script has no preset measured on it)."""
    return dict(presets["real" if real_stand_in() and "real" in presets else "tiny"])


def rehearsal_check(text: str, passed) -> dict:
    return {"check": text, "passed": bool(passed)}


def rehearsal_result(checks: list[dict], reported=(), **extra) -> dict:
    """A rehearsal's verdict: passed when every check passed; `reported` lines are figures shown, not judged."""
    return {"passed": all(c["passed"] for c in checks), "checks": checks, "reported": list(reported),
            "stand_in": stand_in(), **extra}


# ---- tinker_sft.py --rehearse
# tiny: four one-line facts memorised in 40 steps (probes 0/4 -> 4/4; held-out NLL 18.2 -> 3.3).
# real (SmolLM2, measured 2026-12-06, 2 cores shared): the built-in facts 4/4 in 16 steps at 5e-4; the 32-row
# help-desk set (templates/sft_example.jsonl without its reasoning row) 4/4 training probes reproduced word for
# word after 48 steps at 2e-3 linear, rank 32 (2/4 at 2e-3 constant x 32 steps, 0/4 at 5e-4 x 40); held-out NLL
# 1.91 -> 1.50 at step 8 (then it memorises: 2.65 at step 48); 118 s in the script, 2 min 13 s with the server.
SFT_REHEARSAL = {
    "tiny": {"learning_rate": 1e-2, "lr_schedule": "constant", "batch_size": 4, "max_steps": 40, "epochs": 1000,
             "lora_rank": 32, "num_probes": 4, "max_tokens": 8, "save_every": 0, "log_path": "runs/rehearsal"},
    "real": {"learning_rate": 2e-3, "lr_schedule": "linear", "batch_size": 4, "max_steps": 48, "epochs": 1000,
             "lora_rank": 32, "num_probes": 4, "max_tokens": 8, "save_every": 0, "log_path": "runs/rehearsal",
             "eval_every": 8, "eval_samples": 0},
}
# The real model passes an own-data rehearsal when at least this share of its probes (training prompts) answer
# their trained answer word for word.
REAL_PROBE_SHARE = 0.75
# An own-data rehearsal passes when the training loss of the last quarter of its steps is below this share
# of the first step's (the tiny model, 24 one-sentence answers, 40 steps: 22.6 -> 9-10, measured).
REHEARSAL_LOSS_SHARE = 0.8


def sft_rehearsal_checks(report, run, datums, total_steps, *, own_data):
    """tinker_sft.py's rehearsal verdict (the loss masks were checked before training): on the built-in set, that
    the model learnt it; on the user's data, that the pipeline is right and, on the real model, the task learnt."""
    return _sft_own_data_checks(report, run, datums, total_steps) if own_data else _sft_built_in_checks(report)


def _sft_own_data_checks(report, run, datums, total_steps):
    """What a rehearsal on the user's own data can prove (check 1, the masks, ran before training): the datums
    trained, the checkpoints were saved, the saved sampler samples, and the training loss fell. A tiny random
    model cannot learn to answer other questions, nor always reproduce many answers in 40 steps: the probes
    (training prompts) and the held-out NLL are reported, not judged (references/training-sft.md)."""
    losses = [r["loss"] for r in run.rows("metrics.jsonl") if isinstance(r.get("loss"), (int, float))]
    tail = losses[-max(1, len(losses) // 4):]
    last = sum(tail) / len(tail) if tail else None
    probes = report["eval"]["probes"]
    sampled = [p for p in probes if "after" in p]
    exact = sum(1 for p in probes if p.get("after", "").strip() == p["expected"].strip())
    nll_before, nll_after = report["eval"]["nll_before"], report["eval"]["nll_after"]
    real = real_stand_in()
    checks = [
        {"check": f"loss masks train exactly the answers and the end-of-turn token ({datums} datums)",
         "passed": True},
        {"check": f"every step trained: {len(losses)} of {total_steps} metrics rows", "passed": len(losses) == total_steps},
        {"check": "the final checkpoint was saved (state and sampler paths)",
         "passed": bool(report.get("state_path")) and bool(report.get("sampler_path"))},
        {"check": f"the saved sampler samples every probe ({len(sampled)}/{len(probes)})",
         "passed": len(sampled) == len(probes)},
        {"check": f"the training loss falls below {REHEARSAL_LOSS_SHARE:.0%} of the first step's "
                  f"({losses[0]:.3f} -> {last:.3f}, the mean of the last {len(tail)} steps)" if losses
                  else "the training loss was recorded",
         "passed": bool(losses) and last < REHEARSAL_LOSS_SHARE * losses[0]},
    ]
    held_out = [r["nll"] for r in run.rows("eval.jsonl") if r.get("when") != "before" and r.get("nll") is not None]
    nll_text = f"{nll_before:.3f} -> {nll_after:.3f}" if nll_before is not None and nll_after is not None else "not measured"
    if real:  # a real model must learn the user's answers, and what it learns must carry to unseen rows
        need = math.ceil(REAL_PROBE_SHARE * len(probes))
        checks.append(rehearsal_check(f"at least {need} of {len(probes)} probes (training prompts) answer their trained answer "
                                      f"word for word ({exact}/{len(probes)})", probes and exact >= need))
        if nll_before is not None and held_out:
            checks.append(rehearsal_check(f"the held-out NLL falls below its start at some evaluation ({nll_before:.3f} -> best "
                                          f"{min(held_out):.3f}, last {held_out[-1]:.3f})", min(held_out) < nll_before))
        return rehearsal_result(checks, [f"held-out NLL {nll_text}"], data="own")
    reported = [f"probes reproducing their trained answer: {exact}/{len(probes)} (training prompts; reported, not "
                "judged: a tiny random model memorises few answers of a real set in a rehearsal's steps; judged on "
                "the real model: tinker_local.py run --real)",
                f"held-out NLL {nll_text} (reported, not judged: a tiny random model cannot generalise to other "
                "questions)"]
    return rehearsal_result(checks, reported, data="own")


def _sft_built_in_checks(report):
    """Rehearsal checks 2-4 (check 1, the mask, ran before training): every probe (a training prompt)
    answers its trained answer after training and none did before; the held-out NLL at least halves."""
    probes = report["eval"]["probes"]
    after = sum(1 for p in probes if p.get("after_score") == 1.0)
    before = sum(1 for p in probes if p.get("before_score") == 1.0)
    nll_before, nll_after = report["eval"]["nll_before"], report["eval"]["nll_after"]
    checks = [
        {"check": f"after-training probes reproduce the trained answers ({after}/{len(probes)})",
         "passed": bool(probes) and after == len(probes)},
        {"check": f"before-training probes do not ({before}/{len(probes)} did)", "passed": before == 0},
        {"check": f"held-out NLL falls by half or more ({nll_before:.3f} -> {nll_after:.3f})"
         if nll_before is not None and nll_after is not None else "held-out NLL measured",
         "passed": nll_before is not None and nll_after is not None and nll_after <= nll_before / 2},
    ]
    return rehearsal_result(checks)


# The built-in rehearsal set (also templates/sft_rehearsal*.jsonl): four one-line facts the local backend's
# tiny model memorises at lr 1e-2 (measured: probes 4/4 exact after 40 steps, 0/4 before; training loss
# 18.4 -> 0.013; held-out NLL 18.2 -> 3.3), and the same facts asked in other words as the held-out set.
# Built in so the script copied alone can rehearse. tinker_distill.py's rehearsal teacher learns the same answers.
REHEARSAL_QA = [("What colour is the sky?", "Blue."), ("What is the capital of France?", "Paris."),
                ("How many legs does a cat have?", "Four."), ("Which way does rain fall?", "Down.")]
REHEARSAL_TRAIN = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                   for q, a in REHEARSAL_QA]
REHEARSAL_TEST = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in [
    ("Tell me the colour of the sky.", "Blue."), ("Name the capital of France.", "Paris."),
    ("A cat has how many legs?", "Four."), ("In which direction does rain fall?", "Down."),
]]


# ---- common/errors.py ----
# Errors and exit codes: every script fails with one line on stderr and a documented exit code.
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


def judge_rehearsal(report: dict, verdict: dict | None, figures) -> int:
    """Print the run's JSON with the rehearsal's verdict (None: nothing judged, status as it is); a failed check
    sets status "failed" first, then ends the run with exit 1 naming the checks that failed and `figures` (the
    file that holds the figures they judged)."""
    if verdict is not None:
        report["rehearsal"] = verdict
        if not verdict["passed"]:
            report["status"] = "failed"  # the JSON says what the exit code (1) says
    emit(report)
    if verdict is not None and not verdict["passed"]:
        failed = [c["check"] for c in verdict["checks"] if not c["passed"]]
        raise ScriptError(f"rehearsal check failed: {'; '.join(failed)} (figures above and in {figures})")
    return 0


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


def _without_reasoning_on_the_real_stand_in(examples):
    """The local real model's ChatML template has no place for reasoning_content (rendering would stop with
    "drops the reasoning_content"): on that stand-in the answers are trained alone, with a warning. The tiny model
    keeps the named model's template, so a rehearsal there renders the reasoning exactly as Tinker will."""
    if not real_stand_in():
        return examples
    dropped = 0
    out = []
    for ex in examples:
        msgs = ex.get("messages") if isinstance(ex, dict) else None
        if msgs and any(m.get("reasoning_content") for m in msgs):
            dropped += 1
            ex = {**ex, "messages": [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]}
        out.append(ex)
    if dropped:
        say(f"warning: {dropped} example(s) carry reasoning_content, which the local real model's ChatML template "
            "cannot render: trained on their answers alone here; rehearse on the tiny model (tinker_local.py run "
            "without --real) to check how the named model's template renders the reasoning")
    return out


def example_where(example) -> str:
    """How a message names an example: "line 3", or "line 3 of heldout.jsonl" for one with a source."""
    return f"line {example['line']}" + (f" of {example['source']}" if example.get("source") else "")


def render_all(examples, tokenizer, fmt, train_on, *, workers=None, cache_dir=None, fast=True) -> list:
    """[(line, Rendered)] for every validated example, equal to render_example's; a RenderError names the
    example's line.

    Chat conversations render through BatchRenderer (the template run once per conversation shape, the
    tokenizer over the pieces; checked against render_example, see there); fast=False renders each one
    with render_example. Large sets render in a process pool over every core (forked, so each worker
    inherits the tokenizer; the per-datum checks run unchanged in the workers). With cache_dir, the
    result is kept in a file keyed by (examples, tokenizer, format, train_on, rendering code), so a
    --resume or a real run after a dry run reads it back instead of rendering again."""
    examples = _without_reasoning_on_the_real_stand_in(examples)
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
            raise RenderError(f"{example_where(ex)}: {e}") from None
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
                    raise RenderError(f"{example_where(ex)}: {e}") from None
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


def split_examples(train, test, fraction, seed):
    """(train, held-out): `test` when given, else a seeded `fraction` of the training examples."""
    if test is not None or fraction == 0 or len(train) < 2:
        return train, test or []
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    held = set(order[:max(1, round(fraction * len(train)))])
    return [e for i, e in enumerate(train) if i not in held], [train[i] for i in sorted(held)]


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


def system_prompt_record(conversations) -> dict:
    """config.json's record of what sampling needs to prompt as training did: the system prompt every
    conversation shares ("system_prompts": "shared"), none ("none"), or the note that they differ ("differ");
    tinker_infer.py --run uses a shared one by default. conversations: SFT examples ({"messages"} or
    {"prompt", "completion"}) or RL prompts as render_prompt() gave them (a message list, or a str)."""
    def system(conversation):
        messages = conversation.get("messages") if isinstance(conversation, dict) else conversation
        first = messages[0] if isinstance(messages, list) and messages else None
        return first["content"] if isinstance(first, dict) and first.get("role") == "system" else None

    systems = {system(c) for c in conversations}
    if systems <= {None}:
        return {"system_prompt": None, "system_prompts": "none"}
    if len(systems) == 1:
        return {"system_prompt": next(iter(systems)), "system_prompts": "shared"}
    return {"system_prompt": None, "system_prompts": "differ"}


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


def write_report(log):
    """The run's HTML report by tinker_report.py when it is beside this script (else None): one page a person
    can open. A failure here costs the run nothing; the record is complete already."""
    tool = Path(__file__).resolve().parent / "tinker_report.py"
    if not tool.exists():
        return None
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, str(tool), str(log)], capture_output=True, text=True, timeout=300)
        return json.loads(out.stdout.strip().splitlines()[-1]).get("report") if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


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


def no_estimate_reason(*models) -> str:
    """Why a run's summary has no dollar estimate: the prices are not beside this script, or the catalogue has
    no price for one of `models` (retired or unknown; tinker_pricing.py lists what it prices)."""
    pricing = load_pricing()
    if pricing is None:
        return "tinker_pricing.py not beside this script"
    for model in models:
        try:
            pricing.resolve_model(model)
        except ValueError:  # UnknownModelError included
            return f"no catalogue price for {model}; see {script_command('tinker_pricing.py', 'list', server=False)}"
    return "no estimate was made"


def copy_pricing_command() -> str:
    """How to put the prices beside this script: a `cp` from the bundle when the local backend's launcher
    shows where the bundle is, else the words."""
    import shlex

    here = str(Path(__file__).resolve().parent)
    launcher = local_launcher()
    if launcher and (Path(launcher).parent / "tinker_pricing.py").exists():
        return f"copy it: cp {shlex.quote(os.path.join(os.path.dirname(launcher), 'tinker_pricing.py'))} {shlex.quote(here)}"
    return f"copy the bundle's scripts/tinker_pricing.py into {here}"


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


# ---- common/checkpoints.py ----
# Checkpoints by path and by run: tinker:// paths, the server's listing of one run, the run record's checkpoint
# rows, and an SDK failure about a checkpoint as one line with the command that shows what exists.
import os


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


# ---- common/training.py ----
# Optimizer constants, learning-rate rules, data order, sizing advice and the training client shared by the training
# scripts; the teacher a distillation rehearsal trains first.
import math
import random


# The cookbook's Adam values; the SDK's default eps is 1e-12.
ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
PERIODIC_TTL_SECONDS = 7 * 24 * 3600  # periodic saves expire after a week; the final one is kept

# Hidden sizes of the lineup models the cookbook's LR formula is calibrated for (hyperparam_utils).
HIDDEN_SIZES = {
    "meta-llama/Llama-3.2-1B": 2048, "meta-llama/Llama-3.2-3B": 3072, "meta-llama/Llama-3.1-8B": 4096,
    "meta-llama/Llama-3.1-8B-Instruct": 4096, "meta-llama/Llama-3.1-70B": 8192,
    "meta-llama/Llama-3.3-70B-Instruct": 8192,
    "Qwen/Qwen3-8B": 4096, "Qwen/Qwen3-8B-Base": 4096, "Qwen/Qwen3-32B": 5120,
    "Qwen/Qwen3-30B-A3B": 2048, "Qwen/Qwen3-30B-A3B-Base": 2048, "Qwen/Qwen3-30B-A3B-Instruct-2507": 2048,
    "Qwen/Qwen3-4B-Instruct-2507": 2560, "Qwen/Qwen3-235B-A22B-Instruct-2507": 4096,
    "Qwen/Qwen3.5-4B": 2560, "Qwen/Qwen3.5-9B": 4096, "Qwen/Qwen3.5-9B-Base": 4096,
    "Qwen/Qwen3.5-27B": 5120, "Qwen/Qwen3.5-35B-A3B": 2048, "Qwen/Qwen3.5-35B-A3B-Base": 2048,
}


def recommended_learning_rate(model_name):
    """The cookbook's LoRA LR: 5e-5 * 10 * (2000 / hidden) ** P, P = 0.781 (Llama) or 0.0775 (Qwen).
    None when the family is not calibrated or the hidden size is unknown."""
    name = model_name.split(":", 1)[0]
    hidden = HIDDEN_SIZES.get(name)
    lowered = name.lower()
    power = 0.781 if "llama" in lowered else 0.0775 if "qwen" in lowered else None
    if hidden is None or power is None:
        return None
    return 5e-5 * 10 * (2000 / hidden) ** power


def lr_multiplier(step, total_steps, schedule, warmup_steps=0):
    """Multiplier for the 0-based step: linear warmup over warmup_steps, then the cookbook schedules
    (linear 1 - p, cosine 0.5 (1 + cos pi p), constant 1) over the remaining steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = (step - warmup_steps) / span
    if schedule == "linear":
        return 1 - progress
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def plan_steps(n_train, batch_size, epochs, max_steps):
    """(batches per epoch, total steps). A final partial batch is dropped so every step has the
    same size; a data set smaller than one batch is one batch."""
    per_epoch = max(n_train // batch_size, 1)
    total = per_epoch * epochs
    return per_epoch, min(total, max_steps) if max_steps else total


# Fewer steps than this rarely train (the guide's figure, references/hyperparameters.md): tinker_sft.py's plan says
# so and prints --batch-size/--epochs values that reach it.
MIN_STEPS = 100


def sizing_advice(n, batch_size, epochs, lr):
    """When n datums at `batch_size` for `epochs` make fewer than MIN_STEPS steps: a --batch-size/--epochs pair
    that reaches them (the largest batch needing at most 3 epochs, else at most 10, else batch 1) and the
    learning rate for that batch (`lr` scaled by the square root of the batch ratio). None when the plan has
    enough."""
    steps = plan_steps(n, batch_size, epochs, None)[1]
    if steps >= MIN_STEPS:
        return None
    sizes = [batch_size] + [b for b in (2 ** k for k in range(12, -1, -1)) if b < min(batch_size, n)]
    options = [(b, math.ceil(MIN_STEPS / max(n // b, 1))) for b in sizes]
    batch, suggested_epochs = next((o for o in options if o[1] <= 3), None) or next(
        (o for o in options if o[1] <= 10), options[-1])
    rate = lr * math.sqrt(batch / min(batch_size, n))
    reached = plan_steps(n, batch, suggested_epochs, None)[1]
    message = (f"warning: {n} training datums at --batch-size {batch_size} for {epochs} epoch(s) make "
               f"{steps} step(s); fewer than about {MIN_STEPS} rarely train. --batch-size {batch} --epochs "
               f"{suggested_epochs} makes {reached}; a smaller batch wants a lower learning rate, scaled by the square "
               f"root of the batch ratio: --learning-rate {rate:.2e} (from {lr:.2e})"
               + (". With this few examples every epoch repeats them: watch the held-out NLL (--eval-every)"
                  if suggested_epochs > 3 else ""))
    return {"steps": steps, "min_steps": MIN_STEPS, "suggested": {"batch_size": batch, "epochs": suggested_epochs,
            "steps": reached, "learning_rate": float(f"{rate:.3g}")}, "message": message}


class BatchOrder:
    """Datum indices of each global step: a fixed shuffle per epoch from the seed, computed once per
    epoch (not per step), so planning is linear in the data and a resumed run trains exactly the
    batches an uninterrupted one would."""

    def __init__(self, n_train, batch_size, per_epoch, seed):
        self.n, self.size, self.per_epoch, self.seed = n_train, min(batch_size, n_train), per_epoch, seed
        self._epoch, self._order = None, None

    def __call__(self, step) -> list[int]:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._order = list(range(self.n))
            random.Random(f"{self.seed}:{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self._order[index * self.size:(index + 1) * self.size]


def trained_mask(r) -> list[float]:
    """1.0 on each target position the loss trains (after the shift by one), else 0.0."""
    return [1.0 if w else 0.0 for w in r.weights[1:]]


def training_datums(rendered) -> list:
    """Datums with weights 1/(trained tokens): each datum contributes its mean NLL to the loss (the
    cookbook default since its issue 271: long answers do not dominate a batch)."""
    datums = []
    for r in rendered:
        n = sum(1 for w in r.weights[1:] if w) or 1
        datums.append(to_datum(Rendered(r.tokens, [w / n for w in r.weights])))
    return datums


def batch_nll(result, masks) -> float:
    """NLL per trained token of a forward(_backward) result, from the per-datum target logprobs."""
    total = count = 0.0
    for out, mask in zip(result.loss_fn_outputs, masks):
        logprobs = out["logprobs"].tolist()
        total -= sum(lp * m for lp, m in zip(logprobs, mask))
        count += sum(mask)
    return total / max(count, 1.0)


def training_client(service, model_name, lora_rank, seed, *, resume_from=None, position="", init_from=None,
                    train_unembed=True):
    """The training client: the checkpoint --resume continues from (weights and optimizer state; `position`
    says where, e.g. "batch 12"), else the weights of --init-from with a fresh optimizer, else a new LoRA.
    A restored client trains the layers its checkpoint trained: `train_unembed` (--no-train-unembed) only
    shapes a new LoRA, and --resume refuses a changed value (RESUME_KEYS)."""
    import tinker

    if resume_from:
        try:
            tc = service.create_training_client_from_state_with_optimizer(resume_from["state_path"]).result()
        except tinker.NotFoundError as e:  # the store lost it: say which path, not "run again"
            raise tinker_failure(e, "--resume", resume_from["state_path"]) from e
        say(f"resumed from {resume_from['state_path']} at {position}")
        return tc
    if init_from:
        try:
            return service.create_training_client_from_state(init_from).result()
        except tinker.NotFoundError as e:
            raise tinker_failure(e, "--init-from", init_from) from e
    # The SDK's default trains the output head too (train_unembed=True); a LoRA on it is the one vLLM may refuse.
    head = {} if train_unembed else {"train_unembed": False}
    return service.create_lora_training_client(base_model=model_name, rank=lora_rank, seed=seed, **head).result()
# ==== END SHARED CODE (sha256 4f19bec695aa) ====


if __name__ == "__main__":
    exit_process(run_cli(main))
