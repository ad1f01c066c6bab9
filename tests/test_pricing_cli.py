"""tinker_pricing.py as a command: JSON on stdout, exit codes, init, refresh against a local server."""
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "tinker_pricing.py"


@pytest.fixture
def env(tmp_path):
    """Subprocess environment whose price override lives in tmp_path (absent until refresh)."""
    return {**os.environ, "TINKER_PRICES_FILE": str(tmp_path / "override.json")}


def run(env, *args, cwd=None):
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_line_error(stderr):
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr


# ---------------------------------------------------------------- estimates

def test_estimate_rl_prints_the_issue_json_shape_and_hand_computed_total(env):
    code, out, err = run(env, "estimate-rl", "--model", "Qwen/Qwen3-8B", "--iterations", 50,
                         "--tasks-per-iter", 32, "--group-size", 8, "--avg-prompt", 300, "--avg-completion", 400)
    assert code == 0, err
    est = json.loads(out)
    assert est["model"] == "Qwen/Qwen3-8B" and est["catalogue_date"] == "2026-10-07"
    assert est["tokens"] == {"prefill": 480_000, "cached_prefill": 3_360_000, "sample": 5_120_000,
                             "train": 8_960_000}
    assert round(est["usd"]["total"], 2) == 7.24  # 0.0936 + 0.13104 + 3.072 + 3.9424
    assert est["inputs"]["group_size"] == 8 and est["inputs"]["turns"] == 1
    assert "$7.24" in err  # the human table on stderr


def test_estimate_sft_sample_and_raw_match_the_library(env):
    code, out, _ = run(env, "estimate-sft", "--model", "Qwen3.5-397B-A17B", "--examples", 10000,
                       "--avg-tokens", 800, "--epochs", 3, "--storage-gb-months", 2.5, "--json")
    assert code == 0 and round(json.loads(out)["usd"]["total"], 2) == 158.65  # 24M x 6.60 + 0.25
    code, out, err = run(env, "estimate-sample", "--model", "openai/gpt-oss-120b", "--prompts", 500,
                         "--avg-prompt", 400, "--max-tokens", 1024, "--n", 4, "--json")
    assert code == 0 and err == "" and round(json.loads(out)["usd"]["total"], 2) == 1.83
    code, out, _ = run(env, "estimate", "--model", "Inkling", "--prefill-tokens", 1_000_000,
                       "--cached-prefill-tokens", 2_000_000, "--sample-tokens", 3_000_000,
                       "--train-tokens", 4_000_000, "--json")
    assert code == 0 and round(json.loads(out)["usd"]["total"], 2) == 39.10


def test_multi_turn_flags_reach_the_closed_form(env):
    code, out, _ = run(env, "estimate-rl", "--model", "Kimi-K2.6", "--iterations", 100, "--tasks-per-iter", 16,
                       "--group-size", 8, "--turns", 4, "--avg-prompt", 1000, "--avg-completion", 500,
                       "--avg-observation", 300, "--json")
    est = json.loads(out)
    assert code == 0 and est["tokens"]["cached_prefill"] == 99_520_000
    assert round(est["usd"]["total"], 2) == 454.97


def test_estimate_above_max_usd_exits_3_after_printing_the_estimate(env):
    code, out, err = run(env, "estimate-rl", "--iterations", 50, "--tasks-per-iter", 32, "--group-size", 8,
                         "--avg-prompt", 300, "--avg-completion", 400, "--max-usd", 5, "--json")
    assert code == 3
    assert round(json.loads(out)["usd"]["total"], 2) == 7.24
    assert_one_line_error(err)


def test_unknown_price_with_max_usd_exits_3_and_says_unknown(env):
    code, out, err = run(env, "estimate", "--model", "Kimi-K3.1-Pro", "--train-tokens", 1000,
                         "--max-usd", 100, "--json")
    assert code == 3 and json.loads(out)["usd"]["total"] is None
    assert "unknown" in err


@pytest.mark.parametrize("args, expected", [
    (["--iterations", "-5"], "'-5' must be a finite number >= 0"),
    (["--iterations", "ten"], "'ten' is not an integer"),
    (["--iterations", "5", "--avg-prompt", "nan"], "'nan' must be a finite number >= 0"),
    (["--iterations", "5", "--avg-completion", "inf"], "'inf' must be a finite number >= 0"),
    (["--iterations", "5", "--group-size", "0"], "'0' must be a finite number >= 1"),
])
def test_bad_counts_give_one_line_and_exit_2(env, args, expected):
    base = {"--iterations": "5", "--tasks-per-iter": "4", "--group-size": "4", "--avg-prompt": "10",
            "--avg-completion": "10"}
    base.update(dict(zip(args[::2], args[1::2])))
    code, out, err = run(env, "estimate-rl", *[x for pair in base.items() for x in pair])
    assert code == 2 and out == ""
    assert_one_line_error(err)
    assert expected in err


def test_unknown_model_exits_2_listing_the_closest_ids(env):
    code, out, err = run(env, "estimate-sample", "--model", "Qwen3-9B", "--prompts", 1, "--avg-prompt", 1,
                         "--max-tokens", 1)
    assert code == 2 and out == ""
    assert_one_line_error(err)
    assert "Qwen/Qwen3-8B" in err


def test_sft_without_sizes_or_data_exits_2(env, tmp_path):
    code, _, err = run(env, "estimate-sft", "--examples", 10)
    assert code == 2 and "--avg-tokens" in err
    assert_one_line_error(err)
    code, _, err = run(env, "estimate-sft", "--data", tmp_path / "missing.jsonl", "--tokenizer", tmp_path)
    assert code == 2
    assert_one_line_error(err)


# ---------------------------------------------------------------- list / show

def test_list_filters_by_family_context_and_train_price(env):
    code, out, _ = run(env, "list", "--family", "qwen", "--min-context", 100_000, "--json")
    assert code == 0
    ids = [m["id"] for m in json.loads(out)["models"]]
    assert ids == ["Qwen/Qwen3.8-27B:peft:262144", "Qwen/Qwen3.5-397B-A17B:peft:262144"]
    code, out, _ = run(env, "list", "--max-train", 0.5, "--json")
    cheap = {m["id"]: m["train"] for m in json.loads(out)["models"]}
    assert cheap == {"nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": 0.44, "Qwen/Qwen3-8B": 0.44,
                     "openai/gpt-oss-20b": 0.396}


def test_list_markdown_is_the_table_docs_are_checked_against(env):
    code, out, _ = run(env, "list", "--markdown")
    assert code == 0 and out.startswith("| id | family |")
    assert "| `openai/gpt-oss-20b` | gpt-oss | 21B / 3.6B | Reasoning | 32K | 0.18 | 0.036 | 0.45 | 0.396 |" in out


def test_show_resolves_a_short_name_and_lists_variants(env):
    code, out, err = run(env, "show", "Inkling", "--context", 100_000)
    row = json.loads(out)
    assert code == 0 and row["id"] == "thinkingmachines/Inkling:peft:262144"
    assert "thinkingmachines/Inkling" in row["variants"] and "11.22" in err


# ---------------------------------------------------------------- init

def test_init_writes_the_pricing_doc_with_table_formulas_and_checklist(env, tmp_path):
    code, out, _ = run(env, "init", "--out", tmp_path / "proj")
    doc = (tmp_path / "proj" / "TINKER_PRICING.md").read_text()
    assert code == 0 and json.loads(out)["catalogue_date"] == "2026-10-07"
    assert "{{" not in doc
    assert "**2026-10-07**" in doc and "https://tinker-docs.thinkingmachines.ai/tinker/models.json" in doc
    assert "| `Qwen/Qwen3-8B` | Qwen 3 | 8B dense | Hybrid | 32K | 0.195 | 0.039 | 0.60 | 0.44 |" in doc
    assert "`train = I·B·G·(P+C)`" in doc and "(C+O)(T-1)(T-2)/2" in doc
    assert "## Pre-launch checklist" in doc and "$0.10 per GB-month" in doc
    assert "`deepseek-ai/DeepSeek-V4.1-Flash:peft:262144`" in doc.split("## Models without a published price")[1]
    assert [p.name for p in (tmp_path / "proj").iterdir()] == ["TINKER_PRICING.md"]  # no temp file left


def test_init_writes_the_pricing_doc_readable_like_any_project_file(env, tmp_path):
    """Not mkstemp's 0600: the umask's usual 0644 (a project file others read and commit)."""
    import os
    umask = os.umask(0o022)
    try:
        code, _, _ = run(env, "init", "--out", tmp_path / "proj")
    finally:
        os.umask(umask)
    assert code == 0 and (tmp_path / "proj" / "TINKER_PRICING.md").stat().st_mode & 0o777 == 0o644


def test_init_refuses_to_overwrite_without_force(env, tmp_path):
    target = tmp_path / "TINKER_PRICING.md"
    target.write_text("my notes\n")
    code, out, err = run(env, "init", "--out", tmp_path)
    assert code == 2 and out == "" and target.read_text() == "my notes\n"
    assert_one_line_error(err)
    assert "--force" in err
    code, _, _ = run(env, "init", "--out", tmp_path, "--force")
    assert code == 0 and target.read_text().startswith("# Tinker pricing")


def test_init_into_an_unwritable_folder_exits_2_with_one_line(env, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, out, err = run(env, "init", "--out", blocker / "sub")
    assert code == 2 and out == ""
    assert_one_line_error(err)
    assert "cannot write" in err


# ---------------------------------------------------------------- refresh

VALID = [
    {"name": "Qwen3-8B", "tinker_id": "Qwen/Qwen3-8B", "type": "Hybrid", "arch": "Dense", "size": "Small",
     "context": "32K", "prefill": "$0.20", "cached_prefill": "$0.04", "sample": "$0.62", "train": "$0.50"},
    {"name": "New-Model", "tinker_id": "example/New-Model-7B", "type": "Base", "arch": "Dense",
     "size": "Small", "context": "128K", "prefill": "$0.10", "cached_prefill": "$0.02", "sample": "$0.30",
     "train": "$0.25", "note": "Limited-time 50% discount"},
]


class PriceServer(http.server.BaseHTTPRequestHandler):
    user_agents = []

    def do_GET(self):
        PriceServer.user_agents.append(self.headers.get("User-Agent", ""))
        if self.headers.get("User-Agent", "").startswith("Python-urllib"):
            return self._send(403, b"forbidden")  # what the docs host does
        if self.path == "/forbidden.json":
            return self._send(403, b"forbidden")
        if self.path == "/slow.json":
            time.sleep(8)
        body = {"/valid.json": json.dumps(VALID), "/slow.json": json.dumps(VALID),
                "/malformed.json": '[{"tinker_id": "Qwen/Qwen3-8B", "train": "cheap"}]',
                "/truncated.json": json.dumps(VALID)[:-20]}.get(self.path)
        self._send(200, body.encode()) if body else self._send(404, b"no")

    def _send(self, status, body):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except BrokenPipeError:  # the client gave up first (the slow case)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PriceServer)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_refresh_stores_a_valid_table_that_later_estimates_use(env, tmp_path, server):
    code, out, err = run(env, "refresh", "--url", f"{server}/valid.json")
    assert code == 0, err
    report = json.loads(out)
    assert report["changed"] == ["Qwen/Qwen3-8B"] and report["added"] == ["example/New-Model-7B"]
    assert PriceServer.user_agents[-1].startswith("tinker-training-inference")
    stored = json.loads((tmp_path / "override.json").read_text())
    assert stored["models"] == VALID
    today = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    # 1M train tokens at the refreshed $0.50 instead of the snapshot's $0.44
    code, out, _ = run(env, "estimate", "--model", "Qwen3-8B", "--train-tokens", 1_000_000, "--json")
    est = json.loads(out)
    assert est["usd"]["total"] == 0.5 and est["catalogue_date"] == today
    # a new id becomes resolvable with its parsed context (128K = 131072)
    code, out, _ = run(env, "show", "New-Model-7B", "--json")
    assert json.loads(out)["context"] == 131072
    # a snapshot row missing from the refreshed table keeps its price but is flagged
    code, out, _ = run(env, "show", "Qwen3.5-4B", "--json")
    row = json.loads(out)
    assert row["train"] == 0.737 and "absent from models.json" in row["note"]


@pytest.mark.parametrize("path", ["/malformed.json", "/truncated.json"])
def test_refresh_rejects_a_malformed_table_and_keeps_the_current_prices(env, tmp_path, server, path):
    override = tmp_path / "override.json"
    assert run(env, "refresh", "--url", f"{server}/valid.json")[0] == 0
    before = override.read_text()
    code, out, err = run(env, "refresh", "--url", f"{server}{path}")
    assert code == 1 and out == ""
    assert_one_line_error(err)
    assert "not a valid models.json" in err and "kept the current prices" in err
    assert override.read_text() == before


def test_refresh_times_out_on_a_slow_server_and_keeps_the_snapshot(env, tmp_path, server):
    started = time.monotonic()
    code, out, err = run(env, "refresh", "--url", f"{server}/slow.json", "--timeout", 0.5)
    assert time.monotonic() - started < 7  # gave up long before the server's 8 s answer
    assert code == 4 and out == ""
    assert_one_line_error(err)
    assert "timed out" in err and "snapshot 2026-10-07" in err
    assert not (tmp_path / "override.json").exists()


def test_refresh_http_error_is_one_line_and_exit_4(env, tmp_path, server):
    code, out, err = run(env, "refresh", "--url", f"{server}/forbidden.json")
    assert code == 4 and out == ""
    assert_one_line_error(err)
    assert "403" in err and not (tmp_path / "override.json").exists()


def test_refresh_from_a_saved_file(env, tmp_path):
    saved = tmp_path / "models.json"
    saved.write_text(json.dumps(VALID))
    code, out, _ = run(env, "refresh", "--from-file", saved)
    assert code == 0 and json.loads(out)["models"] == 2
    saved.write_text("{}")
    code, out, err = run(env, "refresh", "--from-file", saved)
    assert code == 2 and out == ""
    assert_one_line_error(err)


def test_a_corrupt_override_falls_back_to_the_snapshot_with_a_warning(env, tmp_path):
    (tmp_path / "override.json").write_text("not json")
    code, out, err = run(env, "estimate", "--train-tokens", 1_000_000, "--json")
    assert code == 0 and json.loads(out)["usd"]["total"] == 0.44
    assert "ignoring the price override" in err


# ---------------------------------------------------------------- copied alone / real tokenizer

def test_script_copied_alone_writes_the_same_pricing_doc_as_the_bundle(env, tmp_path):
    """Issue 44: alone in a folder (no templates/ beside it) init wrote a 67-line fallback without the
    metering table or the checklist, exit 0, no warning. The document now travels inside the script."""
    alone = tmp_path / "project"
    alone.mkdir()
    (alone / "tinker_pricing.py").write_bytes(SCRIPT.read_bytes())
    proc = subprocess.run([sys.executable, "tinker_pricing.py", "init", "--out", "."], cwd=alone, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    code, _, err = run(env, "init", "--out", tmp_path / "bundle")
    assert code == 0, err
    doc = (alone / "TINKER_PRICING.md").read_text()
    assert doc == (tmp_path / "bundle" / "TINKER_PRICING.md").read_text()
    assert "{{" not in doc and "2026-10-07" in doc
    assert "| `Qwen/Qwen3-8B` | Qwen 3 | 8B dense | Hybrid | 32K | 0.195 | 0.039 | 0.60 | 0.44 |" in doc
    assert "## What each operation meters" in doc and "## Pre-launch checklist" in doc
    assert "`cached_prefill = (G-1)P + G[(T-1)(P+C) + (C+O)(T-1)(T-2)/2]`" in doc


def test_estimate_sft_counts_a_jsonl_with_a_real_chat_template(env, tmp_path, offline_tokenizer):
    from transformers import AutoTokenizer

    tokenizer_dir = offline_tokenizer("Qwen3-8B")
    conversations = [[{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
                     [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]]
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"messages": conversations[0]}) + "\n"
                    + json.dumps({"prompt": "Name a colour.", "completion": "Blue."}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    lengths = [len(tokenizer.apply_chat_template(c, tokenize=True, return_dict=False)) for c in conversations]
    assert min(lengths) > 10
    code, out, err = run({**env, "HF_HUB_OFFLINE": "1"}, "estimate-sft", "--model", "Qwen3-8B", "--data", data,
                         "--tokenizer", tokenizer_dir, "--epochs", 2, "--json")
    assert code == 0, err
    est = json.loads(out)
    # each datum is its rendering minus one token; two epochs
    assert est["inputs"]["train_tokens_per_epoch"] == sum(lengths) - 2
    assert est["tokens"]["train"] == 2 * (sum(lengths) - 2)
    assert est["usd"]["train"] == pytest.approx(est["tokens"]["train"] * 0.44 / 1e6)
