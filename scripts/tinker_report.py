#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "plotly>=6",
# ]
# ///
"""One self-contained HTML page of a Tinker run folder (SFT or RL): curves, cost, checkpoints, rollouts.

Run:
    # the report of a finished run (or of one still running: torn last lines and missing files are fine)
    uv run tinker_report.py runs/sft1
    # rewrite it every 30 s while the run goes on (the open page reloads itself); Ctrl-C stops
    uv run tinker_report.py runs/rl1 --out rl1.html --watch 30

Edit:
    Nothing for the common case. figures(run) decides which charts exist; each is a plotly figure
    built from the rows as logged (no smoothing, no resampling), so a chart shows exactly the numbers
    in the record.

Outputs:
    RUN_DIR/report.html   (or --out FILE) one file, plotly.js embedded: opens offline, no server
                          SFT: train loss, held-out NLL, learning rate; RL: reward mean +- std, min/max,
                          fraction of tied groups, KL sample-vs-train; both: cost so far vs estimate
                          when the record has them, checkpoints table, settings, rollout browser
                          (rollouts.jsonl: prompt, completion, reward, advantage, trained/masked tokens)
    stdout                one JSON object: status, report (the file written), kind (sft|rl), rows
                          {config, metrics, eval, checkpoints, rollouts}, skipped_lines, in_progress (true
                          while a script holds the folder's lock: LOG/.lock, tested without taking it)

Requires:
    plotly (nothing else: no Tinker call, no tokenizer, no network). Reads only RUN_DIR.

Exit codes: 0 ok (also when --watch is stopped with Ctrl-C), 1 the report could not be written,
2 bad input or usage (RUN_DIR missing or holds no run record, plotly not installed).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

RECORD_FILES = ("config.json", "metrics.jsonl", "eval.jsonl", "checkpoints.jsonl", "rollouts.jsonl")
# The rollout browser keeps the most recent rollouts; the page stays light enough to open anywhere.
MAX_ROLLOUTS = 400


class ReportError(Exception):
    exit_code = 2


class WriteError(ReportError):
    exit_code = 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Write one self-contained HTML report of a Tinker run folder.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --log-path of tinker_sft.py or tinker_rl.py")
    p.add_argument("--out", default=None, help="HTML file to write (default RUN_DIR/report.html)")
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                   help="rewrite the report every SECONDS until interrupted (the page reloads itself)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder; expected a run folder (the --log-path of tinker_sft.py or "
                          f"tinker_rl.py); try: python tinker_report.py runs/sft1")
    if not any((run_dir / name).exists() for name in RECORD_FILES):
        raise ReportError(f"{run_dir} holds no run record (none of {', '.join(RECORD_FILES)}); pass the "
                          "--log-path of a run, e.g. python tinker_report.py runs/sft1")
    if args.watch is not None and args.watch <= 0:
        raise ReportError(f"--watch {args.watch:g}: expected a number of seconds above 0, e.g. --watch 30")
    out = Path(args.out) if args.out else run_dir / "report.html"
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise ReportError("plotly is not installed; pip install plotly (or run with uv run tinker_report.py)") from None

    summary = write_report(run_dir, out, args.watch)
    if args.watch:
        try:
            while True:
                time.sleep(args.watch)
                summary = write_report(run_dir, out, args.watch)
        except KeyboardInterrupt:
            print("--watch stopped; the report holds the record as last read", file=sys.stderr)
    print(json.dumps(summary))
    return 0


def write_report(run_dir, out, watch=None):
    run = read_run(run_dir)
    page = render_page(run, watch)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out)  # a page reloading mid-write sees the old report or the new one, never half
    except OSError as e:
        raise WriteError(f"cannot write {out}: {e.strerror}; pass --out to a writable file") from None
    rows = {"config": int(bool(run["config"])), **{k: len(run[k]) for k in ("metrics", "eval", "checkpoints", "rollouts")}}
    print(f"wrote {out} ({run['kind']}: {rows['metrics']} metrics rows, {rows['checkpoints']} checkpoints, "
          f"{rows['rollouts']} rollouts{', run in progress' if run['in_progress'] else ''})", file=sys.stderr)
    return {"status": "ok", "report": str(out), "kind": run["kind"], "rows": rows,
            "skipped_lines": run["skipped_lines"], "in_progress": run["in_progress"]}


# ---------------------------------------------------------------------------------------------
# Reading the record (every file optional: a run in progress, or one killed mid-write)


def read_rows(path, skipped):
    """Rows of a JSONL file; unparsable lines (a torn last line) are skipped and counted."""
    if not path.exists():
        return []
    rows = []
    for _, line in jsonl_lines(path.read_text(encoding="utf-8", errors="replace")):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            skipped[path.name] = skipped.get(path.name, 0) + 1
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_run(run_dir):
    skipped = {}
    try:
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    metrics = read_rows(run_dir / "metrics.jsonl", skipped)
    checkpoints = read_rows(run_dir / "checkpoints.jsonl", skipped)
    kind = "rl" if ("group_size" in config or any("iteration" in r or "reward_mean" in r for r in metrics)) else "sft"
    return {
        "dir": run_dir, "kind": kind, "config": config if isinstance(config, dict) else {},
        "metrics": metrics, "eval": read_rows(run_dir / "eval.jsonl", skipped), "checkpoints": checkpoints,
        "rollouts": read_rows(run_dir / "rollouts.jsonl", skipped), "skipped_lines": skipped,
        # a live process holds the folder's lock (tested, never taken: reading blocks no writer)
        "in_progress": lock_holder(run_dir) is not None, "finished": any(r.get("name") == "final" for r in checkpoints),
    }


def finite(value):
    """A number plotly can draw, or None (a gap): NaN and infinities are not valid JSON."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def series(rows, x_key, y_key):
    """(x, y) of the rows that logged y_key, in logged order, values exactly as logged."""
    pairs = [(r.get(x_key), finite(r.get(y_key))) for r in rows if y_key in r]
    return [x for x, _ in pairs], [y for _, y in pairs]


def first_key(rows, *keys):
    """The first of keys that any row logged (our names first, then the cookbook's)."""
    return next((k for k in keys if any(k in r for r in rows)), None)


# ---------------------------------------------------------------------------------------------
# Figures: plotly draws; each trace's x/y are the logged values


def figures(run):
    """[(id, title, plotly Figure)] for this run; charts without data are left out."""
    import plotly.graph_objects as go

    figs = []

    def chart(fig_id, title, traces, x_title, y_title, shapes=()):
        if not any(t.x for t in traces):
            return
        fig = go.Figure(traces)
        fig.update_layout(title=title, template="plotly_white", height=340, margin=dict(l=60, r=20, t=50, b=45),
                          xaxis_title=x_title, yaxis_title=y_title, legend=dict(orientation="h", y=-0.25))
        if max(len(t.x) for t in traces) <= 12:
            fig.update_xaxes(dtick=1)  # steps and iterations are whole numbers
        for shape in shapes:
            fig.add_hline(**shape)
        figs.append((fig_id, title, fig))

    m = run["metrics"]
    if run["kind"] == "sft":
        loss_key = first_key(m, "loss", "train_mean_nll")
        x, y = series(m, "step", loss_key) if loss_key else ([], [])
        traces = [go.Scatter(x=x, y=y, name=f"train {loss_key}", mode="lines+markers")]
        ev = [r for r in run["eval"] if "nll" in r]
        if ev:
            ex, ey = series(ev, "step", "nll")
            traces.append(go.Scatter(x=ex, y=ey, name="held-out nll (eval.jsonl)", mode="lines+markers"))
        elif first_key(m, "test/nll"):
            ex, ey = series(m, "step", "test/nll")
            traces.append(go.Scatter(x=ex, y=ey, name="held-out test/nll", mode="lines+markers"))
        chart("loss", "Loss: NLL per trained token", traces, "step", "nats / token")
        x, y = series(m, "step", "learning_rate")
        chart("learning_rate", "Learning rate", [go.Scatter(x=x, y=y, name="learning_rate", mode="lines+markers")],
              "step", "learning rate")
    else:
        it = first_key(m, "iteration", "step") or "iteration"
        reward_key = first_key(m, "reward_mean", "env/all/reward/total")
        if reward_key:
            x, mean = series(m, it, reward_key)
            traces = []
            if reward_key == "reward_mean" and first_key(m, "reward_std"):
                rows = [r for r in m if "reward_mean" in r]
                std = [finite(r.get("reward_std")) for r in rows]
                upper = [None if a is None or s is None else a + s for a, s in zip(mean, std)]
                lower = [None if a is None or s is None else a - s for a, s in zip(mean, std)]
                traces += [go.Scatter(x=x, y=upper, name="mean + std", mode="lines", line=dict(width=0),
                                      showlegend=False, hoverinfo="skip"),
                           go.Scatter(x=x, y=lower, name="mean ± std", mode="lines", line=dict(width=0),
                                      fill="tonexty", fillcolor="rgba(31,119,180,0.18)", hoverinfo="skip",
                                      showlegend=True)]
            traces.append(go.Scatter(x=x, y=mean, name=reward_key, mode="lines+markers",
                                     line=dict(color="rgb(31,119,180)")))
            for key, dash in (("reward_min", "dot"), ("reward_max", "dot")):
                if first_key(m, key):
                    kx, ky = series(m, it, key)
                    traces.append(go.Scatter(x=kx, y=ky, name=key, mode="lines", line=dict(dash=dash, width=1)))
            chart("reward", "Reward: mean, spread (mean ± std), min and max", traces, it, "reward")
        traces = []
        for key in ("frac_groups_tied", "frac_truncated"):
            if first_key(m, key):
                kx, ky = series(m, it, key)
                traces.append(go.Scatter(x=kx, y=ky, name=key, mode="lines+markers"))
        if not first_key(m, "frac_groups_tied") and first_key(m, "by_group/frac_mixed"):
            rows = [r for r in m if "by_group/frac_mixed" in r]
            traces.append(go.Scatter(x=[r.get(it) for r in rows], y=[1 - r["by_group/frac_mixed"] for r in rows],
                                     name="1 - by_group/frac_mixed", mode="lines+markers"))
        chart("tied", "Groups tied (no signal) and episodes truncated", traces, it, "fraction")
        traces = []
        for version in ("v1", "v2"):  # our name, else the cookbook's (a record may carry both: draw one)
            key = first_key(m, f"kl_sample_train_{version}", f"optim/kl_sample_train_{version}")
            if key:
                kx, ky = series(m, it, key)
                traces.append(go.Scatter(x=kx, y=ky, name=key, mode="lines+markers"))
        chart("kl", "KL sampler vs learner on the sampled tokens (stable training: below about 0.01)",
              traces, it, "nats")

    cost = cost_series(run)
    if cost:
        x, y, estimate, x_key = cost
        traces = [go.Scatter(x=x, y=y, name="cost so far (usd)", mode="lines+markers")]
        # SFT's eval after the last step is billed past the last metrics row: its eval.jsonl row holds the total
        ends = [r for r in run["eval"] if finite(r.get("cost/cumulative_usd")) is not None]
        if ends:
            traces.append(go.Scatter(x=[ends[-1].get("step")], y=[ends[-1]["cost/cumulative_usd"]],
                                     name="total with the final eval (eval.jsonl)", mode="markers",
                                     marker=dict(symbol="diamond", size=11)))
        shapes = [dict(y=estimate, line_dash="dash", line_color="firebrick",
                       annotation_text=f"estimate ${estimate:.4g}")] if estimate is not None else []
        chart("cost", "Cost so far vs the pre-run estimate", traces, x_key, "usd", shapes)
    return figs


def estimate_usd(config):
    est = config.get("estimate_usd")
    if est is None and isinstance(config.get("estimate"), dict):
        est = (config["estimate"].get("usd") or {}).get("total")
    return finite(est)


def cost_series(run):
    """(x, cumulative usd, estimate or None, x key) when the record has a cost, else None."""
    m = run["metrics"]
    x_key = first_key(m, "step", "iteration") if run["kind"] == "sft" else first_key(m, "iteration", "step")
    if first_key(m, "cost/cumulative_usd"):
        x, y = series(m, x_key, "cost/cumulative_usd")
    elif first_key(m, "cost/step_usd"):
        x, y, total = [], [], 0.0
        for r in m:
            if finite(r.get("cost/step_usd")) is not None:
                total += r["cost/step_usd"]
                x.append(r.get(x_key))
                y.append(total)
    else:
        return None
    return x, y, estimate_usd(run["config"]), x_key


# ---------------------------------------------------------------------------------------------
# The page


CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 28px; }
.meta { color: #555; font-size: 13px; } .note { color: #8a5a00; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; } td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
th { background: #f4f4f4; } code, .mono { font-family: ui-monospace, monospace; font-size: 12px; word-break: break-all; }
.plot { width: 100%; min-height: 340px; }
details { margin: 4px 0; } summary { cursor: pointer; font-size: 13px; }
.rollout { border-left: 3px solid #ccc; padding: 4px 10px; margin: 6px 0 10px 8px; }
pre { white-space: pre-wrap; background: #f8f8f8; padding: 6px; font-size: 12px; margin: 4px 0; }
.tok { display: inline-block; font-family: ui-monospace, monospace; font-size: 11px; padding: 0 2px; margin: 1px; border-radius: 2px; }
.obs { background: #e6e6e6; color: #666; } .masked { background: #fff; color: #999; text-decoration: line-through; }
.pos { background: #c9efc9; } .neg { background: #f6c8c8; } .zero { background: #e3ecf7; }
.legend { font-size: 13px; } .stop, .datum-break { color: #888; font-size: 11px; margin: 0 4px; } .legend span { margin-right: 12px; }
"""

# The glue between the embedded figure JSON and plotly.js: plotly draws every chart.
PLOT_JS = """
document.querySelectorAll("script.figure").forEach(function (el) {
  var fig = JSON.parse(el.textContent);
  Plotly.newPlot(el.dataset.target, fig.data, fig.layout, {responsive: true, displaylogo: false});
});
"""


def esc(value):
    return html.escape("" if value is None else str(value))


def script_json(text):
    """JSON safe inside a <script> element."""
    return text.replace("</", "<\\/")


def render_page(run, watch=None):
    from plotly.offline import get_plotlyjs

    figs = figures(run)
    cfg = run["config"]
    title = f"{run['kind'].upper()} run {run['dir'].resolve().name}"
    status = ("in progress (a script holds the folder's lock and is writing it)" if run["in_progress"] else
              "finished (final checkpoint saved)" if run["finished"] else
              "stopped before its final checkpoint (nothing is writing it: continue with the same command plus --resume)")
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{max(1, round(watch))}'>" if watch else "",
        f"<title>{esc(title)}</title><style>{CSS}</style>",
        f"<script>{get_plotlyjs()}</script></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<div class='meta'>{esc(run['dir'].resolve())} · model {esc(cfg.get('model_name', 'unknown'))} · "
        f"{esc(status)} · written {esc(datetime.now(timezone.utc).isoformat(timespec='seconds'))}"
        f"{f' · refreshes every {watch:g} s' if watch else ''}</div>",
    ]
    parts += headline(run)
    if run["skipped_lines"]:
        parts.append(f"<p class='note'>skipped unreadable lines (a torn last line of a run in progress): "
                     f"{esc(', '.join(f'{k}: {v}' for k, v in run['skipped_lines'].items()))}</p>")
    if not run["config"]:
        parts.append("<p class='note'>config.json is missing or unreadable: settings unknown.</p>")
    parts.append("<h2>Curves</h2>")
    if not figs:
        parts.append("<p class='note'>no metrics rows yet (metrics.jsonl missing or empty).</p>")
    for fig_id, _, fig in figs:
        parts.append(f"<div id='plot-{fig_id}' class='plot'></div>"
                     f"<script type='application/json' class='figure' id='figure-{fig_id}' "
                     f"data-target='plot-{fig_id}'>{script_json(fig.to_json())}</script>")
    if not cost_series(run):
        parts.append("<p class='note'>no cost in this record (metrics rows carry no cost/cumulative_usd or "
                     f"cost/step_usd){'' if estimate_usd(cfg) is None else f'; pre-run estimate ${estimate_usd(cfg):.4g}'}.</p>")
    parts += checkpoints_table(run["checkpoints"])
    if run["kind"] == "sft":
        parts += probes_table(run["eval"])
    parts += rollout_browser(run["rollouts"])
    parts += settings_table(cfg)
    parts.append(f"<script>{PLOT_JS}</script></body></html>")
    return "\n".join(p for p in parts if p)


def headline(run):
    m = run["metrics"]
    if not m:
        return []
    last = m[-1]
    if run["kind"] == "sft":
        evals = [r for r in run["eval"] if finite(r.get("nll")) is not None]
        before = next((r["nll"] for r in evals if r.get("when") == "before"), None)
        after = next((r["nll"] for r in reversed(evals) if r.get("when") == "after"), None)
        loss_key = first_key(m, "loss", "train_mean_nll")
        text = f"step {last.get('step')} · train {loss_key} {fmt_num(last.get(loss_key))}"
        if before is not None:
            text += f" · held-out nll before {fmt_num(before)}"
        if after is not None:
            text += f" → after {fmt_num(after)}"
    else:
        key = first_key(m, "reward_mean", "env/all/reward/total")
        rewards = [r[key] for r in m if key and finite(r.get(key)) is not None]
        text = f"iteration {last.get('iteration', last.get('step'))}"
        if rewards:
            text += f" · reward first {fmt_num(rewards[0])} → last {fmt_num(rewards[-1])}"
    return [f"<p><b>{esc(text)}</b> ({len(m)} metrics rows)</p>"]


def fmt_num(value):
    return "n/a" if finite(value) is None else f"{value:.4g}"


def checkpoints_table(rows):
    out = ["<h2>Checkpoints</h2>"]
    if not rows:
        return out + ["<p class='note'>no checkpoint saved yet (checkpoints.jsonl missing or empty).</p>"]
    cols = ["name", "step", "next_batch", "next_iteration", "epoch", "state_path", "sampler_path", "time"]
    cols = [c for c in cols if any(c in r for r in rows)]
    out.append("<table id='checkpoints'><tr>" + "".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr>")
    for r in rows:
        out.append("<tr>" + "".join(f"<td class='mono'>{esc(r.get(c))}</td>" for c in cols) + "</tr>")
    return out + ["</table>"]


def probes_table(evals):
    """Greedy probe samples before and after training (eval.jsonl rows carry them)."""
    row = next((r for r in reversed(evals) if r.get("probes")), None)
    if row is None:
        return []
    out = ["<h2>Probes (greedy samples of held-out prompts)</h2><table id='probes'>"
           "<tr><th>prompt</th><th>expected</th><th>before</th><th>after</th></tr>"]
    for p in row["probes"]:
        out.append("<tr>" + "".join(f"<td><pre>{esc(p.get(k))}</pre></td>"
                                    for k in ("prompt", "expected", "before", "after")) + "</tr>")
    return out + ["</table>"]


def settings_table(config):
    if not config:
        return []
    out = ["<h2>Settings (config.json)</h2><details><summary>every setting</summary><table id='settings'>"]
    for key, value in config.items():
        text = value if isinstance(value, (str, int, float)) or value is None else json.dumps(value)
        out.append(f"<tr><th>{esc(key)}</th><td class='mono'>{esc(text)}</td></tr>")
    return out + ["</table></details>"]


# ---------------------------------------------------------------------------------------------
# Rollout browser (rollouts.jsonl, one row per rollout; see references/run-records.md)


def rollout_browser(rows):
    if not rows:
        return []
    shown = rows[-MAX_ROLLOUTS:]
    out = ["<h2>Rollouts</h2>",
           "<p class='legend'><span class='tok obs'>context (prompt, observations): not trained</span>"
           "<span class='tok pos'>trained, advantage &gt; 0</span><span class='tok neg'>trained, advantage &lt; 0</span>"
           "<span class='tok zero'>trained, advantage 0</span><span class='tok masked'>sampled, masked</span> "
           "hover a token for its id and sampler logprob</p>"]
    if len(rows) > len(shown):
        out.append(f"<p class='note'>showing the last {len(shown)} of {len(rows)} rollouts.</p>")
    out.append("<div id='rollouts'>")
    by_iteration = {}
    for r in shown:
        by_iteration.setdefault(r.get("iteration"), []).append(r)
    for i, (iteration, group) in enumerate(reversed(by_iteration.items())):
        rewards = [r["reward"] for r in group if finite(r.get("reward")) is not None]
        mean = f", mean reward {sum(rewards) / len(rewards):.3g}" if rewards else ""
        out.append(f"<details{' open' if i == 0 else ''}><summary>iteration {esc(iteration)}: "
                   f"{len(group)} rollouts{mean}</summary>")
        out += [rollout_html(r, open_=(i == 0 and n == 0)) for n, r in enumerate(group)]
        out.append("</details>")
    return out + ["</div>"]


def rollout_html(r, open_=False):
    adv = finite(r.get("advantage"))
    trained = bool(r.get("trained"))
    head = (f"task {esc(r.get('task'))} · group {esc(r.get('group'))} · sample {esc(r.get('sample'))} · "
            f"reward {fmt_num(r.get('reward'))} · advantage {fmt_num(adv)} · "
            f"{'trained' if trained else 'not trained'}")
    if r.get("sampler_version") is not None:
        head += f" · sampler {esc(r.get('sampler_version'))}"
    parts = [f"<details class='rollout-row'{' open' if open_ else ''}><summary>{head}</summary><div class='rollout'>"]
    if r.get("prompt_text") is not None:
        parts.append(f"<div>prompt</div><pre class='prompt'>{esc(r['prompt_text'])}</pre>")
    if r.get("completion_text") is not None:
        parts.append(f"<div>completion</div><pre class='completion'>{esc(r['completion_text'])}</pre>")
    parts.append("<div>tokens</div><div class='tokens'>" + token_spans(r, adv, trained) + "</div>")
    return "".join(parts) + "</div></details>"


def token_spans(r, adv, trained):
    """Every token id of the rollout, coloured by whether the update trained it. The sequence is
    prompt_tokens + completion_tokens; completion_tokens is each turn's observation_tokens then its
    action_tokens, and sampler_logprobs has one value per completion token (0.0 on observations)."""
    act_class = "masked" if not trained else ("zero" if not adv else ("pos" if adv > 0 else "neg"))
    logprobs = list(r.get("sampler_logprobs") or [])
    turns = r.get("turns") or [{"observation_tokens": [], "action_tokens": r.get("completion_tokens") or [],
                                 "masked": False}]
    spans = [tok(t, "obs", "prompt") for t in r.get("prompt_tokens") or []]
    k = 0  # position in completion_tokens / sampler_logprobs
    for n, turn in enumerate(turns):
        if turn.get("starts_datum"):
            spans.append("<span class='datum-break' title='a new datum starts here'>|</span>")
        if turn.get("observation_text") is not None:
            spans.append(f"<pre class='observation'>{esc(turn['observation_text'])}</pre>")
        observation = turn.get("observation_tokens") or []
        spans += [tok(t, "obs", f"turn {n} observation") for t in observation]
        k += len(observation)
        actions = turn.get("action_tokens") or []
        masked = turn.get("masked", False)
        flags = masked if isinstance(masked, list) else [bool(masked)] * len(actions)
        for t, m in zip(actions, flags + [False] * (len(actions) - len(flags))):
            lp = logprobs[k] if k < len(logprobs) else None
            k += 1
            spans.append(tok(t, "masked" if m else act_class, f"turn {n} action", lp))
        if turn.get("stop_reason"):
            spans.append(f"<span class='stop'>[{esc(turn['stop_reason'])}]</span>")
    return "".join(spans)


def tok(token, cls, where, logprob=None):
    title = f"{where} · id {token}" + ("" if finite(logprob) is None else f" · logprob {logprob:.3f}")
    return f"<span class='tok {cls}' title='{esc(title)}'>{esc(token)}</span>"


def cli(argv=None):
    try:
        return main(argv)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # a bug or an unexpected record: one line, exit 1
        print(f"error: report failed ({type(e).__name__}: {e}); rerun to retry, the run folder was not changed",
              file=sys.stderr)
        return 1


# ==== SHARED CODE (generated from common/: run_files) ====
# Edit the files in common/ of the tinker-training-inference bundle, then run `python tools/splice.py`;
# tests/test_shared_code.py fails when this copy differs from its source.


# ---- common/run_files.py ----
# A run folder's files at the lowest level, carried by every script that reads or writes one (the report
# tool too): JSONL lines as editors save them, and the one-writer lock.
#
# The lock: an exclusive advisory POSIX record lock (lockf) on LOG/.lock, held for the writer's whole life.
# The kernel drops it when its process ends, however it ends (SIGKILL too), and forked workers (the render
# pool) do not inherit it. The file says who holds it (pid, host, script, start time) for the error a second
# writer prints and for readers (tinker_report.py), which never take the lock: they test it for an instant.
# A record left by a process that died holding the lock is taken over by the next writer, which says so.
# Within one process a POSIX lock never conflicts with itself and closing any descriptor of the file drops
# it: only the lock's own code opens LOG/.lock.
import errno
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the scripts run, unguarded
    fcntl = None

LOCK_FILE = ".lock"
# A reader tests the lock for microseconds and a writer records itself right after taking it: a refused
# writer that finds no live holder named in the file tries again for this long before giving up.
SETTLE_S = 2.0


def jsonl_lines(text: str):
    """(line number, line) of each non-blank line of JSONL text: a UTF-8 byte-order mark (Windows editors,
    also where files were concatenated) and CRLF endings are accepted, as pandas and datasets accept them;
    only a newline ends a line (U+2028 and other characters str.splitlines() splits on are valid inside a
    JSON string)."""
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.strip().lstrip("\ufeff")
        if line:
            yield n, line


class FolderBusy(Exception):
    """A live process holds the folder's lock; `holder` is its record ({} when unreadable)."""

    def __init__(self, holder: dict):
        super().__init__(describe_holder(holder))
        self.holder = holder


def describe_holder(holder: dict) -> str:
    if not holder.get("pid"):
        return "another process (it has not recorded itself yet)"
    return (f"{holder.get('script') or 'a script'} (pid {holder['pid']} on host {holder.get('host')}, "
            f"since {holder.get('started')})")


def read_holder(fd) -> dict:
    try:
        data = os.pread(fd, 65536, 0)
        record = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def holder_alive(holder: dict) -> bool | None:
    """Whether the recorded process still runs: True/False on this host, None for another host."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same_file(fd, path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def acquire_lock(folder) -> tuple[int | None, dict]:
    """(descriptor holding FOLDER/.lock, the record of a dead holder taken over or {}). Creates the folder.
    FolderBusy when a live process holds it. Release with release_lock(fd, folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        return None, {}
    path = folder / LOCK_FILE
    deadline = time.monotonic() + SETTLE_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            holder = read_holder(fd)
            os.close(fd)
            if holder_alive(holder) or time.monotonic() > deadline:
                raise FolderBusy(holder) from None
            time.sleep(0.05)
            continue
        if not _same_file(fd, path):  # released and removed between our open and lock: lock the new file
            os.close(fd)
            continue
        previous = read_holder(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "script": Path(sys.argv[0]).name if sys.argv and sys.argv[0] else None,
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        return fd, previous


def release_lock(fd, folder) -> None:
    """Remove FOLDER/.lock (if it is still ours) and drop the lock."""
    if fd is None:
        return
    path = Path(folder) / LOCK_FILE
    try:
        if _same_file(fd, path):
            path.unlink()
    except OSError:
        pass
    os.close(fd)


def lock_holder(folder) -> dict | None:
    """The record of the live process holding FOLDER/.lock, or None. Never waits and never blocks a writer
    for longer than an instant (a writer refused meanwhile tries again). Not for use by the holder itself."""
    if fcntl is None:
        return None
    try:
        fd = os.open(Path(folder) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return read_holder(fd) or {"pid": None}
        return None
    finally:
        os.close(fd)
# ==== END SHARED CODE (sha256 59e646b4bafc) ====


if __name__ == "__main__":
    sys.exit(cli())
