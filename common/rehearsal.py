"""The free rehearsal (--rehearse) on the local backend: which model stands in, each script's preset for it, and the
shape of the rehearsal's checks.

`tinker_local.py run` exports TINKER_LOCAL_STAND_IN, the model standing in for the named one:
- the tiny random Qwen3 (default): the named model's exact tokenizer and chat template, so masks, token counts and
  datums are Qwen3's; it memorises a few short answers and nothing more;
- SmolLM2-135M-Instruct (`tinker_local.py run --real`): a real, weak instruct model with its own tokenizer and ChatML
  template; it follows a prompt, learns a user's answers, earns a user's reward and calls a tool after a warm-up.
Each preset below was measured on its model (references/setup.md, "Which model to rehearse on").
"""
from __future__ import annotations

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


# ---- tinker_rl.py --rehearse
# tiny: the local backend's tiny random model learns at a far larger rate than an 8B model and is slow per token:
# the rehearsal trains the rehearsal task with these unless a flag says otherwise. Temperature 1.2: at 1.0 about
# 1 sample in 8 leaves the blank lines, at 1.5 nearly all do (measured).
RL_REHEARSAL = {
    "tiny": dict(learning_rate=1e-2, iterations=5, batch_size=2, group_size=4, max_tokens=8, temperature=1.2,
                 max_turns=2, on_truncation="continue", lora_rank=8, save_every=0),
}
# Rehearsing your own reward from a checkpoint (--init-from, e.g. an SFT rehearsal's), over RL_REHEARSAL: room for
# the answers it was trained on, sampled as a trained policy is.
# real (measured 2026-12-07 from SFT rehearsals on a 24-row help-desk set, references/training-rl.md has the curves):
# 8 iterations of 4 fixed tasks (scout_rehearsal_tasks) x 8 samples at 3e-4 rose 0.36 -> 0.97; at 1e-3 the replies
# drift into repeated words within 8-12 iterations. real_tools: room for a tool call (SmolLM2 writes the
# calculator's in ~35 tokens), at 2e-4, which stays fluent.
RL_REHEARSAL_FROM_CHECKPOINT = {
    "tiny": dict(max_tokens=32, temperature=1.0),
    "real": dict(max_tokens=48, temperature=1.0, learning_rate=3e-4, iterations=8, batch_size=4, group_size=8),
    "real_tools": dict(max_tokens=48, temperature=1.0, learning_rate=2e-4, iterations=4, batch_size=4, group_size=4),
}


def rl_rehearsal_settings(init_from, multi_turn: bool) -> dict:
    """What --rehearse sets for every flag not on the command line: RL_REHEARSAL's preset and, with --init-from,
    RL_REHEARSAL_FROM_CHECKPOINT's over it ("real" for a single-turn reward on the real model, "real_tools" for a
    multi-turn environment: an iteration of tool episodes costs about 60 s there at 4 x 4)."""
    settings = preset(RL_REHEARSAL)
    if init_from:
        settings.update(RL_REHEARSAL_FROM_CHECKPOINT["real_tools"] if multi_turn and real_stand_in()
                        else preset(RL_REHEARSAL_FROM_CHECKPOINT))
    return settings


def quarter_means(values) -> tuple[int, float, float]:
    """(q, the mean of the first q values, the mean of the last q) with q a quarter of them, at least 1; 0.0 for
    both means when there are none. One iteration's figure is noisy: curves are judged quarter against quarter."""
    q = max(1, len(values) // 4)
    return (q, sum(values[:q]) / q, sum(values[-q:]) / q) if values else (q, 0.0, 0.0)


def rl_rehearsal_checks(args, job, run) -> dict | None:
    """The real model's verdict on an RL rehearsal from a checkpoint with your own reward (None elsewhere: on the
    tiny model the rehearsal proves the pipeline and the exit code says it ran): every iteration trained and,
    single-turn, the mean reward of the last quarter of the iterations is above the first quarter's; multi-turn,
    env_step() answered at least one of the model's turns (it parsed a tool call or went on)."""
    if not (args.rehearse and args.init_from and real_stand_in() and args.reward == "own"):
        return None
    rows = [r for r in run.rows("metrics.jsonl") if isinstance(r.get("reward_mean"), (int, float))]
    checks = [rehearsal_check(f"every iteration trained: {len(rows)} of {args.iterations} metrics rows",
                              len(rows) == args.iterations)]
    if job.env["env_step"] is None:
        q, head, tail = quarter_means([r["reward_mean"] for r in rows])
        checks.append(rehearsal_check(f"the mean reward rises ({head:.3f}, the mean of the first {q} iteration(s) "
                                      f"-> {tail:.3f}, the last {q})", len(rows) > 1 and tail > head))
    else:
        answered = sum(round(r["turns_mean"] * r["episodes"]) - r["episodes"] for r in rows)
        checks.append(rehearsal_check(f"env_step() answered the model's turns: {answered} turn(s) after a first "
                                      "one", answered > 0))
    return rehearsal_result(checks, tasks=getattr(args, "rehearsal_tasks", None))
# The stand-in task (--rehearse, automatic on the local backend). The tiny random model repeats blank lines at
# greedy and drifts into junk text now and then at temperature 1.2; it can never multiply or call a tool, so the
# examples would tie every group. "Say something" is a reward it earns partly and unevenly, which is what RL
# needs: the reward rises towards 1.0 within a few iterations when the pipeline is right.

REHEARSAL_TASKS = [{"topic": t} for t in ("the sky", "cats", "rain", "Paris", "bread", "the sea", "music", "snow",
                                          "trees", "coffee")]  # the last two are held out


def rehearsal_prompt(task):
    return [{"role": "user", "content": f"Say one word about {task['topic']}."}]


def rehearsal_reward(task, completion):
    """The share of the reply that is visible text (the untrained tiny model mostly writes blank lines)."""
    return sum(not c.isspace() for c in completion) / max(1, len(completion))


def rehearsal_env_step(shipped_env_step, task, conversation, model_turn, rng):
    """The shipped environment with two rehearsal changes: a first turn without a tool call gets a
    reminder (so episodes have two turns and exercise the multi-turn datum), and the final answer is
    scored by rehearsal_reward (the environment's own reward is kept as info own_reward)."""
    if len(conversation) == 1 and "<tool_call>" not in model_turn:
        return {"role": "user", "content": "Use the calculator tool first."}, 0.0, False, {"reminders": 1}
    observation, step_reward, done, *info = shipped_env_step(task, conversation, model_turn, rng)
    info = dict(info[0] or {}) if info else {}
    if done:  # the environment's own reward stays visible beside the stand-in: env/own_reward in metrics.jsonl
        info["own_reward"] = float(step_reward)
        step_reward = rehearsal_reward(task, model_turn)
    return observation, step_reward, done, info
