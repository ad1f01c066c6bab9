"""tests/forked_scripts.py keeps subprocess.run's contract: each call below runs twice, as a real process and
forked from the zygote, and both must give the same exit status, stdout and stderr."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import forked_scripts

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

CASES = {
    "argv, exit code, both streams": ([PY, "-c", "import sys; print(sys.argv); print('to stderr', file=sys.stderr); "
                                       "sys.exit(3)", "a", "b"], {}),
    "sys.path[0] of -c": ([PY, "-c", "import sys; print(repr(sys.path[0]))"], {}),
    "uncaught exception": ([PY, "-c", "def f():\n    raise ValueError('boom')\nf()"], {}),
    "uncaught KeyboardInterrupt": ([PY, "-c", "raise KeyboardInterrupt"], {}),
    "SystemExit with a message": ([PY, "-c", "raise SystemExit('bad input')"], {}),
    "cwd and env": ([PY, "-c", "import os; print(os.getcwd(), os.environ.get('FORK_TEST'), 'HOME' in os.environ)"],
                    {"cwd": "/", "env": {"FORK_TEST": "yes", "PATH": os.environ.get("PATH", "")}}),
    "input on stdin": ([PY, "-c", "import sys; print(sys.stdin.read()[::-1])"], {"input": "abc\n"}),
    "no input: stdin is empty": ([PY, "-c", "import sys; print(repr(sys.stdin.read()))"], {}),
    "stderr into stdout": ([PY, "-c", "import sys; print('a', flush=True); print('b', file=sys.stderr)"],
                           {"stderr": subprocess.STDOUT}),
    "bytes, not text": ([PY, "-c", "print('\u00e9')"], {"text": False}),
    "a script: __file__, sys.path[0], __name__": ([PY, str(ROOT / "tests" / "assets" / "fork_probe.py"), "x"], {}),
    "a script's argparse error": ([PY, str(ROOT / "scripts" / "tinker_sft.py"), "--no-such-flag"], {}),
    "a thread still running at exit is joined": ([PY, "-c", "import threading, time\n"
                                                  "threading.Thread(target=lambda: (time.sleep(0.2), print('joined'))"
                                                  ").start()"], {}),
    "atexit handlers run": ([PY, "-c", "import atexit; atexit.register(print, 'at exit')"], {}),
}


def call(run, argv, kwargs):
    kwargs = {"capture_output": "stderr" not in kwargs, "text": True, "timeout": 60, **kwargs}
    if "stderr" in kwargs:
        kwargs["stdout"] = subprocess.PIPE
    return run(argv, **kwargs)


@pytest.mark.parametrize("name", CASES)
def test_a_forked_run_gives_what_a_real_process_gives(name):
    argv, kwargs = CASES[name]
    assert forked_scripts._eligible(argv, {"capture_output": True, "text": True, "timeout": 60, **kwargs}) or \
        "stderr" in kwargs
    real = call(forked_scripts.ORIGINAL_RUN, argv, kwargs)
    forked = call(forked_scripts.run, argv, {**kwargs, "start_zygote": True})
    assert getattr(forked, "forked", False) and not getattr(real, "forked", False)
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)


def test_each_run_gets_its_own_random_state_and_pid():
    argv = [PY, "-c", "import os, random; print(os.getpid(), random.random())"]
    outs = [forked_scripts.run(argv, start_zygote=True, capture_output=True, text=True).stdout.split()
            for _ in range(3)]
    assert len({o[0] for o in outs}) == 3 and len({o[1] for o in outs}) == 3
    assert all(int(o[0]) != os.getpid() for o in outs)


def test_a_timeout_kills_the_run_and_raises_as_subprocess_does():
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        forked_scripts.run([PY, "-c", "import sys, time; print('started', file=sys.stderr, flush=True); "
                                      "time.sleep(600)"], start_zygote=True, capture_output=True, text=True,
                           timeout=2)
    assert caught.value.timeout == 2 and caught.value.stderr == b"started\n"


def test_check_raises_called_process_error():
    with pytest.raises(subprocess.CalledProcessError) as caught:
        forked_scripts.run([PY, "-c", "raise SystemExit(5)"], start_zygote=True, capture_output=True, check=True)
    assert caught.value.returncode == 5


def test_only_plain_calls_of_this_interpreter_are_forked():
    plain = {"capture_output": True, "text": True}
    assert forked_scripts._eligible([PY, "script.py"], plain)
    assert not forked_scripts._eligible(["python3", "script.py"], plain)  # another interpreter
    assert not forked_scripts._eligible([PY, "-m", "pip"], plain)
    assert not forked_scripts._eligible([PY, "script.py"], {**plain, "start_new_session": True})
    assert not forked_scripts._eligible([PY, "script.py"], {**plain, "preexec_fn": print})
    assert not forked_scripts._eligible(f"{PY} script.py", plain)  # a shell string
    with open(os.devnull, "w") as sink:  # output into a file object of the caller's: a real process
        assert not forked_scripts._eligible([PY, "-c", "pass"], {"stdout": sink})
        assert not forked_scripts._eligible([PY, "script.py"], {"stderr": sink})


def test_the_session_runs_eligible_calls_forked():
    """tests/conftest.py installs the patch (unless TINKER_TEST_FORK_SCRIPTS=0)."""
    if os.environ.get("TINKER_TEST_FORK_SCRIPTS", "1") == "0":
        assert subprocess.run is forked_scripts.ORIGINAL_RUN
    else:
        assert subprocess.run is forked_scripts.patched_run
        runs = [subprocess.run([PY, "-c", "import os; print(os.getppid())"], capture_output=True, text=True)
                for _ in range(2)]  # the first use of an environment may run as a real process
        assert runs[-1].forked and int(runs[-1].stdout) != os.getpid()  # the zygote's child, not this process's


LOADS = """
import sys
from transformers import AutoTokenizer
first = AutoTokenizer.from_pretrained(sys.argv[1])
second = AutoTokenizer.from_pretrained(sys.argv[1])
zygote = sys.modules.get("forked_scripts_zygote")
shared = [t for _, t in getattr(zygote, "_TOKENIZERS", {}).values()]
print(any(first is t for t in shared), any(second is t for t in shared), first is second,
      first.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
      == second.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True),
      first("hello world")["input_ids"] == second("hello world")["input_ids"], first.pad_token)
first.pad_token = "<changed>"  # the next run must not see it
"""


def test_a_tokenizer_is_parsed_once_by_the_zygote_and_never_served_stale(offline_tokenizer, tmp_path):
    """The first run loads the tokenizer itself and tells the zygote; a later run's first load is the zygote's
    copy (its own, after the fork: a change made in one run is not seen by the next), a second load in the same
    run is fresh; an edited tokenizer folder is loaded afresh again. Same tokens and template either way."""
    import shutil
    folder = tmp_path / "tokenizer"
    shutil.copytree(offline_tokenizer("Qwen3-8B"), folder)
    env = dict(os.environ)

    def run():
        done = forked_scripts.run([PY, "-c", LOADS, str(folder)], start_zygote=True, env=env, capture_output=True,
                                  text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    fresh = forked_scripts.ORIGINAL_RUN([PY, "-c", LOADS, str(folder)], env=env, capture_output=True, text=True,
                                        timeout=120).stdout.split()
    assert fresh[:3] == ["False", "False", "False"] and fresh[3:5] == ["True", "True"]
    assert run()[:3] == ["False", "False", "False"]      # the zygote learns it now
    shared = run()
    assert shared[:3] == ["True", "False", "False"]      # parsed once, in the zygote
    assert shared[3:] == fresh[3:]                       # the same tokens, template and pad token
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text())                # touched: size the same, modification time not
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    assert run()[:3] == ["False", "False", "False"]      # not the zygote's copy of the old files
