"""Shared fixtures: the local Tinker backend and offline tokenizers (see DEVELOPING.md)."""
import os

import pytest

from fixtures_local import *  # noqa: F401,F403
from fixtures_local import common_module
from fixtures_tokenizers import *  # noqa: F401,F403

_EXIT_STATUS: list[int] = []
WORKER_MEMORY_GIB = 6  # a worker's local server (~2.3 GB), a module's own server, the scripts it runs


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml's addopts): one pytest-xdist worker per core (a third on 2 cores was slower: the
    suite is CPU-bound once two run), at most 4 and at most one per WORKER_MEMORY_GIB of memory. Each worker has its
    own session server (`local_tinker`); `-n 0` runs in one process."""
    cores = len(os.sched_getaffinity(0))
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores, 4, int(memory_gib // WORKER_MEMORY_GIB)))


def xdist_group_of(item) -> str:
    """A test module runs whole on one worker: its module fixtures (a trained run, a server of its own,
    test_bad_inputs.py's batch of every case) are made once. test_faults_e2e.py is split by script: each script's
    uninterrupted baseline run is made once per group."""
    name = item.module.__name__
    case = item.callspec.params.get("case") if hasattr(item, "callspec") else None
    return f"{name}:{case.script}" if name == "test_faults_e2e" and case is not None else name


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """How the workers share the suite (`--dist loadgroup --no-loadscope-reorder` in pyproject.toml's addopts): one
    xdist group per module (xdist_group_of); groups with end-to-end tests go first, then the quick ones, each part
    with the most tests first, so that no worker is left finishing a long module alone at the end."""
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(xdist_group_of(item), []).append(item)

    def order(name: str) -> tuple:
        members = groups[name]
        return (all(item.get_closest_marker("e2e") is None for item in members), -len(members))

    items[:] = [item for name in sorted(groups, key=order) for item in groups[name]]
    for name, members in groups.items():
        for item in members:
            item.add_marker(pytest.mark.xdist_group(name))


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
