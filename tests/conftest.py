"""Shared fixtures: the local Tinker backend and offline tokenizers (see DEVELOPING.md)."""
import os
import warnings

import pytest

import forked_scripts
import shared_tokenizers
from fixtures_local import *  # noqa: F401,F403
from fixtures_local import common_module
from fixtures_tokenizers import *  # noqa: F401,F403

_EXIT_STATUS: list[int] = []
WORKER_MEMORY_GIB = 6  # a worker's local server (~2.3 GB), a module's own server, the scripts it runs


def pytest_xdist_auto_num_workers(config):
    """`-n auto --dist worksteal` (pyproject's addopts; `-n 0` runs one process, see benchmarks/README.md, "The test
    suite"): one pytest-xdist worker per core, at most 4 and at most one per WORKER_MEMORY_GIB of memory. Each worker
    has its own session server (`local_tinker`). Measured on 2 cores: a third worker, or whole modules per worker with
    the end-to-end ones first, were slower: the suite is CPU-bound once two run."""
    cores = len(os.sched_getaffinity(0))
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores, 4, int(memory_gib // WORKER_MEMORY_GIB)))


# Modules run first, longest first: worksteal hands each worker a contiguous share and an idle worker takes the
# tail of another's, so a long test started late stretches the end of the run while the other worker waits.
FIRST = ("test_faults_e2e.py", "test_journey_e2e.py", "test_rl_agentic_e2e.py", "test_distill_e2e.py")

# The real-model tests (marked `real_model`: test_local_real.py, test_sft_real_e2e.py, test_real_rehearsals_e2e.py)
# run in a pytest of their own, one process, after the parallel one (README's test command:
# `pytest -m "not real_model" && pytest -m real_model -n 0`). The real engine's working set is 7 to 9 GB during a
# distillation or RL rehearsal; beside the other worker's servers (tiny engines of 1.4 to 3.8 GB each, its pytest
# ~2.5 GB) the kernel OOM-killed it twice on the 24 GB CI machine (dmesg, 1ae9aac and 718ce20). In their own run
# test_local_real.py goes first, so its own `serve --real` stops before the session's real server starts.
REAL_FIRST = ("test_local_real.py", "test_sft_real_e2e.py", "test_real_rehearsals_e2e.py")
REAL_MODEL_COMMAND = ".venv/bin/python -m pytest -m real_model -n 0"


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: `-m "not real_model"` leaves nothing to warn about
def pytest_collection_modifyitems(config, items):
    order = REAL_FIRST + FIRST
    rank = {name: i for i, name in enumerate(order)}
    items.sort(key=lambda item: rank.get(item.path.name, len(order)))
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    real = [item for item in items if item.get_closest_marker("real_model")]
    if workers > 1 and real:
        # Never two real engines, nor one beside another worker's servers: they run in their own pytest.
        items[:] = [item for item in items if item not in real]
        config.hook.pytest_deselected(items=real)
        warnings.warn(pytest.PytestWarning(
            f"{len(real)} real-model test(s) deselected: they do not run beside other workers (memory); "
            f"run them with `{REAL_MODEL_COMMAND}` (README's test command does)"))


def pytest_configure(config):
    """`subprocess.run([sys.executable, SCRIPT, ...])` forks from a warm interpreter in this test process
    (tests/forked_scripts.py: the same process contract, without ~2.7 s of imports per run;
    TINKER_TEST_FORK_SCRIPTS=0 turns it off). The xdist controller runs no test and starts no zygote."""
    forked_scripts.install()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """In a process that runs tests (not the xdist controller): AutoTokenizer.from_pretrained parses a tokenizer
    once and lends it (tests/shared_tokenizers.py; TINKER_TEST_SHARE_TOKENIZERS=0 turns it off)."""
    shared_tokenizers.install()


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))
    forked_scripts.uninstall()
    shared_tokenizers.uninstall()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After every other plugin has finished (summary printed, cache written), end pytest through
    common/errors.exit_process, as the scripts end, when interpreter teardown can abort: this process holds many
    SDK clients, and a pyqwest thread delivering a late response during teardown aborts CPython < 3.14 (exit
    134 after the results are final; pyqwest issue 164, references/troubleshooting.md)."""
    errors = common_module("errors")
    if _EXIT_STATUS and errors.teardown_can_abort():
        errors.exit_process(_EXIT_STATUS[-1])
