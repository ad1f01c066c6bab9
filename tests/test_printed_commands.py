"""A command a script prints runs as printed (issue 44): under the interpreter that ran the script, with real paths,
pasted into a shell whose PATH has no venv, from a folder outside the bundle. Also the three silent defects found
with it: the "PyTorch was not found" notice, datums.jsonl's `line`, an RL run's system prompt for infer --run."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from fixtures_local import fixture_output

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
EXAMPLE = ROOT / "templates" / "sft_example.jsonl"
PY = shlex.quote(sys.executable)
NO_VENV_PATH = "/usr/bin:/bin"  # no venv on PATH: a bare `python` there has no tinker (or is not there at all)


def bare_shell_env(env: dict) -> dict:
    """`env` as a shell with no venv activated: PATH without the venv's bin/, no VIRTUAL_ENV."""
    out = {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
    out["PATH"] = NO_VENV_PATH
    return out


def paste(command: str, cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    """`command` pasted into bash as printed."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=bare_shell_env(env), capture_output=True, text=True,
                          timeout=timeout)


def no_credentials_env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_LOCAL_LAUNCHER", "TINKER_CREDENTIAL"))}
    return {**env, "HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}  # no stored login either


def test_the_bare_python_of_the_no_venv_shell_cannot_run_the_scripts():
    """Why the printed commands name sys.executable: the shell the tests paste into has no SDK on its python."""
    bare = subprocess.run(["bash", "-c", "python3 -c 'import tinker' || python -c 'import tinker'"],
                          env={"PATH": NO_VENV_PATH}, capture_output=True, text=True)
    assert bare.returncode != 0


# ---- the no-credentials error: a real tinker_local.py, or plainly none -------------------------------------------


def test_no_credentials_error_names_the_tinker_local_py_beside_the_script(tmp_path, offline_tokenizer):
    (tmp_path / "home").mkdir()
    out = subprocess.run([sys.executable, str(SCRIPTS / "tinker_sft.py"), "--data", str(EXAMPLE), "--max-steps", "1",
                          "--tokenizer", offline_tokenizer("Qwen3-8B"), "--log-path", str(tmp_path / "run")],
                         capture_output=True, text=True, env=no_credentials_env(tmp_path), cwd=tmp_path, timeout=300)
    assert out.returncode == 4, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert "no Tinker credentials" in line and "PATH/TO" not in line, line
    command = line.split("for a free rehearsal start the local backend: ", 1)[1]
    words = shlex.split(command)
    assert words[:4] == [sys.executable, str(SCRIPTS / "tinker_local.py"), "run", "--"], words
    assert (tmp_path / words[1]).is_file()  # as printed, from where the script ran
    assert words[4:6] == [sys.executable, str(SCRIPTS / "tinker_sft.py")]


def test_no_credentials_error_of_a_script_copied_alone_says_tinker_local_py_is_not_beside_it(tmp_path,
                                                                                             offline_tokenizer):
    (tmp_path / "home").mkdir()
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy2(SCRIPTS / "tinker_sft.py", project / "tinker_sft.py")
    out = subprocess.run([sys.executable, "tinker_sft.py", "--data", str(EXAMPLE), "--max-steps", "1",
                          "--tokenizer", offline_tokenizer("Qwen3-8B"), "--log-path", "run"],
                         capture_output=True, text=True, env=no_credentials_env(tmp_path), cwd=project, timeout=300)
    assert out.returncode == 4, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert "PATH/TO" not in line, line
    assert (f"tinker_local.py is not beside this script; copy tinker_local.py and tinker_local_server.py from the "
            f"tinker-training-inference bundle's scripts/ folder into {project}, then run "
            f"{PY} tinker_local.py run -- {PY} tinker_sft.py --data ") in line, line


# ---- every printed next command, pasted -----------------------------------------------------------------------


def next_line(stderr: str, label: str) -> str:
    [command] = [line.split(label, 1)[1] for line in stderr.splitlines() if label in line]
    return command


@pytest.mark.e2e
def test_every_printed_next_command_runs_as_printed_with_no_venv_on_path(local_tinker, local_sft_run, local_rl_run,
                                                                         tmp_path):
    printed = {}  # what each script printed, as printed; each fixture run had its cwd two levels above its folder
    sft = fixture_output(local_sft_run)
    printed["sft: next sample it"] = (next_line(sft["stderr"], "next     sample it: "), local_sft_run.parent.parent)
    rl = json.loads(fixture_output(local_rl_run)["stdout"].strip().splitlines()[-1])
    printed["rl: sampling hint"] = (rl["sampling"]["hint"], local_rl_run.parent.parent)

    # the report's hint for a mistyped folder names a real one
    project = tmp_path / "project"
    shutil.copytree(local_sft_run, project / "runs" / "sft")
    out = subprocess.run([sys.executable, str(SCRIPTS / "tinker_report.py"), "runs/sfft"], capture_output=True,
                         text=True, cwd=project, env=local_tinker.env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    printed["report: try"] = (out.stderr.strip().splitlines()[-1].split("try: ", 1)[1], project)

    # tinker_pricing.py: an unknown model names the list command
    out = subprocess.run([sys.executable, str(SCRIPTS / "tinker_pricing.py"), "show", "Nobody/NoModel-1B"],
                         capture_output=True, text=True, cwd=tmp_path, env=local_tinker.env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    printed["pricing: see"] = (out.stderr.split("(see `", 1)[1].split("`", 1)[0], tmp_path)

    # tinker_checkpoints.py and tinker_infer.py: a path that is not a checkpoint / the old subcommand name list
    out = subprocess.run([sys.executable, str(SCRIPTS / "tinker_checkpoints.py"), "export", "not-a-path", "--out",
                          "x"], capture_output=True, text=True, cwd=tmp_path, env=local_tinker.env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    checkpoints_list = out.stderr.strip().splitlines()[-1].split("next: ", 1)[1]
    printed["checkpoints: next"] = (checkpoints_list, tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPTS / "tinker_infer.py"), "checkpoints", "list"],
                         capture_output=True, text=True, cwd=tmp_path, env=local_tinker.env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].split("next: ", 1)[1] == checkpoints_list

    for what, (command, cwd) in printed.items():
        assert command.startswith(PY + " "), (what, command)
        assert "PATH/TO" not in command and not command.startswith("python "), (what, command)
        done = paste(command, cwd, local_tinker.env)
        assert done.returncode == 0, (what, command, done.stderr[-3000:])
        if what.startswith(("sft", "rl")):  # sampled as trained, from the run's record
            assert json.loads(done.stdout.strip().splitlines()[-1])["status"] == "ok", (what, done.stdout[-2000:])


def json_hints(obj) -> list[str]:
    """Every "hint" field of a JSON result, at any depth: each is a command to paste."""
    if isinstance(obj, dict):
        return [v for k, v in obj.items() if k == "hint"] + [h for v in obj.values() for h in json_hints(v)]
    return [h for v in obj for h in json_hints(v)] if isinstance(obj, list) else []


def assert_pasted_sample_runs(what: str, command: str, cwd: Path, env: dict, sampler_path: str, question: str):
    """`command` (a printed `tinker_infer.py --run LOG --prompt QUESTION`) pasted as printed samples the run's
    final checkpoint: exit 0, one sample of the question."""
    assert command.startswith(PY + " ") and "PATH/TO" not in command, (what, command)
    words = shlex.split(command)
    assert "tinker_infer.py" in command and words[-2:] == ["--prompt", question], (what, command)
    done = paste(command, cwd, env)
    assert done.returncode == 0, (what, command, done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["status"], result["model"]) == ("ok", sampler_path), (what, result)
    assert len(result["samples"]) == 1 and result["samples"][0]["prompt_tokens"] > 0, (what, result["samples"])


@pytest.mark.e2e
def test_dpo_prints_a_sample_command_that_runs_as_printed(local_tinker, local_dpo_rehearsal):
    out = fixture_output(local_dpo_rehearsal)
    result = json.loads(out["stdout"].strip().splitlines()[-1])
    import tinker_dpo

    question = tinker_dpo.DPO_REHEARSAL_PAIRS[0]["prompt"]
    printed = [next_line(out["stderr"], "next     sample it: "), *json_hints(result)]
    for command in printed:
        assert_pasted_sample_runs("dpo", command, local_dpo_rehearsal.parent.parent, local_tinker.env,
                                  result["sampler_path"], question)


DISTILL_PROMPT = "Name a colour."


@pytest.fixture(scope="module")
def short_distill_rehearsal(local_tinker, local_sft_run, tmp_path_factory):
    """`tinker_distill.py --rehearse` on own prompts with the SFT fixture run as teacher, one iteration: the
    shortest run that prints both the summary and the JSON result (one iteration cannot halve the reverse KL, so
    the rehearsal's KL check fails: exit 1, status "failed"; the commands it prints must still run)."""
    cwd = tmp_path_factory.mktemp("distill-printed")
    prompts = cwd / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": DISTILL_PROMPT}]}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "Name a fruit."}]}) + "\n")
    out = subprocess.run([sys.executable, str(SCRIPTS / "tinker_distill.py"), "--rehearse", "--teacher",
                          str(local_sft_run), "--prompts", "prompts.jsonl", "--iterations", "1", "--batch-size", "2",
                          "--lora-rank", "8", "--tokenizer", str(local_tinker.tokenizer_dir), "--model-name",
                          local_tinker.model], capture_output=True, text=True, env=local_tinker.env, cwd=cwd,
                         timeout=900)
    return cwd, out


@pytest.mark.e2e
def test_distill_prints_sample_commands_with_its_first_prompt_that_run_as_printed(local_tinker,
                                                                                  short_distill_rehearsal):
    cwd, out = short_distill_rehearsal
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 1 and result["status"] == "failed", out.stderr[-3000:]
    assert [c["passed"] for c in result["rehearsal"]["checks"]] == [True, True, False], result["rehearsal"]
    summary, hint = next_line(out.stderr, "next     sample it: "), *json_hints(result)
    assert summary == hint, (summary, hint)  # one command: pasted once (each paste starts a server)
    assert_pasted_sample_runs("distill", hint, cwd, local_tinker.env, result["sampler_path"], DISTILL_PROMPT)


@pytest.mark.e2e
def test_sft_json_hint_is_the_sample_command_of_its_summary(local_sft_run):
    """The JSON hint is a command (its explanation in hint_note), the same one the summary prints, which
    test_every_printed_next_command_runs_as_printed_with_no_venv_on_path pastes."""
    out = fixture_output(local_sft_run)
    result = json.loads(out["stdout"].strip().splitlines()[-1])
    assert json_hints(result) == [next_line(out["stderr"], "next     sample it: ")], result["sampling"]
    assert shlex.split(result["sampling"]["hint"])[-2] == "--prompt", result["sampling"]
    assert "format" in result["sampling"]["hint_note"]


@pytest.mark.e2e
def test_eval_prints_commands_that_run_as_printed(local_tinker, local_sft_run, tmp_path):
    """tinker_eval.py prints next commands only when it refuses: a local run's checkpoint asked of Tinker (no
    local backend: the same evaluation under the launcher), a weights/ --checkpoint (the same evaluation of the
    sampler path, under the launcher), a --checkpoint that is no tinker:// path (the run's checkpoints). The
    last two are pasted as printed (each paste starts a server); the first is the second's form without
    --checkpoint."""
    (tmp_path / "home").mkdir()
    cwd = local_sft_run.parent.parent  # eval only reads the run folder
    final = [json.loads(r) for r in (local_sft_run / "checkpoints.jsonl").read_text().splitlines()][-1]
    evaluate = [sys.executable, str(SCRIPTS / "tinker_eval.py"), "--run", "runs/sft", "--data", str(EXAMPLE),
                "--limit", "1", "--max-tokens", "4"]

    def refused(extra, env, code):
        out = subprocess.run([*evaluate, *extra], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
        assert out.returncode == code, (extra, out.stderr[-2000:])
        return out.stderr.strip().splitlines()[-1]

    no_key = refused([], no_credentials_env(tmp_path), 2).split("start the local backend: ", 1)[1].removesuffix(")")
    weights = refused(["--checkpoint", final["state_path"]], local_tinker.env, 2).split("next: ", 1)[1]
    not_a_path = refused(["--checkpoint", "runs/sft/final"], local_tinker.env, 2).split("next: ", 1)[1]
    launcher = [sys.executable, str(SCRIPTS / "tinker_local.py"), "run", "--"]
    assert shlex.split(no_key) == [*launcher, *evaluate], no_key
    assert shlex.split(weights) == [*launcher, *evaluate, "--checkpoint", final["sampler_path"]], weights
    assert weights.startswith(PY + " "), weights
    done = paste(weights, cwd, local_tinker.env)
    assert done.returncode == 0, (weights, done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["status"], result["checkpoint"], result["n"]) == ("ok", final["sampler_path"], 1), result
    words = shlex.split(not_a_path)
    assert words[-4].endswith("tinker_checkpoints.py") and words[-3:] == ["list", "--run", "runs/sft"], not_a_path
    done = paste(not_a_path, cwd, local_tinker.env)
    assert done.returncode == 0, (not_a_path, done.stderr[-3000:])
    assert final["sampler_path"] in done.stdout, done.stdout[-2000:]


# ---- the "PyTorch was not found" notice ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_free_python(tmp_path_factory) -> str:
    """A venv of the test venv's packages without torch (hard links, ~1 s): what `pip install -e .` gives a user,
    whose install leaves torch out."""
    import sysconfig

    folder = tmp_path_factory.mktemp("no-torch") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(folder)
    source = Path(sysconfig.get_paths()["purelib"])
    target = folder / source.relative_to(sys.prefix)

    def without_torch(where, names):
        return [n for n in names if where == str(source) and n.split("-")[0] in ("torch", "functorch", "torchgen")]

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, dirs_exist_ok=True, ignore=without_torch, copy_function=link)
    python = str(folder / "bin" / "python")
    check = subprocess.run([python, "-c", "import importlib.util, transformers; "
                            "print(importlib.util.find_spec('torch') is None)"], capture_output=True, text=True)
    assert check.stdout.strip() == "True", check.stderr[-2000:]
    return python


def test_no_script_prints_the_pytorch_not_found_notice_without_torch(torch_free_python, tmp_path,
                                                                     offline_tokenizer):
    tokenizer = offline_tokenizer("Qwen3-8B")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    # the notice itself, so the check below would see it: transformers imported bare in that venv prints it
    bare = subprocess.run([torch_free_python, "-c", "import transformers"], capture_output=True, text=True, env=env)
    assert "PyTorch was not found" in bare.stderr
    runs = {
        "sft dry run": [str(SCRIPTS / "tinker_sft.py"), "--data", str(EXAMPLE), "--tokenizer", tokenizer, "--dry-run",
                        "--log-path", "runs/sft"],
        "infer dry run": [str(SCRIPTS / "tinker_infer.py"), "--model", "Qwen/Qwen3-8B", "--tokenizer", tokenizer,
                          "--prompt", "Hi", "--dry-run"],
        "pricing --help": [str(SCRIPTS / "tinker_pricing.py"), "--help"],
        "pricing estimate-sft --data": [str(SCRIPTS / "tinker_pricing.py"), "estimate-sft", "--model",
                                        "Qwen/Qwen3-8B", "--data", str(EXAMPLE), "--tokenizer", tokenizer],
    }
    for what, argv in runs.items():
        out = subprocess.run([torch_free_python, *argv], capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=300)
        assert out.returncode == 0, (what, out.stderr[-2000:])
        assert "PyTorch was not found" not in out.stderr, (what, out.stderr[:1000])


# ---- datums.jsonl: `line` is the example's line number in its file, an int ----------------------------------


def test_datums_line_is_an_int_line_number_for_training_and_held_out_rows(tmp_path, offline_tokenizer):
    held_out = tmp_path / "held.jsonl"
    lines = EXAMPLE.read_text().splitlines()
    held_out.write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n")  # a blank line: numbers follow the file
    for name, extra in (("own", ["--data", str(EXAMPLE), "--test-data", str(held_out)]), ("built-in", [])):
        out = subprocess.run([sys.executable, str(SCRIPTS / "tinker_sft.py"), *extra, "--tokenizer",
                              offline_tokenizer("Qwen3-8B"), "--dry-run", "--log-path", f"runs/{name}"],
                             capture_output=True, text=True, cwd=tmp_path, timeout=300,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
        rows = [json.loads(r) for r in (tmp_path / "runs" / name / "datums.jsonl").read_text().splitlines()]
        assert {r["split"] for r in rows} == {"train", "test"}
        assert all(type(r["line"]) is int for r in rows), {r["split"]: r["line"] for r in rows}
        if name == "own":
            assert [r["line"] for r in rows if r["split"] == "test"] == [1, 2, 4]
            assert sorted(r["line"] for r in rows if r["split"] == "train") == list(range(1, len(lines) + 1))


def test_a_held_out_example_that_cannot_render_is_named_with_its_file(tmp_path, offline_tokenizer):
    held_out = tmp_path / "held.jsonl"
    held_out.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "<think>x</think>y"}]}) + "\n")
    import tinker_sft

    examples = tinker_sft.normalise_items(tinker_sft.read_jsonl(str(held_out)), str(held_out))
    assert examples[0]["line"] == 1 and tinker_sft.example_where(examples[0]) == f"line 1 of {held_out}"


# ---- an RL run records its system prompt; tinker_infer.py --run sends it --------------------------------------

RL_WITH_SYSTEM = """
import sys
sys.path.insert(0, {scripts!r})
import tinker_rl

tinker_rl.SYSTEM_PROMPT = {system!r}
tinker_rl.TASKS = [{{"id": i}} for i in range(4)]
tinker_rl.EVAL_TASKS = [{{"id": i}} for i in range(4, 6)]
tinker_rl.render_prompt = lambda task: [{{"role": "user", "content": f"Say something {{task['id']}}."}}]
# differs between any two different samples (the system prompt can leave the tiny model no letters to count)
tinker_rl.reward = lambda task, text: sum(map(ord, text)) % 97 / 97
tinker_rl.exit_process(tinker_rl.run_cli(tinker_rl.main, sys.argv[1:]))
"""
SYSTEM = "Be brief."


@pytest.mark.e2e
def test_an_rl_run_records_its_system_prompt_and_infer_run_renders_it(local_tinker, tmp_path):
    log = tmp_path / "runs" / "rl"
    # temperature 2: with a system turn the tiny random model puts ~0.996 on "\n" at 1.0, and tied groups stop the run
    out = subprocess.run(
        [sys.executable, "-c", RL_WITH_SYSTEM.format(scripts=str(SCRIPTS), system=SYSTEM), "--tokenizer",
         str(local_tinker.tokenizer_dir), "--rehearse", "off", "--model-name", local_tinker.model, "--lora-rank", "8",
         "--batch-size", "2", "--group-size", "4", "--max-tokens", "8", "--iterations", "1", "--save-every", "1",
         "--temperature", "2.0", "--learning-rate", "0.003", "--seed", "0", "--log-path", str(log)],
        capture_output=True, text=True, env=local_tinker.env, cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((log / "config.json").read_text())
    assert (config["system_prompt"], config["system_prompts"]) == (SYSTEM, "shared")
    hint = json.loads(out.stdout.strip().splitlines()[-1])["sampling"]["hint"]
    assert shlex.split(hint)[-2:] == ["--prompt", "Say something 0."], hint
    shown = subprocess.run([sys.executable, str(SCRIPTS / "tinker_infer.py"), "--run", str(log), "--prompt",
                            "Say something 0.", "--dry-run"], capture_output=True, text=True,
                           env=local_tinker.env, cwd=tmp_path, timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]
    result = json.loads(shown.stdout.strip().splitlines()[-1])
    assert result["sampling"]["system"] == SYSTEM, result["sampling"]
    assert result["prompts"][0]["text"].startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>"), result["prompts"]
