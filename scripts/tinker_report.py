#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "plotly>=6",
# ]
# ///
"""One self-contained HTML page of a Tinker run (SFT, RL, DPO or distillation): curves, cost, checkpoints, samples.

Run:
    # the report of a finished run (or of one still running: torn last lines and missing files are fine)
    uv run tinker_report.py runs/sft1
    # rewrite it every 30 s while the run goes on (the open page reloads itself); Ctrl-C stops
    uv run tinker_report.py runs/rl1 --out rl1.html --watch 30

Edit:
    Nothing for the common case. figures(run) decides which charts exist (one function per run kind);
    each is a plotly figure built from the rows as logged (no smoothing, no resampling), so a chart shows
    exactly the numbers in the record; each y axis is fitted to the values drawn on it.

Outputs:
    RUN_DIR/report.html   (or --out FILE) one file, plotly.js embedded: opens offline, no server
                          SFT (tinker_sft.py): train loss, held-out NLL, held-out score (--eval-every),
                            learning rate, greedy probes before/after;
                          RL (tinker_rl.py): reward mean +- std, min/max, fraction of tied groups,
                            KL sample-vs-train, rollout browser (rollouts.jsonl: prompt, completion,
                            reward, advantage, trained/masked tokens);
                          DPO (tinker_dpo.py): preference accuracy, margin, chosen and rejected reward,
                            implicit KL, loss, learning rate;
                          distillation (tinker_distill.py): reverse KL to the teacher, teacher and
                            student logprob, KL sample-vs-train, learning rate;
                          every kind: a banner when the run was a local rehearsal (another model stood
                          in for model_name), cost so far vs estimate when the record has them and what
                          neither counts, checkpoints table, settings. The learning rate is drawn on a log axis; whitespace and
                          control characters in samples show as markers (newline, space, tab), the raw
                          text on hover.
    stdout                one JSON object: status, report (the file written), kind (sft|rl|dpo|distill),
                          rows {config, metrics, eval, checkpoints, rollouts}, skipped_lines, in_progress (true
                          while a script holds the folder's lock: LOG/.lock, tested without taking it),
                          rehearsal (null, or {stand_in, model_name, evidence} for a local rehearsal)

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
import unicodedata
from datetime import datetime, timezone
from pathlib import Path

RECORD_FILES = ("config.json", "metrics.jsonl", "eval.jsonl", "checkpoints.jsonl", "rollouts.jsonl")
# The rollout browser keeps the most recent rollouts; the page stays light enough to open anywhere.
MAX_ROLLOUTS = 400
# Run kinds: the script that writes each, and the page title.
KINDS = {"sft": ("tinker_sft.py", "SFT"), "rl": ("tinker_rl.py", "RL"), "dpo": ("tinker_dpo.py", "DPO"),
         "distill": ("tinker_distill.py", "Distillation")}
WRITERS = "tinker_sft.py, tinker_rl.py, tinker_dpo.py or tinker_distill.py"
# What the pre-run estimate and the metered cost/* fields leave out (tinker_pricing.py's not_counted): used when
# config.json does not list them itself (estimate_not_counted).
NOT_COUNTED = ("storage: checkpoints are billed per GB-month for as long as they are kept",
               "checkpoint saves: Tinker meters them per checkpoint, at no published rate")
# Checkpoint ids the local backend (SkyRL) makes: tinker://model_<hex>/... and, for a loaded state,
# tinker://session_<hex>:train:N/...; Tinker's own are UUIDs.
LOCAL_CHECKPOINT_IDS = ("tinker://model_", "tinker://session_")


class ReportError(Exception):
    exit_code = 2


class WriteError(ReportError):
    exit_code = 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Write one self-contained HTML report of a Tinker run folder of any kind: SFT (tinker_sft.py), "
                    "RL (tinker_rl.py), DPO (tinker_dpo.py) or distillation (tinker_distill.py); the kind is read "
                    "from the record.")
    p.add_argument("run_dir", metavar="RUN_DIR", help=f"the --log-path of {WRITERS}")
    p.add_argument("--out", default=None, help="HTML file to write (default RUN_DIR/report.html)")
    p.add_argument("--rollout", type=int, default=None, metavar="N",
                   help="instead of the page: print rollout N of rollouts.jsonl (0 the first, -1 the last) as text, "
                        "trained spans marked apart from the prompt and observations, with reward and advantage")
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                   help="rewrite the report every SECONDS until interrupted (the page reloads itself)")
    return p.parse_args(argv)


def a_run_folder() -> str:
    """A run folder to name in a hint: the first under ./runs/ that holds a record, else the usual name."""
    found = sorted(p.parent for p in Path("runs").glob("*/config.json"))
    return str(found[0]) if found else "runs/sft1"


def main(argv=None):
    args = parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder; expected a run folder (the --log-path of {WRITERS}); "
                          f"try: {script_command('tinker_report.py', a_run_folder(), server=False)}")
    if not any((run_dir / name).exists() for name in RECORD_FILES):
        raise ReportError(f"{run_dir} holds no run record (none of {', '.join(RECORD_FILES)}); pass the "
                          f"--log-path of a run, e.g. {script_command('tinker_report.py', a_run_folder(), server=False)}")
    if args.watch is not None and args.watch <= 0:
        raise ReportError(f"--watch {args.watch:g}: expected a number of seconds above 0, e.g. --watch 30")
    if args.rollout is not None:
        return show_rollout(run_dir, args.rollout)
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


TRAINED_MARK = ("[[", "]]")  # around the tokens that carry the advantage in the text view of one rollout


def rollout_text(row, index=None, total=None):
    """One rollouts.jsonl row as text: a header (iteration, task, reward, advantage, trained), the prompt, then per
    turn the observation added before it and the model's action; trained actions inside [[ ]]."""
    trained = bool(row.get("trained"))
    where = f"rollout {index} of {total}: " if index is not None else ""
    lines = [f"{where}iteration {row.get('iteration')}, task {row.get('task')}, group {row.get('group')}, sample "
             f"{row.get('sample')} | reward {row.get('reward')} | advantage {row.get('advantage', 0.0):+.4g} | "
             + ("trained (the [[ ]] spans carry the advantage)" if trained else "not trained (its group tied or "
                "was dropped): every token masked"),
             "--- prompt (masked) ---", str(row.get("prompt_text", ""))]
    turns = row.get("turns") or []
    if turns and all("action_text" in t for t in turns):
        for k, turn in enumerate(turns, 1):
            if k > 1 or turn.get("observation_text"):
                starts = " (starts a new datum: the whole context)" if turn.get("starts_datum") else ""
                lines += [f"--- observation before turn {k} (masked){starts} ---", turn.get("observation_text", "")]
            action = turn["action_text"]
            marked = f"{TRAINED_MARK[0]}{action}{TRAINED_MARK[1]}" if trained and not turn.get("masked") else action
            lines += [f"--- turn {k}: the model ({'trained' if trained and not turn.get('masked') else 'masked'}, "
                      f"stop {turn.get('stop_reason')}) ---", marked]
    else:  # a trace written before turns carried text: the completion in one piece
        lines += ["--- completion (observations and actions; this row has no per-turn text) ---",
                  str(row.get("completion_text", ""))]
    return "\n".join(lines)


def show_rollout(run_dir, n):
    """--rollout N: one episode as text on stderr, its numbers as the JSON object on stdout."""
    skipped = {}
    path = Path(run_dir) / "rollouts.jsonl"
    rows = read_rows(path, skipped) if path.exists() else []
    if not rows:
        raise ReportError(f"{path} holds no rollouts; tinker_rl.py writes them (every --trace-every iterations)")
    if not -len(rows) <= n < len(rows):
        raise ReportError(f"--rollout {n}: {path} holds {len(rows)} rollouts; pick 0..{len(rows) - 1} (or -1, the last)")
    index = n % len(rows)
    row = rows[index]
    print(rollout_text(row, index, len(rows)), file=sys.stderr)
    print(json.dumps({"status": "ok", "rollout": index, "rollouts": len(rows),
                      **{k: row.get(k) for k in ("iteration", "task", "group", "sample", "reward", "advantage",
                                                 "trained")},
                      "turns": len(row.get("turns") or [])}))
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
            "skipped_lines": run["skipped_lines"], "in_progress": run["in_progress"], "rehearsal": run["rehearsal"]}


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
    config = config if isinstance(config, dict) else {}
    return {
        "rehearsal": local_rehearsal(config, checkpoints),
        "dir": run_dir, "kind": run_kind(config, metrics), "config": config,
        "metrics": metrics, "eval": read_rows(run_dir / "eval.jsonl", skipped), "checkpoints": checkpoints,
        "rollouts": read_rows(run_dir / "rollouts.jsonl", skipped), "skipped_lines": skipped,
        # a live process holds the folder's lock (tested, never taken: reading blocks no writer)
        "in_progress": lock_holder(run_dir) is not None, "finished": any(r.get("name") == "final" for r in checkpoints),
    }


def local_rehearsal(config, checkpoints):
    """{stand_in, model_name, evidence} when the run trained on the local backend (another model stood in for
    model_name), else None. config.json's "backend" says so ({"kind": "local", "stand_in": ...}); older records
    are recognised by a `rehearse` setting, a loopback TINKER_BASE_URL / base_url recorded, or the local
    backend's checkpoint ids in checkpoints.jsonl."""
    backend = config.get("backend") if isinstance(config.get("backend"), dict) else {}
    if backend.get("kind") == "tinker":
        return None
    evidence = None
    if backend.get("kind") == "local":
        evidence = "config.json backend.kind local"
    elif config.get("rehearse") is True:
        evidence = "config.json rehearse true"
    else:
        for key in ("TINKER_BASE_URL", "base_url", "tinker_base_url"):
            url = config.get(key)
            if isinstance(url, str) and any(h in url for h in ("://127.0.0.1", "://localhost", "://[::1]")):
                evidence = f"config.json {key} {url}"
                break
    if evidence is None:
        paths = [str(r.get(k) or "") for r in checkpoints for k in ("state_path", "sampler_path")]
        local = next((p for p in paths if p.startswith(LOCAL_CHECKPOINT_IDS)), None)
        if local is None:
            return None
        evidence = f"a local backend checkpoint id ({local})"
    return {"stand_in": backend.get("stand_in"), "model_name": config.get("model_name"), "evidence": evidence}


def run_kind(config, metrics):
    """sft, rl, dpo or distill, from what each script writes (none writes its kind by name).

    distill: config.json has `teacher` (tinker_distill.py), or rows log `reverse_kl`; it also has RL's
    `group_size` and `iteration`, so it is tested first. dpo: config.json has `dpo_beta`, or rows log
    `chosen_reward`. rl: config.json has `group_size`, or rows log `iteration` / `reward_mean` (or the
    cookbook's env/all/reward/total). Anything else is SFT (tinker_sft.py, or the cookbook's sl_loop)."""
    logged = set().union(*(r.keys() for r in metrics)) if metrics else set()
    if "teacher" in config or "reverse_kl" in logged:
        return "distill"
    if "dpo_beta" in config or "chosen_reward" in logged:
        return "dpo"
    if "group_size" in config or logged & {"iteration", "reward_mean", "env/all/reward/total"}:
        return "rl"
    return "sft"


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

    def chart(fig_id, title, traces, x_title, y_title, shapes=(), axis="fit"):
        """axis: "fit" (linear, fitted to the values), "log" (log scale when every value is above 0: the
        learning rate), or (low, high) for a quantity with known bounds (fractions, accuracy)."""
        if not any(t.x for t in traces):
            return
        fig = go.Figure(traces)
        fig.update_layout(title=title, template="plotly_white", height=340, margin=dict(l=70, r=20, t=50, b=45),
                          xaxis_title=x_title, yaxis_title=y_title, legend=dict(orientation="h", y=-0.25))
        if max(len(t.x) for t in traces) <= 12:
            fig.update_xaxes(dtick=1)  # steps and iterations are whole numbers
        for shape in shapes:
            fig.add_hline(**shape)
        values = [y for t in traces for y in (t.y or ()) if finite(y) is not None]
        values += [s["y"] for s in shapes if finite(s.get("y")) is not None]
        fig.update_yaxes(**y_axis(values, axis))
        figs.append((fig_id, title, fig))

    def line(rows, x_key, key, name=None, **kw):
        x, y = series(rows, x_key, key)
        return go.Scatter(x=x, y=y, name=name or key, mode=kw.pop("mode", "lines+markers"), **kw)

    m = run["metrics"]
    kind_figures = {"sft": sft_figures, "rl": rl_figures, "dpo": dpo_figures, "distill": distill_figures}
    kind_figures[run["kind"]](run, m, chart, line, go)

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


def learning_rate_chart(m, x_key, chart, line):
    if first_key(m, "learning_rate"):
        chart("learning_rate", "Learning rate", [line(m, x_key, "learning_rate")], x_key, "learning rate",
              axis="log")


def sft_figures(run, m, chart, line, go):
    loss_key = first_key(m, "loss", "train_mean_nll")
    x, y = series(m, "step", loss_key) if loss_key else ([], [])
    traces = [go.Scatter(x=x, y=y, name=f"train {loss_key}", mode="lines+markers")]
    ev = [r for r in run["eval"] if "nll" in r]
    if ev:
        traces.append(line(ev, "step", "nll", "held-out nll (eval.jsonl)"))
    elif first_key(m, "test/nll"):
        traces.append(line(m, "step", "test/nll", "held-out test/nll"))
    chart("loss", "Loss: NLL per trained token", traces, "step", "nats / token")
    scored = [r for r in run["eval"] if finite(r.get("score")) is not None]
    if scored:  # tinker_sft.py --eval-every: score() of greedy held-out samples, before / during / after
        chart("score", "Held-out score: mean score() of greedy samples (eval.jsonl)",
              [line(scored, "step", "score", "held-out score (eval.jsonl)")], "step", "score", axis=(0, 1))
    elif first_key(m, "eval_score"):
        chart("score", "Held-out score: mean score() of greedy samples",
              [line(m, "step", "eval_score")], "step", "score", axis=(0, 1))
    learning_rate_chart(m, "step", chart, line)


def rl_figures(run, m, chart, line, go):
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
        for key in ("reward_min", "reward_max"):
            if first_key(m, key):
                traces.append(line(m, it, key, mode="lines", line=dict(dash="dot", width=1)))
        chart("reward", "Reward: mean, spread (mean ± std), min and max", traces, it, "reward")
    traces = [line(m, it, key) for key in ("frac_groups_tied", "frac_truncated") if first_key(m, key)]
    if not first_key(m, "frac_groups_tied") and first_key(m, "by_group/frac_mixed"):
        rows = [r for r in m if "by_group/frac_mixed" in r]
        traces.append(go.Scatter(x=[r.get(it) for r in rows], y=[1 - r["by_group/frac_mixed"] for r in rows],
                                 name="1 - by_group/frac_mixed", mode="lines+markers"))
    chart("tied", "Groups tied (no signal) and episodes truncated", traces, it, "fraction", axis=(0, 1))
    sampler_learner_kl_chart(m, it, chart, line)


def sampler_learner_kl_chart(m, it, chart, line):
    traces = []
    for version in ("v1", "v2"):  # our name, else the cookbook's (a record may carry both: draw one)
        key = first_key(m, f"kl_sample_train_{version}", f"optim/kl_sample_train_{version}")
        if key:
            traces.append(line(m, it, key))
    chart("kl", "KL sampler vs learner on the sampled tokens (stable training: below about 0.01)",
          traces, it, "nats")


def dpo_figures(run, m, chart, line, go):
    """tinker_dpo.py's rows: accuracy (chosen implicit reward above rejected), margin (mean of
    beta * (chosen - rejected log-ratio)), chosen_reward / rejected_reward, implicit_kl, loss."""
    chart("accuracy", "Preference accuracy: chosen reward above rejected (0.5 = chance)",
          [line(m, "step", key) for key in ("accuracy", "policy_accuracy") if first_key(m, key)],
          "step", "fraction of pairs", axis=(0, 1))
    chart("margin", "Margin: beta × (chosen − rejected log-ratio to the reference)",
          [line(m, "step", "margin")] if first_key(m, "margin") else [], "step", "margin")
    chart("rewards", "Implicit rewards: chosen and rejected (beta × log-ratio to the reference)",
          [line(m, "step", key) for key in ("chosen_reward", "rejected_reward") if first_key(m, key)],
          "step", "reward")
    chart("implicit_kl", "Implicit KL: ½ (log π − log ref)² per trained token, the drift from the reference",
          [line(m, "step", "implicit_kl")] if first_key(m, "implicit_kl") else [], "step", "nats")
    chart("loss", "DPO loss: mean of −log sigmoid(beta × log-ratio difference) (log 2 ≈ 0.693 at the reference)",
          [line(m, "step", key) for key in ("loss", "dpo_loss") if first_key(m, key)], "step", "loss")
    learning_rate_chart(m, "step", chart, line)


def distill_figures(run, m, chart, line, go):
    """tinker_distill.py's rows: reverse_kl (student minus teacher logprob per sampled token: the
    quantity distillation lowers), teacher_logprob and student_logprob means, sampler/learner KL."""
    it = first_key(m, "iteration", "step") or "iteration"
    chart("reverse_kl", "Reverse KL to the teacher per sampled token (falls as the student learns)",
          [line(m, it, "reverse_kl")] if first_key(m, "reverse_kl") else [], it, "nats / token")
    chart("logprobs", "Mean logprob of the student's samples: under the teacher and under the student",
          [line(m, it, key) for key in ("teacher_logprob", "student_logprob") if first_key(m, key)],
          it, "nats / token")
    sampler_learner_kl_chart(m, it, chart, line)
    chart("truncated", "Samples truncated at --max-tokens",
          [line(m, it, "frac_truncated")] if first_key(m, "frac_truncated") else [], it, "fraction", axis=(0, 1))
    learning_rate_chart(m, it, chart, line)


def y_axis(values, axis="fit"):
    """Layout of a y axis that fits `values`: plotly's own autorange puts a constant series in [v-1, v+1],
    so a learning rate of 1e-2 would lie flat on zero. "log": a log axis (when every value is above 0)
    spanning the values plus a margin; a constant series gets half a decade on each side. "fit": a linear
    axis from the smallest to the largest value plus 8 % (10 % of the value for a constant one, ±1 for
    zeros). (low, high): that range, widened to the values."""
    if not values:
        return {}
    lo, hi = min(values), max(values)
    if axis == "log" and lo > 0:
        a, b = math.log10(lo), math.log10(hi)
        pad = 0.5 if b - a < 1e-9 else max(0.08 * (b - a), 0.1)
        return dict(type="log", range=[a - pad, b + pad], tickformat=".2~g")
    if isinstance(axis, tuple):
        lo, hi = min(lo, axis[0]), max(hi, axis[1])
    if hi - lo < 1e-12 * max(abs(lo), abs(hi), 1e-300):
        pad = abs(lo) * 0.1 or 1.0
    else:
        pad = 0.08 * (hi - lo) if not isinstance(axis, tuple) else 0.04 * (hi - lo)
    return dict(range=[lo - pad, hi + pad])


def estimate_usd(config):
    est = config.get("estimate_usd")
    if est is None and isinstance(config.get("estimate"), dict):
        est = (config["estimate"].get("usd") or {}).get("total")
    return finite(est)


def cost_series(run):
    """(x, cumulative usd, estimate or None, x key) when the record has a cost, else None."""
    m = run["metrics"]
    x_key = (first_key(m, "step", "iteration") if run["kind"] in ("sft", "dpo")
             else first_key(m, "iteration", "step"))
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
.legend .ws { margin-right: 4px; }
.ws { color: #b54d00; background: #ffe9cc; font-weight: bold; border-radius: 2px; padding: 0 1px; margin: 0 1px; }
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


# Whitespace and invisible characters in samples, drawn as marks: an untrained model's sample is often
# newlines only, which a plain <pre> shows as an empty box.
MARKS = {"\n": "⏎", "\t": "⇥", "\r": "␍", " ": "␣", "\x7f": "␡"}


def mark(char):
    """The visible stand-in of one whitespace or invisible character, or None for an ordinary one."""
    if char in MARKS:
        return MARKS[char]
    if ord(char) < 0x20:
        return chr(0x2400 + ord(char))  # the Unicode control pictures ␀ .. ␟
    if unicodedata.category(char) in ("Cc", "Cf", "Zs", "Zl", "Zp") and char != " ":
        return f"⟨U+{ord(char):04X}⟩"  # no-break and zero-width spaces, BOM, direction marks
    return None


WS_LEGEND = ("<p class='legend'>in samples: <span class='ws'>⏎</span> line break, <span class='ws'>␣</span> "
             "space at a line's start or end or in a run, <span class='ws'>⇥</span> tab, "
             "<span class='ws'>∅</span> empty; hover a sample for its raw text</p>")


def sample_html(text, cls=None):
    """A <pre> of a sample with whitespace and control characters visible, as <span class='ws'> marks: ⏎ at
    each line break (the line still breaks), ␣ for a space at the start or end of a line or next to another
    space (single spaces between words stay plain), ⇥ tab, ␍ carriage return, ␀..␟ and ␡ for other control
    characters, ⟨U+XXXX⟩ for invisible ones; ∅ for an empty sample. When anything is marked, hovering
    shows the raw text as a JSON string."""
    attrs = f" class='{cls}'" if cls else ""
    if text is None:
        return f"<pre{attrs}></pre>"
    text = str(text)
    if text == "":
        return f"<pre{attrs} title='\"\" (empty)'><span class='ws'>∅</span></pre>"
    out, marked = [], False
    for i, char in enumerate(text):
        sign = mark(char)
        if char == " ":
            before = text[i - 1] if i else "\n"
            after = text[i + 1] if i + 1 < len(text) else "\n"
            if before not in " \n" and after not in " \n":
                sign = None  # a space between words
        if sign is None:
            out.append(html.escape(char))
            continue
        marked = True
        out.append(f"<span class='ws'>{sign}</span>" + ("\n" if char == "\n" else ""))
    title = f" title='{esc(json.dumps(text, ensure_ascii=False))}'" if marked else ""
    return f"<pre{attrs}{title}>{''.join(out)}</pre>"


def script_json(text):
    """JSON safe inside a <script> element."""
    return text.replace("</", "<\\/")


def render_page(run, watch=None):
    from plotly.offline import get_plotlyjs

    figs = figures(run)
    cfg = run["config"]
    title = f"{KINDS[run['kind']][1]} run {run['dir'].resolve().name}"
    if run["rehearsal"]:
        title = f"{title} (local rehearsal)"
    status = ("in progress (a script holds the folder's lock and is writing it)" if run["in_progress"] else
              "finished (final checkpoint saved)" if run["finished"] else
              "stopped before its final checkpoint (nothing is writing it: continue with the same command plus --resume)")
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{max(1, round(watch))}'>" if watch else "",
        f"<title>{esc(title)}</title><style>{CSS}</style>",
        f"<script>{get_plotlyjs()}</script></head><body>",
        f"<h1>{esc(title)}</h1>",
        rehearsal_banner(run["rehearsal"]),
        f"<div class='meta'>{esc(run['dir'].resolve())} · {esc(KINDS[run['kind']][0])} · "
        f"model {esc(cfg.get('model_name', 'unknown'))}{stand_in_note(run['rehearsal'])}{teacher_note(cfg)} · "
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
    parts += not_counted_note(run)
    parts += checkpoints_table(run["checkpoints"])
    if run["kind"] == "sft":
        parts += probes_table(run["eval"])
    parts += rollout_browser(run["rollouts"])
    parts += settings_table(cfg)
    parts.append(f"<script>{PLOT_JS}</script></body></html>")
    return "\n".join(p for p in parts if p)


BANNER_CSS = ("background: #fff3cd; border: 2px solid #d39e00; color: #5c4400; padding: 8px 12px; "
              "font-size: 15px; font-weight: bold; margin: 8px 0")


def rehearsal_banner(rehearsal):
    """The warning a rehearsal's page opens with: its curves and samples are the stand-in's."""
    if not rehearsal:
        return ""
    model = rehearsal["model_name"] or "the named model"
    stand_in = rehearsal["stand_in"] or "the local backend's model"
    return (f"<div id='rehearsal-banner' style='{BANNER_CSS}'>local rehearsal: {esc(stand_in)} stood in for "
            f"{esc(model)}; losses and samples are not {esc(model)}'s "
            f"<span style='font-weight: normal; font-size: 12px'>(from {esc(rehearsal['evidence'])}; costs are what "
            f"the same tokens would cost on Tinker)</span></div>")


def stand_in_note(rehearsal):
    if not rehearsal:
        return ""
    return f" (rehearsed: {esc(rehearsal['stand_in'] or 'the local backend model')} stood in)"


def not_counted_note(run):
    """What the estimate and the cost so far leave out, when the record has either."""
    cfg = run["config"]
    if estimate_usd(cfg) is None and not cost_series(run):
        return []
    items = cfg.get("estimate_not_counted")
    items = [str(i) for i in items] if isinstance(items, list) else list(NOT_COUNTED)
    if not items:
        return []
    return ["<p class='note' id='not-counted'>not counted in the estimate nor in the cost so far: "
            + "; ".join(esc(i) for i in items) + ".</p>"]


def teacher_note(config):
    teacher = config.get("teacher")
    return f" · teacher {esc(teacher)}" if teacher else ""


def first_last(rows, key):
    """' first A → last B' of a logged value, or '' when no row has it."""
    values = [r[key] for r in rows if finite(r.get(key)) is not None]
    return f" · {key} first {fmt_num(values[0])} → last {fmt_num(values[-1])}" if values else ""


def headline(run):
    m = run["metrics"]
    if not m:
        return []
    last = m[-1]
    if run["kind"] == "dpo":
        text = f"step {last.get('step')}" + first_last(m, "accuracy") + first_last(m, "margin")
    elif run["kind"] == "distill":
        text = f"iteration {last.get('iteration', last.get('step'))}" + first_last(m, "reverse_kl")
    elif run["kind"] == "sft":
        evals = [r for r in run["eval"] if finite(r.get("nll")) is not None]
        before = next((r["nll"] for r in evals if r.get("when") == "before"), None)
        after = next((r["nll"] for r in reversed(evals) if r.get("when") == "after"), None)
        loss_key = first_key(m, "loss", "train_mean_nll")
        text = f"step {last.get('step')} · train {loss_key} {fmt_num(last.get(loss_key))}"
        if before is not None:
            text += f" · held-out nll before {fmt_num(before)}"
        if after is not None:
            text += f" → after {fmt_num(after)}"
        scores = [r["score"] for r in run["eval"] if finite(r.get("score")) is not None]
        if scores:
            text += f" · held-out score first {fmt_num(scores[0])} → last {fmt_num(scores[-1])}"
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
    out = ["<h2>Probes (greedy samples of held-out prompts)</h2>", WS_LEGEND, "<table id='probes'>"
           "<tr><th>prompt</th><th>expected</th><th>before</th><th>after</th></tr>"]
    for p in row["probes"]:
        out.append("<tr>" + "".join(f"<td class='{k}'>{sample_html(p.get(k))}</td>"
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
           "hover a token for its id and sampler logprob</p>", WS_LEGEND]
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
        parts.append(f"<div>prompt</div>{sample_html(r['prompt_text'], 'prompt')}")
    if r.get("completion_text") is not None:
        parts.append(f"<div>completion</div>{sample_html(r['completion_text'], 'completion')}")
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
            spans.append(sample_html(turn["observation_text"], "observation"))
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


# ==== SHARED CODE (generated from common/: rehearsal, errors, render, run_files, service, rollouts) ====
# Edit the files in common/ of the tinker-training-inference bundle, then run `python tools/splice.py`;
# tests/test_shared_code.py fails when this copy differs from its source. Only the definitions the code
# above uses (directly or through each other) are copied.


# ---- common/rehearsal.py ----
# The free rehearsal (--rehearse) on the local backend: which model stands in, each script's preset for it, and the
# shape of the rehearsal's checks.
#
# `tinker_local.py run` exports TINKER_LOCAL_STAND_IN, the model standing in for the named one:
# - the tiny random Qwen3 (default): the named model's exact tokenizer and chat template, so masks, token counts and
#   datums are Qwen3's; it memorises a few short answers and nothing more;
# - SmolLM2-135M-Instruct (`tinker_local.py run --real`): a real, weak instruct model with its own tokenizer and ChatML
#   template; it follows a prompt, learns a user's answers, earns a user's reward and calls a tool after a warm-up.
# Each preset below was measured on its model (references/setup.md, "Which model to rehearse on").
import os

STAND_IN_ENV = "TINKER_LOCAL_STAND_IN"
TINY_STAND_IN = "tiny-qwen3"


def stand_in() -> str | None:
    """The model standing in on the local backend (from the launcher), or None (Tinker, or an unknown server)."""
    return os.environ.get(STAND_IN_ENV) or None


def real_stand_in() -> bool:
    """True when a real model (`tinker_local.py run --real`) stands in: the rehearsal judges the user's task."""
    return stand_in() not in (None, TINY_STAND_IN)


# ---- common/errors.py ----
# Errors and exit codes: every script fails with one line on stderr and a documented exit code.
import os
import sys
from pathlib import Path


# 0 ok · 1 Tinker or runtime failure · 2 bad input or usage · 3 estimate above --max-usd ·
# 4 no credentials / Tinker unreachable · 130 interrupted (SIGINT) · 143 terminated (SIGTERM)
EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_OVER_BUDGET, EXIT_NO_ACCESS = 0, 1, 2, 3, 4


class ScriptError(Exception):
    """A failure explained in one line: what failed, what was expected, the next command."""

    exit_code = EXIT_FAILURE


class BudgetError(ScriptError):
    exit_code = EXIT_OVER_BUDGET


def say(*parts) -> None:
    """Progress and warnings: stderr, so stdout carries only the final JSON object."""
    print(*parts, file=sys.stderr, flush=True)


def short_path(path) -> str:
    """A path to type from the working directory: relative when it climbs at most one folder, else absolute."""
    path = Path(path).resolve()
    rel = os.path.relpath(path)
    return rel if not rel.startswith(os.path.join("..", "..")) else str(path)


def sibling_script(name: str) -> str | None:
    """The path to type, from where the user stands, for `name` (another script of this bundle) beside this
    script; None when it is not beside it. Built on the script's path as the user typed it (sys.argv[0]), so a
    script copied into a project names its neighbours there, not the bundle's scripts/ folder."""
    here = Path(__file__).resolve()
    if not (here.parent / name).exists():
        return None
    folder = script_folder()
    return os.path.join(folder, name) if folder not in ("", ".") else name


def local_launcher() -> str | None:
    """The path to type for tinker_local.py: the one that started the local backend this script talks to
    (TINKER_LOCAL_LAUNCHER, set by `tinker_local.py run|serve`), else one beside this script, else None."""
    launcher = os.environ.get("TINKER_LOCAL_LAUNCHER")
    if launcher and Path(launcher).exists():
        return short_path(launcher)
    return sibling_script("tinker_local.py")


def python_command(script, *args) -> str:
    """The shell command that runs `script` (a path) with `args` under the interpreter running this script
    (sys.executable), shell-quoted: it works as printed with no venv activated, where a bare `python` may be
    another interpreter without the SDK (No module named 'tinker')."""
    import shlex

    return shlex.join([sys.executable or "python3", str(script), *map(str, args)])


def script_command(name: str, *args, server: bool = True) -> str:
    """The command that runs `name` (a bundle script) with ARGS: this interpreter, and the script beside this one,
    else beside the local backend's launcher (the bundle's scripts/), else where it belongs beside this one (copy
    it there from the bundle's scripts/ folder). On the local backend it is wrapped in `tinker_local.py run --`,
    which reaches the same checkpoint store, unless server=False (a command that never calls Tinker, e.g.
    `tinker_pricing.py list`)."""
    path = sibling_script(name)
    launcher = local_launcher()
    if path is None and launcher and (Path(launcher).parent / name).exists():
        path = os.path.join(os.path.dirname(launcher), name)
    command = python_command(path or os.path.join(script_folder(), name), *args)
    return under_launcher(command) if server else command


def under_launcher(command: str) -> str:
    """`command` wrapped in `tinker_local.py run [--real] --` when this script runs under the launcher: the
    same model stands in again and the same checkpoint store answers."""
    launcher = local_launcher()
    if launcher and os.environ.get("TINKER_LOCAL_LAUNCHER"):
        return f"{python_command(launcher, 'run', *(['--real'] if real_stand_in() else []), '--')} {command}"
    return command


def script_folder() -> str:
    """This script's folder as the user typed it (sys.argv[0]), else as a path to type from here."""
    here = Path(__file__).resolve()
    typed = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return os.path.dirname(typed) if typed and Path(typed).resolve() == here else short_path(here.parent)


# ---- common/render.py ----
# Tokenizer loading, the run record's "format", and rendering through the model's own chat template.
#
# The masking rule: a datum's weights are 1 exactly on what the model must produce after the generation
# prompt (the assistant's tokens, end-of-turn token included) and 0 on everything else. Rendering is
# deterministic: the date a template prints is frozen, so a resumed run renders the same datums.
import contextlib
import importlib


@contextlib.contextmanager
def _frozen_clock(date_iso):
    # transformers builds strftime_now() on datetime.now() and rebuilds any callable kwarg into a
    # string, so the only way to freeze the date a template prints is its module's clock.
    mod = importlib.import_module("transformers.utils.chat_template_utils")
    real = getattr(mod, "datetime", None)
    if real is None or not date_iso:
        yield
        return

    class FrozenDatetime(real):
        @classmethod
        def now(cls, tz=None):
            return real.fromisoformat(date_iso)

    mod.datetime = FrozenDatetime
    try:
        yield
    finally:
        mod.datetime = real


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
import json
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the scripts run, unguarded
    fcntl = None

LOCK_FILE = ".lock"


def jsonl_lines(text: str):
    """(line number, line) of each non-blank line of JSONL text: a UTF-8 byte-order mark (Windows editors,
    also where files were concatenated) and CRLF endings are accepted, as pandas and datasets accept them;
    only a newline ends a line (U+2028 and other characters str.splitlines() splits on are valid inside a
    JSON string)."""
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.strip().lstrip("\ufeff")
        if line:
            yield n, line


def read_holder(fd) -> dict:
    try:
        data = os.pread(fd, 65536, 0)
        record = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


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


# ---- common/service.py ----
# Reaching Tinker: credentials, a fast reachability check, the served-model check, checkpoint paths,
# and the optional cost preflight and per-step cost metering through tinker_pricing.py beside the script.
import importlib
import os
import sys
from pathlib import Path


def load_pricing():
    """tinker_pricing from beside this script, or None (then no dollar estimate)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        return importlib.import_module("tinker_pricing")
    except ImportError:
        return None


def estimate(model_name, tokens: dict, max_usd, *, label: str, context=None):
    """The pricing estimate dict, or None; BudgetError when --max-usd is exceeded or cannot be proven."""
    pricing = load_pricing()
    if pricing is None:
        # A dry run refuses --max-usd exactly as the real run does: a dry run that passes is an audit.
        if max_usd is not None:
            raise BudgetError(f"cannot check --max-usd: tinker_pricing.py (the prices) is not beside this script; "
                              f"{copy_pricing_command()}, or drop --max-usd")
        say("no dollar estimate: tinker_pricing.py is not beside this script")
        return None
    try:
        return pricing.preflight(model_name, tokens, max_usd, label=label, context=context)
    except pricing.BudgetExceeded as e:
        raise BudgetError(str(e)) from None
    except (pricing.UnknownModelError, ValueError, OverflowError) as e:
        if max_usd is not None:
            raise BudgetError(f"cannot check --max-usd: {e}") from None
        say(f"no dollar estimate: {e}")
        return None


def copy_pricing_command() -> str:
    """How to put the prices beside this script: a `cp` from the bundle when the local backend's launcher
    shows where the bundle is, else the words."""
    import shlex

    here = str(Path(__file__).resolve().parent)
    launcher = local_launcher()
    if launcher and (Path(launcher).parent / "tinker_pricing.py").exists():
        return f"copy it: cp {shlex.quote(os.path.join(os.path.dirname(launcher), 'tinker_pricing.py'))} {shlex.quote(here)}"
    return f"copy the bundle's scripts/tinker_pricing.py into {here}"


# ---- common/rollouts.py ----
# RL rollouts for tinker_rl.py: tasks and seeds per iteration, episodes sampled with bounded concurrency
# and environment calls that overlap, group-relative advantages, datums, the rollout trace, and the
# schedule of sampler versions (on-policy, or up to --max-staleness steps behind while training runs); what a
# run says about them (the metrics row, the progress line, the rehearsal's banner, the summary at the end); the
# cost of iterations (the estimate and its assumptions per episode, the running --max-usd check).
_PROBE = "Zq7PROBEqZ"


def render_text(tokenizer, fmt, messages, tools=None, add_generation_prompt=True):
    kwargs = dict(fmt["template_kwargs"])
    frozen = kwargs.pop("strftime_now", None)
    with _frozen_clock(frozen):
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **kwargs)


def observation_tokens(tokenizer, fmt, message):
    """Tokens that follow a closed model turn: the observation message and the next generation prompt.

    Rendered after a probe assistant turn and cut after its end-of-turn token, so the result appends
    to the tokens actually sampled (the extension property holds by construction and the episode
    stays one datum, whatever the template does to earlier turns)."""
    if isinstance(message, str):
        message = {"role": "user", "content": message}
    text = render_text(tokenizer, fmt, [{"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": _PROBE}, message])
    eot = tokenizer.decode([fmt["stop"][0]])
    start = text.index(_PROBE) + len(_PROBE)
    cut = text.index(eot, start) + len(eot)
    return tokenizer.encode(text[cut:], add_special_tokens=False)


def completion_text(tokenizer, fmt, tokens):
    if tokens and tokens[-1] in fmt["stop"]:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens)


def sampler_version(iteration, start, max_staleness, save_every):
    """The weights (counted in optim steps) the rollouts of `iteration` are sampled with: its own when
    max_staleness is 0 (on-policy), else up to max_staleness steps older, but never older than the run's
    start or the last save point at or before it, so a --resume samples exactly what the uninterrupted
    run did."""
    floor = max(start, iteration // save_every * save_every) if save_every else start
    return max(iteration - max_staleness, floor)
# ==== END SHARED CODE (sha256 865cf1551242) ====


if __name__ == "__main__":
    sys.exit(cli())
