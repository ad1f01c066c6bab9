"""Checkpoints by path and by run: tinker:// paths, the server's listing of one run, the run record's checkpoint
rows, and an SDK failure about a checkpoint as one line with the command that shows what exists."""
from __future__ import annotations

import os
from pathlib import Path

from errors import AccessError, DataError, ScriptError, one_line, script_command  # splice: drop
from run_record import Run, edited_command  # splice: drop
from service import check_reachable, require_credentials, rest_client, service_url  # splice: drop

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


def server_message(response) -> str:
    """The error an HTTP server put in its response body (JSON "error"/"detail", else the text), one line."""
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
