#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "tinker>=0.38,<0.39",
#     "transformers",
#     "jinja2>=3.1.6",  # transformers renders chat templates with jinja2 but does not declare it
#     "numpy",
# ]
# ///
"""On-policy distillation on Tinker: the student samples, a teacher grades every sampled token (reverse KL).

Run:
    # check for free (no Tinker call): renders every prompt, checks the teacher shares the student's
    # tokenizer and chat template, estimates the cost including the teacher's prefill
    uv run tinker_distill.py --dry-run --teacher runs/sft1 --prompts data/train.jsonl
    # distil: from a bigger model of the same family, or from the final sampler checkpoint of an SFT/RL run
    uv run tinker_distill.py --model-name Qwen/Qwen3.5-4B --teacher Qwen/Qwen3.5-397B-A17B --log-path runs/distill1 --max-usd 5
    uv run tinker_distill.py --teacher runs/sft1 --prompts data/train.jsonl --log-path runs/distill2 --max-usd 5

Edit:
    The block marked `# ==== EDIT ME ====` below the settings: PROMPTS (or --prompts FILE.jsonl) and
    load_prompts(path) -> list of prompts, each a list of chat messages ending with a user turn, or a str
    for a base model. There is no reward function: the teacher's logprobs are the only signal.

Outputs:
    LOG/config.json       every setting (never the API key), the teacher (path, base model) and the "format"
    LOG/metrics.jsonl     one row per iteration: reverse_kl (mean per sampled token, student minus teacher
                          logprob), teacher/student logprob means, tokens sampled/trained/teacher-scored,
                          frac_truncated, loss, sampler/learner KL, seconds, the prompts and sampling seeds
    LOG/checkpoints.jsonl one row per save: name, step, next_iteration, epoch, state_path, sampler_path, format
    stdout                one JSON object: status, log_path, iterations, state_path, sampler_path,
                          reverse_kl {first, last}, teacher, format, sampling

Requires:
    TINKER_API_KEY (not for --dry-run); TINKER_BASE_URL to point at a local rehearsal backend
    (scripts/tinker_local.py). --tokenizer / --teacher-tokenizer PATH, or HF_HUB_OFFLINE=1 with a warm
    cache, to run offline.

Exit codes: 0 ok, 1 Tinker or runtime failure, 2 bad input or usage (prompts, flags, unknown model, a
teacher whose tokenizer or chat template differs from the student's), 3 cost estimate above --max-usd,
4 no credentials or Tinker unreachable, 130 interrupted / 143 terminated (resume with --resume).

Why a sibling of tinker_rl.py rather than a --teacher flag on it: distillation has no reward function,
no groups (advantages are not compared inside a group, so --group-size only shares a prompt's prefill)
and a different datum (one advantage per token from the teacher instead of one per episode). Grafted
onto the RL loop, every RL rule (tied groups, reward contracts, environments) would need an exception.

The recipe (tinker-cookbook distillation/train_on_policy.py, incorporate_kl_penalty): per iteration,
snapshot the student into a sampling client; sample --group-size completions of each of --batch-size
prompts; the teacher's compute_logprobs on the same tokens (prompt + completion) scores each sampled
token; advantage = -(student logprob - teacher logprob) * --kl-coef on completion tokens (the negative
per-token reverse KL), 0 on prompt tokens; forward_backward("importance_sampling") with the sampler's
logprobs as the behaviour policy, optim_step submitted right behind it. Teacher and student must share
the tokenizer and chat template: the teacher scores the student's token ids as they are.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

# Settings a --resume must repeat: any other value would make the resumed run a different run.
RESUME_KEYS = ("model_name", "teacher", "teacher_base", "lora_rank", "train_unembed", "learning_rate", "batch_size",
               "group_size", "max_tokens", "temperature", "kl_coef", "seed", "prompts_sha256", "init_from")
# --rehearse: the settings of DISTILL_REHEARSAL (in the shared code below, by the model standing in; any flag given
# wins). Without --teacher the rehearsal first trains its own teacher on the same base (REHEARSAL_QA, SFT's
# rehearsal recipe; DISTILL_REHEARSAL_TEACHER), so the teacher samples differently from the untrained student;
# without --prompts the student answers REHEARSAL_QA's questions.


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="On-policy distillation on Tinker: the student samples, the teacher's logprobs grade it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model-name", default="Qwen/Qwen3-8B", help="the student (trained with LoRA)")
    p.add_argument("--tokenizer", default=None, help="student tokenizer folder or hub id (default: the model's)")
    p.add_argument("--teacher", default=None,
                   help="a model name, a tinker://.../sampler_weights/NAME path, or a run record folder "
                        "(LOG of tinker_sft.py / tinker_rl.py: its final sampler checkpoint)")
    p.add_argument("--teacher-base", default=None,
                   help="base model of a tinker:// teacher (default: asked from Tinker; needed for --dry-run)")
    p.add_argument("--teacher-tokenizer", default=None,
                   help="teacher tokenizer folder or hub id (default: the teacher's base model's)")
    p.add_argument("--prompts", default=None,
                   help="JSONL of {'messages': [...]} or {'prompt': str}; a trailing assistant turn is dropped, "
                        "so an SFT data file works (default: PROMPTS in the EDIT ME block)")
    p.add_argument("--lora-rank", type=int, default=32, help="ignored with --init-from (the checkpoint's rank)")
    p.add_argument("--no-train-unembed", dest="train_unembed", action="store_false",
                   help="leave the output head out of the LoRA (the SDK's train_unembed=False; its default "
                        "trains it): an export then has no lm_head LoRA, which some vLLM versions and models "
                        "refuse; ignored with --init-from (the checkpoint's layers)")
    p.add_argument("--init-from", default=None,
                   help="start the student from a tinker://.../weights/NAME state, weights only, fresh optimizer "
                        "(e.g. the state_path of an SFT run's final checkpoint)")
    p.add_argument("--learning-rate", type=float, default=1e-4, help="cookbook distillation recipes: 1e-4 (LoRA)")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per iteration")
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt (they share its prefill)")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens per sample")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--kl-coef", type=float, default=1.0, help="advantage = -kl_coef * (student - teacher logprob)")
    p.add_argument("--save-every", type=int, default=10, help="iterations between save_state; 0 = only final")
    p.add_argument("--log-path", default="runs/distill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-usd", type=float, default=None, help="stop before any paid call if the estimate is above")
    p.add_argument("--dry-run", action="store_true", help="render and check, no Tinker call")
    p.add_argument("--resume", action="store_true", help="continue from the last row of checkpoints.jsonl")
    p.add_argument("--overwrite", action="store_true", help="start over in an existing --log-path")
    p.add_argument("--rehearse", action="store_true",
                   help="free rehearsal preset for the local backend (DISTILL_REHEARSAL, by the model standing in; "
                        "any flag you pass wins): without --teacher, a teacher trained first on the same base; then checks the "
                        "reverse KL halves")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--rehearse" in argv:
        p.set_defaults(**preset(DISTILL_REHEARSAL))  # defaults only: a flag given on the command line still wins
    args = p.parse_args(argv)
    args.train_teacher = bool(args.rehearse and not args.teacher)
    if args.train_teacher:  # the teacher is a checkpoint of the student's own base, trained before the run
        args.teacher = args.model_name
        args.teacher_tokenizer = args.teacher_tokenizer or args.tokenizer
    return args


# ==== EDIT ME: PROMPTS / load_prompts() ====
# Prompts the student answers and the teacher grades. No answers are needed: the teacher's opinion of
# every token the student samples is the training signal. Use prompts from the distribution you care
# about; the student only learns where it samples.

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a lighthouse.",
    "What is 17 * 23? Show the steps briefly.",
    "Give three tips for writing a clear commit message.",
    "Translate 'Where is the train station?' into French and German.",
    "Summarise the rules of tic-tac-toe in one paragraph.",
    "Name two differences between a list and a tuple in Python.",
    "Suggest a name for a bakery that sells only bread, and say why.",
    "What causes the seasons on Earth?",
    "Write a limerick about a cat who learns to code.",
    "How many minutes are in a week? Explain the arithmetic.",
    "Describe the water cycle for a ten-year-old.",
    "What is the capital of Australia, and why is it not Sydney?",
    "List the planets of the solar system in order from the Sun.",
    "Give a one-sentence definition of entropy in information theory.",
    "Write a polite email declining a meeting invitation.",
]


def load_prompts(path):
    """The prompts to distil on: a list where each item is a list of {"role", "content"} messages ending
    with a user (or tool) turn, rendered with the student's chat template, or a str (raw text for a base
    model; a user message for a chat model).

    Contract: return a non-empty list; the order is the order iterations draw from (shuffled per epoch
    by --seed). With --prompts FILE.jsonl each line is {"messages": [...]} or {"prompt": str}; a
    trailing assistant message is dropped, so SFT data doubles as prompts.
    """
    if not path:
        return list(PROMPTS)
    prompts = []
    for line_no, obj in read_jsonl(path, "--prompts"):
        where = f"{path} line {line_no}"
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
            continue
        if not isinstance(obj, dict) or "messages" not in obj:
            raise DataError(f"{where}: expected {{'messages': [...]}} or {{'prompt': str}}")
        messages = validate_messages(obj["messages"], where, need_assistant=False)
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages or messages[-1]["role"] not in ("user", "tool"):
            raise DataError(f"{where}: the prompt must end with a user (or tool) message")
        prompts.append(messages)
    return prompts

# ==== END OF EDIT ME ====


def main(argv=None):
    args = parse_args(argv)
    check_settings(args)
    student = prepare_student(args)
    teacher = describe_teacher(args)
    if teacher.tokenizer is not None:
        check_same_rendering(student, teacher)
    if args.max_usd is not None and load_pricing() is None:  # exit 3 before any Tinker call, dry run or not
        estimate(args.model_name, {}, args.max_usd, label="distill")
    prompt_lengths = [len(t) for t in student.prompts]
    say(f"{len(prompt_lengths)} prompts, {min(prompt_lengths)}-{max(prompt_lengths)} tokens; teacher {teacher.label}; "
        f"{args.batch_size} prompts x {args.group_size} samples x <= {args.max_tokens} tokens per iteration")

    if args.dry_run:
        if teacher.tokenizer is None:
            raise DataError(f"--dry-run cannot check the teacher {args.teacher} offline: its base model is asked "
                            "from Tinker; pass --teacher-base MODEL (or the run record folder as --teacher)")
        check_context(args, student.prompts, catalogue_context(args.model_name))
        say("first prompt as the student and the teacher see it:\n" + student.tokenizer.decode(student.prompts[0]))
        usd = preflight(args, teacher.base, prompt_lengths, 0)
        emit({"status": "dry_run", "prompts": len(prompt_lengths),
              "prompt_tokens": {"min": min(prompt_lengths), "mean": round(sum(prompt_lengths) / len(prompt_lengths), 1),
                                "max": max(prompt_lengths)},
              "max_tokens": args.max_tokens, "teacher": teacher.record(), "estimate_usd": usd,
              "format": student.fmt})
        return 0
    # `run` holds the folder's lock until the end: a second script on the same --log-path stops with exit 2
    # before it reads, deletes or writes anything. watch_service(): a service lost for TINKER_UNREACHABLE_S
    # ends the run with exit 4, not a hang.
    with Run(args.log_path) as run, watch_service():
        return train_run(args, student, teacher, prompt_lengths, run)


def train_run(args, student, teacher, prompt_lengths, run):
    started = time.monotonic()
    service, context_window = connect(args.model_name)
    check_context(args, student.prompts, context_window)
    if args.train_teacher:
        teacher.path = train_rehearsal_teacher(service, args.model_name, args.lora_rank, args.seed,
                                               student.tokenizer, student.fmt)
        teacher.label = f"{teacher.path} (trained first on the built-in answers)"
    teacher_client = open_teacher(service, teacher, args)  # free: opening a sampler is not metered
    if teacher.fmt is None:
        check_same_rendering(student, teacher)
    resume_row = run.resume_point(resume=args.resume, overwrite=args.overwrite)
    config = {**vars(args), "teacher": teacher.path or teacher.base, "teacher_base": teacher.base,
              "teacher_record": teacher.record(), "prompts_sha256": prompts_digest(student.prompts),
              "n_prompts": len(student.prompts), "context_window": context_window, "format": student.fmt}
    start = resume_row["next_iteration"] if resume_row else 0
    if resume_row:
        run.check_resume(config, RESUME_KEYS)
    config["estimate_usd"] = preflight(args, teacher.base, prompt_lengths, start)  # compared with cost/cumulative_usd
    if resume_row:
        run.rewind("metrics.jsonl", lambda r: r.get("iteration", -1) < start)
    else:
        run.begin(config)
    tc = training_client(service, args.model_name, args.lora_rank, args.seed, resume_from=resume_row,
                         position=f"iteration {start}", init_from=args.init_from,
                         train_unembed=args.train_unembed)
    if args.init_from and not resume_row:
        say(f"student starts from {args.init_from} (weights only, fresh optimizer)")

    order = BatchOrder(len(student.prompts), args.batch_size,
                       max(len(student.prompts) // args.batch_size, 1), args.seed)
    room = max_tokens_with_room(args.max_tokens, prompt_lengths, context_window)
    gate = RequestGate(MAX_IN_FLIGHT)  # sample and compute_logprobs requests: bounded, a 429 retried
    cost = CostMeter(args.model_name, run)  # cost/* per row, priced as the estimate; a resume continues the sum
    final = resume_row if resume_row and start >= args.iterations else None
    for it in range(start, args.iterations):
        t0 = time.time()
        sampler = tc.save_weights_and_get_sampling_client().result()
        indices = order(it)
        seeds = [sampling_seed(args.seed, it, slot) for slot in range(len(indices))]
        sequences = asyncio.run(sample_and_grade(gate, sampler, teacher_client, [student.prompts[i] for i in indices],
                                                 seeds, args.group_size, room, args.temperature, student.fmt["stop"]))
        t1 = time.time()
        datums, reverse_kl, stats = [], [], {"teacher": [], "student": []}
        for seq in sequences:
            datum, kl = distill_datum(seq.prompt, seq.completion, seq.logprobs, seq.teacher_logprobs, args.kl_coef)
            datums.append(datum)
            reverse_kl += kl
            stats["student"] += seq.logprobs
            stats["teacher"] += seq.teacher_logprobs[len(seq.prompt):]
        result = train_step(tc, datums, "importance_sampling", None, args.learning_rate)
        t2 = time.time()
        row = {
            "iteration": it, "reverse_kl": mean(reverse_kl),
            "teacher_logprob": mean(stats["teacher"]), "student_logprob": mean(stats["student"]),
            "loss_sum": result.metrics.get("loss:sum"),
            **kl_metrics(datums, [completion_mask(s) for s in sequences], result.loss_fn_outputs),
            "sequences": len(sequences), "frac_truncated": mean([s.truncated for s in sequences]),
            "tokens_sampled": len(reverse_kl), "tokens_trained": sum(d.model_input.length for d in datums),
            "tokens_teacher": sum(len(s.prompt) + len(s.completion) for s in sequences),
            "kl_coef": args.kl_coef, "learning_rate": args.learning_rate,
            "seconds_sampling_and_teacher": t1 - t0, "seconds_training": t2 - t1,
            "sample_retries": gate.take_retries(),
            "prompts": indices, "sampling_seeds": seeds,
        }
        cost.add(teacher.base, prefill=row["tokens_teacher"], sample=row["sequences"])  # compute_logprobs: max_tokens=1
        row.update(cost.row(train=row["tokens_trained"], **sample_call_tokens(
            sum(len(student.prompts[i]) for i in indices), args.group_size, row["tokens_sampled"])))
        run.append("metrics.jsonl", row)
        say(f"iter {it + 1}/{args.iterations} | reverse KL {row['reverse_kl']:.4f} | teacher lp "
            f"{row['teacher_logprob']:.3f} | student lp {row['student_logprob']:.3f} | trunc "
            f"{row['frac_truncated']:.2f} | sample+teacher {t1 - t0:.1f}s | train {t2 - t1:.1f}s")
        done = it + 1
        if args.save_every and done % args.save_every == 0 and done < args.iterations:
            save_checkpoint(tc, run, f"{done:06d}", done, done * args.batch_size // len(student.prompts),
                            student.fmt, final=False)
    if final is None:
        final = save_checkpoint(tc, run, "final", args.iterations,
                                args.iterations * args.batch_size // len(student.prompts), student.fmt, final=True)
    curve = [r["reverse_kl"] for r in run.rows("metrics.jsonl")]
    report = {"status": "ok", "log_path": str(run.path), "iterations": args.iterations,
              "state_path": final["state_path"], "sampler_path": final["sampler_path"],
              "reverse_kl": {"first": curve[0] if curve else None, "last": curve[-1] if curve else None},
              "teacher": teacher.record(), "format": student.fmt,
              "sampling": {"model_path": final["sampler_path"], "stop": student.fmt["stop"],
                           "hint": script_command("tinker_infer.py", "--run", run.path, "--prompt", student.question)}}
    if args.rehearse:
        report["rehearsal"] = distill_rehearsal_checks(run, report, args.iterations)
        report["estimate_usd"], report["seconds"] = config["estimate_usd"], round(time.monotonic() - started, 1)
        report["status"] = "ok" if report["rehearsal"]["passed"] else "failed"  # as the exit code (1) says
        run.unlock()  # the record is complete: the report page written next shows a finished run
        print_outcome(args, student, report)
    return judge_rehearsal(report, report.get("rehearsal"), run.path / "metrics.jsonl")


# ---------------------------------------------------------------------------------------------
# --rehearse: the summary (the teacher trained first, train_rehearsal_teacher, and the checks,
# distill_rehearsal_checks, are in the shared code)

def print_outcome(args, student, report):
    """A few lines a newcomer can read: what was distilled, how far it moved, where it is, what it costs."""
    log, usd = report["log_path"], report.get("estimate_usd")
    lines = ["", "==== what happened ====",
             f"distilled  {report['teacher']['teacher']} into a LoRA (rank {args.lora_rank}) on {args.model_name}: "
             f"{args.iterations} iterations of {args.batch_size} prompts x {args.group_size} samples x <= "
             f"{args.max_tokens} tokens"]
    for c in report["rehearsal"]["checks"]:
        lines.append(f"check    {'ok  ' if c['passed'] else 'FAIL'} {c['check']}")
    for note in report["rehearsal"]["reported"]:
        lines.append(f"report   {note}")
    lines += [f"record   {log}/ (config.json, metrics.jsonl, checkpoints.jsonl); final sampler {report['sampler_path']}",
              f"on Tinker this run would cost about ${usd:.4f} ({args.model_name} and the teacher's prefill, the "
              "estimate above; the rehearsal teacher's own training is not in it)" if usd is not None
              else "on Tinker: no dollar estimate "
                   f"({no_estimate_reason(args.model_name, report['teacher']['base_model'])})",
              "next     sample it: " + script_command("tinker_infer.py", "--run", log, "--prompt", student.question),
              f"took     {report['seconds']:.0f} s"]
    page = write_report(log)
    if page:
        lines.insert(-1, f"report   {page} (reverse KL, teacher and student logprob curves, checkpoints)")
    say("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# The datum: one per sampled sequence, an advantage per token from the teacher


def distill_datum(prompt, completion, sampler_logprobs, teacher_logprobs, kl_coef):
    """(importance_sampling Datum, per-token reverse KL) of one sampled sequence.

    prompt, completion: token ids; sampler_logprobs: the student sampler's logprob of each completion
    token; teacher_logprobs: compute_logprobs(prompt + completion), one per token, None first.
    The datum is shifted by one (input tokens[:-1], targets tokens[1:]): position i predicts token i+1,
    so completion token j sits at position len(prompt) - 1 + j. There the behaviour logprob is the
    sampler's, and the advantage is -kl_coef * (student - teacher) = kl_coef * (teacher - student);
    every prompt position carries logprob 0 and advantage 0 (nothing to learn about the prompt).
    """
    p, c = len(prompt), len(completion)
    if p < 1 or c < 1:
        raise ValueError(f"a sequence needs a prompt and a completion (got {p} and {c} tokens)")
    if len(sampler_logprobs) != c or len(teacher_logprobs) != p + c:
        raise ValueError(f"logprob lengths {len(sampler_logprobs)} (sampler) and {len(teacher_logprobs)} (teacher) "
                         f"do not match {c} completion tokens after a {p}-token prompt")
    teacher = teacher_logprobs[p:]
    if any(t is None for t in teacher):
        raise ValueError("the teacher returned no logprob for a completion token")
    reverse_kl = [float(s) - float(t) for s, t in zip(sampler_logprobs, teacher)]
    datum = rl_datum(list(prompt) + list(completion), [0.0] * p + [float(s) for s in sampler_logprobs],
                     [0.0] * p + [-kl_coef * d for d in reverse_kl])
    return datum, reverse_kl


def completion_mask(seq):
    """1 on the datum positions that predict a completion token (after the shift by one)."""
    return [0.0] * (len(seq.prompt) - 1) + [1.0] * len(seq.completion)


# ---------------------------------------------------------------------------------------------
# Sampling and grading: every prompt in flight, each sequence graded as soon as it is sampled


@dataclasses.dataclass
class Graded:
    prompt: list
    completion: list
    logprobs: list
    teacher_logprobs: list
    truncated: bool


async def sample_and_grade(gate, sampler, teacher, prompts, seeds, group_size, max_tokens, temperature, stop):
    """group_size samples of each prompt from the student, each scored by the teacher's compute_logprobs
    on prompt + completion, every request through `gate` (bounded, retried). Returns Graded sequences in
    prompt order, samples in the order sampled."""
    import tinker

    async def grade(prompt, seq):
        scored = await gate.call(teacher.compute_logprobs, tinker.ModelInput.from_ints(list(prompt) + list(seq.tokens)))
        return Graded(list(prompt), list(seq.tokens), list(seq.logprobs), list(scored), seq.stop_reason == "length")

    async def one_prompt(prompt, seed):
        params = tinker.SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop, seed=seed)
        response = await gate.call(sampler.sample, tinker.ModelInput.from_ints(prompt), num_samples=group_size,
                                   sampling_params=params)
        kept = [s for s in response.sequences if s.tokens]  # an empty completion has nothing to grade
        return await asyncio.gather(*(grade(prompt, s) for s in kept))

    groups = await asyncio.gather(*(one_prompt(p, s) for p, s in zip(prompts, seeds)))
    sequences = [s for g in groups for s in g]
    if not sequences:
        raise ScriptError("the student sampled no tokens for any prompt this iteration; check --max-tokens")
    return sequences


def sampling_seed(seed, iteration, slot):
    """The sampler seed of one prompt slot: a resumed run samples what an uninterrupted one would."""
    return random.Random(f"{seed}:{iteration}:{slot}").randrange(2 ** 31)


def mean(values):
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------------------------------------
# Student, teacher, and the check that they read the same tokens the same way


@dataclasses.dataclass
class Student:
    tokenizer: object
    fmt: dict
    prompts: list  # rendered prompt token ids, one per prompt
    question: str = "Hello"  # the --prompt of the printed sample command: the first prompt's last user message


@dataclasses.dataclass
class Teacher:
    label: str  # how the user named it, for messages
    base: str | None  # the base model the teacher samples on (priced, tokenizer default)
    path: str | None  # tinker://.../sampler_weights/NAME, or None for a base model
    tokenizer: object = None
    fmt: dict | None = None  # the teacher's own format (from its run record, or its tokenizer)
    tokenizer_name: str | None = None

    def record(self):
        return {"teacher": self.label, "base_model": self.base, "model_path": self.path,
                "tokenizer": self.tokenizer_name}


def check_settings(args):
    check_numbers(args, {
        "lora_rank": dict(low=1), "learning_rate": dict(low=0, low_open=True), "iterations": dict(low=1),
        "batch_size": dict(low=1), "group_size": dict(low=1), "max_tokens": dict(low=1),
        "temperature": dict(low=0, low_open=True), "kl_coef": dict(low=0, low_open=True),
        "save_every": dict(low=0), "max_usd": dict(low=0),
    })
    if not args.teacher:
        raise DataError("no teacher: pass --teacher MODEL (same tokenizer and chat template as --model-name), a tinker://.../sampler_weights/NAME "
                        "path, or the log folder of an SFT/RL run")
    if args.resume and args.overwrite:
        raise DataError("--resume and --overwrite contradict each other; pick one")
    check_writable_dir(args.log_path, "--log-path")
    if args.prompts:
        check_readable_file(args.prompts, "--prompts")
    if args.init_from:
        check_tinker_path(args.init_from, "weights")


def prepare_student(args):
    if args.rehearse and not args.prompts:
        say("no --prompts: the student answers the built-in rehearsal questions (pass --prompts for your own)")
        prompts = [[{"role": "user", "content": q}] for q, _ in REHEARSAL_QA]
    else:
        prompts = load_prompts(args.prompts)
    if not isinstance(prompts, list) or not prompts:
        raise DataError("load_prompts() returned no prompts; fill PROMPTS in the EDIT ME block or pass --prompts")
    name = tokenizer_record(args.tokenizer or args.model_name)
    tokenizer = load_tokenizer(name)
    if all(isinstance(p, str) for p in prompts):
        fmt = resolve_format("auto", args.model_name, tokenizer, name)
    elif all(isinstance(p, list) and p for p in prompts):
        fmt = resolve_format("chat", args.model_name, tokenizer, name)
    else:
        raise DataError("load_prompts() must return message lists for every prompt (or a str for every prompt "
                        "with a base model)")
    rendered = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list):
            validate_messages(prompt, f"prompt {i}", need_assistant=False)
        rendered.append(generation_prompt(prompt, tokenizer, fmt))
    first = prompts[0]
    question = first if isinstance(first, str) else next(
        (m["content"] for m in reversed(first) if m.get("role") == "user" and isinstance(m.get("content"), str)), "Hello")
    return Student(tokenizer, fmt, rendered, question)


def describe_teacher(args):
    """The teacher as far as it is known offline: a run record folder, a tinker:// path (its base model
    from --teacher-base, else asked from Tinker later), or a model name."""
    spec = args.teacher
    if os.path.isdir(spec):
        return teacher_from_run_record(Path(spec), args)
    if spec.startswith("tinker://"):
        path = check_tinker_path(spec, "sampler_weights")
        teacher = Teacher(label=spec, base=args.teacher_base, path=path)
    else:
        if args.teacher_base and args.teacher_base != spec:
            raise DataError(f"--teacher-base {args.teacher_base} applies to a tinker:// teacher, not the model {spec}")
        teacher = Teacher(label=spec, base=spec, path=None)
    if teacher.base:
        load_teacher_tokenizer(teacher, args)
    return teacher


def teacher_from_run_record(log, args):
    """The final sampler checkpoint of an SFT/RL run record, its base model and the format it trained with."""
    run = Run(log)
    config = run.config()
    rows = [r for r in run.rows("checkpoints.jsonl") if r.get("sampler_path")]
    if not config or not rows:
        raise DataError(f"--teacher {log}: not a finished run record (needs config.json and a checkpoints.jsonl row "
                        "with a sampler_path, written by the final save); pass a tinker://.../sampler_weights/NAME path")
    base = config.get("model_name")
    if args.teacher_base and args.teacher_base != base:
        raise DataError(f"--teacher-base {args.teacher_base} contradicts the run record {log} (model_name {base})")
    teacher = Teacher(label=str(log), base=base, path=rows[-1]["sampler_path"], fmt=rows[-1].get("format"))
    load_teacher_tokenizer(teacher, args, (teacher.fmt or {}).get("tokenizer"))
    return teacher


def load_teacher_tokenizer(teacher, args, recorded=None):
    teacher.tokenizer_name = tokenizer_record(args.teacher_tokenizer or recorded or teacher.base)
    teacher.tokenizer = load_tokenizer(teacher.tokenizer_name, flag="--teacher-tokenizer")


def open_teacher(service, teacher, args):
    """The teacher's sampling client, checked before any paid call: a tinker:// teacher that exists (one
    without a known base model learns it here), or a base model this Tinker serves for sampling."""
    import tinker

    if teacher.path:
        try:
            client = service.create_sampling_client(model_path=teacher.path).result()
        except (tinker.NotFoundError, tinker.BadRequestError, tinker.UnprocessableEntityError) as e:
            raise DataError(f"the teacher checkpoint {teacher.path} cannot be sampled on this Tinker ({type(e).__name__}: "
                            f"{one_line(getattr(e, 'message', None) or e, 120)}): it is unknown or expired; pass the "
                            "sampler_path of the teacher run's final checkpoint (checkpoints.jsonl), or that run's "
                            "folder as --teacher") from None
        served = client.get_base_model()
        if teacher.base and served and served.split(":", 1)[0] != teacher.base.split(":", 1)[0]:
            raise DataError(f"the teacher {teacher.path} samples on {served}, not {teacher.base} as given; "
                            f"pass --teacher-base {served}")
        if teacher.base is None:
            teacher.base = served
            load_teacher_tokenizer(teacher, args)
        return client
    check_teacher_served(teacher.base)
    return service.create_sampling_client(base_model=teacher.base).result()


def check_teacher_served(base):
    """DataError unless this Tinker serves the teacher's base model for sampling (asked once, free)."""
    caps = rest_client().get_server_capabilities().result(timeout=CAPABILITIES_TIMEOUT_S)
    sampleable = sorted(m.model_name for m in caps.supported_models if m.model_name and m.sampleable is not False)
    if base.split(":", 1)[0] not in sampleable and base not in sampleable:
        pricing = load_pricing()
        retired = getattr(pricing, "retired_note", lambda _: None)(base) if pricing else None
        raise DataError(f"the teacher {base} is not served for sampling by this Tinker ("
                        + (f"{retired}; " if retired else "") + "it serves "
                        f"{', '.join(sampleable[:12])}); pass one of those as --teacher, or a teacher run's folder")


def check_same_rendering(student, teacher):
    """DataError (exit 2) naming every difference that would make the teacher grade other text than the
    student wrote: the vocabulary (the same ids must be the same tokens), the stop tokens, the chat
    template (same sha256), and the teacher's run record format when it has one."""
    reasons = rendering_differences(student.tokenizer, student.fmt, teacher.tokenizer, teacher_format(student, teacher))
    if reasons:
        raise DataError(f"the teacher {teacher.label} does not share the student's tokenizer and chat template: "
                        f"{'; '.join(reasons)}. Distillation scores the student's token ids with the teacher, so "
                        "both must read them the same way: pick a teacher of the same family (e.g. a bigger Qwen3.5 "
                        "for a Qwen3.5 student)")


def teacher_format(student, teacher):
    if teacher.fmt is not None:
        return teacher.fmt
    if student.fmt["kind"] == "chat":
        if not teacher.tokenizer.chat_template:
            return {"kind": "raw", "stop": [teacher.tokenizer.eos_token_id], "tokenizer": teacher.tokenizer_name}
        return chat_format(teacher.tokenizer, name=teacher.tokenizer_name,
                           thinking=student.fmt["template_kwargs"].get("enable_thinking", False))
    return raw_format(teacher.tokenizer, name=teacher.tokenizer_name)


def prompts_digest(rendered) -> str:
    return hashlib.sha256(json.dumps(rendered).encode()).hexdigest()


def check_context(args, rendered, context_window):
    if context_window is None:
        return
    for i, tokens in enumerate(rendered):
        if len(tokens) >= context_window:
            raise DataError(f"prompt {i} is {len(tokens)} tokens, not below the context window of {context_window}; "
                            "shorten it")
    longest = max(map(len, rendered))
    if longest + args.max_tokens > context_window:
        say(f"note: longest prompt {longest} + --max-tokens {args.max_tokens} exceeds the context window "
            f"{context_window}; completions are capped to the room left")


def max_tokens_with_room(max_tokens, prompt_lengths, context_window):
    if context_window is None:
        return max_tokens
    return max(1, min(max_tokens, context_window - max(prompt_lengths)))


# ---------------------------------------------------------------------------------------------
# Cost: the student's sampling and training, plus the teacher's prefill of every sampled sequence


def distill_tokens(iterations, batch_size, group_size, avg_prompt, avg_completion):
    """Billed tokens of `iterations`, split by the model that meters them.

    student: one sample call of group_size per prompt (prefill P once, cached (G-1)P, sample G*C), and
    one datum per sequence (train P + C - 1). teacher: compute_logprobs is a sample call with
    max_tokens=1 and prompt logprobs, so each sequence is prefilled (P + C) and samples 1 token;
    counted at the full prefill rate (an upper bound: a prompt shared by a group may hit the cache)."""
    prompts = iterations * batch_size
    sequences = prompts * group_size
    student = {"prefill": prompts * avg_prompt, "cached_prefill": prompts * (group_size - 1) * avg_prompt,
               "sample": sequences * avg_completion, "train": sequences * (avg_prompt + avg_completion - 1)}
    teacher = {"prefill": sequences * (avg_prompt + avg_completion), "sample": sequences}
    return student, teacher


def preflight(args, teacher_base, prompt_lengths, start):
    """Dollar estimate of iterations start..--iterations (completions counted at --max-tokens, an upper
    bound); BudgetError above --max-usd. One model prices it all when the teacher shares the student's
    base model; otherwise each model is priced at its own rates and the sum is checked."""
    remaining = max(0, args.iterations - start)
    avg_prompt = sum(prompt_lengths) / len(prompt_lengths)
    student, teacher = distill_tokens(remaining, min(args.batch_size, len(prompt_lengths)), args.group_size,
                                      avg_prompt, args.max_tokens)
    label = "distill" if not start else f"distill, remaining {remaining} of {args.iterations} iterations after --resume"
    if teacher_base == args.model_name:
        merged = {k: student.get(k, 0) + teacher.get(k, 0) for k in (*student, *teacher)}
        est = estimate(args.model_name, merged, args.max_usd, label=f"{label} (teacher prefill included)")
        return est["usd"]["total"] if est else None
    est_s = estimate(args.model_name, student, None, label=f"{label}: student sampling + training")
    est_t = estimate(teacher_base, teacher, None, label=f"{label}: teacher prefill on {teacher_base}")
    totals = [e["usd"]["total"] if e else None for e in (est_s, est_t)]
    total = None if None in totals else sum(totals)
    if args.max_usd is not None:
        if total is None:
            unpriced = args.model_name if totals[0] is None else teacher_base
            raise BudgetError(f"cannot check --max-usd {args.max_usd:g}: no price for {unpriced}; drop --max-usd "
                              "or add its prices (tinker_pricing.py)")
        if total > args.max_usd:
            raise BudgetError(f"estimated ${total:,.2f} (student + teacher prefill) exceeds --max-usd {args.max_usd:g}; "
                              "reduce --iterations/--batch-size/--group-size/--max-tokens, or raise --max-usd")
    if total is not None:
        say(f"estimated total ${total:,.2f} (student + teacher)")
    return total


# ==== SHARED CODE (generated from common/: rehearsal, errors, flags, render, run_files, data, run_record, service, checkpoints, training, onpolicy) ====
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


def rehearsal_check(text: str, passed) -> dict:
    return {"check": text, "passed": bool(passed)}


# The built-in rehearsal set (also templates/sft_rehearsal*.jsonl): four one-line facts the local backend's
# tiny model memorises at lr 1e-2 (measured: probes 4/4 exact after 40 steps, 0/4 before; training loss
# 18.4 -> 0.013; held-out NLL 18.2 -> 3.3), and the same facts asked in other words as the held-out set.
# Built in so the script copied alone can rehearse. tinker_distill.py's rehearsal teacher learns the same answers.
REHEARSAL_QA = [("What colour is the sky?", "Blue."), ("What is the capital of France?", "Paris."),
                ("How many legs does a cat have?", "Four."), ("Which way does rain fall?", "Down.")]
REHEARSAL_TRAIN = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                   for q, a in REHEARSAL_QA]


# ---- tinker_distill.py --rehearse
# tiny: a run the tiny model visibly distils (figures measured on it, see references/distillation.md).
# real (measured 2026-12-07: teacher a 24-step SFT rehearsal on a 24-row help-desk set, the base as student, its
# prompts): reverse KL 2.02 (first quarter's mean) -> 1.48 (last quarter's) in 12 iterations, the teacher's logprob
# of the student's samples -4.98 -> -2.83; about 14 s an iteration.
DISTILL_REHEARSAL = {
    "tiny": {"learning_rate": 5e-3, "iterations": 20, "batch_size": 4, "group_size": 2, "max_tokens": 8,
             "lora_rank": 32, "save_every": 0, "log_path": "runs/distill-rehearsal"},
    "real": {"learning_rate": 1e-3, "iterations": 12, "batch_size": 4, "group_size": 2, "max_tokens": 24,
             "lora_rank": 32, "save_every": 0, "log_path": "runs/distill-rehearsal"},
}
# The teacher a rehearsal without --teacher trains first on REHEARSAL_QA. tiny: a soft teacher, 3 full-batch SFT
# steps (held-out NLL 18.4 -> 10.8); a fully memorised one (40 steps) rates every other token near -20 and the
# student's KL only fell 16 -> 12 in 12 iterations (measured).
# real: SFT's real-model recipe for these facts (4/4 word for word in 16 steps at 5e-4, measured). Distilled from it
# (measured 2026-12-07, the preset: lr 1e-3, 12 iterations) the base student drops its sentences for the teacher's
# one-word form ("Azul.", "Spectrum." to "What colour is the sky?"): the reverse KL a sample falls 44 -> 15 nats
# (first quarter -> last), while the per-token mean rises 2.07 -> 3.70: what is left are the answer words, where the
# two disagree most. So the real model's checks judge each sample's sum, with the per-token figure beside it.
DISTILL_REHEARSAL_TEACHER = {
    "tiny": {"steps": 3, "learning_rate": 1e-2},
    "real": {"steps": 16, "learning_rate": 5e-4},
}
# A rehearsal passes when the mean reverse KL of the last quarter of its iterations is at most this share of
# the first iteration's (the untrained student's distance to the teacher).
DISTILL_REHEARSAL_KL_SHARE = 0.5


def distill_rehearsal_checks(run, report, iterations):
    """What a distillation rehearsal proves: every iteration sampled, was graded by the teacher and trained; the
    final checkpoint was saved; the student's reverse KL to the teacher fell by half from where the student
    started (the last quarter's mean: one iteration's figure is noisy)."""
    curve = [r["reverse_kl"] for r in run.rows("metrics.jsonl") if isinstance(r.get("reverse_kl"), (int, float))]
    q = max(1, len(curve) // 4)
    head = curve[0] if curve else float("nan")
    tail = sum(curve[-q:]) / q if curve else float("nan")
    rows = run.rows("metrics.jsonl")
    checks = [
        {"check": f"every iteration sampled, was graded and trained: {len(curve)} of {iterations} metrics rows",
         "passed": len(curve) == iterations},
        {"check": "the final checkpoint was saved (state and sampler paths)",
         "passed": bool(report.get("state_path")) and bool(report.get("sampler_path"))},
        {"check": f"the reverse KL to the teacher falls by half or more ({head:.3f} at the first iteration -> "
                  f"{tail:.3f}, the mean of the last {q})",
         "passed": bool(curve) and tail <= DISTILL_REHEARSAL_KL_SHARE * head},
    ]
    if real_stand_in() and curve:  # a real student changes its length too: judged per sample, quarter against quarter
        def per_sample(key):  # a row's token mean x its tokens / its samples: the sum over one sample's tokens
            return [r[key] * r["tokens_sampled"] / max(1, r["sequences"]) for r in rows
                    if isinstance(r.get(key), (int, float)) and r.get("tokens_sampled") and r.get("sequences")]

        kl, teacher = per_sample("reverse_kl"), per_sample("teacher_logprob")
        k_head, k_tail = sum(kl[:q]) / q, sum(kl[-q:]) / q
        t_head, t_tail = sum(teacher[:q]) / q, sum(teacher[-q:]) / q
        per_token = f"per token {sum(curve[:q]) / q:.3f} -> {tail:.3f}"
        checks[-1] = rehearsal_check(f"the reverse KL to the teacher falls ({k_head:.1f} nats a sample, the mean of "
                                     f"the first {q} iterations -> {k_tail:.1f}, the last {q}; {per_token})",
                                     bool(kl) and k_tail < k_head)
        checks.append(rehearsal_check(f"the teacher rates the student's samples higher ({t_head:.1f} -> {t_tail:.1f}, "
                                      f"logprob a sample, first {q} -> last {q} iterations)",
                                      bool(teacher) and t_tail > t_head))
    reported = [f"teacher logprob of the student's samples {rows[0].get('teacher_logprob', 0):.3f} -> "
                f"{rows[-1].get('teacher_logprob', 0):.3f}, student logprob {rows[0].get('student_logprob', 0):.3f} -> "
                f"{rows[-1].get('student_logprob', 0):.3f} (reported, not judged)"] if rows else []
    return {"passed": all(c["passed"] for c in checks), "checks": checks, "reported": reported,
            "reverse_kl": {"first": head, "last_quarter": tail}}


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


def rendering_differences(student_tok, student_fmt, teacher_tok, teacher_fmt) -> list[str]:
    """What differs between how the student and the teacher read token ids (empty when nothing does)."""
    reasons = []
    student_vocab, teacher_vocab = vocab_digest(student_tok), vocab_digest(teacher_tok)
    if student_vocab != teacher_vocab:
        s_n, t_n = len(student_tok), len(teacher_tok)
        reasons.append(f"vocabularies differ ({s_n} vs {t_n} tokens)" if s_n != t_n
                       else f"vocabularies of {s_n} tokens map some ids to different tokens")
    if student_fmt.get("kind") != teacher_fmt.get("kind"):
        reasons.append(f"the student renders {student_fmt.get('kind')}, the teacher {teacher_fmt.get('kind')}")
    elif student_fmt.get("kind") == "chat" and student_fmt.get("template_sha256") != teacher_fmt.get("template_sha256"):
        reasons.append(f"chat templates differ (sha256 {student_fmt.get('template_sha256', '')[:12]} vs "
                       f"{(teacher_fmt.get('template_sha256') or '')[:12]})")
    if list(student_fmt.get("stop") or []) != list(teacher_fmt.get("stop") or []):
        reasons.append(f"stop tokens differ ({student_fmt.get('stop')} vs {teacher_fmt.get('stop')})")
    return reasons


def vocab_digest(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


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


def sample_call_tokens(prompt_len, num_samples, sampled, cached_prefix=0) -> dict:
    """What one sample call meters, as tinker_pricing.sample_tokens / rl_tokens count it: the prompt is
    prefilled once (minus a prefix the server saw before, `cached_prefix`), the other num_samples - 1
    copies are cache hits, and every generated token is sampled (`sampled`: their total)."""
    return {"prefill": prompt_len - cached_prefix, "cached_prefill": cached_prefix + (num_samples - 1) * prompt_len,
            "sample": sampled}


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
import random


# The cookbook's Adam values; the SDK's default eps is 1e-12.
ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
PERIODIC_TTL_SECONDS = 7 * 24 * 3600  # periodic saves expire after a week; the final one is kept


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


# ---- tinker_distill.py --rehearse without --teacher: the teacher, trained first

def train_rehearsal_teacher(service, model_name, lora_rank, seed, tokenizer, fmt):
    """A LoRA of the student's own base trained on the built-in answers (REHEARSAL_TRAIN: REHEARSAL_QA as
    conversations; the student's rendering, cross-entropy on each answer and its end-of-turn token) with the
    recipe DISTILL_REHEARSAL_TEACHER, saved for sampling, so the teacher prefers answers the untrained student
    does not. `seed`: the student's, so both LoRAs start from the same init and the teacher is reachable from the
    student's start. Returns its tinker://.../sampler_weights path."""
    import tinker

    datums = [to_datum(r) for ex in REHEARSAL_TRAIN for r in render_example(ex, tokenizer, fmt)]
    tc = training_client(service, model_name, lora_rank, seed, position="rehearsal teacher")
    recipe = preset(DISTILL_REHEARSAL_TEACHER)
    steps, lr = recipe["steps"], recipe["learning_rate"]
    for step in range(steps):
        fwd = tc.forward_backward(datums, "cross_entropy")
        opt = tc.optim_step(tinker.AdamParams(learning_rate=lr, **ADAM))
        loss = fwd.result().metrics["loss:sum"]
        opt.result()
        if step in (0, steps - 1):
            say(f"rehearsal teacher: step {step + 1}/{steps} | loss {loss:.4f}")
    path = tc.save_weights_for_sampler("rehearsal-teacher").result().path
    say(f"rehearsal teacher: {steps} SFT steps on the {len(REHEARSAL_TRAIN)} built-in answers at lr {lr:g} -> {path}")
    return path


# ---- common/onpolicy.py ----
# Sampling-based training shared by tinker_rl.py and tinker_distill.py: bounded, retried requests, the
# importance-sampling datum, the sampler/learner KL, the train step, the training client restored or
# created, and checkpoint saves.
import asyncio
import random


# 64 sampling requests in flight: the cookbook's evaluation default (BenchmarkConfig concurrency=64);
# hosted Tinker answers 429 under load, and the SDK alone allows 1,000 per client (RetryConfig).
MAX_IN_FLIGHT = 64
SAMPLE_RETRIES, RETRY_BASE_S, RETRY_MAX_S = 6, 0.5, 30.0


def is_transient(e):
    """Worth retrying the same request: rate limit (429), timeouts (408), conflicts, 5xx, connection loss."""
    import tinker

    status = getattr(e, "status_code", None)
    return (status in (408, 409, 429) or (status is not None and status >= 500)
            or isinstance(e, (tinker.APIConnectionError, asyncio.TimeoutError))
            or str(getattr(e, "category", "")).lower().endswith("server"))


class RequestGate:
    """At most `limit` requests at once (per event loop; the rest wait), a 429 or transient error
    retried with jittered exponential back-off; `retries` counts them."""

    def __init__(self, limit):
        self.limit, self.retries = limit, 0
        self._loop = self._semaphore = None

    def take_retries(self):
        count, self.retries = self.retries, 0
        return count

    async def call(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a semaphore belongs to one event loop
            self._loop, self._semaphore = loop, asyncio.Semaphore(self.limit)
        for attempt in range(SAMPLE_RETRIES + 1):
            async with self._semaphore:
                try:
                    return await fn(*args, **kwargs)
                except Exception as e:
                    if not is_transient(e) or attempt == SAMPLE_RETRIES:
                        raise
                    self.retries += 1
            await asyncio.sleep(min(RETRY_MAX_S, RETRY_BASE_S * 2**attempt) * (0.75 + 0.25 * random.random()))


def rl_datum(tokens, logprobs, advs):
    """The importance-sampling datum of one sequence, shifted by one: position i predicts token i+1.
    logprobs (the sampler's) and advs are per token of `tokens`, 0 where nothing is learned; no `mask`
    key: prompt and observation positions are out of the loss because their advantage is 0."""
    import tinker

    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": list(tokens[1:]), "logprobs": list(logprobs[1:]),
                        "advantages": list(advs[1:])})


def kl_metrics(datums, masks, outputs):
    """Sampler vs learner on the sampled tokens (mask 1; the ratio importance sampling corrects):
    v1 = mean(lp_sampler - lp_learner), v2 = half the mean square (stable training keeps these below
    about 0.01), entropy = -mean(lp_sampler)."""
    diffs, sampler_lps = [], []
    for datum, mask, out in zip(datums, masks, outputs):
        learner = out["logprobs"].tolist() if hasattr(out["logprobs"], "tolist") else list(out["logprobs"])
        sampler = datum.loss_fn_inputs["logprobs"].tolist()
        for m, q, p in zip(mask, sampler, learner):
            if m:
                diffs.append(q - p)
                sampler_lps.append(q)
    if not diffs:
        return {}
    n = len(diffs)
    return {"kl_sample_train_v1": sum(diffs) / n, "kl_sample_train_v2": 0.5 * sum(d * d for d in diffs) / n,
            "entropy": -sum(sampler_lps) / n}


def train_step(training_client, datums, loss_fn, config, learning_rate, on_error=None):
    """forward_backward with the chosen loss and its config, optim_step submitted right behind it;
    on_error(exception) -> the exception to raise instead."""
    import tinker

    try:
        fb = training_client.forward_backward(datums, loss_fn=loss_fn, loss_fn_config=config)
        step = training_client.optim_step(tinker.AdamParams(learning_rate=learning_rate, **ADAM))
        result = fb.result()
        step.result()
    except ScriptError:  # ours already (a lost service stays exit 4)
        raise
    except Exception as e:
        if on_error is None:
            raise
        raise on_error(e) from None
    return result


def save_checkpoint(tc, run, name, next_iteration, epoch, fmt, final=False):
    """save_state (and, for the final save, save_weights_for_sampler) submitted together; the row is
    appended once both paths are known. Periodic saves expire after PERIODIC_TTL_SECONDS."""
    state = tc.save_state(name, ttl_seconds=None if final else PERIODIC_TTL_SECONDS)
    sampler = tc.save_weights_for_sampler(name) if final else None
    return run.checkpoint(name=name, step=next_iteration, position={"next_iteration": next_iteration}, epoch=epoch,
                          state_path=state.result().path, sampler_path=sampler.result().path if sampler else None,
                          fmt=fmt)
# ==== END SHARED CODE (sha256 e195a5b8c70c) ====


if __name__ == "__main__":
    exit_process(run_cli(main))
