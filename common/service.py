"""Reaching Tinker: credentials, a fast reachability check, the served-model check, checkpoint paths,
and the optional cost preflight and per-step cost metering through tinker_pricing.py beside the script."""
from __future__ import annotations

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

from errors import AccessError, BudgetError, DataError, local_hint, local_launcher, say, script_command  # splice: drop

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
