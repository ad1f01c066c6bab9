#!/usr/bin/env python3
"""How fast the local backend's tiny model memorises a small chat set (SFT) and learns a fixed answer (RL).

**Run:**
    .venv/bin/python benchmarks/local_rehearsal_learning.py                  # SFT, the installed tiny model
    .venv/bin/python benchmarks/local_rehearsal_learning.py --rl --steps 6   # RL check
    .venv/bin/python benchmarks/local_rehearsal_learning.py --base-url http://127.0.0.1:PORT --lr 2e-2

**Outputs:** progress on stderr; one JSON object on stdout: settings, seconds (server start, training),
NLL per answer token before/after (and per step), greedy probes before/after, exact-match counts.
RL: mean reward per iteration.

**Requires:** the local backend set up (`python scripts/tinker_local.py setup`); the tinker SDK and
transformers in this Python. Starts its own server unless --base-url is given (stopped at the end).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import tinker_local  # noqa: E402

# One-line question/answer pairs: the rehearsal set a user can check by eye.
PAIRS = [
    ("What colour is the sky?", "Blue."),
    ("What is the capital of France?", "Paris."),
    ("How many legs does a cat have?", "Four."),
    ("Which way does rain fall?", "Down."),
    ("What do bees make?", "Honey."),
    ("What is frozen water called?", "Ice."),
    ("Which animal says moo?", "A cow."),
    ("What colour is grass?", "Green."),
]


def say(message: str) -> None:
    print(f"local_rehearsal_learning: {message}", file=sys.stderr, flush=True)


def render(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    return tokenizer.encode(text, add_special_tokens=False)


def sft_datum(tokenizer, question: str, answer: str):
    from tinker import types
    prompt = render(tokenizer, question)
    completion = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
    ids = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})


def nll_per_token(training, data) -> float:
    out = training.forward(data, "cross_entropy").result()
    weight = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    return out.metrics["loss:sum"] / weight


def greedy(sampler, tokenizer, questions, max_tokens: int) -> list[str]:
    from tinker import types
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["<|im_end|>"])
    futures = [sampler.sample(types.ModelInput.from_ints(render(tokenizer, q)), 1, params) for q in questions]
    return [tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True).strip() for f in futures]


def run_sft(service, tokenizer, args) -> dict:
    from tinker import types
    pairs = PAIRS[:args.pairs]
    data = [sft_datum(tokenizer, q, a) for q, a in pairs]
    questions = [q for q, _ in pairs]
    tc = service.create_lora_training_client(args.model, rank=args.lora_rank, seed=0).result()
    base = service.create_sampling_client(base_model=args.model).result()
    probes_before = greedy(base, tokenizer, questions, args.max_tokens)
    nll_before = nll_per_token(tc, data)
    say(f"before: nll {nll_before:.3f}; probes {probes_before}")
    rng = random.Random(0)
    losses, t0 = [], time.monotonic()
    order: list = []
    probes_mid: dict = {}
    for step in range(args.steps):
        if len(order) < args.batch_size:
            order += rng.sample(range(len(data)), len(data))
        batch = [data[i] for i in order[:args.batch_size]]
        del order[:args.batch_size]
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=args.lr))
        weight = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
        losses.append(round(fb.result().metrics["loss:sum"] / weight, 4))
        opt.result()
        if step % 10 == 9 or step == args.steps - 1:
            say(f"step {step + 1}/{args.steps} | nll {losses[-1]:.3f} | {time.monotonic() - t0:.1f}s")
        if step + 1 in args.probe_at and step + 1 != args.steps:
            mid = tc.save_weights_and_get_sampling_client(f"rehearsal-{step + 1}")
            mid = mid.result() if hasattr(mid, "result") else mid
            probes_mid[step + 1] = greedy(mid, tokenizer, questions, args.max_tokens)
            say(f"probes at step {step + 1}: {probes_mid[step + 1]}")
    train_seconds = time.monotonic() - t0
    nll_after = nll_per_token(tc, data)
    sampler = tc.save_weights_and_get_sampling_client("rehearsal")
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    probes_after = greedy(sampler, tokenizer, questions, args.max_tokens)
    say(f"after: nll {nll_after:.3f}; probes {probes_after}")
    answers = [a for _, a in pairs]
    return {"nll_before": round(nll_before, 4), "nll_after": round(nll_after, 4), "train_nll": losses,
            "train_seconds": round(train_seconds, 1), "seconds_per_step": round(train_seconds / args.steps, 2),
            "probes_before": probes_before, "probes_after": probes_after, "probes_at": probes_mid, "answers": answers,
            "exact_before": sum(p == a for p, a in zip(probes_before, answers)),
            "exact_after": sum(p == a for p, a in zip(probes_after, answers))}


def reward(text: str, args) -> float:
    """exact: 1 when the reply is exactly --rl-target; visible: 1 when it has any non-whitespace text
    (the random base model mostly repeats the newline that ends its prompt, so groups differ)."""
    if args.rl_reward == "exact":
        return float(text.strip() == args.rl_target)
    return float(bool(text.strip()))


def run_rl(service, tokenizer, args) -> dict:
    """Reward 1 when the sampled answer is exactly TARGET; importance_sampling on centred rewards."""
    from tinker import types
    questions = [q for q, _ in PAIRS[:args.pairs]]
    target = args.rl_target
    tc = service.create_lora_training_client(args.model, rank=args.lora_rank, seed=0).result()
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=["<|im_end|>"])
    rewards, t0 = [], time.monotonic()
    for it in range(args.steps):
        sampler = tc.save_weights_and_get_sampling_client(f"rl-{it}")
        sampler = sampler.result() if hasattr(sampler, "result") else sampler
        prompts = [render(tokenizer, q) for q in questions]
        results = [sampler.sample(types.ModelInput.from_ints(p), args.group_size, params) for p in prompts]
        data, all_r = [], []
        for prompt, fut in zip(prompts, results):
            seqs = fut.result().sequences
            rs = [reward(tokenizer.decode(s.tokens, skip_special_tokens=True), args) for s in seqs]
            all_r += rs
            mean = sum(rs) / len(rs)
            for s, r in zip(seqs, rs):
                if r == mean:
                    continue  # zero advantage
                ids = prompt + list(s.tokens)
                n = len(s.tokens)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": ids[1:],
                                    "logprobs": [0.0] * (len(prompt) - 1) + list(s.logprobs),
                                    "advantages": [0.0] * (len(prompt) - 1) + [r - mean] * n}))
        rewards.append(round(sum(all_r) / len(all_r), 3))
        say(f"iteration {it + 1}/{args.steps} | reward {rewards[-1]:.3f} | datums {len(data)} | "
            f"{time.monotonic() - t0:.1f}s")
        if data:
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(types.AdamParams(learning_rate=args.lr))
            fb.result()
            opt.result()
    return {"rewards": rewards, "reward": args.rl_reward, "target": target, "seconds": round(time.monotonic() - t0, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="reuse a running local server")
    p.add_argument("--weights", type=Path, default=None, help="model folder to serve (default: the tiny model)")
    p.add_argument("--model", default=tinker_local.DEFAULT_MODEL)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--probe-at", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                   help="also probe after these steps, e.g. 20,30")
    p.add_argument("--rl", action="store_true", help="RL check instead of SFT")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--rl-target", default="Blue.")
    p.add_argument("--rl-reward", choices=["exact", "visible"], default="exact")
    args = p.parse_args()
    import os

    import tinker
    import transformers
    home = tinker_local.resolve_home()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(args.weights or tinker_local.tiny_model_dir(home)))
    server, start_seconds = None, 0.0
    if not args.base_url:
        server = tinker_local.start_server(args.model, weights=args.weights)
        base_url, start_seconds = server.base_url, server.ready_seconds
        say(f"server ready in {start_seconds:.1f} s")
    else:
        base_url = args.base_url
    os.environ.update(tinker_local.client_env(base_url, home))
    try:
        service = tinker.ServiceClient()
        result = run_rl(service, tokenizer, args) if args.rl else run_sft(service, tokenizer, args)
        service.close("success").result()
    finally:
        if server:
            server.stop()
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print(json.dumps({"settings": settings, "server_start_seconds": round(start_seconds, 1), **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
