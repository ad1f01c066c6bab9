"""The reports open in a real browser: headless Debian Chromium loads the report of every run kind (SFT, RL,
DPO, distillation: synthetic records, and real runs on the local backend); the page logs nothing to the console,
plotly draws every embedded figure with every trace, and a screenshot is written. The curves of the real runs
hold exactly the rows of their metrics.jsonl. A screenshot check finds the learning-rate curve drawn inside an
axis fitted to it (a constant 1e-2 is not flat on zero) and the whitespace marks of a newline-only probe sample
painted in the probe table.

Screenshots go to $TINKER_REPORT_SCREENSHOTS (a folder) when set, else to the test's tmp folder.
Chromium missing is a failure naming the install command, never a skip: CI installs it (.ci/run)."""
from __future__ import annotations

import html
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from test_report import distill_folder, dpo_folder, figures_in, rl_folder, sft_folder, trace, write_rows

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


@pytest.mark.parametrize("make, kind, title", [
    (lambda tmp: sft_folder(tmp)[0], "sft", "SFT run sft"),
    (lambda tmp: rl_folder(tmp)[0], "rl", "RL run rl"),
    (lambda tmp: dpo_folder(tmp)[0], "dpo", "DPO run dpo"),
    (lambda tmp: distill_folder(tmp)[0], "distill", "Distillation run distill"),
])
def test_reports_of_every_run_kind_load_in_chromium(make, kind, title, tmp_path):
    report, result = make_report(make(tmp_path))
    assert result["kind"] == kind
    page = report.read_text()
    dom, console, shot = load_in_browser(report, tmp_path, f"report-kind-{kind}.png")
    assert console == []
    assert f"<h1>{title}</h1>" in dom
    assert set(assert_every_figure_drawn(dom, page)) == set(figures_in(page))


# ---------------------------------------------------------------------------------------------
# a screenshot check: where the learning-rate curve and the probe marks are painted


# Runs after plotly drew the page: the geometry of every plot (axes as drawn, plot area) and of the probe
# table's cells and marks, in page pixels, written into the DOM for --dump-dom to carry out.
GEOMETRY_JS = """
<script>
setTimeout(function () {
  function box(el) { var r = el.getBoundingClientRect();
    return {x: r.left + window.scrollX, y: r.top + window.scrollY, w: r.width, h: r.height}; }
  var out = {plots: {}, probes: [], height: document.documentElement.scrollHeight};
  document.querySelectorAll('.js-plotly-plot').forEach(function (gd) {
    var L = gd._fullLayout;
    out.plots[gd.id] = {box: box(gd), size: L._size,
      x: {type: L.xaxis.type, range: L.xaxis.range}, y: {type: L.yaxis.type, range: L.yaxis.range},
      yticks: Array.from(gd.querySelectorAll('.ytick text')).map(function (t) { return t.textContent; }),
      colors: gd._fullData.map(function (t) { return (t.marker && t.marker.color) || t.line.color; })};
  });
  document.querySelectorAll('#probes tr').forEach(function (tr) {
    var row = {};
    tr.querySelectorAll('td').forEach(function (td) {
      var pre = td.querySelector('pre');
      row[td.className] = {title: pre.title, text: pre.textContent, box: box(pre),
        marks: Array.from(pre.querySelectorAll('.ws')).map(function (m) {
          return {text: m.textContent, box: box(m), color: getComputedStyle(m).color,
                  background: getComputedStyle(m).backgroundColor}; })};
    });
    if (Object.keys(row).length) out.probes.push(row);
  });
  var pre = document.createElement('pre');
  pre.id = 'geometry';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 500);
</script>
"""
WINDOW = (1200, 3000)


def png_rgb(path, rows_needed):
    """The screenshot's pixels as a (height, width, 3) array of its first rows_needed rows: PNG decoded with
    zlib and the five scanline filters (no imaging library in the test environment)."""
    import numpy as np

    data, pos, idat = path.read_bytes(), 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), (depth, color)  # 8-bit RGB or RGBA
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(height, width * bpp + 1)
    out = np.zeros((min(rows_needed, height), width * bpp), dtype=np.int32)
    prev = np.zeros(width * bpp, dtype=np.int32)
    for y in range(out.shape[0]):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if f == 1:
            line = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) % 256
        elif f == 2:
            line = (line + prev) % 256
        elif f in (3, 4):
            line = line.copy()
            for i in range(0, width * bpp, bpp):
                a = line[i - bpp:i] if i else np.zeros(bpp, dtype=np.int32)
                b = prev[i:i + bpp]
                if f == 3:
                    line[i:i + bpp] = (line[i:i + bpp] + (a + b) // 2) % 256
                else:
                    c = prev[i - bpp:i] if i else np.zeros(bpp, dtype=np.int32)
                    pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                    pred = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))
                    line[i:i + bpp] = (line[i:i + bpp] + pred) % 256
        out[y] = line
        prev = line
    return out.reshape(out.shape[0], width, bpp)[:, :, :3]


def near(pixels, color, tolerance):
    """How many pixels lie within `tolerance` (max channel difference) of color."""
    import numpy as np

    return int((np.abs(pixels - np.array(color)).max(axis=2) <= tolerance).sum())


def ink(pixels, background):
    """How many pixels carry the marks' orange ink: well darker than the background, red well above blue."""
    import numpy as np

    darker = np.array(background).sum() - pixels.sum(axis=2) > 150
    return int((darker & (pixels[:, :, 0] - pixels[:, :, 2] > 60)).sum())


def drawn_geometry(report, tmp_path):
    """(geometry from the DOM, screenshot path) of the report opened at WINDOW, the page unchanged but for the
    geometry script appended after plotly's."""
    page = report.read_text()
    probe = report.with_name("report-geometry.html")
    probe.write_text(page.replace("</body></html>", GEOMETRY_JS + "</body></html>"))
    size = f"--window-size={WINDOW[0]},{WINDOW[1]}"
    dom = chromium(tmp_path / "profile-geometry", size, "--hide-scrollbars", "--virtual-time-budget=10000",
                   "--dump-dom", probe.as_uri())
    assert console_lines(dom.stderr) == []
    found = re.search(r"<pre id=\"geometry\">(.*?)</pre>", dom.stdout, re.S)
    assert found, "the geometry script did not run"
    geometry = json.loads(html.unescape(found.group(1)))
    assert geometry["height"] <= WINDOW[1], "the page is taller than the screenshot window"
    shot = screenshot_path(tmp_path, "report-lr-and-probes.png")
    shot.unlink(missing_ok=True)
    chromium(tmp_path / "profile-geometry-shot", size, "--hide-scrollbars", "--virtual-time-budget=10000",
             f"--screenshot={shot}", probe.as_uri())
    assert png_size(shot) == WINDOW
    return geometry, shot


def test_the_learning_rate_curve_and_the_probe_marks_are_painted_where_the_data_says(tmp_path):
    """The rehearsal's case: a constant learning rate of 1e-2 and an untrained model whose "before" sample is
    newlines only. In the screenshot, every logged learning rate is a blue marker inside the plot at the height
    its value has on the drawn axis (a log axis within a decade of 1e-2, its tick labels in that decade, not
    a +-1 axis with the curve flat on 0), and the "before" cell shows one orange ⏎ mark per newline."""
    run, metrics, evals = sft_folder(tmp_path)
    metrics = [dict(m, learning_rate=1e-2) for m in metrics]
    write_rows(run / "metrics.jsonl", metrics)
    evals[0]["probes"] = [{"line": 1, "prompt": "What colour is the sky?", "expected": "Blue.",
                           "before": "\n\n\n", "after": "Blue."}]
    write_rows(run / "eval.jsonl", evals)
    report, _ = make_report(run)
    geometry, shot = drawn_geometry(report, tmp_path)

    lr = geometry["plots"]["plot-learning_rate"]
    assert lr["y"]["type"] == "log"
    low, high = lr["y"]["range"]
    assert low < math.log10(1e-2) < high and high - low <= 1.0  # fitted: one decade at most
    tick_values = [float(t.replace("\u2212", "-")) for t in lr["yticks"] if re.fullmatch(r"[\d.e\u2212-]+", t)]
    assert tick_values and all(1e-3 < v < 1e-1 for v in tick_values), lr["yticks"]

    probe = geometry["probes"][0]["before"]
    assert probe["title"] == json.dumps("\n\n\n") and [m["text"] for m in probe["marks"]] == ["⏎"] * 3
    assert all(m["box"]["w"] > 4 and m["box"]["h"] > 8 for m in probe["marks"])
    assert probe["marks"][0]["color"] == "rgb(181, 77, 0)"

    bottom = max(lr["box"]["y"] + lr["box"]["h"], probe["box"]["y"] + probe["box"]["h"])
    pixels = png_rgb(shot, math.ceil(bottom) + 2)
    size, (x0, x1) = lr["size"], lr["x"]["range"]
    blue = tuple(int(lr["colors"][0][i:i + 2], 16) for i in (1, 3, 5))  # the trace's colour as plotly drew it
    for m in metrics:
        fx = (m["step"] - x0) / (x1 - x0)
        fy = (math.log10(m["learning_rate"]) - low) / (high - low)
        assert 0 < fx < 1 and 0.05 < fy < 0.95, (m["step"], fx, fy)  # inside the plot, clear of its edges
        px = round(lr["box"]["x"] + size["l"] + fx * size["w"])
        py = round(lr["box"]["y"] + size["t"] + (1 - fy) * size["h"])
        around = pixels[py - 4:py + 5, px - 4:px + 5]
        assert near(around, blue, 40) >= 6, f"no learning-rate marker painted at step {m['step']}"
    for mark in probe["marks"]:
        b = mark["box"]
        cell = pixels[round(b["y"]):round(b["y"] + b["h"]), round(b["x"]):round(b["x"] + b["w"])]
        assert near(cell, (255, 233, 204), 12) > 0.3 * cell.shape[0] * cell.shape[1]  # the mark's background
        assert ink(cell, (255, 233, 204)) >= 5, "the ⏎ glyph left no ink in the screenshot"


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
    # a rehearsal on the local backend (issue 44): the banner is on the drawn page, and --eval-every's held-out
    # scores are a curve of their own, exactly as logged
    banner = re.search(r"<div id=\"rehearsal-banner\"[^>]*>(.*?)</div>", dom, re.S)
    assert banner and "stood in for Qwen/Qwen3-8B; losses and samples are not Qwen/Qwen3-8B's" in html.unescape(
        re.sub(r"<[^>]+>", "", banner.group(1)))
    assert result["rehearsal"]["model_name"] == "Qwen/Qwen3-8B"
    scored = [r for r in rows(log / "eval.jsonl") if r.get("score") is not None]
    score = trace(figs["score"], "held-out score (eval.jsonl)")
    assert len(scored) >= 3 and score["x"] == [r["step"] for r in scored] and score["y"] == [r["score"] for r in scored]


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


@pytest.mark.e2e
def test_report_of_a_local_dpo_run_renders_in_chromium(local_tinker, tmp_path):
    log = tmp_path / "dpo"
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "tinker_dpo.py"), "--data", str(ROOT / "templates" / "dpo_example.jsonl"),
         "--tokenizer", str(local_tinker.tokenizer_dir), "--model-name", local_tinker.model, "--batch-size", "4",
         "--epochs", "2", "--max-steps", "3", "--save-every", "2", "--learning-rate", "1e-2",
         "--lr-schedule", "constant", "--lora-rank", "8", "--log-path", str(log)],
        capture_output=True, text=True, env={**os.environ, **local_tinker.env}, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report, result = make_report(log)
    assert result["kind"] == "dpo" and result["in_progress"] is False
    page = report.read_text()
    dom, console, shot = load_in_browser(report, tmp_path, "report-dpo.png")
    assert console == [] and "<h1>DPO run dpo (local rehearsal)</h1>" in dom
    figs = assert_every_figure_drawn(dom, page)
    assert set(figs) == {"accuracy", "margin", "rewards", "implicit_kl", "loss", "learning_rate", "cost"}
    metrics = rows(log / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for fig_id, key in [("accuracy", "accuracy"), ("margin", "margin"), ("rewards", "chosen_reward"),
                        ("rewards", "rejected_reward"), ("implicit_kl", "implicit_kl"), ("loss", "loss"),
                        ("learning_rate", "learning_rate")]:
        assert trace(figs[fig_id], key)["y"] == [m[key] for m in metrics], (fig_id, key)
    lr_axis = figs["learning_rate"]["layout"]["yaxis"]
    assert lr_axis["type"] == "log" and lr_axis["range"][0] < -2 < lr_axis["range"][1]  # constant 1e-2, fitted


@pytest.mark.e2e
def test_report_of_a_local_distillation_run_renders_in_chromium(local_tinker, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Say hello.", "Name a colour.")))
    log = tmp_path / "distill"
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "tinker_distill.py"), "--prompts", str(prompts),
         "--tokenizer", str(local_tinker.tokenizer_dir), "--model-name", local_tinker.model,
         "--teacher", local_tinker.model, "--teacher-tokenizer", str(local_tinker.tokenizer_dir),
         "--batch-size", "2", "--group-size", "2", "--max-tokens", "8", "--iterations", "2", "--save-every", "0",
         "--learning-rate", "1e-2", "--lora-rank", "8", "--log-path", str(log)],
        capture_output=True, text=True, env={**os.environ, **local_tinker.env}, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report, result = make_report(log)
    assert result["kind"] == "distill" and result["in_progress"] is False
    page = report.read_text()
    dom, console, shot = load_in_browser(report, tmp_path, "report-distill.png")
    assert console == [] and "<h1>Distillation run distill (local rehearsal)</h1>" in dom
    figs = assert_every_figure_drawn(dom, page)
    assert {"reverse_kl", "logprobs", "kl", "learning_rate", "cost"} <= set(figs)
    metrics = rows(log / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1]
    for fig_id, key in [("reverse_kl", "reverse_kl"), ("logprobs", "teacher_logprob"),
                        ("logprobs", "student_logprob"), ("kl", "kl_sample_train_v1"),
                        ("learning_rate", "learning_rate")]:
        assert trace(figs[fig_id], key)["y"] == [m[key] for m in metrics], (fig_id, key)
