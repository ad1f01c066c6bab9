"""The shared rules have one source (common/); every script carries an exact generated copy of exactly what its
hand-written part uses (nothing unreachable, nothing missing), and still runs when copied alone."""
import ast
import builtins
import json
import os
import shutil
import subprocess
import symtable
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import splice  # noqa: E402

MODULES = sorted(p.stem for p in (ROOT / "common").glob("*.py"))
SPLICED = [p.name for p in splice.targets()]


def test_every_script_region_is_exactly_what_common_generates():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "splice.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_copy_and_edit_scripts_carry_a_shared_region():
    assert {"tinker_sft.py", "tinker_rl.py", "tinker_dpo.py", "tinker_distill.py", "tinker_infer.py",
            "tinker_checkpoints.py"} <= set(SPLICED)


def hand_written_lines(text):
    """(lines outside the generated region, the line `def main(` is on) of a script's text."""
    start, end, _ = splice.find_region(text)
    region = text[start:end].count("\n") + 1
    main = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("def main("))
    return len(text.splitlines()) - region, main


def test_hand_written_lines_count_everything_outside_the_region():
    hand = "import sys\n\n\ndef main(argv=None):\n    raise DataError('x')\n\n\n"
    text = hand + splice.region_for(hand) + "\n\n\nif __name__ == '__main__':\n    main()\n"
    assert hand_written_lines(text) == (len(hand.splitlines()) + 4, 4)  # the blank lines and the guard after it


@pytest.mark.parametrize("script", ["tinker_sft.py", "tinker_rl.py", "tinker_distill.py"])
def test_a_training_script_reads_as_one_file_main_near_the_top(script):
    """Issue 43: a reader meets main() after the settings and the EDIT ME block (within 250 lines), and the part a
    user reads and edits stays at most 700 lines; a rule more than one script needs, or plumbing, lives in common/
    (spliced below), not here."""
    lines, main = hand_written_lines((ROOT / "scripts" / script).read_text())
    assert lines <= 700, f"{script}: {lines} hand-written lines (at most 700): move shared rules or plumbing to common/"
    assert main <= 250, f"{script}: `def main(` on line {main} (at most 250)"


@pytest.mark.parametrize("script", ["tinker_sft.py", "tinker_rl.py", "tinker_dpo.py", "tinker_distill.py"])
def test_the_edit_me_block_runs_with_the_stdlib_modules_a_user_block_reaches_for(script):
    """A user's own EDIT ME block (a reward reading its file beside the script, a math-based score) runs where it
    sits: os, sys, json and math are imported above it. The journey test's own reward (os.path, json) crashed
    with NameError once the imports moved below the block into the generated region."""
    text = (ROOT / "scripts" / script).read_text()
    above = ast.parse(text[:text.index("\n# ==== EDIT ME")])
    bound = {alias.asname or alias.name for node in above.body if isinstance(node, ast.Import) for alias in node.names}
    assert {"os", "sys", "json", "math"} <= bound, f"{script}: missing above its EDIT ME block: " \
        f"{sorted({'os', 'sys', 'json', 'math'} - bound)}"


def test_a_hand_edit_inside_a_region_is_detected():
    hand = "import sys\n\n\ndef main(argv=None):\n    raise DataError('x')\n\n\n"
    text = hand + splice.region_for(hand) + "\n"
    assert splice.spliced(text) == text
    edited = text.replace("exit_code = EXIT_BAD_INPUT", "exit_code = 5")
    assert edited != text and splice.spliced(edited) != edited


def test_a_new_use_in_the_hand_written_part_is_stale_until_spliced():
    """The region follows the hand-written part: calling one more shared function makes --check fail."""
    hand = "def main(argv=None):\n    raise DataError('x')\n\n\n"
    text = hand + splice.region_for(hand) + "\n"
    assert "def read_jsonl" not in text
    grown = text.replace("raise DataError('x')", "return read_jsonl(argv)")
    assert splice.spliced(grown) != grown
    assert "def read_jsonl" in splice.spliced(grown) and "def load_tokenizer" not in splice.spliced(grown)


@pytest.mark.parametrize("name", MODULES)
def test_a_whole_generated_module_compiles_without_its_dropped_imports(name):
    mod = splice.load_module(name)
    text = splice.module_section(mod, [u.index for u in mod.units], set().union(*(u.binds for u in mod.units)))
    ast.parse(text)
    assert splice.DROP not in text and "from __future__" not in text


def test_no_script_imports_the_shared_source():
    """A script copied alone has no common/ beside it: it must use its generated copy, never an import."""
    for path in (ROOT / "scripts").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in MODULES + ["common"], (path.name, node.module)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] not in MODULES + ["common"], (path.name, alias.name)


def test_the_region_sits_before_the_main_guard():
    for path in splice.targets():
        text = path.read_text()
        start, end, _ = splice.find_region(text)
        guard = text.find('if __name__ == "__main__":')
        assert guard > end, f"{path.name}: the generated region must end before the __main__ guard"


# ---------------------------------------------------------------------------------------------
# the copy holds exactly what the script needs, read from the assembled file itself


def script_units(path):
    """(hand-written units, region units) of a script, each unit a top-level statement of the whole file."""
    text = path.read_text()
    start, end, _ = splice.find_region(text)
    first, last = text[:start].count("\n") + 1, text[:end].count("\n") + 1
    units = splice.units_of(text)
    inside = [u for u in units if first <= u.node.lineno <= last]
    return [u for u in units if u not in inside], inside


@pytest.mark.parametrize("script", SPLICED)
def test_no_spliced_definition_is_unreachable_from_the_hand_written_part(script):
    """Follow names through the assembled file as Python would run it (one namespace): from every hand-written
    statement, through function bodies, decorators, defaults, class bases and bodies, constants and names given
    as strings, every statement of the generated region is reached."""
    hand, region = script_units(ROOT / "scripts" / script)
    binders = {}
    for u in hand + region:
        for name in u.binds:
            binders.setdefault(name, []).append(u)
    effects = [u for u in region if not u.binds]  # run on import: not definitions, but their uses count
    reached, queue = set(), hand + effects
    while queue:
        u = queue.pop()
        names = u.uses | {s for s in u.strings if any(not b.is_import for b in binders.get(s, []))}
        for name in names:
            for target in binders.get(name, []):
                if id(target) not in reached:
                    reached.add(id(target))
                    queue.append(target)
    unreachable = [f"line {u.node.lineno}: {splice.unit_label(u)}" for u in region
                   if u.binds and id(u) not in reached]
    assert unreachable == [], f"{script}: spliced but never used: {unreachable}"


def module_level_names(path):
    """(names bound at module level, names looked up at module level by any scope) of a whole file."""
    table = symtable.symtable(path.read_text(), str(path), "exec")
    bound = {s.get_name() for s in table.get_symbols() if s.is_local() or s.is_imported()}
    used = {s.get_name() for s in table.get_symbols() if s.is_referenced()}

    def walk(t):
        for s in t.get_symbols():
            if s.is_referenced() and s.is_global():
                used.add(s.get_name())
        for child in t.get_children():
            walk(child)

    for child in table.get_children():
        walk(child)
    return bound, used


@pytest.mark.parametrize("script", SPLICED)
def test_every_name_a_script_looks_up_is_defined_in_it(script):
    """Nothing is missing from the copy: every global name any function of the file reads is bound in the file
    or is a builtin (a path --help and --dry-run never take is covered too)."""
    bound, used = module_level_names(ROOT / "scripts" / script)
    missing = sorted(used - bound - set(dir(builtins)) - {"__file__", "__name__", "__doc__"})
    assert missing == [], f"{script} looks up names nothing defines: {missing}"


# ---------------------------------------------------------------------------------------------
# the closure on a made-up common/: every indirect way a name is used


FAKE_COMMON = {
    "errors": '''"""Errors."""
from __future__ import annotations

import json
import sys

CODE = 2  # used only as a class attribute's value


class Base(Exception):
    code = CODE


class Child(Base):
    """used only as another class's base"""


class Unused(Exception):
    pass


def say(*parts):
    print(*parts, file=sys.stderr)


def dumps(obj):
    return json.dumps(obj)
''',
    "helpers": '''"""Helpers."""
import functools
import os

from errors import Child, say  # splice: drop

LIMIT = 3  # used only as a default argument
LOOKUP = "by_name"  # a string naming a function, looked up with globals()


def traced(fn):  # used only as a decorator
    @functools.wraps(fn)
    def inner(*a):
        say(fn.__name__)
        return fn(*a)
    return inner


def by_name():  # reached only through the string in LOOKUP
    return os.sep


def deep():  # used only inside another spliced function
    raise Child("x")


@traced
def entry(n=LIMIT):
    if n < 0:
        deep()
    return globals()[LOOKUP]()


class Error2(Child):  # a class whose base comes from another module
    pass


os.environ.setdefault("SPLICE_TEST_EFFECT", by_name())  # binds nothing: runs on import, goes with its module


def never_called():
    return LIMIT
''',
}


EFFECT = "helpers:os.environ.setdefault('SPLICE_TEST_EFFECT', by_name())"


@pytest.fixture
def fake_common(tmp_path, monkeypatch):
    for name, text in FAKE_COMMON.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.setattr(splice, "COMMON", tmp_path)
    return tmp_path


def copied(hand):
    mods = splice.common_modules()
    return {f"{m}:{splice.unit_label(mods[m].units[i])}" for m, i in splice.closure(hand, mods)}


def test_the_closure_follows_decorators_defaults_bases_constants_strings_and_nested_uses(fake_common):
    assert copied("def main():\n    return entry()\n") == {
        "helpers:entry", "helpers:traced", "helpers:functools", "helpers:LIMIT", "helpers:LOOKUP",
        "helpers:by_name", "helpers:os", "helpers:deep", EFFECT,
        "errors:Child", "errors:Base", "errors:CODE", "errors:say", "errors:sys"}


def test_a_class_whose_base_lives_in_another_module_brings_the_base(fake_common):
    assert copied("def f():\n    raise Error2()\n") == {
        "helpers:Error2", "errors:Child", "errors:Base", "errors:CODE",
        EFFECT, "helpers:by_name", "helpers:os"}  # helpers is copied from: its statement run on import too


def test_a_module_the_shared_code_imports_serves_the_hand_written_part_too(fake_common):
    """A script that calls json.dumps without importing json gets the shared code's import of it."""
    assert copied("def f():\n    return json.dumps(1)\n") == {"errors:json"}


def test_a_name_the_script_defines_itself_is_not_copied(fake_common):
    assert copied("def say(x):\n    pass\n\n\ndef f():\n    say(1)\n") == set()


def test_a_script_defining_a_name_the_copy_also_needs_is_refused(fake_common):
    with pytest.raises(splice.SpliceError, match="defines say, which the copied shared code also defines"):
        copied("def say(x):\n    pass\n\n\ndef f():\n    return entry()\n")


def test_the_region_of_the_made_up_modules_runs(fake_common, capsys):
    hand = "import sys\n\n\ndef main():\n    return entry()\n"
    text = hand + splice.region_for(hand) + "\n"
    assert "never_called" not in text and "class Unused" not in text
    assert 'os.environ.setdefault("SPLICE_TEST_EFFECT", by_name())' in text  # a statement run for its effect
    namespace = {"__name__": "copied"}
    exec(compile(text, "copied.py", "exec"), namespace)
    assert namespace["main"]() == os.sep and capsys.readouterr().err == "entry\n"
    assert namespace["Child"].code == 2 and "Error2" not in namespace


# ---------------------------------------------------------------------------------------------
# each spliced script, copied alone into an empty folder, still runs (with and without tinker_pricing.py)


PAIRS = ROOT / "templates" / "dpo_example.jsonl"


def dry_runs(tok):
    """script -> (help must mention, [argv of an offline run], JSON status it prints)."""
    return {
        "tinker_sft.py": ("--rehearse", ["--dry-run", "--tokenizer", tok], "dry_run"),
        "tinker_rl.py": ("--max-in-flight", ["--dry-run", "--tokenizer", tok], "dry_run"),
        "tinker_dpo.py": ("--dpo-beta", ["--dry-run", "--data", "pairs.jsonl", "--tokenizer", tok], "dry_run"),
        "tinker_distill.py": ("--teacher", ["--dry-run", "--tokenizer", tok, "--teacher", "Qwen/Qwen3-8B",
                                            "--teacher-tokenizer", tok], "dry_run"),
        "tinker_infer.py": ("--dry-run", ["--dry-run", "--prompt", "hi", "--tokenizer", tok], "dry_run"),
        # no dry run: resolving a run record's checkpoint reads the record offline, no Tinker call
        "tinker_checkpoints.py": ("merge", ["resolve", "runs/sft", "--kind", "sampler"], None),
        # no dry run either: the report of a run record, written offline (plotly is its one dependency)
        "tinker_report.py": ("--watch", ["runs/sft"], "ok"),
        "tinker_eval.py": ("--checkpoint", ["--run", "runs/sft", "--data", "heldout.jsonl", "--dry-run",
                                            "--tokenizer", tok], "dry_run"),
    }


def write_finished_run(folder, fmt=None):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_name": "Qwen/Qwen3-8B"}))
    (folder / "checkpoints.jsonl").write_text(json.dumps(
        {"name": "final", "step": 4, "next_batch": 4, "epoch": 0, "state_path": "tinker://r/weights/final",
         "sampler_path": "tinker://r/sampler_weights/final", "format": fmt, "time": "2026-12-01T00:00:00+00:00"})
        + "\n")


def chat_format_of(tok):
    """The format tinker_sft.py records for a chat run with this tokenizer (what tinker_eval.py samples in)."""
    import tinker_sft

    return {**tinker_sft.chat_format(tinker_sft.load_tokenizer(tok), name=tok), "kind": "chat"}


@pytest.mark.parametrize("with_pricing", [False, True], ids=["alone", "with-pricing"])
@pytest.mark.parametrize("script", SPLICED)
def test_a_script_copied_into_an_empty_folder_runs_help_and_its_dry_run(script, with_pricing, tmp_path,
                                                                        offline_tokenizer):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "scripts" / script, project / script)
    if with_pricing:
        shutil.copy(ROOT / "scripts" / "tinker_pricing.py", project / "tinker_pricing.py")
    must_mention, argv, status = dry_runs(offline_tokenizer("Qwen3-8B"))[script]
    shutil.copy(PAIRS, project / "pairs.jsonl")
    shutil.copy(ROOT / "templates" / "sft_example.jsonl", project / "heldout.jsonl")
    write_finished_run(project / "runs" / "sft", chat_format_of(offline_tokenizer("Qwen3-8B")))
    # nothing from this repository on the path: no PYTHONPATH, the folder itself is the script's only neighbour
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1",
           "TINKER_TELEMETRY": "0"}

    def run(*args):
        return subprocess.run([sys.executable, script, *args], cwd=project, env=env, capture_output=True,
                              text=True, timeout=300)

    helped = run("--help")
    assert helped.returncode == 0 and must_mention in helped.stdout, helped.stderr[-2000:]
    out = run(*argv)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if status is None:  # tinker_checkpoints.py resolve: the run's final sampler path
        assert "tinker://r/sampler_weights/final" in out.stdout
        return
    assert result["status"] == status
    if script == "tinker_report.py":  # prices nothing: the page of the finished run, beside it
        assert result["kind"] == "sft" and (project / "runs" / "sft" / "report.html").is_file()
        return
    unpriced = "no dollar estimate: tinker_pricing.py is not beside this script" in out.stderr
    assert unpriced is not with_pricing, out.stderr[-2000:]
    cost = result.get("cost", result.get("estimate_usd"))
    assert (cost is not None) is with_pricing, result

TRAINING = ("tinker_sft.py", "tinker_rl.py", "tinker_dpo.py", "tinker_distill.py")


@pytest.fixture
def capabilities_only_tinker():
    """An address that answers Tinker's free capabilities call (Qwen/Qwen3-8B) and nothing else: a real run
    reaches its budget check, and any paid call would fail loudly."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            free = {"/api/v1/get_server_capabilities": {"supported_models": [
                        {"model_name": "Qwen/Qwen3-8B", "max_context_length": 32768}]},
                    "/api/v1/create_session": {"type": "create_session", "session_id": "fake"},
                    "/api/v1/session_heartbeat": {"type": "session_heartbeat"}}
            if self.headers.get("Content-Length"):
                self.rfile.read(int(self.headers["Content-Length"]))
            path = self.path.split("?", 1)[0]
            body = free.get(path, {} if path.startswith("/api/v1/client/") else None)  # the SDK's own flags
            self.send_response(404 if body is None else 200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body or {}).encode())

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("script", TRAINING)
def test_a_training_script_copied_alone_refuses_max_usd_in_its_dry_run_as_its_real_run_does(
        script, tmp_path, offline_tokenizer, capabilities_only_tinker):
    """The dry run is the audit of the real run: without tinker_pricing.py beside the copy both stop with exit 3
    and the same line, naming the file to copy; with it beside the copy the dry run checks the budget."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "scripts" / script, project / script)
    shutil.copy(PAIRS, project / "pairs.jsonl")
    _, argv, _ = dry_runs(offline_tokenizer("Qwen3-8B"))[script]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1",
           "TINKER_TELEMETRY": "0", "TINKER_API_KEY": "tml-dummy", "TINKER_BASE_URL": capabilities_only_tinker}

    def run(*args):
        return subprocess.run([sys.executable, script, *args], cwd=project, env=env, capture_output=True,
                              text=True, timeout=300)

    if script == "tinker_sft.py":  # the real run of the built-in set is --rehearse, a local-backend preset
        shutil.copy(ROOT / "templates" / "sft_example.jsonl", project / "sft.jsonl")
        argv = [*argv, "--data", "sft.jsonl"]
    if script == "tinker_rl.py":  # 127.0.0.1 reads as the local backend: its rehearsal samples before the budget
        argv = [*argv, "--rehearse", "off"]
    expected = ("error: cannot check --max-usd: tinker_pricing.py (the prices) is not beside this script; copy the "
                f"bundle's scripts/tinker_pricing.py into {project.resolve()}, or drop --max-usd")
    dry = run(*argv, "--max-usd", "100")
    real = run(*[a for a in argv if a != "--dry-run"], "--max-usd", "100")
    assert (dry.returncode, real.returncode) == (3, 3), (dry.stderr[-1500:], real.stderr[-1500:])
    assert dry.stderr.strip().splitlines()[-1] == expected
    assert real.stderr.strip().splitlines()[-1] == expected
    assert not (project / "runs").exists() or not any((project / "runs").rglob("metrics.jsonl"))
    shutil.copy(ROOT / "scripts" / "tinker_pricing.py", project / "tinker_pricing.py")
    over = run(*argv, "--max-usd", "0.000001")  # priced now: the dry run checks the budget the real run would
    assert over.returncode == 3 and "exceeds --max-usd" in over.stderr, over.stderr[-1500:]
    assert run(*argv, "--max-usd", "100").returncode == 0


# ---- printed next commands (common/errors.py): runnable from where the user stands


def test_a_next_command_names_the_neighbour_as_the_user_typed_the_script_and_wraps_the_local_launcher(
        monkeypatch, tmp_path):
    import shlex
    import shutil

    import tinker_sft
    py = shlex.quote(sys.executable)  # the interpreter running the script, never a bare `python`
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("TINKER_LOCAL_LAUNCHER", raising=False)
    monkeypatch.setattr(sys, "argv", ["scripts/tinker_sft.py", "--data", "my data.jsonl"])
    assert tinker_sft.script_command("tinker_infer.py", "--run", "runs/a b") == \
        f"{py} scripts/tinker_infer.py --run 'runs/a b'"
    assert tinker_sft.this_command() == f"{py} scripts/tinker_sft.py --data 'my data.jsonl'"
    monkeypatch.setenv("TINKER_LOCAL_LAUNCHER", str(ROOT / "scripts" / "tinker_local.py"))
    assert tinker_sft.script_command("tinker_infer.py", "--run", "runs/x") == \
        f"{py} scripts/tinker_local.py run -- {py} scripts/tinker_infer.py --run runs/x"
    # a copy in a project without tinker_infer.py beside it: the bundle's, found beside the launcher
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy2(ROOT / "scripts" / "tinker_sft.py", project / "tinker_sft.py")
    monkeypatch.chdir(project)
    monkeypatch.setattr(tinker_sft, "__file__", str(project / "tinker_sft.py"))
    monkeypatch.setattr(sys, "argv", ["tinker_sft.py"])
    assert tinker_sft.script_command("tinker_infer.py") == (
        f"{py} {ROOT / 'scripts' / 'tinker_local.py'} run -- {py} {ROOT / 'scripts' / 'tinker_infer.py'}")
    shutil.copy2(ROOT / "scripts" / "tinker_infer.py", project / "tinker_infer.py")
    assert tinker_sft.script_command("tinker_infer.py") == \
        f"{py} {ROOT / 'scripts' / 'tinker_local.py'} run -- {py} tinker_infer.py"
