"""The reports open in a real browser: headless Debian Chromium loads the report of a local-backend SFT
run, of a local-backend RL run and of a run with a rollout trace; the page logs nothing to the console,
plotly draws every embedded figure with every trace, and a screenshot is written. The curves of the
real runs hold exactly the rows of their metrics.jsonl.

Screenshots go to $TINKER_REPORT_SCREENSHOTS (a folder) when set, else to the test's tmp folder.
Chromium missing is a failure naming the install command, never a skip: CI installs it (.ci/run)."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from test_report import figures_in, rl_folder, trace

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
CHROMIUM = "/usr/bin/chromium"
INSTALL = "apt-get update && apt-get install -y chromium"


def chromium(profile, *args):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"the browser test needs Debian chromium at {CHROMIUM}; install it (as root) with: {INSTALL}")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def console_lines(stderr):
    """Every console message the page produced (console.log/warn/error and uncaught exceptions):
    chromium prints them all as INFO:CONSOLE lines. The report's page produces none."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def screenshot_path(tmp_path, name):
    folder = Path(os.environ.get("TINKER_REPORT_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def load_in_browser(report, tmp_path, shot_name):
    """The DOM after the page's scripts ran, the console lines, and the screenshot's path."""
    dom = chromium(tmp_path / "profile-dom", "--virtual-time-budget=10000", "--dump-dom", report.as_uri())
    shot = screenshot_path(tmp_path, shot_name)
    shot.unlink(missing_ok=True)
    pic = chromium(tmp_path / "profile-shot", "--hide-scrollbars", "--window-size=1200,2000",
                   "--virtual-time-budget=10000", f"--screenshot={shot}", report.as_uri())
    assert shot.exists() and png_size(shot) == (1200, 2000) and shot.stat().st_size > 30_000, shot
    return dom.stdout, console_lines(dom.stderr) + console_lines(pic.stderr), shot


def assert_every_figure_drawn(dom, page):
    """plotly.js turned each figure's div into a plot holding one drawn trace per trace in the data."""
    figs = figures_in(page)
    assert figs
    for fig_id, fig in figs.items():
        div = re.search(rf"<div id=\"plot-{fig_id}\" class=\"([^\"]*)\"(.*?)</script>", dom, re.S)
        assert div and "js-plotly-plot" in div.group(1), f"figure {fig_id} was not drawn"
        drawn = len(re.findall(r"<g class=\"trace scatter", div.group(2)))
        assert drawn == len(fig["data"]), (fig_id, drawn, len(fig["data"]))
    return figs


def make_report(run_dir):
    out = subprocess.run([sys.executable, str(SCRIPTS / "tinker_report.py"), str(run_dir)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    return Path(result["report"]), result


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_report_with_a_rollout_trace_renders_in_chromium(tmp_path):
    run, _, rollouts = rl_folder(tmp_path)
    report, _ = make_report(run)
    page = report.read_text()
    dom, console, shot = load_in_browser(report, tmp_path, "report-trace.png")
    assert console == []
    assert set(assert_every_figure_drawn(dom, page)) == {"reward", "tied", "kl", "cost"}
    assert len(re.findall(r"<details class=\"rollout-row\"", dom)) == len(rollouts)
    # the trace's text stays text: no element was made from it
    assert "<script>alert(1)</script>" not in dom and "&lt;script&gt;alert(1)&lt;/script&gt;" in dom


def test_without_chromium_the_browser_test_fails_naming_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(sys.modules[__name__], "CHROMIUM", str(tmp_path / "no-chromium"))
    with pytest.raises(pytest.fail.Exception, match=re.escape(INSTALL)):
        chromium(tmp_path / "profile", "--version")


# ---------------------------------------------------------------------------------------------
# real runs on the local backend


@pytest.mark.e2e
def test_report_of_a_local_sft_run_renders_in_chromium(local_sft_run, tmp_path):
    log = tmp_path / "sft"
    shutil.copytree(local_sft_run, log)  # the session's shared run (fixtures_local.py); the report is written here
    report, result = make_report(log)
    assert result["kind"] == "sft" and result["in_progress"] is False and result["skipped_lines"] == {}
    page = report.read_text()
    dom, console, shot = load_in_browser(report, tmp_path, "report-sft.png")
    assert console == []
    figs = assert_every_figure_drawn(dom, page)
    metrics = rows(log / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    loss = trace(figs["loss"], "train loss")
    assert loss["x"] == [1, 2, 3, 4] and loss["y"] == [m["loss"] for m in metrics]
    assert trace(figs["learning_rate"], "learning_rate")["y"] == [m["learning_rate"] for m in metrics]
    evals = [r for r in rows(log / "eval.jsonl") if r.get("nll") is not None]
    held_out = trace(figs["loss"], "held-out nll (eval.jsonl)")
    assert held_out["x"] == [r["step"] for r in evals] and held_out["y"] == [r["nll"] for r in evals]
    assert len(evals) >= 3  # before, during (step 2), after
    names = [r["name"] for r in rows(log / "checkpoints.jsonl")]
    assert names == ["000002", "final"] and all(f">{n}</td>" in page for n in names)
    # cost so far vs the estimate: the logged sum per step, the total with the final eval, the estimate line
    cost = trace(figs["cost"], "cost so far (usd)")
    assert cost["x"] == [1, 2, 3, 4] and cost["y"] == [m["cost/cumulative_usd"] for m in metrics]
    after = rows(log / "eval.jsonl")[-1]
    assert trace(figs["cost"], "total with the final eval (eval.jsonl)")["y"] == [after["cost/cumulative_usd"]]
    estimate = json.loads((log / "config.json").read_text())["estimate_usd"]
    assert [s["y0"] for s in figs["cost"]["layout"]["shapes"]] == [estimate]
    assert 0 < cost["y"][-1] < after["cost/cumulative_usd"] <= estimate  # samples may stop before --max-tokens


@pytest.mark.e2e
def test_report_of_a_local_rl_run_renders_in_chromium(local_rl_run, tmp_path):
    log = tmp_path / "rl"
    shutil.copytree(local_rl_run, log)  # the session's shared run (fixtures_local.py); the report is written here
    report, result = make_report(log)
    assert result["kind"] == "rl" and result["in_progress"] is False
    page = report.read_text()
    dom, console, shot = load_in_browser(report, tmp_path, "report-rl.png")
    assert console == []
    figs = assert_every_figure_drawn(dom, page)
    metrics = rows(log / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    assert trace(figs["reward"], "reward_mean")["y"] == [m["reward_mean"] for m in metrics]
    assert trace(figs["reward"], "mean + std")["y"] == [m["reward_mean"] + m["reward_std"] for m in metrics]
    assert trace(figs["tied"], "frac_groups_tied")["y"] == [m["frac_groups_tied"] for m in metrics]
    assert trace(figs["kl"], "kl_sample_train_v1")["y"] == [m["kl_sample_train_v1"] for m in metrics]
    cost = trace(figs["cost"], "cost so far (usd)")
    assert cost["x"] == [0, 1, 2] and cost["y"] == [m["cost/cumulative_usd"] for m in metrics]
    estimate = json.loads((log / "config.json").read_text())["estimate_usd"]
    assert [s["y0"] for s in figs["cost"]["layout"]["shapes"]] == [estimate]
    assert 0 < cost["y"][-1] < estimate  # the estimate prices every completion at --max-tokens
    # the rollout browser shows the trace token for token, newest iteration first
    trace_rows = rows(log / "rollouts.jsonl")
    assert len(trace_rows) == 3 * 2 * 4 and result["rows"]["rollouts"] == 24
    shown = re.findall(r"<details class=\"rollout-row\"[^>]*>(.*?)</details>", dom, re.S)
    expected = [r for it in (2, 1, 0) for r in trace_rows if r["iteration"] == it]
    assert [[int(t) for t in re.findall(r"<span class=\"tok \w+\" title=\"[^\"]*\">(\d+)</span>", body)]
            for body in shown] == [r["prompt_tokens"] + r["completion_tokens"] for r in expected]
