"""Shared fixtures: the local Tinker backend and offline tokenizers (see DEVELOPING.md)."""
import pytest

from fixtures_local import *  # noqa: F401,F403
from fixtures_local import common_module
from fixtures_tokenizers import *  # noqa: F401,F403

_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After every other plugin has finished (summary printed, cache written), end pytest through
    common/errors.exit_process, as the scripts end, when interpreter teardown can abort: this process holds many
    SDK clients, and a pyqwest thread delivering a late response during teardown aborts CPython < 3.14 (exit
    134 after the results are final; pyqwest issue 164, references/troubleshooting.md)."""
    errors = common_module("errors")
    if _EXIT_STATUS and errors.teardown_can_abort():
        errors.exit_process(_EXIT_STATUS[-1])
