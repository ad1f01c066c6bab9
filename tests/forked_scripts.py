"""`subprocess.run([sys.executable, SCRIPT_OR_-c, ...])` from a warm interpreter: test infrastructure only.

Why: a training script's 2-step run on the local backend used 3.3 s of CPU, 2.7 s of it importing the SDK (which
imports torch) and transformers before any work (measured 5 December 2026). The suite runs a few hundred such
processes. Here a "zygote" process imports those packages once and forks a child for every run; the child is the
script's process: its own pid, the argv, environment, working directory, stdin/stdout/stderr and exit status
that `subprocess.run` would have given it, and the script's file executed fresh as `__main__` (`runpy`), with
sys.path[0] its folder, as `python SCRIPT` sets it. Only the import of third-party packages is shared; nothing
of this repository is imported by the zygote, so every run executes the current files.

What is forked (tests/conftest.py patches `subprocess.run` for the test session): `[sys.executable, X.py, ...]`
and `[sys.executable, "-c", CODE, ...]` with only these keywords: capture_output, stdout, stderr (PIPE, DEVNULL,
STDOUT, None), stdin (DEVNULL, None), input, text / universal_newlines, encoding, errors, env, cwd, timeout,
check. Anything else (another interpreter, `-m`, preexec_fn, start_new_session, Popen) runs as before, so tests
that kill, signal or time a process get a real one; a test that inspects the interpreter itself (which modules
a script imports) passes `close_fds=True` (subprocess's default) to get a fresh one. Packages that read their environment when imported
(HF_*, TRANSFORMERS_*, TINKER_LOG, PYTHON*, locale, thread counts) get one zygote per distinct set of those
values, started the second time such a set is used (the first run is a real process); at most MAX_ZYGOTES
live per pytest process, the least recently used is stopped.

A fresh interpreter's per-process state is re-made in the child: `random` and numpy's global generator are
reseeded from the OS, SIGINT raises KeyboardInterrupt, sys.stdin/stdout/stderr are new objects over fds 0-2
with the buffering CPython gives (PYTHONUNBUFFERED honoured). An uncaught exception prints its traceback and
exits 1, an uncaught KeyboardInterrupt ends the process by SIGINT, as CPython does.

Tokenizers are parsed once too: loading Qwen3's tokenizer.json costs ~0.6 s of CPU, most of a forked run's.
A child's first `AutoTokenizer.from_pretrained(X, **kw)` for a given (X, kw) returns the zygote's copy when the
zygote has loaded it and X's files (the folder, or the cached hub snapshot) are unchanged since (names, sizes and
modification times); otherwise it loads as usual and tells the zygote, which loads it between forks for later
children. A fork gives each child its own copy of the object, so nothing a script does to it is seen by another;
a second call in one run loads afresh. Not shared: `trust_remote_code`, positional arguments beyond the name.

Off: TINKER_TEST_FORK_SCRIPTS=0. Measured: see benchmarks/README.md, "The test suite".
"""
from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading


def _server_module():
    """scripts/tinker_local_server.py (standard library only at import), loaded by its path: sys.path, which the
    forked children inherit, stays as a real process has it."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "tinker_local_server.py")
    spec = importlib.util.spec_from_file_location("forked_scripts_local_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the engine zygote's (tinker_local.EngineZygote) socket, request, child set-up and exit reporting, shared
_SERVER = _server_module()
accept_request, report_exits, zygote_socket = _SERVER.accept_request, _SERVER.report_exits, _SERVER.zygote_socket
become_forked_child, exit_like_python = _SERVER.become_forked_child, _SERVER.exit_like_python
# a tokenizer parsed once: its key, its files' fingerprint, a forked child's first load of it
tokenizer_key, tokenizer_files, lend_held_tokenizers = (_SERVER.tokenizer_key, _SERVER.tokenizer_files,
                                                        _SERVER.lend_held_tokenizers)

# Imported once by the zygote: what the scripts import before their work (tinker imports torch).
PRELOAD = ("numpy", "tinker", "transformers", "jinja2", "rich.console", "rich.progress", "rich.table", "httpx")
PRELOAD_ATTRS = (("transformers", "AutoTokenizer"), ("transformers", "PreTrainedTokenizerFast"))
IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "OMP_", "MKL_", "OPENBLAS_",
                   "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONNOUSERSITE", "PYTHONSAFEPATH",
                   "PYTHONDEVMODE", "PYTHONUTF8", "PYTHONOPTIMIZE", "LANG", "LC_", "TINKER_LOG", "NUMPY_", "NPY_")
MAX_ZYGOTES = 4  # alive at once per pytest process (~0.4 GB each); the least recently used one is stopped
ALLOWED = {"capture_output", "stdout", "stderr", "stdin", "input", "text", "universal_newlines", "encoding",
           "errors", "env", "cwd", "timeout", "check"}


# ---------------------------------------------------------------- the zygote (a process of its own)

_TOKENIZERS: dict[str, tuple] = {}  # in the zygote: key -> (files' fingerprint, tokenizer)


def _learn_tokenizer(line: bytes) -> None:
    """In the zygote, between forks: load a tokenizer a child loaded, for the children after it."""
    key = line.decode()
    if key in _TOKENIZERS:
        return
    name, kwargs = json.loads(key)
    files = tokenizer_files(name)
    if files is None:
        return
    with contextlib.suppress(Exception):
        from transformers import AutoTokenizer
        _TOKENIZERS[key] = (files, AutoTokenizer.from_pretrained(name, **kwargs))


def _share_tokenizers(learn_fd: int) -> None:
    """In the child: the first from_pretrained of each (name, keywords) returns the zygote's copy if its files are
    unchanged; a load the zygote lacks is reported on learn_fd."""
    def learn(key: str) -> None:
        with contextlib.suppress(OSError):
            os.write(learn_fd, key.encode() + b"\n")

    lend_held_tokenizers(_TOKENIZERS, learn)


def _child(request: dict, fds: list[int], listener: socket.socket, conns, wake: tuple[int, int],
           learn: tuple[int, int]) -> None:
    """In the forked child: become the script's process, run it, exit as `python SCRIPT` would."""
    become_forked_child(request, fds, [listener, *conns], [*wake, learn[0]])
    _share_tokenizers(learn[1])
    argv = request["argv"]
    import runpy
    import types
    code = 0
    try:
        try:
            if argv[0] == "-c":
                sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
                main = types.ModuleType("__main__")
                main.__dict__["__builtins__"] = __builtins__
                sys.modules["__main__"] = main
                exec(compile(argv[1], "<string>", "exec"), main.__dict__)
            else:
                script = argv[0]
                sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(script))
                runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    except KeyboardInterrupt as exc:
        _print_exception(exc, argv)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException as exc:  # noqa: BLE001 - what the interpreter does with any uncaught exception
        _print_exception(exc, argv)
        code = 1
    exit_like_python(code)


def _print_exception(exc: BaseException, argv: list[str]) -> None:
    """The traceback from the script's own frames on (runpy's and this module's are not in a real run's)."""
    tb = exc.__traceback__
    first = "<string>" if argv[0] == "-c" else os.path.abspath(argv[0])
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != first \
            and tb.tb_frame.f_code.co_filename != first:
        tb = tb.tb_next
    tb = tb or exc.__traceback__
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)


def serve(path: str) -> None:
    """The zygote: import PRELOAD, then fork one child per request on the unix socket at `path`."""
    import importlib
    sys.modules["forked_scripts_zygote"] = sys.modules[__name__]  # its tokenizers, for a test to find
    for name in PRELOAD:
        importlib.import_module(name)
    for module, attr in PRELOAD_ATTRS:
        getattr(sys.modules[module], attr)
    parent = os.getppid()
    listener, wake_r, wake_w = zygote_socket(path)
    learn_r, learn_w = os.pipe()  # children name the tokenizers they loaded (_share_tokenizers)
    os.set_blocking(learn_w, False)
    learned = b""
    print("ready", flush=True)
    running: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, wake_r, learn_r, *running.values()], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 4096)
            readable.remove(wake_r)
        if learn_r in readable:
            learned += os.read(learn_r, 1 << 16)
            readable.remove(learn_r)
            *lines, learned = learned.split(b"\n")
            for line in dict.fromkeys(lines):
                _learn_tokenizer(line)
        if os.getppid() != parent:  # the pytest process is gone
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        for sock in readable:
            if sock is listener:
                accepted = accept_request(listener)
                if accepted is None:
                    continue
                conn, request, fds = accepted
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, listener, [conn, *running.values()], (wake_r, wake_w), (learn_r, learn_w))
                for fd in set(fds):
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                running[pid] = conn
            else:  # the requester hung up early: its child dies with it
                pid = next(p for p, c in running.items() if c is sock)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        report_exits(running)


# ---------------------------------------------------------------- the pytest side

class _Zygote:
    def __init__(self, env: dict):
        self.dir = tempfile.mkdtemp(prefix="forked-scripts-")
        self.path = os.path.join(self.dir, "zygote.sock")
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", self.path], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the script zygote did not start (exit {self.proc.wait()})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.dir)


_zygotes: dict[tuple, _Zygote] = {}  # in order of last use
_seen: set[tuple] = set()
_lock = threading.Lock()
STATS = {"forked": 0, "real": 0, "zygotes_started": 0}  # eligible calls; TINKER_TEST_FORK_SCRIPTS_STATS=FILE logs them


def _zygote_for(env: dict, start: bool = False) -> _Zygote | None:
    """The zygote for env's import-time variables; None (a real process) the first time a set is seen, since a
    zygote's start costs what one real run does and some tests use a set of their own once (a fresh HF_HOME)."""
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)))
    with _lock:
        zygote = _zygotes.pop(key, None)
        if zygote is not None and zygote.alive():
            _zygotes[key] = zygote
            return zygote
        if key not in _seen and not start:
            _seen.add(key)
            return None
        while len(_zygotes) >= MAX_ZYGOTES:
            _zygotes.pop(next(iter(_zygotes))).close()
        _zygotes[key] = zygote = _Zygote(env)
        STATS["zygotes_started"] += 1
        return zygote


def close_all() -> None:
    with _lock:
        for zygote in _zygotes.values():
            zygote.close()
        _zygotes.clear()
        _seen.clear()


def _eligible(args, kwargs) -> bool:
    if not isinstance(args, (list, tuple)) or len(args) < 2 or set(kwargs) - ALLOWED:
        return False
    if str(args[0]) != sys.executable:
        return False
    first = str(args[1])
    if first == "-c" and len(args) < 3 or first != "-c" and (first.startswith("-") or not first.endswith(".py")):
        return False
    if kwargs.get("stdin") not in (None, subprocess.DEVNULL) or (kwargs.get("input") is not None and "stdin" in kwargs):
        return False
    for name in ("stdout", "stderr"):
        if kwargs.get(name) not in (None, subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT):
            return False
    return kwargs.get("stdout") != subprocess.STDOUT


def _decode(data: bytes, text: bool, encoding, errors):
    if not text:
        return data
    return data.decode(encoding or "utf-8", errors or "strict").replace("\r\n", "\n").replace("\r", "\n")


def run(args, start_zygote: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run's contract for an eligible call (see the module's docstring), from a forked child; the
    result's `forked` says whether it was (start_zygote: fork even on an environment's first use)."""
    argv = [str(a) for a in args]
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    zygote = _zygote_for(env, start_zygote)
    STATS["real" if zygote is None else "forked"] += 1
    if zygote is None:
        return ORIGINAL_RUN(args, **kwargs)
    capture = kwargs.get("capture_output", False)
    out_mode = subprocess.PIPE if capture else kwargs.get("stdout")
    err_mode = subprocess.PIPE if capture else kwargs.get("stderr")
    text = bool(kwargs.get("text") or kwargs.get("universal_newlines") or kwargs.get("encoding")
                or kwargs.get("errors"))
    opened = []

    def fd_for(mode, default_fd, stdin=False):
        if mode == subprocess.PIPE:
            f = tempfile.TemporaryFile()
            opened.append(f)
            return f.fileno(), f
        if mode == subprocess.DEVNULL:
            f = open(os.devnull, "rb" if stdin else "wb")
            opened.append(f)
            return f.fileno(), None
        return default_fd, None

    try:
        given = kwargs.get("input")
        if given is not None:
            stdin_file = tempfile.TemporaryFile()
            opened.append(stdin_file)
            stdin_file.write(given.encode(kwargs.get("encoding") or "utf-8") if isinstance(given, str) else given)
            stdin_file.seek(0)
            in_fd = stdin_file.fileno()
        else:
            in_fd, _ = fd_for(subprocess.DEVNULL, 0, stdin=True)
        out_fd, out_file = fd_for(out_mode, 1)
        if err_mode == subprocess.STDOUT:
            err_fd, err_file = out_fd, None
        else:
            err_fd, err_file = fd_for(err_mode, 2)
        request = {"argv": argv[1:], "env": env, "cwd": str(kwargs.get("cwd") or os.getcwd())}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(zygote.path)
            conn.sendmsg([json.dumps(request).encode() + b"\n"],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [in_fd, out_fd, err_fd]))])
            reader = conn.makefile("r")
            pid = json.loads(reader.readline())["pid"]
            timeout = kwargs.get("timeout")
            conn.settimeout(timeout)
            try:
                line = reader.readline()
            except (TimeoutError, socket.timeout):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                conn.settimeout(None)
                with contextlib.suppress(Exception):
                    reader.readline()
                # as subprocess.run's: the bytes written so far, None when nothing was
                raise subprocess.TimeoutExpired(args, timeout, output=_read(out_file) or None,
                                                stderr=_read(err_file) or None) from None
            returncode = json.loads(line)["returncode"]
        finally:
            conn.close()
        stdout = _decode(_read(out_file), text, kwargs.get("encoding"), kwargs.get("errors")) if out_file else None
        stderr = _decode(_read(err_file), text, kwargs.get("encoding"), kwargs.get("errors")) if err_file else None
    finally:
        for f in opened:
            f.close()
    done = subprocess.CompletedProcess(args, returncode, stdout, stderr)
    done.forked = True
    if kwargs.get("check"):
        done.check_returncode()
    return done


def _read(f) -> bytes:
    if f is None:
        return b""
    f.seek(0)
    return f.read()


ORIGINAL_RUN = subprocess.run


def patched_run(*args, **kwargs):
    """subprocess.run, forking eligible calls from a zygote."""
    call = args[0] if args else kwargs.get("args")
    rest = {k: v for k, v in kwargs.items() if k != "args"}
    if len(args) <= 1 and _eligible(call, rest):
        return run(call, **rest)
    return ORIGINAL_RUN(*args, **kwargs)


def install() -> bool:
    """Patch subprocess.run for this process (tests/conftest.py); False when TINKER_TEST_FORK_SCRIPTS=0."""
    if os.environ.get("TINKER_TEST_FORK_SCRIPTS", "1") == "0" or not hasattr(socket, "SCM_RIGHTS"):
        return False
    subprocess.run = patched_run
    return True


def uninstall() -> None:
    subprocess.run = ORIGINAL_RUN
    close_all()
    if os.environ.get("TINKER_TEST_FORK_SCRIPTS_STATS"):
        with open(os.environ["TINKER_TEST_FORK_SCRIPTS_STATS"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **STATS}) + "\n")


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(sys.argv[2])
