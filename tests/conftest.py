"""Shared fixtures: the local Tinker backend and offline tokenizers (see DEVELOPING.md)."""
import os
import sys

import pytest

from fixtures_local import *  # noqa: F401,F403
from fixtures_tokenizers import *  # noqa: F401,F403

_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After every other plugin has finished (summary printed, cache written), end pytest without interpreter
    teardown when the SDK's HTTP transport is loaded on CPython < 3.14: a pyqwest thread delivering a late
    response there aborts the process (exit 134 after the results are final; pyqwest issue 164,
    references/troubleshooting.md), the same reason the scripts end through common/errors.exit_process."""
    if _EXIT_STATUS and "pyqwest" in sys.modules and sys.version_info < (3, 14):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
