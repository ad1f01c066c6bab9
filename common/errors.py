"""Errors and exit codes: every script fails with one line on stderr and a documented exit code."""
from __future__ import annotations

import json
import signal
import sys

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
