"""Optimizer constants, learning-rate rules, data order, sizing advice and the training client shared by the training
scripts; the teacher a distillation rehearsal trains first."""
from __future__ import annotations

import math
import random

from checkpoints import tinker_failure  # splice: drop
from errors import say  # splice: drop
from rehearsal import DISTILL_REHEARSAL_TEACHER, REHEARSAL_TRAIN, preset  # splice: drop
from render import Rendered, render_example, to_datum  # splice: drop

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
