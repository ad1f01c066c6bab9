"""Run records readable by the ecosystem (issue 15, item 1): tinkerscope's own run discovery parses a
run folder written by tinker_sft.py / tinker_rl.py on the local backend, and the records carry the
field names the tinker-cookbook writes.

What tinkerscope 1.6.1 reads (tinkerscope/api/discovery.py, `scan_runs`):
  - a run is every folder holding a file named `checkpoints.jsonl`, with a sibling `config.json`;
  - config.json: `model_name`, `lora_rank`, `learning_rate`, `seed`, `wandb_name`, `wandb_project`,
    `dataset_builder.common_config.renderer_name` (nested, as the cookbook's chz config dumps it),
    `dataset_builder.file_path`;
  - checkpoints.jsonl rows: `name`, `batch`, `epoch`, `state_path`, `sampler_path`; the step it shows is
    int(name) ("000002" -> 2), else `batch` when it is an int > 0 ("final" needs `batch`);
  - metrics.jsonl: nothing (the cookbook's names are checked here against our rows instead).

tinkerscope is installed without its dependencies, into a cache folder of its own (`tinkerscope_dir()`):
`pip install tinkerscope==1.6.1` pulls tinker-cookbook, which downgrades transformers/tokenizers/
huggingface_hub in this venv; discovery needs only python-dotenv.
The real-run tests check the fields the shared run-record code writes (common/run_record.py, issue 15).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_local import EXIT_WITHOUT_TEARDOWN

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
TINKERSCOPE_DIR = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                   / "tinker-training-inference" / "tinkerscope-1.6.1")
# cookbook renderer names a Qwen3-8B run can be recorded with (notes/cookbook-facts.md 1.2)
QWEN3_RENDERERS = {"qwen3", "qwen3_disable_thinking", "qwen3_instruct"}

DISCOVER = """
import json
from tinkerscope.api.discovery import run_to_dict, scan_runs
print(json.dumps([run_to_dict(r) for r in scan_runs()]))
"""


def tinkerscope_dir():
    """A folder holding tinkerscope 1.6.1 and python-dotenv only (pip --target, once per machine, from PyPI)."""
    if not (TINKERSCOPE_DIR / "tinkerscope" / "api" / "discovery.py").exists():
        partial = TINKERSCOPE_DIR.with_name(TINKERSCOPE_DIR.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial),
                              "tinkerscope==1.6.1", "python-dotenv"], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            pytest.fail(f"cannot install tinkerscope==1.6.1 from PyPI into {partial}: {out.stderr[-800:]}")
        partial.rename(TINKERSCOPE_DIR)
    return TINKERSCOPE_DIR


def tinkerscope_discovery(root, tmp_path, server_env=None):
    """tinkerscope's own scan of `root` as plain dicts: offline (no TINKER_API_KEY, no probes) unless
    server_env gives a key and a base URL. Its settings are read once at import from
    TINKERSCOPE_SCAN_ROOTS, so it runs in a fresh process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "TINKERSCOPE_"))}
    env.update(server_env or {}, TINKERSCOPE_SCAN_ROOTS=str(root), XDG_STATE_HOME=str(tmp_path / "state"),
               PYTHONPATH=str(tinkerscope_dir()))
    out = subprocess.run([sys.executable, "-c", DISCOVER + EXIT_WITHOUT_TEARDOWN], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# tinkerscope itself, on the cookbook's shape (pins what the docstring above says it reads)


def test_tinkerscope_reads_the_fields_listed_here_from_a_cookbook_shaped_folder(tmp_path):
    run = tmp_path / "runs" / "cookbook-sft"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({
        "model_name": "Qwen/Qwen3-8B", "lora_rank": 32, "learning_rate": 2e-4, "seed": 7, "wandb_name": "sft-a",
        "renderer_name": "top-level-is-not-read",
        "dataset_builder": {"common_config": {"renderer_name": "qwen3"}, "file_path": "data.jsonl"}}))
    (run / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"name": "000010", "batch": 10, "epoch": 0, "state_path": "tinker://a/weights/000010",
         "sampler_path": "tinker://a/sampler_weights/000010"},
        {"name": "final", "batch": 20, "epoch": 1, "final": True, "state_path": "tinker://a/weights/final",
         "sampler_path": "tinker://a/sampler_weights/final"}]) + '{"name": "torn')
    [found] = tinkerscope_discovery(tmp_path / "runs", tmp_path)
    assert found["run_dir"] == str(run.resolve()) and found["config_error"] is None
    assert (found["name"], found["base_model"], found["renderer_name"]) == ("sft-a", "Qwen/Qwen3-8B", "qwen3")
    assert (found["lora_rank"], found["learning_rate"], found["seed"]) == (32, 2e-4, 7)
    assert [(c["name"], c["step"], c["batch"], c["epoch"]) for c in found["checkpoints"]] == \
        [("000010", 10, 10, 0), ("final", 20, 20, 1)]
    assert found["checkpoints"][1]["sampler_path"] == "tinker://a/sampler_weights/final"
    assert found["sampleable"] is None  # offline: unknown, never guessed


# ---------------------------------------------------------------------------------------------
# our runs (local backend)


@pytest.fixture(scope="module")
def sft_run(local_sft_run):
    """The session's shared SFT run (fixtures_local.py): tinkerscope only reads it."""
    return local_sft_run


@pytest.fixture(scope="module")
def rl_run(local_rl_run):
    """The session's shared RL run (fixtures_local.py): tinkerscope only reads it."""
    return local_rl_run


def discovered(log, tmp_path, env=None):
    [found] = [r for r in tinkerscope_discovery(log.parent, tmp_path, env) if r["run_dir"] == str(log.resolve())]
    return found


@pytest.mark.e2e
@pytest.mark.parametrize("run_fixture", ["sft_run", "rl_run"])
def test_tinkerscope_discovers_our_run_its_settings_and_checkpoints(run_fixture, request, tmp_path, local_tinker):
    log = request.getfixturevalue(run_fixture)
    config = json.loads((log / "config.json").read_text())
    ours = rows(log / "checkpoints.jsonl")
    found = discovered(log, tmp_path)
    assert found["config_error"] is None and found["name"] == log.name
    assert found["base_model"] == config["model_name"] == local_tinker.model
    assert (found["lora_rank"], found["learning_rate"], found["seed"]) == \
        (config["lora_rank"], config["learning_rate"], config["seed"]) == (8, config["learning_rate"], 0)
    assert [(c["name"], c["state_path"], c["sampler_path"]) for c in found["checkpoints"]] == \
        [(r["name"], r["state_path"], r["sampler_path"]) for r in ours]
    assert found["checkpoints"][-1]["sampler_path"], "the final row must carry a sampler path to chat with"


@pytest.mark.e2e
@pytest.mark.parametrize("run_fixture", ["sft_run", "rl_run"])
def test_tinkerscope_shows_our_renderer_and_every_checkpoint_step(run_fixture, request, tmp_path):
    """Needs config.json dataset_builder.common_config.renderer_name and `batch` on checkpoint rows."""
    log = request.getfixturevalue(run_fixture)
    found = discovered(log, tmp_path)
    assert found["renderer_name"] in QWEN3_RENDERERS, found["renderer_name"]
    # the step tinkerscope shows is ours: "final" gets it from `batch`
    assert [c["step"] for c in found["checkpoints"]] == [r["step"] for r in rows(log / "checkpoints.jsonl")]


@pytest.mark.e2e
def test_tinkerscope_marks_our_run_sampleable_on_the_local_backend(sft_run, tmp_path, local_tinker):
    """With a key, tinkerscope asks the server's capabilities whether our model_name is served. The local
    backend has no list_user_checkpoints, so the weights check is unknown and it trusts the base."""
    found = discovered(sft_run, tmp_path, env=local_tinker.env)
    assert found["sampleable"] is True, found["unsampleable_reason"]


@pytest.mark.e2e
def test_sft_record_carries_the_cookbook_field_names(sft_run):
    config = json.loads((sft_run / "config.json").read_text())
    assert config["dataset_builder"]["common_config"]["renderer_name"] in QWEN3_RENDERERS
    for r in rows(sft_run / "checkpoints.jsonl"):
        assert r["batch"] == r["next_batch"] and isinstance(r["epoch"], int)
    assert rows(sft_run / "checkpoints.jsonl")[-1].get("final") is True
    metrics = rows(sft_run / "metrics.jsonl")
    for m in metrics:  # the cookbook's names next to ours, same numbers
        assert m["train_mean_nll"] == m["loss"]
        assert m["num_tokens"] == m["tokens"] and m["num_loss_tokens"] == m["trained_tokens"]
    # held-out NLL under the cookbook's name: the --eval-every values of eval.jsonl
    during = [r["nll"] for r in rows(sft_run / "eval.jsonl") if r.get("when") == "during"]
    logged = [m["test/nll"] for m in metrics if "test/nll" in m]
    assert during and logged and set(logged) <= set(during)


@pytest.mark.e2e
def test_rl_record_carries_the_cookbook_field_names(rl_run):
    config = json.loads((rl_run / "config.json").read_text())
    assert config["dataset_builder"]["common_config"]["renderer_name"] in QWEN3_RENDERERS
    for r in rows(rl_run / "checkpoints.jsonl"):
        assert r["batch"] == r["next_iteration"] and isinstance(r["epoch"], int)
    for m in rows(rl_run / "metrics.jsonl"):
        assert m["env/all/reward/total"] == m["reward_mean"]
        assert m["optim/kl_sample_train_v1"] == m["kl_sample_train_v1"]
        assert m["optim/kl_sample_train_v2"] == m["kl_sample_train_v2"]
