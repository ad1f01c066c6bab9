"""The user's whole journey on the local backend (issue 27), typed as a user types it, from a project folder
outside the bundle that holds copied scripts: SFT rehearsal on their own data (with a system prompt) ->
sample with the command it prints, exactly as printed -> RL from the SFT checkpoint with their own reward
written into the EDIT ME block -> SIGKILL after the first checkpoint -> --resume -> report.

Every step is a separate `tinker_local.py run -- ...`, so a checkpoint of one step is found by the next only
through the checkpoint store (each server starts with an empty database). Each step's wall time and the
reward curve are printed (run with -s to see them)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "scripts" / "tinker_local.py"
COPIED = ("tinker_sft.py", "tinker_infer.py", "tinker_rl.py", "tinker_pricing.py", "tinker_report.py")
SYSTEM = "You are the help desk of Acme Cloud. Answer in one short sentence."
SUPPORT = [
    ("How do I reset my password?", "Open Settings, choose Account, then Reset password."),
    ("Where can I download my invoice?", "Invoices are under Billing, one PDF per month."),
    ("Can I change my username?", "No, usernames are fixed; you can change the display name."),
    ("How do I delete my account?", "Write to support and we delete it within two days."),
    ("Is there a mobile app?", "Yes, search for Acme Cloud in your app store."),
    ("What is the storage limit?", "The free plan stores 5 GB; Pro stores 1 TB."),
    ("How do I share a folder?", "Right-click the folder and choose Share."),
    ("Can I recover a deleted file?", "Yes, deleted files stay in Trash for 30 days."),
    ("How do I turn on two-factor login?", "Open Settings, choose Security, then Two-factor."),
    ("Why is my upload slow?", "Large uploads pause when the app is in the background."),
    ("How do I cancel Pro?", "Open Billing and choose Cancel plan."),
    ("Do you offer student discounts?", "Yes, students get Pro at half price."),
    ("Can I use Acme Cloud offline?", "Yes, mark a folder Available offline."),
    ("How do I contact a person?", "Use the chat button, weekdays from 9 to 5."),
    ("Which file types can I preview?", "PDF, images, video and office files preview in the browser."),
    ("How do I move files between folders?", "Drag them, or choose Move from the menu."),
    ("Is my data encrypted?", "Yes, files are encrypted at rest and in transit."),
    ("Can two people edit one file?", "Yes, office files support live co-editing."),
    ("How do I restore an old version?", "Open the file's History and pick a version."),
    ("What happens when my storage is full?", "Uploads stop until you free space or upgrade."),
    ("How do I change my email?", "Open Settings, choose Account, then Email."),
    ("Can I pay yearly?", "Yes, yearly billing saves two months."),
    ("How do I log out everywhere?", "Open Security and choose Sign out all devices."),
    ("Where is the desktop app?", "Download it from acme.cloud/desktop."),
]
# What the user writes into tinker_rl.py's EDIT ME block: their questions, their system prompt, their reward.
OWN_REWARD = '''# ==== EDIT ME: TASKS, render_prompt(), reward(), env_step() ====
# Our help desk: the questions of support.jsonl (beside this script), rewarded for answering like the docs.
import difflib

SYSTEM = "You are the help desk of Acme Cloud. Answer in one short sentence."
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "support.jsonl")) as _f:
    _rows = [json.loads(line)["messages"] for line in _f]
_ALL_TASKS = [{"question": m[1]["content"], "answer": m[2]["content"]} for m in _rows]
TASKS, EVAL_TASKS = _ALL_TASKS[:20], _ALL_TASKS[20:]
PASS_REWARD = 1.0


def render_prompt(task):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]


def reward(task, completion):
    """How close the reply is to the documented answer: difflib's similarity ratio, 0 to 1."""
    return difflib.SequenceMatcher(None, completion.strip().lower(), task["answer"].lower()).ratio()


env_step = None

'''


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def last_json(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture
def project(tmp_path):
    """A user's project: the copied scripts and their data, nowhere near the bundle."""
    folder = tmp_path / "project"
    folder.mkdir()
    for name in COPIED:
        shutil.copy2(ROOT / "scripts" / name, folder / name)
    with open(folder / "support.jsonl", "w") as f:
        for question, answer in SUPPORT:
            f.write(json.dumps({"messages": [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return folder


def user_env():
    """The user's shell: `python` is this interpreter; no Tinker or Hugging Face variables of the test run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_BASE_URL", "TINKER_API_KEY", "HF_"))}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def typed(command, project, timings, step, timeout=1500):
    """Run `command` as typed in the project folder; its wall time goes to timings[step]."""
    started = time.monotonic()
    done = subprocess.run(shlex.split(command), cwd=project, env=user_env(), capture_output=True, text=True,
                          timeout=timeout)
    timings[step] = round(time.monotonic() - started, 1)
    return done


def child_running(parent_pid, script, log_path, project, timeout=600):
    """The pid of the python process `tinker_local.py run` started for `script` (its direct child, whose
    command line names `log_path`): the process to kill, not the launcher around it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cwd = os.readlink(entry / "cwd")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent_pid and script.encode() in cmdline and log_path.encode() in cmdline \
                    and cwd == str(project):
                return int(entry.name)
        time.sleep(0.1)
    raise AssertionError(f"no {script} process under pid {parent_pid}")


def wait_for_checkpoint(path, launcher, timeout=900):
    """Block until checkpoints.jsonl holds a whole row (the event), or the run ended without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and any(r.get("state_path") for r in rows(path)):
            return rows(path)
        if launcher.poll() is not None:
            _, err = launcher.communicate()
            raise AssertionError(f"the run ended (exit {launcher.returncode}) before its first checkpoint:\n"
                                 f"{(err or '')[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint row in {path} within {timeout} s")


def test_sft_sample_rl_from_it_with_own_reward_kill_resume_report(local_backend_install, project):
    timings, launcher = {}, shlex.quote(str(LAUNCHER))

    # 1. SFT rehearsal on the user's own data, which carries a system prompt.
    sft = typed(f"python {launcher} run -- python tinker_sft.py --rehearse --data support.jsonl --log-path runs/sft",
                project, timings, "sft rehearsal")
    assert sft.returncode == 0, sft.stderr[-3000:]
    report = last_json(sft.stdout)
    assert report["status"] == "ok" and report["rehearsal"]["passed"], report["rehearsal"]
    assert [c["passed"] for c in report["rehearsal"]["checks"]] == [True] * 5
    config = json.loads((project / "runs/sft/config.json").read_text())
    assert (config["system_prompt"], config["system_prompts"]) == (SYSTEM, "shared")
    probe = report["eval"]["probes"][0]

    # 2. The printed next command, run exactly as printed (a new server: only the store knows the checkpoint).
    [printed] = [line.split("sample it: ", 1)[1] for line in sft.stderr.splitlines() if "next     sample it: " in line]
    py = shlex.quote(sys.executable)  # the interpreter `python` is in the user's shell (user_env)
    assert printed.startswith(f"{py} {LAUNCHER} run -- {py} tinker_infer.py --run runs/sft --prompt "), printed
    sampled = typed(printed, project, timings, "sample (printed command)")
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    answer = last_json(sampled.stdout)
    assert answer["status"] == "ok" and answer["model"] == report["sampler_path"]
    assert answer["sampling"]["system"] == SYSTEM and answer["sampling"]["temperature"] == 0.0
    assert answer["samples"][0]["text"] == probe["after"]  # greedy, as trained: what the probe saw after training
    assert "system prompt: the one every training example of runs/sft carried" in sampled.stderr

    # 3. RL from the SFT checkpoint with the user's own reward in the EDIT ME block; killed after its first save.
    script = (project / "tinker_rl.py").read_text()
    start, end = script.index("# ==== EDIT ME: TASKS"), script.index("# ==== END OF EDIT ME ====")
    (project / "tinker_rl.py").write_text(script[:start] + OWN_REWARD + script[end:])
    rl_command = (f"python {launcher} run -- python tinker_rl.py --init-from {report['state_path']} "
                  "--iterations 6 --save-every 2 --log-path runs/rl")
    started = time.monotonic()
    run = subprocess.Popen(shlex.split(rl_command), cwd=project, env=user_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        rl_pid = child_running(run.pid, "tinker_rl.py", "runs/rl", project)
        saved = wait_for_checkpoint(project / "runs/rl/checkpoints.jsonl", run)
        os.kill(rl_pid, signal.SIGKILL)  # the python process itself, not the launcher around it
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    timings["rl until killed"] = round(time.monotonic() - started, 1)
    assert run.returncode == 128 + signal.SIGKILL, err[-3000:]  # `run` exits with its command's, as a shell does
    assert saved[0]["name"] == "000002" and saved[0]["next_iteration"] == 2
    assert "reward: your reward() from the EDIT ME block, on its 20 TASKS, from " + report["state_path"] in err
    assert "reward() (EDIT ME) on the first 8 samples (2 groups)" in err
    killed_at = [r["iteration"] for r in rows(project / "runs/rl/metrics.jsonl")]
    assert killed_at[:2] == [0, 1] and "final" not in [r["name"] for r in rows(project / "runs/rl/checkpoints.jsonl")]

    # 4. --resume: the same command plus --resume, on yet another server.
    resumed = typed(rl_command + " --resume", project, timings, "rl --resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = last_json(resumed.stdout)
    assert result["status"] == "ok" and result["reward_source"] == "own" and result["init_from"] == report["state_path"]
    assert "resumed from" in resumed.stderr
    metrics = rows(project / "runs/rl/metrics.jsonl")
    assert [m["iteration"] for m in metrics] == list(range(6))  # each iteration exactly once
    assert [c["name"] for c in rows(project / "runs/rl/checkpoints.jsonl")][-1] == "final"
    rl_config = json.loads((project / "runs/rl/config.json").read_text())
    assert rl_config["init_from"] == report["state_path"] and rl_config["reward"] == "own"

    # 5. The report of each run.
    for log in ("runs/rl", "runs/sft"):
        page = typed(f"python tinker_report.py {log}", project, timings, f"report {log}", timeout=300)
        assert page.returncode == 0, page.stderr[-2000:]
        assert (project / log / "report.html").stat().st_size > 0

    curve = [round(m["reward_mean"], 4) for m in metrics]
    print(f"\njourney wall times (s): {json.dumps(timings)}; load average {os.getloadavg()[0]:.2f}")
    print(f"own reward (difflib similarity to the documented answer) from the SFT checkpoint, per iteration: {curve}")
    assert all(0.0 <= r <= 1.0 for r in curve) and any(m["datums"] for m in metrics)
