"""tinker_pricing.py as a library: catalogue, name resolution, metering formulas, preflight.

Every expected figure below is worked out by hand in the comment above it, from the rates in
the catalogue snapshot (USD per 1M tokens): Qwen3-8B 0.195 / 0.039 / 0.60 / 0.44,
Kimi-K2.6 2.205 / 0.441 / 5.49 / 4.84, Qwen3.5-397B-A17B train 6.60, gpt-oss-120b 0.33 / 0.066 / 0.84,
Inkling 1.87 / 0.374 / 4.68 / 5.61, Inkling-Small:peft:262144 1.16 / 0.232 / 2.89 / unknown.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import tinker_pricing as tp

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "tinker_pricing.py"


@pytest.fixture(autouse=True)
def no_user_override(tmp_path, monkeypatch):
    """Price from the snapshot, never from a refresh the developer ran on this machine."""
    monkeypatch.setenv("TINKER_PRICES_FILE", str(tmp_path / "no-override.json"))


def cents(x):
    return round(x + 1e-9, 2)


# ---------------------------------------------------------------- catalogue

def test_catalogue_has_the_29_training_rows_of_the_pricing_table():
    priced = [r for r in tp.SNAPSHOT if r["kind"] == "training" and r["sources"] != "S10"]
    assert len(priced) == 29
    assert len({r["id"] for r in tp.SNAPSHOT}) == len(tp.SNAPSHOT)


def test_every_row_has_every_field_or_an_explicit_unknown():
    keys = set(tp.SNAPSHOT[0])
    for row in tp.SNAPSHOT:
        assert set(row) == keys, row["id"]
        for field in ("id", "name", "family", "kind", "source_date", "sources", "catalogue_date"):
            assert isinstance(row[field], str) and row[field], (row["id"], field)
        for kind in tp.PRICE_KINDS:
            value = row[kind]
            if value is None:
                # an unknown price is always explained, never silently blank
                assert row["note"] and ("not found" in row["note"] or "unknown" in row["note"]
                                        or "serverless" in row["note"]), (row["id"], kind)
            else:
                assert isinstance(value, float) and 0 < value < 100, (row["id"], kind)
        if row["context"] is None:
            assert "context window not found" in row["note"]
        else:
            assert row["context"] in (32768, 65536, 131072, 262144)


def test_cached_prefill_is_a_fifth_of_prefill_on_every_priced_training_row():
    for row in tp.SNAPSHOT:
        if row["kind"] == "training" and row["prefill"] is not None:
            assert row["cached_prefill"] == pytest.approx(row["prefill"] / 5, abs=5e-4), row["id"]


def test_snapshot_holds_the_notes_values_and_flags_disagreements():
    qwen = tp.resolve_model("Qwen/Qwen3-8B")
    assert (qwen["prefill"], qwen["cached_prefill"], qwen["sample"], qwen["train"]) == (0.195, 0.039, 0.60, 0.44)
    assert qwen["context"] == 32768 and tp.CATALOGUE_DATE == "2026-10-07"
    assert tp.STORAGE_USD_PER_GB_MONTH == 0.10
    inkling = tp.resolve_model("thinkingmachines/Inkling")
    assert inkling["list_price"] == {"prefill": 3.74, "sample": 9.36, "train": 11.22}
    assert "50%" in inkling["promo"]
    assert "11.23" in tp.resolve_model("Inkling:peft:262144")["note"]
    assert "0.39" in tp.resolve_model("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")["note"]
    assert tp.resolve_model("Inkling-Small:peft:262144")["train"] is None
    unknown = tp.resolve_model("deepseek-ai/DeepSeek-V4.1-Flash:peft:262144")
    assert all(unknown[k] is None for k in tp.PRICE_KINDS)


# ---------------------------------------------------------------- name resolution

def test_short_name_means_the_instruct_row_not_the_base_row():
    assert tp.resolve_model("Qwen3.5-9B")["id"] == "Qwen/Qwen3.5-9B"
    assert tp.resolve_model("Qwen3.5-9B-Base")["id"] == "Qwen/Qwen3.5-9B-Base"
    assert tp.resolve_model("qwen/qwen3-8b")["id"] == "Qwen/Qwen3-8B"  # canonical case returned


def test_a_model_with_only_a_long_context_id_resolves_by_its_short_name():
    assert tp.resolve_model("GLM-5.3")["id"] == "zai-org/GLM-5.3:peft:262144"


def test_context_picks_the_cheapest_variant_wide_enough():
    assert tp.resolve_model("Inkling")["id"] == "thinkingmachines/Inkling"
    assert tp.resolve_model("Inkling", context=100_000)["id"] == "thinkingmachines/Inkling:peft:262144"
    assert tp.resolve_model("Qwen/Qwen3.5-397B-A17B", context=65536)["id"] == "Qwen/Qwen3.5-397B-A17B"
    assert tp.resolve_model("Qwen/Qwen3.5-397B-A17B", context=65537)["id"] == "Qwen/Qwen3.5-397B-A17B:peft:262144"
    assert tp.resolve_model("Kimi-K2.6", context=40_000)["id"] == "moonshotai/Kimi-K2.6:peft:131072"


def test_context_wider_than_every_variant_is_an_error_naming_the_windows():
    with pytest.raises(tp.UnknownModelError, match=r"Qwen/Qwen3-8B \(32768\)"):
        tp.resolve_model("Qwen3-8B", context=40_000)


def test_ambiguous_name_lists_the_candidates():
    with pytest.raises(tp.UnknownModelError, match="ambiguous") as err:
        tp.resolve_model("gpt-oss")
    assert "openai/gpt-oss-120b" in str(err.value) and "openai/gpt-oss-20b" in str(err.value)


def test_unknown_name_lists_the_closest_ids():
    with pytest.raises(tp.UnknownModelError) as err:
        tp.resolve_model("Qwen3.9-9B")
    assert isinstance(err.value, ValueError)
    assert "Qwen/Qwen3.5-9B" in str(err.value)



def test_a_retired_model_says_when_it_retired_and_what_replaced_it():
    # Tinker's Model Deprecations page: Qwen3-30B-A3B retired 2026-06-12, replaced by Qwen3.6-35B-A3B
    with pytest.raises(tp.UnknownModelError) as err:
        tp.resolve_model("Qwen/Qwen3-30B-A3B")
    assert str(err.value).startswith("unknown model 'Qwen/Qwen3-30B-A3B': Qwen/Qwen3-30B-A3B was retired from "
                                     "Tinker on 2026-06-12; its recommended replacement is Qwen/Qwen3.6-35B-A3B;")
    # the short name and a :peft: suffix are the same model; one with no named replacement still gives the date
    assert tp.retired_note("qwen3.5-27b:peft:131072").endswith("its recommended replacement is Qwen/Qwen3.6-27B")
    assert tp.retired_note("moonshotai/Kimi-K2.5") == (
        "moonshotai/Kimi-K2.5 was retired from Tinker on 2026-07-12; no replacement is named "
        f"(see `{sys.executable} {SCRIPT} list`)")  # a command that runs as printed, from anywhere
    assert tp.retired_note("Qwen/Qwen3-8B") is None


def test_a_retired_model_is_never_resolved_to_a_served_model_whose_id_contains_it():
    # Qwen/Qwen3.5-35B-A3B is a substring of the served Qwen/Qwen3.5-35B-A3B-Base: not the same model
    with pytest.raises(tp.UnknownModelError, match="retired from Tinker on 2026-06-12; its recommended "
                                                   r"replacement is Qwen/Qwen3\.6-35B-A3B"):
        tp.resolve_model("Qwen/Qwen3.5-35B-A3B")
    assert tp.resolve_model("Qwen/Qwen3.5-35B-A3B-Base")["id"] == "Qwen/Qwen3.5-35B-A3B-Base"


# ---------------------------------------------------------------- formulas

def test_single_turn_rl_bills_the_whole_datum_and_the_group_prompt_once():
    # I=50, B=32 -> 1600 groups of G=8, P=300, C=400:
    #   prefill 1600*300 = 480,000        cached 1600*7*300 = 3,360,000
    #   sample  1600*8*400 = 5,120,000    train  1600*8*(300+400) = 8,960,000
    tokens = tp.rl_tokens(50, 32, 8, 300, 400)
    assert tokens == {"prefill": 480_000, "cached_prefill": 3_360_000, "sample": 5_120_000, "train": 8_960_000}
    # $: 0.48*0.195 = 0.0936; 3.36*0.039 = 0.13104; 5.12*0.60 = 3.072; 8.96*0.44 = 3.9424; total 7.23904
    est = tp.estimate_cost("Qwen/Qwen3-8B", **tokens)
    usd = dict(est["usd"])
    assert usd.pop("storage") is None  # not counted, and said so (test_storage_not_given_is_not_counted_...)
    assert usd == pytest.approx({"prefill": 0.0936, "cached_prefill": 0.13104, "sample": 3.072,
                                 "train": 3.9424, "total": 7.23904})
    assert cents(est["usd"]["total"]) == 7.24


def test_storage_not_given_is_not_counted_and_the_estimate_says_so():
    """Issue 44: "storage": 0.0 read as free when the estimate had not counted it."""
    est = tp.estimate_cost("Qwen/Qwen3-8B", train=1_000_000)
    assert est["usd"]["storage"] is None and est["usd"]["total"] == pytest.approx(0.44)
    assert [item.split(":")[0] for item in est["not_counted"]] == ["storage", "checkpoint saves"]
    assert "$0.10 per GB-month" in est["not_counted"][0] and "--storage-gb-months" in est["not_counted"][0]
    assert "not counted: storage, checkpoint saves" in tp.summary_line(est)
    zero = tp.estimate_cost("Qwen/Qwen3-8B", train=1_000_000, storage_gb_months=0)  # given as none: counted
    assert zero["usd"]["storage"] == 0.0 and [i.split(":")[0] for i in zero["not_counted"]] == ["checkpoint saves"]


def test_multi_turn_rl_bills_resent_prefixes_at_the_cached_rate():
    # One trajectory, P=1000, C=500, O=300, T=4: prompts 1000, 1800, 2600, 3400 (sum 8800).
    # Group of G=8: turn 1 prefills 1000 once and 7*1000 cached; turns 2..4 each bill the new
    # observation (300) full-rate and the previous prompt + completion cached:
    #   prefill = 1000 + 8*3*300 = 8,200        cached = 7000 + 8*(1500+2300+3100) = 62,200
    #   (prefill + cached = 8 * 8800 = 70,400)   sample = 8*4*500 = 16,000
    #   train  = 8 * (1000 + 4*500 + 3*300) = 31,200 (one merged datum per trajectory)
    # x 1600 groups (I=100, B=16):
    tokens = tp.rl_tokens(100, 16, 8, 1000, 500, turns=4, avg_observation=300)
    assert tokens == {"prefill": 13_120_000, "cached_prefill": 99_520_000, "sample": 25_600_000,
                      "train": 49_920_000}
    # Kimi-K2.6: 13.12*2.205 = 28.9296; 99.52*0.441 = 43.88832; 25.6*5.49 = 140.544;
    # 49.92*4.84 = 241.6128; total 454.97472
    est = tp.estimate_cost("moonshotai/Kimi-K2.6", **tokens)
    assert est["usd"]["prefill"] == pytest.approx(28.9296)
    assert est["usd"]["cached_prefill"] == pytest.approx(43.88832)
    assert est["usd"]["sample"] == pytest.approx(140.544)
    assert est["usd"]["train"] == pytest.approx(241.6128)
    assert cents(est["usd"]["total"]) == 454.97


def test_multi_turn_closed_form_equals_a_turn_by_turn_simulation():
    for g, t, p, c, o in [(1, 2, 10, 5, 3), (4, 3, 200, 100, 50), (8, 6, 512, 256, 128), (3, 1, 7, 9, 11)]:
        prefill = cached = sample = train = 0
        for member in range(g):
            prompt = p
            for turn in range(1, t + 1):
                if turn == 1:
                    full, hit = (p, 0) if member == 0 else (0, p)
                else:  # everything up to the previous completion is a cache hit
                    full, hit = o, prompt - o
                prefill, cached, sample = prefill + full, cached + hit, sample + c
                if turn < t:
                    prompt += c + o
            train += prompt + c
        assert tp.rl_tokens(1, 1, g, p, c, turns=t, avg_observation=o) == {
            "prefill": prefill, "cached_prefill": cached, "sample": sample, "train": train}


def test_sft_bills_examples_times_length_times_epochs_plus_storage():
    # 10,000 examples x 800 tokens x 3 epochs = 24,000,000 train tokens x 6.60 = $158.40;
    # storage 2.5 GB-months x $0.10 = $0.25; total $158.65
    tokens = tp.sft_tokens(10_000, 800, 3)
    assert tokens == {"prefill": 0, "cached_prefill": 0, "sample": 0, "train": 24_000_000}
    est = tp.estimate_cost("Qwen/Qwen3.5-397B-A17B", storage_gb_months=2.5, **tokens)
    assert est["usd"]["train"] == pytest.approx(158.40)
    assert est["usd"]["storage"] == pytest.approx(0.25)
    assert cents(est["usd"]["total"]) == 158.65


def test_sampling_bills_the_prompt_once_and_n_minus_one_cached_copies():
    # 500 prompts x 400 tokens, n=4, max_tokens 1024:
    #   prefill 200,000 x 0.33 = 0.066; cached 500*3*400 = 600,000 x 0.066 = 0.0396;
    #   sample 500*4*1024 = 2,048,000 x 0.84 = 1.72032; total 1.82592
    tokens = tp.sample_tokens(500, 400, 1024, 4)
    assert tokens == {"prefill": 200_000, "cached_prefill": 600_000, "sample": 2_048_000, "train": 0}
    est = tp.estimate_cost("openai/gpt-oss-120b", **tokens)
    assert est["usd"]["total"] == pytest.approx(1.82592)
    assert cents(est["usd"]["total"]) == 1.83


def test_raw_estimate_multiplies_each_meter_by_its_rate():
    # Inkling: 1M x 1.87 + 2M x 0.374 + 3M x 4.68 + 4M x 5.61 = 1.87 + 0.748 + 14.04 + 22.44 = 39.098
    est = tp.estimate_cost("Inkling", prefill=1_000_000, cached_prefill=2_000_000, sample=3_000_000,
                           train=4_000_000)
    assert est["model"] == "thinkingmachines/Inkling" and est["catalogue_date"] == "2026-10-07"
    assert set(est) >= {"model", "catalogue_date", "tokens", "usd"}
    assert set(est["usd"]) == {"prefill", "cached_prefill", "sample", "train", "storage", "total"}
    assert est["usd"]["total"] == pytest.approx(39.098)
    assert cents(est["usd"]["total"]) == 39.10


def test_unknown_price_gives_none_and_a_warning_not_a_guess():
    est = tp.estimate_cost("deepseek-ai/DeepSeek-V4.1-Flash:peft:262144", train=1_000_000)
    assert est["usd"]["train"] is None and est["usd"]["total"] is None
    assert "DeepSeek-V4.1-Flash" in est["warning"] and "unknown" in est["warning"]


def test_a_partly_priced_row_prices_what_it_knows():
    # Inkling-Small 256K: 100 prompts x 1000, n=2, max 500 -> prefill 100,000 x 1.16 = 0.116,
    # cached 100,000 x 0.232 = 0.0232, sample 100,000 x 2.89 = 0.289; total 0.4282
    est = tp.estimate_cost("Inkling-Small:peft:262144", **tp.sample_tokens(100, 1000, 500, 2))
    assert est["usd"]["total"] == pytest.approx(0.4282) and "warning" not in est
    est = tp.estimate_cost("Inkling-Small:peft:262144", train=10)
    assert est["usd"]["train"] is None and "train" in est["warning"]


def test_serverless_ids_cannot_be_priced_for_training():
    with pytest.raises(ValueError, match="serverless"):
        tp.estimate_cost("Inkling:peft:262144:sampling-nvfp4", train=100)


@pytest.mark.parametrize("bad", [-1, "12", float("nan"), float("inf"), True])
def test_bad_token_counts_are_refused(bad):
    with pytest.raises(ValueError, match="train must be a finite number >= 0"):
        tp.estimate_cost("Qwen/Qwen3-8B", train=bad)


# ---------------------------------------------------------------- preflight

def test_preflight_prints_one_line_and_returns_the_estimate(capsys):
    est = tp.preflight("Qwen/Qwen3-8B", tp.rl_tokens(50, 32, 8, 300, 400), max_usd=10, label="rl")
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("cost estimate (rl: Qwen/Qwen3-8B, catalogue 2026-10-07): $7.24 = train 8.96M tok $3.94")
    assert cents(est["usd"]["total"]) == 7.24


def test_preflight_stops_above_max_usd_and_says_how_to_proceed():
    with pytest.raises(tp.BudgetExceeded) as err:
        tp.preflight("Qwen/Qwen3-8B", tp.rl_tokens(50, 32, 8, 300, 400), max_usd=5)
    message = str(err.value)
    assert "$7.24" in message and "--max-usd 5" in message and "raise --max-usd" in message


def test_preflight_with_unknown_prices_cannot_pass_a_budget():
    unknown = "zai-org/GLM-5.3-Flash:peft:262144"
    assert tp.preflight(unknown, {"train": 1000})["usd"]["total"] is None  # no budget: warn only
    with pytest.raises(tp.BudgetExceeded, match="drop --max-usd"):
        tp.preflight(unknown, {"train": 1000}, max_usd=100)


def test_preflight_refuses_a_misspelt_token_kind():
    with pytest.raises(ValueError, match="unknown token kinds \\['trained'\\]"):
        tp.preflight("Qwen/Qwen3-8B", {"trained": 1000})


def test_preflight_raises_unknown_model_for_a_typo():
    with pytest.raises(tp.UnknownModelError, match="Qwen/Qwen3-8B"):
        tp.preflight("Qwen/Qwen3-8b-instruct", {"train": 1})


# ---------------------------------------------------------------- exact SFT counting

class CharTokenizer:
    """One token per character; the chat template wraps each message in <role>...</role>."""
    chat_template = "<role>content</role>"

    def encode(self, text, add_special_tokens=True):
        return list(range(len(text)))

    def apply_chat_template(self, messages, tokenize=True):
        return self.encode("".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages))


def test_sft_data_count_sums_datum_lengths_one_shorter_than_the_rendering(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"prompt": "2+2=", "completion": "4"},
            {"text": "x" * 50}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    # renderings: "<user>hi</user><assistant>hello</assistant>" = 6+2+7 + 11+5+12 = 43 chars;
    # "<user>2+2=</user><assistant>4</assistant>" = 6+4+7 + 11+1+12 = 41; text = 50.
    # datum length = rendering - 1: 42 + 40 + 49 = 131
    assert tp.count_sft_tokens(data, CharTokenizer()) == {"examples": 3, "train_tokens": 131, "max": 50}
    # truncated to 45 first: 42 + 40 + 44 = 126
    assert tp.count_sft_tokens(data, CharTokenizer(), max_length=45)["train_tokens"] == 126


def test_sft_data_count_names_the_bad_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "ok"}\n{"question": "no"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 needs"):
        tp.count_sft_tokens(data, CharTokenizer())


# ---------------------------------------------------------------- import cost

def test_import_is_stdlib_only():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import tinker_pricing; "
            "print(sorted(m for m in ('rich', 'httpx', 'tinker', 'transformers') if m in sys.modules))")
    # close_fds: a fresh interpreter (tests/forked_scripts.py forks plain calls from one that preloaded the SDK)
    out = subprocess.run([sys.executable, "-c", code, str(SCRIPT.parent)], capture_output=True, text=True,
                         check=True, close_fds=True).stdout
    assert out.strip() == "[]"


def test_markdown_table_lists_every_row_with_its_rates():
    table = tp.markdown_table(tp.SNAPSHOT)
    lines = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(lines) == len(tp.SNAPSHOT)
    qwen = next(line for line in lines if line.startswith("| `Qwen/Qwen3-8B`"))
    assert "| 32K | 0.195 | 0.039 | 0.60 | 0.44 |" in qwen


# ---------------------------------------------------------------- price files

def test_a_table_without_cached_prefill_keeps_the_snapshot_rate_and_says_so(tmp_path):
    # the pre-July-17 models.json had no cached_prefill field
    old = [{"name": "Qwen3-8B", "tinker_id": "Qwen/Qwen3-8B", "context": "32K",
            "prefill": "$0.13", "sample": "$0.40", "train": "$0.40"}]
    path = tmp_path / "models.json"
    path.write_text(json.dumps(old))
    rows, meta = tp.load_catalogue(path)
    qwen = tp.resolve_model("Qwen3-8B", rows=rows)
    assert (qwen["prefill"], qwen["cached_prefill"], qwen["sample"], qwen["train"]) == (0.13, 0.039, 0.40, 0.40)
    assert "cached_prefill kept from the 2026-10-07 snapshot" in qwen["note"]
    assert meta["source"].startswith("override") and qwen["catalogue_date"] == meta["date"]
    # 1M train tokens at 0.40 and 1M cached at 0.039
    est = tp.estimate_cost("Qwen3-8B", train=1_000_000, cached_prefill=1_000_000, rows=rows)
    assert est["usd"]["total"] == pytest.approx(0.439)


@pytest.mark.parametrize("bad, problem", [
    ([], "non-empty JSON array"),
    ([{"name": "x"}], "no tinker_id"),
    ([{"tinker_id": "a/b", "train": "$-1"}], "out of range"),
    ([{"tinker_id": "a/b", "train": "cheap"}], "is not like"),
    ([{"tinker_id": "a/b", "train": "$1", "sample": "$1", "context": "big"}], "context 'big'"),
    ([{"tinker_id": "a/b", "prefill": "$1"}], "not a price table"),
])
def test_malformed_tables_are_rejected_with_the_reason(bad, problem):
    with pytest.raises(ValueError, match=problem):
        tp.parse_models_json(bad)


def test_a_missing_price_file_is_bad_input(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        tp.load_catalogue(tmp_path / "nope.json")
