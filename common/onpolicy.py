"""Sampling-based training shared by tinker_rl.py and tinker_distill.py: bounded, retried requests, the
importance-sampling datum, the sampler/learner KL, the train step, the training client restored or
created, and checkpoint saves."""
from __future__ import annotations

import asyncio
import random

from errors import ScriptError, say  # splice: drop
from training import ADAM, PERIODIC_TTL_SECONDS  # splice: drop

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


def is_rejection(e):
    """A request the server refused as invalid (4xx, or a failed request of category user)."""
    status = getattr(e, "status_code", None)
    category = str(getattr(e, "category", "")).lower()
    return (status is not None and 400 <= status < 500) or category.endswith("user")


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
