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


def xdist_group(nodeid: str) -> str:
    """The share of the suite one worker runs whole: a test module, so its module fixtures (a trained run, a server
    of its own, test_bad_inputs.py's batch of every case) are made once; test_faults_e2e.py's cases are split by
    script (each case id starts with it), each script's uninterrupted baseline run made once per group."""
    path, _, name = nodeid.partition("::")
    if path.endswith("test_faults_e2e.py") and "[" in name:
        return f"{path}:{name.split('[', 1)[1].split('-', 1)[0]}"
    return path


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist hands out whole groups (xdist_group) in collection order (pytest_collection_modifyitems). Its own
    `--dist loadgroup` marks cannot do this under pytest 9 (xdist 3.8 renames `item._nodeid`, which pytest 9 no
    longer reads), so the group is computed from the test id here."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    """The order the groups are handed out in (pyproject.toml's addopts: `-n auto --dist loadscope
    --no-loadscope-reorder`): groups with end-to-end tests first, then the quick ones, each part with the most tests
    first, so that no worker is left finishing a long module alone at the end."""
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(xdist_group(item.nodeid), []).append(item)

    def order(name: str) -> tuple:
        members = groups[name]
        return (all(item.get_closest_marker("e2e") is None for item in members), -len(members))

    items[:] = [item for name in sorted(groups, key=order) for item in groups[name]]


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
