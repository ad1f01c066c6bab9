"""The table of fault cases in references/troubleshooting.md is generated from the harness's own case list
(tests/fault_cases.py), so it cannot drift: this fails when the two disagree
(fix: python tests/fault_cases.py --write)."""
from fault_cases import CASES, REQUESTS, fault_count, render_table, table_in_doc


def test_the_troubleshooting_table_is_the_one_the_harness_runs():
    assert table_in_doc() == render_table(), "run: python tests/fault_cases.py --write"


def test_the_harness_runs_at_least_60_cases_over_every_script_fault_and_point():
    assert fault_count() >= 60
    kinds = {f.kind for c in CASES for f in c.faults}
    assert kinds >= {"429-0", "429-1", "500", "502", "503", "reset-before", "reset-after", "delay", "death",
                     "restart", "sigkill"}
    for script, ops in REQUESTS.items():
        hit = {f.op for c in CASES if c.script == script for f in c.faults}
        assert set(ops) <= hit, (script, set(ops) - hit)  # every point of every script takes a fault
        assert sum(c.kind == "sigkill" for c in CASES if c.script == script) >= 2
    for kind in ("429-0", "429-1", "500", "502", "503", "reset-before", "reset-after"):
        points = {f.op for c in CASES for f in c.faults if f.kind == kind}
        assert len(points) >= 5, (kind, points)  # each fault at several points


def test_every_fault_hits_a_request_the_run_makes():
    for case in CASES:
        for fault in case.faults:
            assert 1 <= fault.nth <= REQUESTS[case.script][fault.op.removeprefix("result:")], (case, fault)
