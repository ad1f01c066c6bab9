"""tinker_report.py on synthetic run folders: every curve holds exactly the logged values (read back
out of the HTML), a run in progress (torn last line, missing files) still gets a report, the rollout
browser marks each token as the update used it, and the page needs no network."""
from __future__ import annotations

import html
import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures_local import sigint_default

import tinker_report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "tinker_report.py"


# ---------------------------------------------------------------------------------------------
# helpers shared with test_report_browser.py


def write_rows(path, rows, torn_tail=None):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    Path(path).write_text(text + (torn_tail or ""))


def figures_in(page):
    """{figure id: plotly figure dict} as embedded in the page."""
    found = re.findall(r"<script type='application/json' class='figure' id='figure-([\w-]+)'[^>]*>(.*?)</script>",
                       page, re.S)
    return {fig_id: json.loads(text.replace("<\\/", "</")) for fig_id, text in found}


def trace(fig, name):
    [t] = [t for t in fig["data"] if t.get("name") == name]
    return t


def run_report(run_dir, *extra):
    out = subprocess.run([sys.executable, str(SCRIPT), str(run_dir), *extra], capture_output=True, text=True,
                         timeout=120)
    return out.returncode, (json.loads(out.stdout) if out.stdout.strip() else None), out.stderr


def sft_folder(tmp_path):
    run = tmp_path / "sft"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model_name": "Qwen/Qwen3-8B", "lora_rank": 8,
                                                 "learning_rate": 0.01, "estimate_usd": 0.25}))
    metrics = [{"step": s, "epoch": 0, "loss": 2.5 / s + 0.125 * s, "learning_rate": 0.01 * (1 - (s - 1) / 4),
                "tokens": 400 + s, "trained_tokens": 100, "seconds": 0.5} for s in range(1, 5)]
    write_rows(run / "metrics.jsonl", metrics, torn_tail='{"step": 5, "loss": 1.2')
    evals = [{"step": 0, "when": "before", "nll": 3.25, "test_tokens": 50,
              "probes": [{"line": 3, "prompt": "<b>2+2</b>?", "expected": "4", "before": "5"}]},
             {"step": 2, "when": "during", "nll": 2.75, "test_tokens": 50}]
    write_rows(run / "eval.jsonl", evals)
    write_rows(run / "checkpoints.jsonl", [{"name": "000002", "step": 2, "next_batch": 2, "epoch": 0,
                                            "state_path": "tinker://run-1/weights/000002", "sampler_path": None}])
    return run, metrics, evals


def rl_folder(tmp_path, with_trace=True):
    run = tmp_path / "rl"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model_name": "Qwen/Qwen3-8B", "group_size": 2, "batch_size": 2,
                                                 "estimate_usd": 0.5}))
    metrics = [{"iteration": i, "reward_mean": 0.125 * i, "reward_std": 0.0625, "reward_min": 0.0,
                "reward_max": 0.5 + 0.125 * i, "frac_groups_tied": 0.5 - 0.125 * i, "frac_truncated": 0.25,
                "kl_sample_train_v1": 1e-4 * (i + 1), "kl_sample_train_v2": float("nan") if i == 1 else 1e-8,
                "cost/step_usd": 0.0625} for i in range(4)]
    write_rows(run / "metrics.jsonl", metrics)
    write_rows(run / "checkpoints.jsonl", [
        {"name": "000002", "step": 2, "next_iteration": 2, "epoch": 0, "state_path": "tinker://r/weights/000002",
         "sampler_path": None},
        {"name": "final", "step": 4, "next_iteration": 4, "epoch": 1, "state_path": "tinker://r/weights/final",
         "sampler_path": "tinker://r/sampler_weights/final"}])
    rollouts = []
    if with_trace:
        for it in range(2):
            for group in range(2):
                for sample in range(2):
                    rollouts.append({
                        "iteration": it, "task": 10 + group, "group": group, "sample": sample, "sampler_version": it,
                        "prompt_tokens": [101, 102, 103], "completion_tokens": [201, 202, 250, 301, 302],
                        "sampler_logprobs": [-0.5, -0.25, 0.0, -1.0, -2.0], "reward": float(sample),
                        "advantage": sample - 0.5, "trained": group == 0,
                        "turns": [{"observation_tokens": [], "action_tokens": [201, 202], "masked": group != 0,
                                   "starts_datum": False, "stop_reason": "stop"},
                                  # one masked token inside a trained action: the report takes a list too
                                  {"observation_tokens": [250], "action_tokens": [301, 302],
                                   "masked": [group != 0, True], "starts_datum": False, "stop_reason": "length",
                                   "observation_text": "tool: 42"}],
                        "prompt_text": "What is 6*7? </script><script>alert(1)</script>", "completion_text": "42"})
        write_rows(run / "rollouts.jsonl", rollouts)
    return run, metrics, rollouts


def dpo_folder(tmp_path):
    """A DPO record with the keys tinker_dpo.py writes (config: dpo_beta, reference, pairs_sha256; rows: loss,
    dpo_loss, accuracy, margin, chosen_reward, rejected_reward, policy_accuracy, implicit_kl, learning_rate)."""
    run = tmp_path / "dpo"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model_name": "Qwen/Qwen3-8B", "dpo_beta": 0.1,
                                                 "reference": "forward", "pairs": 4, "pairs_sha256": "ab" * 32,
                                                 "learning_rate": 1e-3, "batch_size": 4, "estimate_usd": 0.5}))
    metrics = [{"step": s, "epoch": s - 1, "loss": 0.693 - 0.125 * (s - 1), "dpo_loss": 0.693 - 0.125 * (s - 1),
                "accuracy": [0.0, 0.5, 0.75, 1.0][s - 1], "margin": 0.25 * (s - 1),
                "chosen_reward": 0.125 * (s - 1), "rejected_reward": -0.125 * (s - 1),
                "policy_accuracy": 0.5, "implicit_kl": 0.001 * (s - 1), "learning_rate": 1e-3, "pairs": 4,
                "tokens": 96, "seconds": 0.5, "cost/step_usd": 0.0625, "cost/cumulative_usd": 0.0625 * s,
                "num_tokens": 96} for s in range(1, 5)]
    write_rows(run / "metrics.jsonl", metrics)
    write_rows(run / "reference_logprobs.jsonl", [{"pair": 0, "chosen": [-1.0], "rejected": [-2.0]}])
    write_rows(run / "checkpoints.jsonl", [{"name": "final", "step": 4, "next_batch": 4, "epoch": 3,
                                            "state_path": "tinker://d/weights/final",
                                            "sampler_path": "tinker://d/sampler_weights/final"}])
    return run, metrics


def distill_folder(tmp_path):
    """A distillation record with the keys tinker_distill.py writes (config: teacher, teacher_base, kl_coef and
    RL's group_size; rows per iteration: reverse_kl, teacher_logprob, student_logprob, kl_sample_train_v1/v2,
    frac_truncated, learning_rate)."""
    run = tmp_path / "distill"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model_name": "Qwen/Qwen3-8B", "teacher": "runs/sft1",
                                                 "teacher_base": "Qwen/Qwen3-8B", "kl_coef": 1.0,
                                                 "group_size": 4, "batch_size": 4, "iterations": 4,
                                                 "learning_rate": 2e-2, "estimate_usd": 0.25}))
    metrics = [{"iteration": i, "reverse_kl": 2.0 / (i + 1), "teacher_logprob": -3.0 + 0.5 * i,
                "student_logprob": -1.0 + 0.125 * i, "loss_sum": -0.5, "kl_sample_train_v1": 1e-4,
                "kl_sample_train_v2": 1e-8, "entropy": 1.0, "sequences": 16, "frac_truncated": 0.25 * i,
                "tokens_sampled": 128, "tokens_trained": 400, "tokens_teacher": 400, "kl_coef": 1.0,
                "learning_rate": 2e-2, "seconds_sampling_and_teacher": 1.0, "seconds_training": 1.0,
                "sample_retries": 0, "prompts": [0, 1, 2, 3], "sampling_seeds": [1, 2, 3, 4],
                "cost/step_usd": 0.03125, "cost/cumulative_usd": 0.03125 * (i + 1)} for i in range(4)]
    write_rows(run / "metrics.jsonl", metrics)
    write_rows(run / "checkpoints.jsonl", [{"name": "final", "step": 4, "next_iteration": 4, "epoch": 4,
                                            "state_path": "tinker://s/weights/final",
                                            "sampler_path": "tinker://s/sampler_weights/final"}])
    return run, metrics


# ---------------------------------------------------------------------------------------------
# curves


def test_sft_curves_hold_exactly_the_logged_values(tmp_path):
    run, metrics, evals = sft_folder(tmp_path)
    code, result, err = run_report(run)
    assert code == 0, err
    assert result["report"] == str(run / "report.html") and result["kind"] == "sft"
    assert result["rows"] == {"config": 1, "metrics": 4, "eval": 2, "checkpoints": 1, "rollouts": 0}
    assert result["skipped_lines"] == {"metrics.jsonl": 1} and result["in_progress"] is False  # nobody holds it
    assert "stopped before its final checkpoint" in (run / "report.html").read_text()
    figs = figures_in((run / "report.html").read_text())
    assert set(figs) == {"loss", "learning_rate"}  # no cost rows: no cost curve, the estimate in a note
    assert "no cost in this record" in (run / "report.html").read_text()
    assert "pre-run estimate $0.25" in (run / "report.html").read_text()
    loss = trace(figs["loss"], "train loss")
    assert loss["x"] == [m["step"] for m in metrics] and loss["y"] == [m["loss"] for m in metrics]
    held_out = trace(figs["loss"], "held-out nll (eval.jsonl)")
    assert held_out["x"] == [0, 2] and held_out["y"] == [3.25, 2.75]
    lr = trace(figs["learning_rate"], "learning_rate")
    assert lr["x"] == [1, 2, 3, 4] and lr["y"] == [m["learning_rate"] for m in metrics]


def test_rl_curves_hold_reward_spread_tied_groups_and_kl_as_logged(tmp_path):
    run, metrics, _ = rl_folder(tmp_path, with_trace=False)
    code, result, err = run_report(run, "--out", str(tmp_path / "rl.html"))
    assert code == 0, err
    assert result["kind"] == "rl" and result["in_progress"] is False and result["rows"]["metrics"] == 4
    figs = figures_in((tmp_path / "rl.html").read_text())
    assert set(figs) == {"reward", "tied", "kl", "cost"}
    its = [0, 1, 2, 3]
    mean = trace(figs["reward"], "reward_mean")
    assert mean["x"] == its and mean["y"] == [m["reward_mean"] for m in metrics]
    assert trace(figs["reward"], "mean + std")["y"] == [m["reward_mean"] + m["reward_std"] for m in metrics]
    assert trace(figs["reward"], "mean ± std")["y"] == [m["reward_mean"] - m["reward_std"] for m in metrics]
    assert trace(figs["reward"], "reward_max")["y"] == [m["reward_max"] for m in metrics]
    assert trace(figs["reward"], "reward_min")["y"] == [0.0] * 4
    assert trace(figs["tied"], "frac_groups_tied")["y"] == [0.5, 0.375, 0.25, 0.125]
    assert trace(figs["kl"], "kl_sample_train_v1")["y"] == [m["kl_sample_train_v1"] for m in metrics]
    # NaN is not JSON: a logged NaN becomes a gap (null), never a made-up number
    assert trace(figs["kl"], "kl_sample_train_v2")["y"] == [1e-8, None, 1e-8, 1e-8]


def test_cost_so_far_is_the_running_sum_with_the_estimate_as_a_line(tmp_path):
    run, _, _ = rl_folder(tmp_path, with_trace=False)
    code, _, err = run_report(run)
    assert code == 0, err
    fig = figures_in((run / "report.html").read_text())["cost"]
    cost = trace(fig, "cost so far (usd)")
    assert cost["x"] == [0, 1, 2, 3] and cost["y"] == [0.0625, 0.125, 0.1875, 0.25]
    [line] = fig["layout"]["shapes"]
    assert line["y0"] == line["y1"] == 0.5


def test_cost_chart_of_a_record_written_by_tinker_sft_holds_its_logged_cost(tmp_path, monkeypatch, offline_tokenizer,
                                                                          capsys):
    """tinker_sft.py (against the recording fake of test_sft_loop) writes cost/* per step and the total on its
    final eval row; the chart draws exactly those, the total as a marker, the config's estimate as a line."""
    import tinker_sft
    from test_sft_loop import EXAMPLE, RecordingService

    log = tmp_path / "sft"
    monkeypatch.setattr(tinker_sft, "connect", lambda model_name, **_: (RecordingService(), 4096))
    assert tinker_sft.main(["--data", str(EXAMPLE), "--tokenizer", offline_tokenizer("Qwen3-8B"), "--max-steps", "4",
                            "--batch-size", "4", "--eval-every", "2", "--num-probes", "1", "--max-tokens", "8",
                            "--log-path", str(log)]) == 0
    capsys.readouterr()
    code, _, err = run_report(log)
    assert code == 0, err
    fig = figures_in((log / "report.html").read_text())["cost"]
    metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    after = [json.loads(line) for line in (log / "eval.jsonl").read_text().splitlines()][-1]
    cost = trace(fig, "cost so far (usd)")
    assert cost["x"] == [1, 2, 3, 4] and cost["y"] == [m["cost/cumulative_usd"] for m in metrics]
    total = trace(fig, "total with the final eval (eval.jsonl)")
    assert total["x"] == [4] and total["y"] == [after["cost/cumulative_usd"]] and total["y"][0] > cost["y"][-1]
    [line] = fig["layout"]["shapes"]
    estimate = json.loads((log / "config.json").read_text())["estimate_usd"]
    assert line["y0"] == estimate >= after["cost/cumulative_usd"]  # samples shorter than --max-tokens: below


def test_cookbook_metric_names_are_drawn_too(tmp_path):
    sft = tmp_path / "cook-sft"
    sft.mkdir()
    write_rows(sft / "metrics.jsonl", [{"step": 0, "train_mean_nll": 2.0, "learning_rate": 1e-4},
                                       {"step": 1, "train_mean_nll": 1.5, "learning_rate": 5e-5, "test/nll": 1.75,
                                        "cost/cumulative_usd": 0.01}])
    assert run_report(sft)[0] == 0
    figs = figures_in((sft / "report.html").read_text())
    assert trace(figs["loss"], "train train_mean_nll")["y"] == [2.0, 1.5]
    assert trace(figs["loss"], "held-out test/nll")["x"] == [1]
    assert trace(figs["cost"], "cost so far (usd)")["y"] == [0.01]
    rl = tmp_path / "cook-rl"
    rl.mkdir()
    (rl / "config.json").write_text(json.dumps({"model_name": "m", "group_size": 4}))
    write_rows(rl / "metrics.jsonl", [{"step": i, "env/all/reward/total": 0.25 * i, "by_group/frac_mixed": 0.75,
                                       "optim/kl_sample_train_v1": 0.001} for i in range(3)])
    assert run_report(rl)[0] == 0
    figs = figures_in((rl / "report.html").read_text())
    assert trace(figs["reward"], "env/all/reward/total")["y"] == [0.0, 0.25, 0.5]
    assert trace(figs["tied"], "1 - by_group/frac_mixed")["y"] == [0.25] * 3
    assert trace(figs["kl"], "optim/kl_sample_train_v1")["y"] == [0.001] * 3


def test_a_record_with_both_our_names_and_the_cookbooks_draws_each_curve_once(tmp_path):
    run = tmp_path / "both"
    run.mkdir()
    write_rows(run / "metrics.jsonl", [{"iteration": i, "step": i, "reward_mean": 0.5, "env/all/reward/total": 0.5,
                                        "frac_groups_tied": 0.25, "by_group/frac_mixed": 0.75,
                                        "kl_sample_train_v1": 0.002, "optim/kl_sample_train_v1": 0.002}
                                       for i in range(2)])
    assert run_report(run)[0] == 0
    figs = figures_in((run / "report.html").read_text())
    assert [t["name"] for t in figs["reward"]["data"]] == ["reward_mean"]
    assert [t["name"] for t in figs["tied"]["data"]] == ["frac_groups_tied"]
    assert [t["name"] for t in figs["kl"]["data"]] == ["kl_sample_train_v1"]


# ---------------------------------------------------------------------------------------------
# a run in progress


def test_a_run_with_only_a_config_gets_a_report_that_says_so(tmp_path):
    run = tmp_path / "starting"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model_name": "Qwen/Qwen3-8B"}))
    code, result, err = run_report(run)
    assert code == 0, err
    page = (run / "report.html").read_text()
    assert figures_in(page) == {} and result["rows"]["metrics"] == 0 and result["in_progress"] is False
    assert "no metrics rows yet" in page and "no checkpoint saved yet" in page


def test_in_progress_is_true_exactly_while_a_live_process_holds_the_folder_lock(tmp_path):
    """The report tests LOG/.lock without taking it: true while a writer lives, false once it is killed
    (the lock file it left behind names a dead process) and the folder is reported as stopped."""
    run, _, _ = sft_folder(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, tinker_sft; tinker_sft.Run(sys.argv[1]).lock(); print('held', flush=True); "
         "sys.stdin.read()", str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=ROOT / "scripts")
    try:
        assert holder.stdout.readline().strip() == "held"  # the event: the lock is taken
        code, result, err = run_report(run)
        assert code == 0 and result["in_progress"] is True, err
        assert "in progress (a script holds the folder" in (run / "report.html").read_text()
        assert json.loads((run / ".lock").read_text())["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait(timeout=30)
    code, result, err = run_report(run)
    assert code == 0 and result["in_progress"] is False, err
    assert (run / ".lock").exists() and "stopped before its final checkpoint" in (run / "report.html").read_text()


def test_torn_config_and_torn_metrics_are_tolerated(tmp_path):
    run = tmp_path / "torn"
    run.mkdir()
    (run / "config.json").write_text('{"model_name": "Qwen/Qw')
    write_rows(run / "metrics.jsonl", [{"step": 1, "loss": 2.0, "learning_rate": 0.1}], torn_tail='{"step": 2, "lo')
    code, result, err = run_report(run)
    assert code == 0, err
    page = (run / "report.html").read_text()
    assert "config.json is missing or unreadable" in page
    assert trace(figures_in(page)["loss"], "train loss")["y"] == [2.0]
    assert result["skipped_lines"] == {"metrics.jsonl": 1}


def test_watch_rewrites_the_report_as_rows_arrive_and_stops_cleanly_on_ctrl_c(tmp_path):
    run = tmp_path / "live"
    run.mkdir()
    write_rows(run / "metrics.jsonl", [{"step": 1, "loss": 2.0, "learning_rate": 0.1}])
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(run), "--watch", "0.5"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    try:
        report = run / "report.html"

        def loss_y():
            try:
                return trace(figures_in(report.read_text())["loss"], "train loss")["y"]
            except (OSError, KeyError, ValueError):
                return None

        deadline = time.time() + 60
        while loss_y() != [2.0] and time.time() < deadline:
            time.sleep(0.2)
        assert loss_y() == [2.0]
        assert "http-equiv='refresh' content='1'" in report.read_text()  # the open page reloads itself
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 2, "loss": 1.5, "learning_rate": 0.05}) + "\n")
        while loss_y() != [2.0, 1.5] and time.time() < deadline:
            time.sleep(0.2)
        assert loss_y() == [2.0, 1.5]
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert json.loads(out)["report"] == str(run / "report.html")


# ---------------------------------------------------------------------------------------------
# rollouts, checkpoints, the page itself


def test_rollout_browser_marks_every_token_as_the_update_used_it(tmp_path):
    run, _, rollouts = rl_folder(tmp_path)
    code, result, err = run_report(run)
    assert code == 0, err
    assert result["rows"]["rollouts"] == 8
    page = (run / "report.html").read_text()
    browser = page.split("<div id='rollouts'>", 1)[1].split("<h2>", 1)[0]
    rows = re.findall(r"<details class='rollout-row'[^>]*><summary>(.*?)</summary>(.*?)</div></details>", browser, re.S)
    assert len(rows) == 8
    # newest iteration first; each summary carries task, group, sample, reward, advantage, trained
    assert html.unescape(rows[0][0]).startswith("task 10 · group 0 · sample 0 · reward 0 · advantage -0.5 · trained")
    for (summary, body), r in zip(rows, [r for it in (1, 0) for r in rollouts if r["iteration"] == it]):
        spans = re.findall(r"<span class='tok (\w+)' title='([^']*)'>(\d+)</span>", body)
        assert [int(t) for _, _, t in spans] == [101, 102, 103, 201, 202, 250, 301, 302]
        act = "masked" if not r["trained"] else ("pos" if r["advantage"] > 0 else "neg")
        assert [c for c, _, _ in spans] == ["obs"] * 3 + [act, act, "obs", act, "masked"]
        # hovering an action token shows its sampler logprob (one per action token, turn after turn)
        assert [re.search(r"logprob (-?[\d.]+)", html.unescape(t)).group(1) for c, t, _ in spans[3:5] + spans[6:]] == \
            ["-0.500", "-0.250", "-1.000", "-2.000"]
        assert "tool: 42" in body and "<pre class='completion'>42</pre>" in body
    # text from the trace is escaped: it cannot close the page's script elements
    assert "<script>alert(1)</script>" not in page and "&lt;/script&gt;&lt;script&gt;alert(1)" in page


def test_checkpoints_table_lists_every_saved_row(tmp_path):
    run, _, _ = rl_folder(tmp_path, with_trace=False)
    assert run_report(run)[0] == 0
    table = (run / "report.html").read_text().split("<table id='checkpoints'>", 1)[1].split("</table>", 1)[0]
    cells = [re.findall(r"<td class='mono'>(.*?)</td>", row) for row in table.split("</tr>")[1:-1]]
    assert [c[0] for c in cells] == ["000002", "final"]
    assert "tinker://r/sampler_weights/final" in cells[1] and "tinker://r/weights/000002" in cells[0]


def test_the_page_is_self_contained_plotly_embedded_no_network(tmp_path):
    run, _, _ = sft_folder(tmp_path)
    assert run_report(run)[0] == 0
    page = (run / "report.html").read_text()
    assert not re.search(r"<script[^>]*\bsrc=", page) and "<link" not in page
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js itself is in the file
    from plotly.offline import get_plotlyjs

    assert page.count(get_plotlyjs()) == 1
    ours = page.replace(get_plotlyjs(), "")
    assert not re.search(r"""(src|href)=["']?https?://""", ours) and "<iframe" not in ours


@pytest.mark.parametrize("make, expected", [
    (lambda tmp: tmp / "missing", "is not a folder"),
    (lambda tmp: tmp, "holds no run record"),
])
def test_bad_run_folder_is_one_line_and_exit_2(tmp_path, make, expected):
    code, result, err = run_report(make(tmp_path))
    assert code == 2 and result is None
    assert expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_watch_must_be_positive(tmp_path):
    run, _, _ = sft_folder(tmp_path)
    assert tinker_report.cli([str(run), "--watch", "0"]) == 2
    assert not (run / "report.html").exists()


def test_a_report_that_cannot_be_written_is_exit_1_with_one_line(tmp_path):
    run, _, _ = sft_folder(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, result, err = run_report(run, "--out", str(blocker / "report.html"))
    assert code == 1 and result is None
    assert err.startswith(f"error: cannot write {blocker / 'report.html'}") and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# every run kind: the title and the curves that kind is judged by


def page_title(page):
    return re.search(r"<h1>(.*?)</h1>", page).group(1)


def test_a_dpo_run_is_titled_dpo_and_draws_accuracy_margin_rewards_and_implicit_kl(tmp_path):
    run, metrics = dpo_folder(tmp_path)
    code, result, err = run_report(run)
    assert code == 0, err
    assert result["kind"] == "dpo" and result["in_progress"] is False
    page = (run / "report.html").read_text()
    assert page_title(page) == "DPO run dpo" and "tinker_dpo.py" in page
    figs = figures_in(page)
    assert set(figs) == {"accuracy", "margin", "rewards", "implicit_kl", "loss", "learning_rate", "cost"}
    steps = [1, 2, 3, 4]
    for fig_id, key in [("accuracy", "accuracy"), ("accuracy", "policy_accuracy"), ("margin", "margin"),
                        ("rewards", "chosen_reward"), ("rewards", "rejected_reward"),
                        ("implicit_kl", "implicit_kl"), ("loss", "loss"), ("loss", "dpo_loss"),
                        ("learning_rate", "learning_rate")]:
        drawn = trace(figs[fig_id], key)
        assert drawn["x"] == steps and drawn["y"] == [m[key] for m in metrics], (fig_id, key)
    assert trace(figs["cost"], "cost so far (usd)")["x"] == steps
    assert figs["accuracy"]["layout"]["yaxis"]["range"][0] <= 0 and figs["accuracy"]["layout"]["yaxis"]["range"][1] >= 1
    text = html.unescape(page)
    assert "accuracy first 0 → last 1" in text and "margin first 0 → last 0.75" in text


def test_a_distillation_run_is_titled_distillation_and_draws_reverse_kl_and_both_logprobs(tmp_path):
    run, metrics = distill_folder(tmp_path)
    code, result, err = run_report(run)
    assert code == 0, err
    assert result["kind"] == "distill"  # not RL, though its config has group_size and its rows iteration
    page = (run / "report.html").read_text()
    assert page_title(page) == "Distillation run distill" and "teacher runs/sft1" in page
    figs = figures_in(page)
    assert set(figs) == {"reverse_kl", "logprobs", "kl", "truncated", "learning_rate", "cost"}
    its = [0, 1, 2, 3]
    for fig_id, key in [("reverse_kl", "reverse_kl"), ("logprobs", "teacher_logprob"),
                        ("logprobs", "student_logprob"), ("kl", "kl_sample_train_v1"), ("kl", "kl_sample_train_v2"),
                        ("truncated", "frac_truncated"), ("learning_rate", "learning_rate")]:
        drawn = trace(figs[fig_id], key)
        assert drawn["x"] == its and drawn["y"] == [m[key] for m in metrics], (fig_id, key)
    assert trace(figs["cost"], "cost so far (usd)")["x"] == its
    assert "reverse_kl first 2 → last 0.5" in html.unescape(page)


@pytest.mark.parametrize("config, rows, kind", [
    ({"model_name": "m", "learning_rate": 1e-4, "batch_size": 8}, [{"step": 1, "loss": 1.0}], "sft"),
    ({"model_name": "m", "group_size": 4}, [], "rl"),
    ({}, [{"iteration": 0, "reward_mean": 0.5}], "rl"),
    ({"model_name": "m", "dpo_beta": 0.1}, [], "dpo"),
    ({}, [{"step": 1, "loss": 0.69, "chosen_reward": 0.0, "rejected_reward": 0.0}], "dpo"),
    ({"model_name": "m", "teacher": "Qwen/Qwen3-32B", "group_size": 4}, [], "distill"),
    ({}, [{"iteration": 0, "reverse_kl": 1.0}], "distill"),
])
def test_the_run_kind_is_read_from_what_each_script_writes(config, rows, kind):
    assert tinker_report.run_kind(config, rows) == kind


def test_help_names_all_four_run_kinds():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for kind, script in [("SFT", "tinker_sft.py"), ("RL", "tinker_rl.py"), ("DPO", "tinker_dpo.py"),
                         ("distillation", "tinker_distill.py")]:
        assert f"{kind} ({script})" in text


# ---------------------------------------------------------------------------------------------
# axes that fit their data


def learning_rate_axis(tmp_path, rates):
    run = tmp_path / "lr"
    run.mkdir()
    write_rows(run / "metrics.jsonl", [{"step": s + 1, "loss": 1.0, "learning_rate": lr} for s, lr in enumerate(rates)])
    assert run_report(run)[0] == 0
    return figures_in((run / "report.html").read_text())["learning_rate"]["layout"]["yaxis"]


def test_a_constant_learning_rate_of_1e_2_is_drawn_on_a_log_axis_around_it_not_flat_on_zero(tmp_path):
    axis = learning_rate_axis(tmp_path, [1e-2] * 5)
    assert axis["type"] == "log"
    low, high = (10 ** v for v in axis["range"])
    assert low < 1e-2 < high and high / low <= 10.0 + 1e-9  # within one decade of the value, not [-1, 1]


def test_a_decaying_schedule_fills_its_log_axis(tmp_path):
    rates = [1e-2 * (1 - s / 10) for s in range(10)]  # linear decay 1e-2 -> 1e-3
    axis = learning_rate_axis(tmp_path, rates)
    low, high = axis["range"]
    span = math.log10(max(rates)) - math.log10(min(rates))
    assert axis["type"] == "log" and low < math.log10(min(rates)) and high > math.log10(max(rates))
    assert span / (high - low) > 0.8  # the curve fills most of the height


def test_a_learning_rate_of_zero_falls_back_to_a_linear_axis_holding_it(tmp_path):
    axis = learning_rate_axis(tmp_path, [1e-3, 5e-4, 0.0])
    assert axis.get("type") in (None, "linear")
    low, high = axis["range"]
    assert low < 0.0 and high > 1e-3 and high - low < 2e-3


@pytest.mark.parametrize("values, inside", [([0.25] * 4, (0.2, 0.3)), ([0.0] * 3, (-1.0, 1.0)),
                                            ([1e-4, 3e-4], (5e-5, 3.5e-4))])
def test_every_other_curve_gets_a_linear_axis_fitted_to_its_values(values, inside):
    axis = tinker_report.y_axis(values)
    low, high = axis["range"]
    assert low <= min(values) and max(values) <= high
    assert inside[0] <= low and high <= inside[1]


def test_fractions_keep_their_whole_zero_to_one_range(tmp_path):
    run, _, _ = rl_folder(tmp_path, with_trace=False)
    assert run_report(run)[0] == 0
    low, high = figures_in((run / "report.html").read_text())["tied"]["layout"]["yaxis"]["range"]
    assert low < 0 < 1 < high < 1.1


# ---------------------------------------------------------------------------------------------
# whitespace and control characters in samples


def probe_cells(page):
    table = page.split("<table id='probes'>", 1)[1].split("</table>", 1)[0]
    return [dict(re.findall(r"<td class='(\w+)'>(.*?)</td>", row, re.S)) for row in table.split("</tr>")[1:-1]]


def test_a_newline_only_before_sample_shows_one_mark_per_newline_and_the_raw_text_on_hover(tmp_path):
    run, _, evals = sft_folder(tmp_path)
    evals[0]["probes"] = [
        {"line": 1, "prompt": "What colour is the sky?", "expected": "Blue.", "before": "\n\n\n", "after": "Blue."},
        {"line": 2, "prompt": "x", "expected": "  two  spaces\tand a tab ", "before": "", "after": "a\x00b\u200bc"},
    ]
    write_rows(run / "eval.jsonl", evals)
    assert run_report(run)[0] == 0
    cells = probe_cells((run / "report.html").read_text())
    assert cells[0]["before"] == ("<pre title='&quot;\\n\\n\\n&quot;'><span class='ws'>⏎</span>\n"
                                  "<span class='ws'>⏎</span>\n<span class='ws'>⏎</span>\n</pre>")
    assert cells[0]["after"] == "<pre>Blue.</pre>" and cells[0]["prompt"] == "<pre>What colour is the sky?</pre>"
    expected = html.unescape(re.sub(r"<[^>]+>", "", cells[1]["expected"]))
    assert expected == "␣␣two␣␣spaces⇥and a tab␣"  # the single space between words stays a space
    assert "title='&quot;  two  spaces\\tand a tab &quot;'" in cells[1]["expected"]
    assert "<span class='ws'>∅</span>" in cells[1]["before"]
    assert html.unescape(re.sub(r"<[^>]+>", "", cells[1]["after"])) == "a␀b⟨U+200B⟩c"


def test_sample_text_is_escaped_around_the_marks():
    shown = tinker_report.sample_html("<b>  </b>\n")
    two_spaces = "<span class='ws'>␣</span><span class='ws'>␣</span>"
    assert shown.startswith("<pre title=") and f"&lt;b&gt;{two_spaces}&lt;/b&gt;" in shown
    assert "<b>" not in shown


def test_rollout_texts_show_their_whitespace_too(tmp_path):
    run, _, rollouts = rl_folder(tmp_path)
    for r in rollouts:
        r["completion_text"] = "\n\n"
    write_rows(run / "rollouts.jsonl", rollouts)
    assert run_report(run)[0] == 0
    page = (run / "report.html").read_text()
    assert page.count("<pre class='completion' title='&quot;\\n\\n&quot;'><span class='ws'>⏎</span>") == len(rollouts)


# ---------------------------------------------------------------------------------------------
# issue 44: a rehearsal never reads as the named model's run; eval scores drawn; what the cost leaves out


BANNER = re.compile(r"<div id='rehearsal-banner'[^>]*>(.*?)</div>", re.S)


def banner_text(page):
    found = BANNER.search(page)
    return html.unescape(re.sub(r"<[^>]+>", "", found.group(1))) if found else None


def test_a_local_rehearsal_opens_with_a_banner_naming_the_model_that_stood_in(tmp_path):
    """Before: a rehearsal's page read as a Qwen3-8B run (title, model line, curves), nothing said otherwise."""
    run, _, _ = sft_folder(tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["backend"] = {"kind": "local", "stand_in": "tiny-qwen3", "stand_in_kind": "tiny"}
    (run / "config.json").write_text(json.dumps(config))
    code, result, err = run_report(run)
    assert code == 0, err
    page = (run / "report.html").read_text()
    assert banner_text(page).startswith("local rehearsal: tiny-qwen3 stood in for Qwen/Qwen3-8B; losses and "
                                        "samples are not Qwen/Qwen3-8B's")
    assert page_title(page) == "SFT run sft (local rehearsal)"
    assert result["rehearsal"] == {"stand_in": "tiny-qwen3", "model_name": "Qwen/Qwen3-8B",
                                   "evidence": "config.json backend.kind local"}


@pytest.mark.parametrize("config, checkpoint_path, evidence", [
    ({"rehearse": True}, "tinker://run-1/weights/000002", "config.json rehearse true"),
    ({"TINKER_BASE_URL": "http://127.0.0.1:8765"}, "tinker://run-1/weights/000002",
     "config.json TINKER_BASE_URL http://127.0.0.1:8765"),
    ({}, "tinker://model_3fa2c9d1/weights/000002", "a local backend checkpoint id (tinker://model_3fa2c9d1/weights/000002)"),
    ({}, "tinker://session_0a1b2c3d:train:0/weights/000002", "a local backend checkpoint id"),
])
def test_an_older_rehearsal_record_is_recognised_without_a_backend_field(tmp_path, config, checkpoint_path, evidence):
    run, _, _ = sft_folder(tmp_path)
    (run / "config.json").write_text(json.dumps({"model_name": "Qwen/Qwen3-8B", **config}))
    write_rows(run / "checkpoints.jsonl", [{"name": "000002", "step": 2, "state_path": checkpoint_path,
                                            "sampler_path": None}])
    code, result, err = run_report(run)
    assert code == 0, err
    assert banner_text((run / "report.html").read_text()).startswith(
        "local rehearsal: the local backend's model stood in for Qwen/Qwen3-8B; losses and samples are not "
        "Qwen/Qwen3-8B's")
    assert result["rehearsal"]["evidence"].startswith(evidence)


@pytest.mark.parametrize("config, checkpoint_path", [
    ({"backend": {"kind": "tinker", "stand_in": None, "stand_in_kind": None}}, "tinker://model_x/weights/1"),
    ({}, "tinker://3f2a0b4e-6c1d-4e8f-9a7b-1c2d3e4f5a6b:train:0/weights/000002"),
])
def test_a_run_on_tinker_has_no_rehearsal_banner(tmp_path, config, checkpoint_path):
    run, _, _ = sft_folder(tmp_path)
    (run / "config.json").write_text(json.dumps({"model_name": "Qwen/Qwen3-8B", **config}))
    write_rows(run / "checkpoints.jsonl", [{"name": "final", "step": 4, "state_path": checkpoint_path}])
    code, result, err = run_report(run)
    assert code == 0, err
    assert result["rehearsal"] is None and banner_text((run / "report.html").read_text()) is None


def test_sft_held_out_scores_are_drawn_as_logged(tmp_path):
    """tinker_sft.py --eval-every writes score() of greedy held-out samples in eval.jsonl; before: not drawn."""
    run, _, evals = sft_folder(tmp_path)
    scored = [{"step": 0, "when": "before", "nll": 3.25, "score": 0.0, "scored": 8},
              {"step": 2, "when": "during", "nll": 2.75, "score": 0.375, "scored": 8},
              {"step": 4, "when": "after", "nll": 2.5, "score": 0.625, "scored": 8}]
    write_rows(run / "eval.jsonl", scored)
    code, _, err = run_report(run)
    assert code == 0, err
    page = (run / "report.html").read_text()
    drawn = trace(figures_in(page)["score"], "held-out score (eval.jsonl)")
    assert drawn["x"] == [0, 2, 4] and drawn["y"] == [0.0, 0.375, 0.625]
    assert "held-out score first 0 → last 0.625" in html.unescape(page)


def test_sft_metrics_eval_score_is_drawn_when_eval_rows_carry_none(tmp_path):
    run, metrics, _ = sft_folder(tmp_path)
    rows = [dict(m, eval_score=0.25 * m["step"]) if m["step"] % 2 == 0 else m for m in metrics]
    write_rows(run / "metrics.jsonl", rows)
    code, _, err = run_report(run)
    assert code == 0, err
    drawn = trace(figures_in((run / "report.html").read_text())["score"], "eval_score")
    assert drawn["x"] == [2, 4] and drawn["y"] == [0.5, 1.0]


def test_what_the_estimate_and_the_cost_leave_out_is_said(tmp_path):
    """Before: the page showed an estimate and a cost with no word that storage was not in them."""
    run, _, _ = sft_folder(tmp_path)  # estimate_usd 0.25, no cost rows
    code, _, err = run_report(run)
    assert code == 0, err
    note = re.search(r"<p class='note' id='not-counted'>(.*?)</p>", (run / "report.html").read_text()).group(1)
    assert note.startswith("not counted in the estimate nor in the cost so far: storage: ")
    assert "checkpoint saves" in note
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "estimate_not_counted": ["storage: 2 GB kept a month"]}))
    run_report(run)
    note = re.search(r"<p class='note' id='not-counted'>(.*?)</p>", (run / "report.html").read_text()).group(1)
    assert note == "not counted in the estimate nor in the cost so far: storage: 2 GB kept a month."
    (run / "config.json").write_text(json.dumps({"model_name": "Qwen/Qwen3-8B"}))  # no estimate, no cost: nothing
    run_report(run)
    assert "id='not-counted'" not in (run / "report.html").read_text()
