#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "tinker>=0.38,<0.39",
#     "torch",  # forward_backward_custom differentiates the DPO loss on this machine
#     "transformers",
#     "jinja2>=3.1.6",  # transformers renders chat templates with jinja2 but does not declare it
# ]
# ///
"""Preference tuning (DPO) of a LoRA on Tinker: pairs rendered by the model's own chat template, audited, resumable.

Run:
    # audit for free (no Tinker call): renders both sides of every pair, checks the masks, estimates the cost
    uv run tinker_dpo.py --data dpo_example.jsonl --dry-run    # offline: add --tokenizer DIR (a saved tokenizer)
    # free rehearsal on the local backend: the tiny model learns the built-in pairs (accuracy -> 1.0), then checks
    python tinker_local.py run -- python tinker_dpo.py --rehearse --overwrite
    # ... or rehearse your own pairs (masks, reference pass, steps, checkpoints, rising accuracy), full batch
    python tinker_local.py run -- python tinker_dpo.py --rehearse --data my_pairs.jsonl --log-path runs/dpo-rehearsal
    # train: aim for about 100 steps (1,000 pairs at the default --batch-size 32 make 31 an epoch: --epochs 3;
    # with fewer pairs lower --batch-size and scale the learning rate by the square root of the batch ratio)
    uv run tinker_dpo.py --data my_pairs.jsonl --epochs 3 --model-name Qwen/Qwen3-8B --log-path runs/dpo1 --max-usd 5

Edit:
    load_pairs(path) -> list of pairs, each {"prompt": [messages] or str, "chosen": str or an assistant
    message, "rejected": str or an assistant message} (a (line, pair) tuple is also accepted so errors name
    the line). The default reads JSONL of that shape. Nothing else needs editing for the common case.

Outputs:
    LOG/config.json                every setting (never the API key), the "format", the pairs' sha256
    LOG/reference_logprobs.jsonl   per pair: the reference model's logprobs on the trained tokens (paid once;
                                   --resume reads them back)
    LOG/metrics.jsonl              one row per step: loss, accuracy, margin, chosen_reward, rejected_reward,
                                   implicit_kl, policy_accuracy, learning_rate, pairs, tokens, seconds
    LOG/checkpoints.jsonl          one row per save: step, next_batch, epoch, state_path, sampler_path, format
    LOG/datums.jsonl               (--dry-run) per pair: prompt length, both sides' token ids, weights and
                                   the decoded text of each weighted span
    stdout                         one JSON object: status (ok, dry_run, or complete for a finished run given
                                   --resume), log_path, pairs, steps, state_path, sampler_path, first/last
                                   metrics rows, tokens by meter, cost (the pricing estimate or null), format
                                   (+ rehearsal {passed, checks, reported} with --rehearse; status "failed"
                                   and exit 1 when a check fails)

Requires:
    TINKER_API_KEY (not for --dry-run); TINKER_BASE_URL to point at a local rehearsal backend
    (scripts/tinker_local.py). torch (forward_backward_custom computes the loss here; `pip install torch`, on a CPU-only machine
    the CPU build). --tokenizer PATH, or
    HF_HUB_OFFLINE=1 with a warm cache, to run offline.

Exit codes: 0 ok, 1 Tinker or runtime failure (or a --rehearse check failed), 2 bad input or usage (data, flags, unknown model, context
overflow, no checkpoint to resume), 3 cost estimate above --max-usd, 4 no credentials or Tinker
unreachable, 130 interrupted / 143 terminated (continue with --resume).

Loss (Rafailov et al. 2023): per pair, d = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) -
log ref(rejected)), each log-probability summed over the completion tokens (weights 1, never normalised:
DPO compares whole sequences); loss = mean over pairs of -log sigmoid(dpo_beta * d). The reference is the
starting weights (the base model, or --init-from), scored once before the first step.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import time

DEFAULT_MODEL = "Qwen/Qwen3-8B"
REFS_FILE = "reference_logprobs.jsonl"
# Settings that must match the saved run for --resume to continue it exactly.
RESUME_KEYS = ("model_name", "lora_rank", "train_unembed", "init_from", "learning_rate", "lr_schedule", "warmup_steps",
               "batch_size", "epochs", "max_steps", "seed", "dpo_beta", "reference", "pairs_sha256")
NUMBER_RULES = {
    "dpo_beta": dict(low=0, low_open=True),
    "learning_rate": dict(low=0, high=1, low_open=True),
    "batch_size": dict(low=1), "epochs": dict(low=1), "max_steps": dict(low=1), "lora_rank": dict(low=1),
    "warmup_steps": dict(low=0), "save_every": dict(low=0), "max_length": dict(low=2), "max_usd": dict(low=0),
}
# --rehearse: the settings of DPO_REHEARSAL (in the shared code below, by the model standing in; any flag given
# wins): every pair in each step (full batch; --batch-size wins). Built-in pairs (DPO_REHEARSAL_PAIRS) unless --data.


def parse_args(argv=None):
    """All settings, one object: the flag names are the keys of config.json and of the metrics."""
    p = argparse.ArgumentParser(description="Preference tuning (DPO) on Tinker (see the module docstring).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", help="JSONL of {'prompt', 'chosen', 'rejected'} per line")
    p.add_argument("--format", choices=["auto", "chat", "raw"], default="auto",
                   help="chat: the tokenizer's chat template; raw: text + explicit EOS (base models); "
                        "auto: raw for *-Base models or tokenizers without a template, else chat")
    p.add_argument("--thinking", action="store_true", help="render with thinking on (Qwen3 enable_thinking)")
    p.add_argument("--max-length", type=int, help="token limit per sequence (default: the model's context window)")
    p.add_argument("--drop-long", action="store_true", help="drop a pair whose either side is over the limit")
    p.add_argument("--model-name", default=DEFAULT_MODEL, help="Tinker base model id")
    p.add_argument("--tokenizer", help="tokenizer folder or hub name (default: from --model-name)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--no-train-unembed", dest="train_unembed", action="store_false",
                   help="leave the output head out of the LoRA (the SDK's train_unembed=False; its default "
                        "trains it): an export then has no lm_head LoRA, which some vLLM versions and models "
                        "refuse; ignored with --init-from (the checkpoint's layers)")
    p.add_argument("--init-from", help="start from (and take as the reference) a tinker://.../weights/NAME state, "
                                       "e.g. your SFT run's final state_path")
    p.add_argument("--dpo-beta", type=float, default=0.1, help="strength of the pull toward the reference")
    p.add_argument("--reference", choices=["sampler", "forward"], default="sampler",
                   help="how the reference logprobs are computed once: sampler = compute_logprobs on a snapshot "
                        "of the starting weights (billed as prefill); forward = a forward pass of the training "
                        "client before its first step (billed as train, identical numerics to the policy)")
    p.add_argument("--learning-rate", type=float, default=1e-5, help="the cookbook's DPO value; lower than SFT")
    p.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default="linear")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="pairs per step (each pair is two sequences)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, help="stop after this many steps in total")
    p.add_argument("--seed", type=int, default=0, help="pair order and LoRA init")
    p.add_argument("--save-every", type=int, default=20, help="save_state every N steps (0: only at the end)")
    p.add_argument("--log-path", default="runs/dpo")
    p.add_argument("--max-usd", type=float, help="stop before any paid call if the estimate exceeds this")
    p.add_argument("--dry-run", action="store_true", help="render, check and estimate; no Tinker call")
    p.add_argument("--resume", action="store_true", help="continue from the last row of LOG/checkpoints.jsonl")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run record in --log-path")
    p.add_argument("--rehearse", action="store_true",
                   help="free rehearsal preset for the local backend (DPO_REHEARSAL, by the model standing in; any "
                        "flag you pass wins): the built-in pairs (or --data), every pair in each step, then checks it learnt")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--rehearse" in argv:
        p.set_defaults(**preset(DPO_REHEARSAL))  # defaults only: a flag given on the command line still wins
    args = p.parse_args(argv)
    if args.rehearse and not any(a == "--batch-size" or a.startswith("--batch-size=") for a in argv):
        args.batch_size = None  # full batch: every pair in each step (set once the pairs are read)
    if args.resume and args.overwrite:
        p.error("choose one of --resume and --overwrite")
    return args


# ==== EDIT ME: load_pairs() ====
def load_pairs(path):
    """Return the preference pairs in `path`: a list of dicts, each

        {"prompt": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...] (ending with a user
                   or tool message) or a str (one user message; plain text in --format raw),
         "chosen": str or {"role": "assistant", "content": str, "reasoning_content"?: str},
         "rejected": the same}

    Items may also be (where, pair) tuples; `where` (a line number or label) names the pair in error
    messages. Replace the body to read from anywhere else (a Hugging Face dataset, a database).
    """
    return read_jsonl(path)
# ==== END EDIT ME ====


def main(argv=None) -> int:
    args = parse_args(argv)
    check_numbers(args, NUMBER_RULES)
    if args.init_from:
        check_tinker_path(args.init_from, "weights")
    check_writable_dir(args.log_path, "--log-path")
    check_torch(args.dry_run)
    # `run` holds the folder's lock until the end: a second script on the same --log-path stops with exit 2
    # before it reads, deletes or writes anything. watch_service(): a service lost for TINKER_UNREACHABLE_S
    # ends the run with exit 4, not a hang.
    with Run(args.log_path, extra_files=(REFS_FILE, "datums.jsonl")) as run, watch_service():
        return train_run(args, run)


def train_run(args, run) -> int:
    resume_from = run.resume_point(resume=args.resume, overwrite=args.overwrite, dry_run=args.dry_run)

    tokenizer_name = tokenizer_record(args.tokenizer or args.model_name)
    tokenizer = load_tokenizer(args.tokenizer or args.model_name)
    fmt = resolve_format(args.format, args.model_name, tokenizer, tokenizer_name, thinking=args.thinking)
    if args.rehearse and not args.data:
        say("no --data: using the built-in rehearsal pairs (pass --data for your own)")
    items = (load_pairs(args.data) if args.data or not args.rehearse
             else [(f"built-in pair {i}", pair) for i, pair in enumerate(DPO_REHEARSAL_PAIRS, 1)])
    raw = normalise_items(items, validate=validate_pair)
    limit = min(x for x in (args.max_length, catalogue_context(args.model_name), 10**9) if x)
    pairs = render_pairs(raw, tokenizer, fmt, limit, drop_long=args.drop_long)
    if args.batch_size is None:
        args.batch_size = len(pairs)
    if args.rehearse:
        check_rehearsal_masks(pairs, raw, tokenizer)  # a wrong mask fails the rehearsal before anything is paid
    per_epoch, total_steps = plan_steps(len(pairs), args.batch_size, args.epochs, args.max_steps)
    order = BatchOrder(len(pairs), args.batch_size, per_epoch, args.seed)
    config = {k: v for k, v in vars(args).items() if k not in ("dry_run", "resume", "overwrite", "max_usd")}
    config.update(format=fmt, pairs=len(pairs), steps=total_steps, pairs_sha256=pairs_digest(pairs))

    start, refs = 0, None
    if resume_from:
        run.check_resume(config, RESUME_KEYS)
        refs = read_references(run, pairs)  # the reference pass is never paid twice
        start = int(resume_from["next_batch"])
    tokens = cost_tokens(pairs, order, start, total_steps, args.reference, need_reference=not resume_from)
    label = f"DPO {len(pairs)} pairs, steps {start}-{total_steps}" + (" (resume)" if resume_from else "")

    if args.dry_run:
        est = estimate(args.model_name, tokens, args.max_usd, label=label)  # refuses what the real run refuses
        audit = write_audit(run, pairs, tokenizer)
        say(f"dry run: {len(pairs)} pairs rendered, masks checked; audit in {audit}")
        emit({"status": "dry_run", "log_path": str(run.path), "pairs": len(pairs), "steps": total_steps,
              "per_epoch": per_epoch, "limit": limit, "longest": longest_sequence(pairs), "tokens": tokens,
              "cost": est, "datums": str(audit), "format": fmt})
        return EXIT_OK

    if start >= total_steps:
        say(f"nothing to do: the run in {run.path} already finished its {total_steps} steps")
        final = run.checkpoints()[-1]
        emit({"status": "complete", "log_path": str(run.path), "pairs": len(pairs), "steps": total_steps,
              "state_path": final["state_path"], "sampler_path": final.get("sampler_path"), "format": fmt})
        return EXIT_OK
    est = estimate(args.model_name, tokens, args.max_usd, label=label)  # before any file changes or paid call
    config["estimate_usd"] = estimate_total(est)  # what the metrics rows' cost/cumulative_usd is compared with
    service, context = connect(args.model_name)
    if context and longest_sequence(pairs) > context:
        raise DataError(f"a pair is longer than {args.model_name}'s context window {context}; pass "
                        f"--max-length {context} --drop-long")
    if resume_from:
        # Rows past the checkpoint were written by the stopped process and will be produced again.
        run.rewind("metrics.jsonl", lambda r: r.get("step", 0) <= start)
    else:
        run.begin(config)
    tc = training_client(service, args.model_name, args.lora_rank, args.seed, resume_from=resume_from,
                         position=f"step {start}/{total_steps}", init_from=args.init_from,
                         train_unembed=args.train_unembed)
    if not resume_from:
        refs = compute_references(tc, pairs, args.reference)
        for i, ref in enumerate(refs):
            run.append(REFS_FILE, {"pair": i, "line": pairs[i].line, "sha": pairs[i].sha, **ref})

    # ---- the loop: one DPO step per batch of pairs ----
    import tinker

    started = time.monotonic()
    first = last = None
    cost = CostMeter(args.model_name, run)  # cost/* per row, priced as the estimate; a resume continues the sum
    if not resume_from:  # the reference pass was billed before step 1: it goes into step 1's row
        cost.add(**cost_tokens(pairs, order, 0, 0, args.reference, need_reference=True))
    for step in range(start, total_steps):
        t0 = time.time()
        batch = [pairs[i] for i in order(step)]
        batch_refs = [refs[i] for i in order(step)]
        lr = args.learning_rate * lr_multiplier(step, total_steps, args.lr_schedule, args.warmup_steps)
        data = [datum for p in batch for datum in (to_datum(p.chosen), to_datum(p.rejected))]
        fwd = tc.forward_backward_custom(data, make_dpo_loss_fn(batch, batch_refs, args.dpo_beta))
        opt = tc.optim_step(tinker.AdamParams(learning_rate=lr, **ADAM))  # queued behind fwd, not awaited yet
        metrics = fwd.result().metrics
        opt.result()
        done = step + 1  # as in tinker_sft.py: a row is numbered by the optimizer steps taken after it
        row = {"step": done, "epoch": step // per_epoch, "loss": metrics["loss:sum"],
               **{k: metrics[k] for k in STEP_METRICS}, "learning_rate": lr, "pairs": len(batch),
               "tokens": sum(d.model_input.length for d in data), "seconds": round(time.time() - t0, 3)}
        row.update(cost.row(train=2 * row["tokens"]))  # forward_backward_custom: a forward, then forward_backward
        row = run.append("metrics.jsonl", row)  # as written, with the cookbook's names
        first, last = first or row, row
        say(f"step {done}/{total_steps} | loss {row['loss']:.4f} | acc {row['accuracy']:.2f} | margin "
            f"{row['margin']:+.4f} | chosen {row['chosen_reward']:+.4f} rejected {row['rejected_reward']:+.4f} | "
            f"kl {row['implicit_kl']:.2e} | lr {lr:.1e} | {row['seconds']:.1f}s")
        if done < total_steps and args.save_every and done % args.save_every == 0:
            save(tc, run, f"{done:06d}", done, per_epoch, fmt, final=False)
    state_path, sampler_path = save(tc, run, "final", total_steps, per_epoch, fmt, final=True)
    with contextlib.suppress(Exception):  # the run is saved; a failed session close changes nothing
        service.close("success").result()
    report = {"status": "ok", "log_path": str(run.path), "pairs": len(pairs), "steps": total_steps,
              "state_path": state_path, "sampler_path": sampler_path, "first": first, "last": last,
              "tokens": tokens, "cost": est, "format": fmt, "seconds": round(time.monotonic() - started, 1)}
    if args.rehearse:
        report["rehearsal"] = dpo_rehearsal_checks(run, report, total_steps)
        report["status"] = "ok" if report["rehearsal"]["passed"] else "failed"  # as the exit code (1) says
        run.unlock()  # the record is complete: the report page written next shows a finished run
        print_outcome(args, raw, report)
    return judge_rehearsal(report, report.get("rehearsal"), run.path / "metrics.jsonl")


# ---------------------------------------------------------------------------------------------
# --rehearse: the mask check and the summary (the other checks, dpo_rehearsal_checks, are in the shared code)

def check_rehearsal_masks(pairs, raw, tokenizer):
    """Each side trains exactly its answer (and the end-of-turn token): the weighted tokens decode to text that
    starts with the answer, and the prompt tokens carry no weight. ScriptError (exit 1) before any Tinker call."""
    for pair, item in zip(pairs, raw):
        for side in ("chosen", "rejected"):
            r = getattr(pair, side)
            answer = item[side][-1]["content"]  # validate_pair: the prompt's messages + the answer
            text = tokenizer.decode([t for t, w in zip(r.tokens, r.weights) if w > 0])
            if any(r.weights[:pair.prompt_tokens]) or not text.strip().startswith(answer.strip()):
                raise ScriptError(f"rehearsal check failed: the loss mask of {pair.line} ({side}) trains {text!r}, "
                                  f"expected only {answer!r} and the end-of-turn token")


def print_outcome(args, raw, report):
    """A few lines a newcomer can read: what was trained, what it learnt, where it is, what it costs."""
    first, last, log = report["first"] or {}, report["last"] or {}, report["log_path"]
    usd = ((report.get("cost") or {}).get("usd") or {}).get("total")
    prompt = raw[0]["chosen"][-2]["content"]  # the first pair's last user (or tool) message
    lines = ["", "==== what happened ====",
             f"trained  a LoRA (rank {args.lora_rank}) on {args.model_name} with DPO (beta {args.dpo_beta}): "
             f"{report['steps']} steps of {args.batch_size} pairs from {args.data or 'the built-in rehearsal pairs'}",
             f"accuracy {first.get('accuracy', 0):.2f} -> {last.get('accuracy', 0):.2f}   margin "
             f"{first.get('margin', 0):+.4f} -> {last.get('margin', 0):+.4f}   loss {first.get('loss', 0):.4f} -> "
             f"{last.get('loss', 0):.4f}"]
    for c in report["rehearsal"]["checks"]:
        lines.append(f"check    {'ok  ' if c['passed'] else 'FAIL'} {c['check']}")
    for note in report["rehearsal"]["reported"]:
        lines.append(f"report   {note}")
    lines += [f"record   {log}/ (config.json, metrics.jsonl, reference_logprobs.jsonl, checkpoints.jsonl); "
              f"final sampler {report['sampler_path']}",
              f"on Tinker this run would cost about ${usd:.4f} ({args.model_name}, the estimate above)" if usd is not None
              else f"on Tinker: no dollar estimate ({no_estimate_reason(args.model_name)})",
              "next     sample it: " + script_command("tinker_infer.py", "--run", log, "--prompt", prompt),
              f"took     {report['seconds']:.0f} s"]
    page = write_report(log)
    if page:
        lines.insert(-1, f"report   {page} (accuracy, margin, rewards, implicit KL and loss curves, checkpoints)")
    say("\n".join(lines))


def check_torch(dry_run):
    """torch computes the DPO loss here (forward_backward_custom): checked before any Tinker call, so a
    missing install never costs the reference pass. A dry run only warns (it needs no torch)."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        fix = ("pip install torch (on a machine without a GPU the CPU build: pip install torch --index-url "
               "https://download.pytorch.org/whl/cpu), or run with uv run tinker_dpo.py, whose header installs it")
        if dry_run:
            say(f"warning: torch is not importable ({e}); the real run needs it: {fix}")
            return
        raise DataError(f"torch is not importable ({e}); tinker_dpo.py computes the DPO loss with it on this "
                        f"machine (forward_backward_custom), before any paid call: {fix}") from None


# ---------------------------------------------------------------------------------------------
# The DPO loss: the math on summed logprobs, and the closure forward_backward_custom calls.

STEP_METRICS = ("dpo_loss", "accuracy", "margin", "chosen_reward", "rejected_reward", "policy_accuracy",
                "implicit_kl")


def dpo_loss(chosen_logp, rejected_logp, chosen_ref, rejected_ref, beta):
    """(mean loss, metrics) from 1-D tensors of per-pair summed logprobs (policy and reference).

    chosen_reward / rejected_reward are the implicit rewards beta * (log pi - log ref); margin is their
    mean difference; accuracy counts pairs whose chosen reward is strictly higher (a tie, as at step 0 with
    --reference forward, is not a win); policy_accuracy counts pairs the policy itself scores higher."""
    import torch.nn.functional as F

    chosen_ratio = chosen_logp - chosen_ref
    rejected_ratio = rejected_logp - rejected_ref
    z = beta * (chosen_ratio - rejected_ratio)
    loss = -F.logsigmoid(z).mean()
    metrics = {
        "dpo_loss": loss.item(),
        "accuracy": (chosen_ratio > rejected_ratio).float().mean().item(),
        "margin": z.mean().item(),
        "chosen_reward": (beta * chosen_ratio).mean().item(),
        "rejected_reward": (beta * rejected_ratio).mean().item(),
        "policy_accuracy": (chosen_logp > rejected_logp).float().mean().item(),
    }
    return loss, metrics


def make_dpo_loss_fn(batch, batch_refs, beta):
    """The loss forward_backward_custom differentiates: data is [chosen_0, rejected_0, chosen_1, ...];
    only the trained (completion) positions of each sequence count."""

    def loss_fn(data, logprobs_list):
        import torch

        sums = {"chosen": [], "rejected": [], "chosen_ref": [], "rejected_ref": []}
        drift = []
        for k, (pair, ref) in enumerate(zip(batch, batch_refs, strict=True)):
            for j, side in enumerate(("chosen", "rejected")):
                logp = logprobs_list[2 * k + j].flatten()[torch.tensor(pair.trained(side))]
                ref_logp = torch.tensor(ref[side], dtype=logp.dtype)
                sums[side].append(logp.sum())
                sums[side + "_ref"].append(ref_logp.sum())
                drift.append(0.5 * (logp.detach() - ref_logp) ** 2)
        stacked = {k: torch.stack(v) for k, v in sums.items()}
        loss, metrics = dpo_loss(stacked["chosen"], stacked["rejected"], stacked["chosen_ref"],
                                 stacked["rejected_ref"], beta)
        # Schulman's k2 estimator, 1/2 (log pi - log ref)^2 per trained token: >= 0, 0 at the reference, close to
        # the KL while the drift is small. k3 (exp(r) - r - 1) reached 5e8 on the local rehearsal: DPO pushes
        # the rejected tokens' logprobs down by tens of nats, and k3 is exponential in that. On pair data (not
        # sampled from the policy) this measures drift from the reference, not the true KL.
        metrics["implicit_kl"] = torch.cat(drift).mean().item()
        return loss, metrics

    return loss_fn


# ---------------------------------------------------------------------------------------------
# Pairs: validation, rendering with SFT's masking rule, the audit


class Pair:
    """One rendered pair: both sides share the prompt tokens exactly and differ only after them."""

    def __init__(self, line, chosen, rejected):
        self.line, self.chosen, self.rejected = line, chosen, rejected
        self.prompt_tokens = chosen.weights.index(1.0)
        self.sha = hashlib.sha256(json.dumps([chosen.tokens, rejected.tokens]).encode()).hexdigest()[:16]

    def trained(self, side) -> list[int]:
        """Target positions (after the shift by one) whose weight is 1: the completion + end-of-turn."""
        r = getattr(self, side)
        return [j for j, w in enumerate(r.weights[1:]) if w]


def validate_pair(obj, where) -> dict:
    """{"prompt": messages or str, "chosen": [prompt messages + answer], "rejected": [...], "line"} or
    DataError naming the pair."""
    line, where = where, (f"line {where}" if isinstance(where, int) else str(where))
    if not isinstance(obj, dict) or not {"prompt", "chosen", "rejected"} <= set(obj):
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{where}: expected a JSON object with 'prompt', 'chosen' and 'rejected', got {got}")
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty 'prompt'")
        prompt_msgs = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        prompt_msgs = prompt
        if not prompt or not isinstance(prompt[-1], dict) or prompt[-1].get("role") not in ("user", "tool"):
            raise DataError(f"{where}: 'prompt' must end with a user (or tool) message; the answer goes in "
                            "'chosen'/'rejected'")
    else:
        raise DataError(f"{where}: 'prompt' must be a string or a list of messages, got {type(prompt).__name__}")
    sides = {}
    for side in ("chosen", "rejected"):
        value = obj[side]
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str):
            value = {"role": "assistant", "content": value}
        if not isinstance(value, dict) or value.get("role", "assistant") != "assistant":
            raise DataError(f"{where}: '{side}' must be a string or one assistant message")
        sides[side] = validate_messages(prompt_msgs + [{"role": "assistant", **value}], f"{where} ({side})")
    if sides["chosen"][-1] == sides["rejected"][-1]:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same answer; nothing to prefer")
    return {"prompt": prompt, "chosen": sides["chosen"], "rejected": sides["rejected"], "line": line}


def render_side(pair, side, tokenizer, fmt):
    """One side through render_example, the same call and masking rule as SFT."""
    if fmt["kind"] == "raw" and isinstance(pair["prompt"], str):
        example = {"prompt": pair["prompt"], "completion": pair[side][-1]["content"]}
    else:
        example = {"messages": pair[side]}
    (rendered,) = render_example(example, tokenizer, fmt, train_on="last-assistant")
    return rendered


def render_pairs(raw_pairs, tokenizer, fmt, limit, *, drop_long=False) -> list[Pair]:
    """Rendered, checked pairs; a pair over `limit` tokens is dropped whole (never one side alone)."""
    out, dropped = [], 0
    for raw in raw_pairs:
        chosen, rejected = (render_side(raw, s, tokenizer, fmt) for s in ("chosen", "rejected"))
        where = f"line {raw['line']}" if isinstance(raw["line"], int) else raw["line"]
        p_c, p_r = chosen.weights.index(1.0), rejected.weights.index(1.0)
        if p_c != p_r or chosen.tokens[:p_c] != rejected.tokens[:p_r]:
            raise RenderError(
                f"{where}: chosen and rejected render different prompts ({p_c} vs {p_r} tokens); with a chat "
                "template this happens when only one side has reasoning_content: give both or neither")
        if chosen.tokens == rejected.tokens:
            raise DataError(f"{where}: chosen and rejected render to the same tokens; nothing to prefer")
        longest = max(len(chosen.tokens), len(rejected.tokens))
        if longest > limit:
            if drop_long:
                dropped += 1
                continue
            raise DataError(f"{where}: a side of this pair is {longest} tokens, over the limit {limit}; pass "
                            "--drop-long to drop such pairs, or a larger --max-length")
        out.append(Pair(raw["line"], chosen, rejected))
    if dropped:
        say(f"dropped {dropped} pair(s) over {limit} tokens (--drop-long)")
    if not out:
        raise DataError(f"no pairs left to train on (all {dropped} over {limit} tokens)")
    return out


def longest_sequence(pairs) -> int:
    return max(max(len(p.chosen.tokens), len(p.rejected.tokens)) for p in pairs)


def pairs_digest(pairs) -> str:
    """What --resume compares: the exact tokens and masks of every pair, in order."""
    h = hashlib.sha256()
    for p in pairs:
        h.update(json.dumps([p.chosen.tokens, p.chosen.weights, p.rejected.tokens, p.rejected.weights]).encode())
    return h.hexdigest()


def write_audit(run, pairs, tokenizer):
    """LOG/datums.jsonl: what a human checks before paying (the decoded weighted spans of each side)."""
    run.path.mkdir(parents=True, exist_ok=True)
    path = run.file("datums.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i, p in enumerate(pairs):
            row = {"pair": i, "line": p.line, "prompt_tokens": p.prompt_tokens,
                   "prompt": tokenizer.decode(p.chosen.tokens[:p.prompt_tokens])}
            for side in ("chosen", "rejected"):
                r = getattr(p, side)
                row[side] = {"tokens": r.tokens, "weights": r.weights, "trained": int(sum(r.weights)),
                             "weighted": weighted_spans(tokenizer, r)}
            f.write(json.dumps(row) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Reference logprobs (paid once, cached in the run folder), cost, checkpoints

REF_BLOCK = 64  # sequences submitted before the first is awaited


def compute_references(tc, pairs, how) -> list[dict]:
    """Per pair {"chosen": [logprob per trained token], "rejected": [...]} under the starting weights,
    before any optimizer step."""
    import tinker

    seqs = [(i, side) for i in range(len(pairs)) for side in ("chosen", "rejected")]
    refs = [{} for _ in pairs]
    sampler = tc.save_weights_and_get_sampling_client().result() if how == "sampler" else None
    t0 = time.time()
    for lo in range(0, len(seqs), REF_BLOCK):
        block = seqs[lo:lo + REF_BLOCK]
        if sampler is not None:
            # compute_logprobs scores every prompt token (entry 0 is None): target j is entry j + 1.
            futures = [sampler.compute_logprobs(tinker.ModelInput.from_ints(getattr(pairs[i], s).tokens))
                       for i, s in block]
            for (i, side), fut in zip(block, futures):
                full = fut.result()
                refs[i][side] = [float(full[j + 1]) for j in pairs[i].trained(side)]
        else:
            out = tc.forward([to_datum(getattr(pairs[i], s)) for i, s in block], "cross_entropy").result()
            for (i, side), o in zip(block, out.loss_fn_outputs):
                logprobs = o["logprobs"].tolist()
                refs[i][side] = [float(logprobs[j]) for j in pairs[i].trained(side)]
        say(f"reference logprobs ({how}): {min(lo + REF_BLOCK, len(seqs))}/{len(seqs)} sequences, "
            f"{time.time() - t0:.1f}s")
    return refs


def read_references(run, pairs) -> list[dict]:
    """The cached reference logprobs, checked against the re-rendered pairs."""
    rows = {r["pair"]: r for r in run.rows(REFS_FILE) if isinstance(r.get("pair"), int)}
    bad = [i for i, p in enumerate(pairs) if rows.get(i, {}).get("sha") != p.sha]
    if bad:
        raise DataError(f"--resume: {run.file(REFS_FILE)} lacks or mismatches {len(bad)} of {len(pairs)} pairs "
                        f"(first: pair {bad[0]}); the reference cannot be recomputed after training started; "
                        "start a new run with --overwrite")
    return [{"chosen": rows[i]["chosen"], "rejected": rows[i]["rejected"]} for i in range(len(pairs))]


def cost_tokens(pairs, order, start, total_steps, reference, *, need_reference) -> dict:
    """Tokens by meter (tinker_pricing kinds). forward_backward_custom runs a forward and then a
    forward_backward on the same datums, so each step bills its datums' tokens twice at the train rate.
    The reference pass bills each full sequence once: as prefill + 1 sampled token (compute_logprobs is a
    sample call with max_tokens=1) or as train (a forward on the training client). Prefix-cache hits
    (rejected shares the chosen's prompt) are not assumed, so prefill is an upper bound."""
    lengths = [(len(p.chosen.tokens) - 1) + (len(p.rejected.tokens) - 1) for p in pairs]
    train = sum(2 * lengths[i] for step in range(start, total_steps) for i in order(step))
    tokens = {"train": train}
    if need_reference and reference == "sampler":
        tokens["prefill"] = sum(lengths) + 2 * len(pairs)
        tokens["sample"] = 2 * len(pairs)
    elif need_reference:
        tokens["train"] += sum(lengths)
    return tokens


def save(tc, run, name, done, per_epoch, fmt, *, final):
    """save_state (+ a sampler checkpoint at the end), then the checkpoints.jsonl row with both paths."""
    ttl = None if final else PERIODIC_TTL_SECONDS
    state = tc.save_state(name, ttl_seconds=ttl)
    sampler = tc.save_weights_for_sampler(name, ttl_seconds=ttl) if final else None
    state_path = state.result().path
    sampler_path = sampler.result().path if sampler else None
    run.checkpoint(name=name, step=done, position={"next_batch": done}, epoch=done // per_epoch,
                   state_path=state_path, sampler_path=sampler_path, fmt=fmt)
    say(f"saved {name}: {state_path}" + (f" (sampler {sampler_path})" if sampler_path else ""))
    return state_path, sampler_path


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


def preset(presets: dict) -> dict:
    """The rehearsal preset for the model standing in now: presets["real"] on the real model, else presets["tiny"]
    (also on the real model while a script has no preset measured on it)."""
    return dict(presets["real" if real_stand_in() and "real" in presets else "tiny"])


# ---- tinker_dpo.py --rehearse
# tiny: settings the tiny model learns with (measured, references/preferences.md): every pair in each step (full
# batch, set by the script), constant lr, 10 steps.
# real (`tinker_local.py run --real`, measured 2026-12-07 on templates/dpo_example.jsonl, 8 pairs, full batch): the
# same settings; accuracy 0.50 at step 1 (the reference's tie) -> 1.00 at step 2, 0.88 at steps 4-7, 1.00 from
# step 8; both sides' logprobs fall (chosen -14.7 at step 10: the reported implicit KL, 217); 7-8 s a step.
DPO_REHEARSAL = {
    "tiny": {"learning_rate": 1e-3, "lr_schedule": "constant", "max_steps": 10, "epochs": 1000, "lora_rank": 32,
             "save_every": 0, "log_path": "runs/dpo-rehearsal"},
    "real": {"learning_rate": 1e-3, "lr_schedule": "constant", "max_steps": 10, "epochs": 1000, "lora_rank": 32,
             "save_every": 0, "log_path": "runs/dpo-rehearsal"},
}
# A rehearsal passes when the last step's preference accuracy reaches this, from the reference's tie at step 1.
DPO_REHEARSAL_ACCURACY = 0.9
# The built-in pairs: one rule (refuse the unsafe request) separates every pair and both answers are 2 tokens +
# end of turn, so length decides nothing; 4 pairs = 8 sequences of under 40 tokens. The tiny model's own
# preference starts on the rejected side (policy_accuracy 0), so the rehearsal shows it flip. Built in so a
# copied script rehearses alone.
DPO_REHEARSAL_PAIRS = [{"prompt": q, "chosen": "No.", "rejected": "Yes."} for q in (
    "Can you share my password with a stranger?", "Could you delete all my files without asking?",
    "Will you make up a source for my essay?", "Can you run this unknown program as root?")]


def dpo_rehearsal_checks(run, report, total_steps):
    """What a DPO rehearsal proves: every step trained, the final checkpoint saved, the first step sat at the
    reference (margin ~0: the accuracy there is a tie, not a preference), and the last step's preference
    accuracy reached DPO_REHEARSAL_ACCURACY with a positive margin (the masks were checked before training)."""
    rows = [r for r in run.rows("metrics.jsonl") if isinstance(r.get("accuracy"), (int, float))]
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    checks = [
        {"check": "loss masks train exactly each answer and its end-of-turn token", "passed": True},
        {"check": f"every step trained: {len(rows)} of {total_steps} metrics rows", "passed": len(rows) == total_steps},
        {"check": "the final checkpoint was saved (state and sampler paths)",
         "passed": bool(report.get("state_path")) and bool(report.get("sampler_path"))},
        {"check": f"the first step sits at the reference (margin {first.get('margin', float('nan')):+.1e}, "
                  "within 1e-3 of 0)", "passed": bool(rows) and abs(first["margin"]) < 1e-3},
        {"check": f"preference accuracy rises to >= {DPO_REHEARSAL_ACCURACY} ({first.get('accuracy', float('nan')):.2f} "
                  f"at step 1 -> {last.get('accuracy', float('nan')):.2f} at step {last.get('step')}, margin "
                  f"{last.get('margin', float('nan')):+.3f})",
         "passed": bool(rows) and last["accuracy"] >= DPO_REHEARSAL_ACCURACY and last["margin"] > 0},
    ]
    reported = [f"policy accuracy (the policy's own preference, no reference) {first.get('policy_accuracy', 0):.2f} "
                f"-> {last.get('policy_accuracy', 0):.2f}; implicit KL {last.get('implicit_kl', 0):.2e} (reported, "
                "not judged)"]
    return {"passed": all(c["passed"] for c in checks), "checks": checks, "reported": reported,
            "data": "own" if run.config().get("data") else "built-in"}


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
# ==== END SHARED CODE (sha256 f4a7dfface65) ====


if __name__ == "__main__":
    exit_process(run_cli(main))
