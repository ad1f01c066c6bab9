"""Tests that keep SKILL.md and references/ true of the code and of the installed SDK.

What they prove, whatever documents exist at the time:
- SKILL.md loads in agent skill loaders (frontmatter) and stays a router (<= 200 lines,
  sections in order, <= 12 gotchas, every reference linked with a "read when" condition);
- every relative link and anchor resolves;
- every ```python block compiles, and every SDK name it uses (`tinker.X`, `types.X`, methods
  and fields of the clients, futures and responses) exists, is not deprecated in the installed
  `tinker`, and is called with keyword arguments its signature accepts: a rename fails here;
- blocks whose first line is `# runs-against-local-backend` run against the local backend;
- every price and context window quoted in the docs equals the pricing script's catalogue;
- every `--flag` the docs give a script exists in that script's `--help`.
"""
from __future__ import annotations

import ast
import builtins
import collections.abc
import dataclasses
import functools
import inspect
import os
import re
import subprocess
import sys
import types as pytypes
import typing
from pathlib import Path

import pytest
import tinker
import tinker.types

ROOT = Path(__file__).resolve().parent.parent
SKILL = ROOT / "SKILL.md"
REFERENCES = ROOT / "references"
SCRIPTS = ROOT / "scripts"
RUN_MARKER = "# runs-against-local-backend"
# Every shipped script, whichever exist now (a doc naming a script that is gone fails below).
SCRIPT_NAMES = tuple(sorted({"tinker_sft", "tinker_rl", "tinker_infer", "tinker_pricing", "tinker_local"}
                            | {p.stem for p in SCRIPTS.glob("tinker_*.py")}))


# --------------------------------------------------------------------------- markdown helpers

def doc_files() -> list[Path]:
    return [SKILL, *sorted(REFERENCES.glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@dataclasses.dataclass
class Block:
    path: Path
    lang: str
    line: int  # 1-based line of the first code line
    code: str

    @property
    def id(self) -> str:
        return f"{rel(self.path)}:{self.line}"


def split_markdown(text: str) -> tuple[list[tuple[str, int, str]], list[tuple[int, str]]]:
    """Return (fenced blocks as (lang, first_line, code), prose lines as (lineno, line))."""
    blocks, prose = [], []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if m:
            indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
            body, j = [], i + 1
            while j < len(lines) and not re.match(rf"^\s*{re.escape(fence)}\s*$", lines[j]):
                line = lines[j]
                body.append(line[indent:] if line[:indent].strip() == "" else line)
                j += 1
            blocks.append((lang, i + 2, "\n".join(body) + "\n"))
            i = j + 1
            continue
        prose.append((i + 1, lines[i]))
        i += 1
    return blocks, prose


def code_blocks(langs: tuple[str, ...]) -> list[Block]:
    found = []
    for path in doc_files():
        blocks, _ = split_markdown(path.read_text(encoding="utf-8"))
        found += [Block(path, lang, line, code) for lang, line, code in blocks if lang in langs]
    return found


def strip_code_spans(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)


def headings(text: str) -> list[tuple[int, str]]:
    _, prose = split_markdown(text)
    return [(len(m.group(1)), m.group(2).strip()) for _, line in prose
            if (m := re.match(r"^(#{1,6})\s+(.*)$", line))]


def github_slug(title: str) -> str:
    title = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", title.strip().lower())
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
    title = re.sub(r"[^\w\- ]", "", title)
    return title.replace(" ", "-")


def frontmatter(text: str) -> dict:
    import yaml  # a dependency of transformers, itself a runtime dependency of the bundle

    m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert m, "SKILL.md must open with a '---' YAML frontmatter block"
    data = yaml.safe_load(m.group(1))
    assert isinstance(data, dict), "frontmatter must be a YAML mapping"
    return data


def markdown_tables(text: str) -> list[tuple[int, list[str], list[tuple[int, list[str]]]]]:
    """Tables as (first line, header cells, [(lineno, cells)]), outside code blocks."""
    _, prose = split_markdown(text)
    tables, run = [], []

    def flush():
        if len(run) >= 2 and re.match(r"^\s*\|?\s*:?-{3,}", run[1][1]):
            header = split_row(run[0][1])
            tables.append((run[0][0], header, [(n, split_row(l)) for n, l in run[2:]]))
        run.clear()

    previous = None
    for lineno, line in prose:
        if line.lstrip().startswith("|") and (previous is None or lineno == previous + 1 or not run):
            run.append((lineno, line))
        else:
            flush()
            if line.lstrip().startswith("|"):
                run.append((lineno, line))
        previous = lineno
    flush()
    return tables


def split_row(line: str) -> list[str]:
    line = line.strip()
    if line.startswith("|"):
        line = line[1:]
    if line.endswith("|"):
        line = line[:-1]
    cells, cur, in_code = [], "", False
    i = 0
    while i < len(line):
        ch = line[i]
        if ch == "`":
            in_code = not in_code
        if ch == "\\" and i + 1 < len(line) and line[i + 1] == "|":
            cur += "|"
            i += 2
            continue
        if ch == "|" and not in_code:
            cells.append(cur.strip())
            cur = ""
        else:
            cur += ch
        i += 1
    cells.append(cur.strip())
    return cells


# --------------------------------------------------------------------------- SKILL.md shape

def test_skill_frontmatter_is_valid_for_skill_loaders():
    text = SKILL.read_text(encoding="utf-8")
    meta = frontmatter(text)
    assert set(meta) >= {"name", "description"}, f"frontmatter keys: {sorted(meta)}"
    name, description = meta["name"], meta["description"]
    assert name == "tinker-training-inference"
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name) and len(name) <= 64
    assert isinstance(description, str) and 0 < len(description) <= 1024, len(description)
    assert "<" not in description and ">" not in description
    assert re.search(r"\bUse when\b", description), "description must say when to use the skill"


def test_skill_is_a_router_of_at_most_200_lines():
    lines = SKILL.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"SKILL.md has {len(lines)} lines; move detail into references/"


def test_skill_sections_come_in_the_documented_order():
    titles = [t.lower() for level, t in headings(SKILL.read_text(encoding="utf-8")) if level == 2]
    wanted = ["do this first", "pick a path", "scripts", "gotchas", "references"]
    positions = []
    for w in wanted:
        hits = [i for i, t in enumerate(titles) if t.startswith(w)]
        assert hits, f"SKILL.md has no '## {w.capitalize()}...' section; sections: {titles}"
        positions.append(hits[0])
    assert positions == sorted(positions), f"sections out of order: {titles}"


def section_lines(text: str, title_prefix: str) -> list[str]:
    lines, out, inside = text.splitlines(), [], False
    for line in lines:
        if re.match(r"^##\s", line):
            inside = line[2:].strip().lower().startswith(title_prefix)
            continue
        if inside:
            out.append(line)
    return out


def test_skill_lists_at_most_12_gotchas():
    items = [l for l in section_lines(SKILL.read_text(encoding="utf-8"), "gotchas")
             if re.match(r"^(\d+\.|[-*])\s", l)]
    assert 1 <= len(items) <= 12, f"{len(items)} gotchas; the issue allows at most 12"


def test_every_reference_is_linked_from_skill_with_a_read_when_condition():
    text = SKILL.read_text(encoding="utf-8")
    _, prose = split_markdown(text)
    for ref in sorted(REFERENCES.glob("*.md")):
        target = f"references/{ref.name}"
        rows = [l for _, l in prose if re.search(rf"\]\({re.escape(target)}(#[^)]*)?\)", l)]
        assert rows, f"SKILL.md does not link {target}"
        assert any(re.search(r"\bwhen\b", strip_code_spans(r), re.I) for r in rows), (
            f"SKILL.md links {target} without a 'read when' condition")


@pytest.mark.parametrize("ref", sorted(REFERENCES.glob("*.md")), ids=lambda p: p.name)
def test_reference_opens_with_read_this_when(ref):
    _, prose = split_markdown(ref.read_text(encoding="utf-8"))
    body = [l.strip() for _, l in prose if l.strip()]
    assert body and body[0].startswith("# "), f"{ref.name} must open with a '# Title'"
    assert body[1].startswith("Read this when"), f"{ref.name}: line after the title: {body[1]!r}"


# --------------------------------------------------------------------------- links

LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")


def anchors_of(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in headings(path.read_text(encoding="utf-8")):
        slug = github_slug(title)
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


@pytest.mark.parametrize("doc", [p for p in [*doc_files(), ROOT / "README.md"] if p.exists()],
                         ids=rel)
def test_relative_links_and_anchors_resolve(doc):
    _, prose = split_markdown(doc.read_text(encoding="utf-8"))
    broken = []
    for lineno, line in prose:
        for _, target in LINK.findall(strip_code_spans(line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # http:, https:, mailto:
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if not dest.exists():
                broken.append(f"{rel(doc)}:{lineno}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
                broken.append(f"{rel(doc)}:{lineno}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


# --------------------------------------------------------------------------- SDK names in code

MODULE_NAMES = {"tinker": tinker, "tinker.types": tinker.types}
BACKCOMPAT_RESULT = {
    tinker.BackcompatTrainingClientFuture: tinker.TrainingClient,
    tinker.BackcompatSamplingClientFuture: tinker.SamplingClient,
}
# Conventional variable names documents use without showing where the object came from.
NAME_HINTS = {
    "service_client": tinker.ServiceClient,
    "training_client": tinker.TrainingClient,
    "sampling_client": tinker.SamplingClient,
    "rest_client": tinker.RestClient,
}
# Keyword arguments the SDK still accepts but has deprecated (it warns or ignores them).
DEPRECATED_KEYWORDS = {
    ("save_weights_and_get_sampling_client", "name"),
    ("forward_backward_custom", "loss_type_input"),
}


def is_sdk(obj) -> bool:
    mod = getattr(obj, "__module__", "") or ""
    return mod == "tinker" or mod.startswith("tinker.")


def origin_of(tp):
    return typing.get_origin(tp) or tp


@functools.lru_cache(maxsize=None)
def _namespace(module_name: str) -> dict:
    ns = {}
    ns.update(vars(typing))
    ns.update(vars(collections.abc))
    ns.update(vars(builtins))
    ns.update({k: v for k, v in vars(tinker.types).items() if not k.startswith("_")})
    ns.update({k: v for k, v in vars(tinker).items() if not k.startswith("_")})
    mod = sys.modules.get(module_name)
    if mod is not None:
        ns.update(vars(mod))
    return ns


def annotations_of(obj) -> dict[str, object]:
    """Annotations evaluated one by one; an annotation that cannot be evaluated is left out."""
    raw: dict[str, object] = {}
    owners = reversed(inspect.getmro(obj)) if inspect.isclass(obj) else [obj]
    for owner in owners:
        try:
            raw.update({k: (v, getattr(owner, "__module__", "")) for k, v in
                        inspect.get_annotations(owner).items()})
        except Exception:
            pass
    out = {}
    for key, (value, module) in raw.items():
        if isinstance(value, str):
            try:
                value = eval(value, _namespace(module))  # noqa: S307 - SDK annotations only
            except Exception:
                continue
        out[key] = value
    return out


def strip_optional(tp):
    if typing.get_origin(tp) in (typing.Union, pytypes.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return strip_optional(args[0])
        return None
    return tp


def has_member(cls, name: str) -> bool:
    if hasattr(cls, name) or name in getattr(cls, "model_fields", {}):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    return name in annotations_of(cls)


def deprecated(obj) -> bool:
    return bool(getattr(obj, "__deprecated__", None))


# A static type: ("mod", module) | ("cls", class) | ("inst", type) | ("fn", callable, owner type)
class SdkChecker(ast.NodeVisitor):
    """Walks one code block in source order, infers SDK types and records misuses."""

    def __init__(self) -> None:
        self.env: dict[str, tuple] = {}
        self.errors: list[str] = []

    # ---- statements
    def bind(self, target, tp) -> None:
        if isinstance(target, ast.Name):
            if tp is None and target.id in NAME_HINTS:
                tp = ("inst", NAME_HINTS[target.id])
            if tp is None:
                self.env.pop(target.id, None)
            else:
                self.env[target.id] = tp
        elif isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                self.bind(elt, None)
        else:
            self.infer(target)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name == "tinker" or alias.name.startswith("tinker."):
                try:
                    mod = __import__(alias.name, fromlist=["_"])
                except ImportError:
                    self.error(node, f"module {alias.name} does not exist in tinker {tinker.__version__}")
                    continue
                if alias.asname:
                    self.env[alias.asname] = ("mod", mod)
                else:
                    self.env["tinker"] = ("mod", tinker)

    def visit_ImportFrom(self, node):
        if not node.module or not (node.module == "tinker" or node.module.startswith("tinker.")):
            return
        try:
            mod = __import__(node.module, fromlist=["_"])
        except ImportError:
            self.error(node, f"module {node.module} does not exist in tinker {tinker.__version__}")
            return
        for alias in node.names:
            if not hasattr(mod, alias.name):
                self.error(node, f"{node.module} has no name {alias.name!r}")
                continue
            self.env[alias.asname or alias.name] = self.classify(getattr(mod, alias.name), None)

    def visit_Assign(self, node):
        tp = self.infer(node.value)
        for target in node.targets:
            self.bind(target, tp)

    def visit_AnnAssign(self, node):
        tp = self.infer(node.value) if node.value else None
        ann = self.infer(node.annotation)
        if ann and ann[0] == "cls":
            tp = ("inst", ann[1])
        self.bind(node.target, tp)

    def visit_For(self, node):
        self.bind(node.target, self.element_of(self.infer(node.iter)))
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    visit_AsyncFor = visit_For

    def visit_With(self, node):
        for item in node.items:
            tp = self.infer(item.context_expr)
            if item.optional_vars is not None:
                self.bind(item.optional_vars, tp)  # SDK clients return self from __enter__
        for stmt in node.body:
            self.visit(stmt)

    visit_AsyncWith = visit_With

    def visit_FunctionDef(self, node):
        saved = dict(self.env)
        for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            ann = self.infer(arg.annotation) if arg.annotation else None
            self.bind(ast.Name(id=arg.arg), ("inst", ann[1]) if ann and ann[0] == "cls" else None)
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d]:
            self.infer(default)
        for stmt in node.body:
            self.visit(stmt)
        self.env = saved

    visit_AsyncFunctionDef = visit_FunctionDef

    def generic_visit(self, node):
        if isinstance(node, ast.expr):
            self.infer(node)
            return
        super().generic_visit(node)

    # ---- expressions
    def error(self, node, message: str) -> None:
        self.errors.append(f"line {getattr(node, 'lineno', '?')}: {message}")

    def classify(self, obj, owner):
        if isinstance(obj, pytypes.ModuleType):
            return ("mod", obj)
        if inspect.isclass(obj):
            return ("cls", obj)
        if callable(obj):
            return ("fn", obj, owner)
        return None

    def element_of(self, tp):
        if not tp or tp[0] != "inst":
            return None
        origin, args = typing.get_origin(tp[1]), typing.get_args(tp[1])
        if origin in (list, tuple, set, collections.abc.Sequence, typing.Sequence) and args:
            inner = strip_optional(args[0])
            return ("inst", inner) if inner is not None else None
        return None

    def member(self, node, tp, attr):
        kind = tp[0]
        if kind == "mod":
            mod = tp[1]
            if not hasattr(mod, attr):
                try:
                    sub = __import__(f"{mod.__name__}.{attr}", fromlist=["_"])
                    return ("mod", sub)
                except ImportError:
                    self.error(node, f"{mod.__name__}.{attr} does not exist in tinker {tinker.__version__}")
                    return None
            obj = getattr(mod, attr)
            if deprecated(obj):
                self.error(node, f"{mod.__name__}.{attr} is deprecated in tinker {tinker.__version__}")
            return self.classify(obj, None)
        if kind in ("cls", "inst"):
            cls = origin_of(tp[1])
            if not inspect.isclass(cls) or not is_sdk(cls):
                return None
            if not has_member(cls, attr):
                what = "method or field"
                self.error(node, f"{cls.__name__} has no {what} {attr!r} in tinker {tinker.__version__}")
                return None
            raw = inspect.getattr_static(cls, attr, None)
            obj = getattr(cls, attr, None)
            if deprecated(obj) or deprecated(raw):
                hint = ""
                if cls in BACKCOMPAT_RESULT:
                    hint = " (call .result() on the future first)"
                self.error(node, f"{cls.__name__}.{attr} is deprecated in tinker {tinker.__version__}{hint}")
            if isinstance(raw, property):
                ret = annotations_of(raw.fget).get("return")
                ret = strip_optional(ret) if ret is not None else None
                return ("inst", ret) if ret is not None else None
            if obj is not None and callable(obj) and not inspect.isclass(obj):
                return ("fn", obj, tp[1] if kind == "inst" else None)
            if obj is not None and inspect.isclass(obj):
                return ("cls", obj)
            field_tp = annotations_of(cls).get(attr)
            field_tp = strip_optional(field_tp) if field_tp is not None else None
            return ("inst", field_tp) if field_tp is not None else None
        return None

    def check_keywords(self, node, fn, name: str) -> None:
        keywords = [k.arg for k in node.keywords if k.arg]
        for k in keywords:
            if (name, k) in DEPRECATED_KEYWORDS:
                self.error(node, f"{name}({k}=...) is deprecated in tinker {tinker.__version__}")
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return
        params = sig.parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return
        for k in keywords:
            if k not in params or params[k].kind is inspect.Parameter.POSITIONAL_ONLY:
                self.error(node, f"{name}() takes no keyword {k!r} in tinker {tinker.__version__}; "
                                 f"it takes {', '.join(p for p in params if p != 'self')}")

    def future_result(self, tp):
        if not tp or tp[0] != "inst":
            return None
        cls = origin_of(tp[1])
        if cls in BACKCOMPAT_RESULT:
            return ("inst", BACKCOMPAT_RESULT[cls])
        if inspect.isclass(cls) and issubclass(cls, tinker.APIFuture):
            args = typing.get_args(tp[1])
            if args:
                inner = strip_optional(args[0])
                return ("inst", inner) if inner is not None else None
        return None

    def infer(self, node):
        if node is None:
            return None
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            if node.id in NAME_HINTS:
                return ("inst", NAME_HINTS[node.id])
            return None
        if isinstance(node, ast.Attribute):
            base = self.infer(node.value)
            return self.member(node, base, node.attr) if base else None
        if isinstance(node, ast.Call):
            ft = self.infer(node.func)
            for arg in node.args:
                self.infer(arg)
            for kw in node.keywords:
                self.infer(kw.value)
            if not ft:
                return None
            if ft[0] == "cls":
                if is_sdk(ft[1]):
                    self.check_keywords(node, ft[1], ft[1].__name__)
                return ("inst", ft[1])
            if ft[0] == "fn":
                fn, owner = ft[1], ft[2]
                name = getattr(fn, "__name__", "?")
                if is_sdk(fn) or (owner is not None and is_sdk(origin_of(owner))):
                    self.check_keywords(node, fn, name)
                if name in ("result", "result_async") and owner is not None:
                    return self.future_result(("inst", owner))
                ret = annotations_of(fn).get("return")
                ret = strip_optional(ret) if ret is not None else None
                return ("inst", ret) if ret is not None else None
            return None
        if isinstance(node, ast.Await):
            tp = self.infer(node.value)
            return self.future_result(tp)
        if isinstance(node, ast.Subscript):
            tp = self.infer(node.value)
            self.infer(node.slice)
            if tp and tp[0] == "inst":
                origin, args = typing.get_origin(tp[1]), typing.get_args(tp[1])
                if origin in (dict, collections.abc.Mapping, typing.Mapping) and len(args) == 2:
                    inner = strip_optional(args[1])
                    return ("inst", inner) if inner is not None else None
                if not isinstance(node.slice, ast.Slice):
                    return self.element_of(tp)
                return tp
            return None
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            saved = dict(self.env)
            for gen in node.generators:
                self.bind(gen.target, self.element_of(self.infer(gen.iter)))
                for cond in gen.ifs:
                    self.infer(cond)
            if isinstance(node, ast.DictComp):
                self.infer(node.key)
                self.infer(node.value)
            else:
                self.infer(node.elt)
            self.env = saved
            return None
        if isinstance(node, ast.Lambda):
            return None
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.infer(child)
        return None


def sdk_errors(code: str) -> list[str]:
    tree = ast.parse(code)
    checker = SdkChecker()
    for stmt in tree.body:
        checker.visit(stmt)
    return checker.errors


PYTHON_BLOCKS = code_blocks(("python", "py"))


def test_sdk_checker_catches_renamed_methods_stale_fields_and_missing_results():
    """The checker itself: each misuse the docs must never show is reported."""
    code = (
        "import tinker\n"
        "from tinker import types\n"
        "sc = tinker.ServiceClient()\n"
        "tc = sc.create_lora_training_client(base_model='Qwen/Qwen3-8B', rank=32).result()\n"
        "fwd = tc.forward_backward([], 'cross_entropy').result()\n"
        "print(fwd.loss)\n"                                          # no .loss in 0.38
        "tc.save_weights_and_get_sampling_client(name='x')\n"        # deprecated keyword
        "tc.load_state('tinker://x/weights/y')\n"                   # deprecated method
        "tc.get_checkpoint_archive_url('p')\n"                      # removed method
        "p = types.SamplingParams(max_new_tokens=8)\n"               # wrong field
        "f = tc.optim_step(types.AdamParams(learning_rate=1e-4))\n"
        "f.metrics\n"                                                # forgot .result()
        "t2 = sc.create_lora_training_client(base_model='m')\n"
        "t2.forward_backward([], 'cross_entropy')\n"                 # future used as client
        "ok = tc.save_state('s').result().path\n"
        "x = tinker.NoSuchThing\n"
    )
    errors = "\n".join(sdk_errors(code))
    for line, fragment in [(6, "'loss'"), (7, "name=...) is deprecated"), (8, "load_state is deprecated"),
                           (9, "'get_checkpoint_archive_url'"), (10, "'max_new_tokens'"),
                           (12, "'metrics'"), (14, "call .result()"), (16, "NoSuchThing")]:
        assert f"line {line}: " in errors and fragment in errors, (line, fragment, errors)
    assert "line 15" not in errors and "line 5" not in errors and "line 11" not in errors, errors


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_block_compiles_and_uses_only_current_sdk_names(block):
    try:
        compile(block.code, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        pytest.fail(f"{block.id}: does not compile: {exc}")
    errors = sdk_errors(block.code)
    assert not errors, f"{block.id} (line numbers within the block):\n" + "\n".join(errors)


RUNNABLE = [b for b in PYTHON_BLOCKS if b.code.lstrip().startswith(RUN_MARKER)]


def test_docs_have_at_least_one_block_that_runs_against_the_local_backend():
    assert RUNNABLE, f"mark a python block in SKILL.md or references/ with '{RUN_MARKER}'"


@pytest.mark.e2e
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_marked_python_block_runs_against_the_local_backend(block, local_tinker, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {**os.environ, **local_tinker.env}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


# --------------------------------------------------------------------------- prices and windows

MODEL_ID = re.compile(r"`([A-Za-z0-9][\w.-]*/[\w.-]+(?::peft:\d+)?(?::[\w-]+)?)`")
PRICE_FIELDS = ("prefill", "cached_prefill", "sample", "train")


@functools.lru_cache(maxsize=1)
def catalogue() -> dict[str, dict]:
    """The pricing script's dated snapshot as {tinker id: row}; never a local refresh override."""
    import tinker_pricing  # scripts/ is on pythonpath (pyproject)

    return {row["id"]: row for row in tinker_pricing.SNAPSHOT}


def parse_number(cell: str):
    cell = strip_markup(cell)
    if re.search(r"unknown|not found|not offered|n/a|—|–|^-$|^$", cell, re.I):
        return None
    m = re.match(r"^\$?\s*([\d,]*\.?\d+)\s*([KkMm]?)\b", cell)
    if not m:
        return "unparsed"
    value = float(m.group(1).replace(",", ""))
    unit = m.group(2).upper()
    return value * (1024 if unit == "K" else 1024 * 1024 if unit == "M" else 1)


def strip_markup(cell: str) -> str:
    return re.sub(r"[`*]", "", cell).strip()


def column_role(header: str):
    h = header.lower()
    if "list" in h or "date" in h:
        return None  # list (undiscounted) prices and dates are not billed rates
    if "context" in h or h in ("ctx", "window"):
        return "context"
    if "cached" in h:
        return "cached_prefill"
    if "prefill" in h or h == "input":
        return "prefill"
    if "sample" in h or h == "output":
        return "sample"
    if "train" in h:
        return "train"
    return None


def figures_in(text: str, where: str) -> list[tuple[str, str, str, object]]:
    """(where, model id, field, value) for every price or window a document quotes."""
    figures = []
    for _, header, rows in markdown_tables(text):
        roles = [column_role(h) for h in header]
        if not any(roles):
            continue
        for lineno, cells in rows:
            ids = [m for c in cells for m in MODEL_ID.findall(c)]
            if len(ids) != 1:
                continue
            for role, cell in zip(roles, cells):
                if role is not None:
                    figures.append((f"{where}:{lineno}", ids[0], role, parse_number(cell)))
    _, prose = split_markdown(text)
    for lineno, line in prose:
        if line.lstrip().startswith("|"):
            continue
        ids = set(MODEL_ID.findall(line))
        prices = re.findall(r"\$(\d+(?:\.\d+)?)\s*(?:/\s*1?M\b|per (?:1M|million))", line)
        if len(ids) == 1:
            figures += [(f"{where}:{lineno}", next(iter(ids)), "any-rate", float(p)) for p in prices]
    return figures


def mismatches(figures) -> list[str]:
    cat = catalogue()
    wrong = []
    for where, model, field, value in figures:
        row = cat.get(model)
        if row is None:
            wrong.append(f"{where}: {model} is not in the catalogue")
        elif value == "unparsed":
            wrong.append(f"{where}: cannot read the {field} figure for {model}")
        elif field == "any-rate":
            rates = [row[f] for f in PRICE_FIELDS if row[f] is not None]
            if not any(abs(value - float(r)) < 1e-9 for r in rates):
                wrong.append(f"{where}: ${value}/M for {model} is none of its rates {rates}")
        elif value is None or row[field] is None:
            if (value is None) != (row[field] is None):
                wrong.append(f"{where}: {model} {field} is {value}, catalogue has {row[field]}")
        elif abs(float(row[field]) - value) > 1e-9:
            wrong.append(f"{where}: {model} {field} is {value}, catalogue has {row[field]}")
    return wrong


def test_price_check_accepts_the_catalogue_table_and_catches_a_changed_rate():
    import tinker_pricing

    table = tinker_pricing.markdown_table(tinker_pricing.SNAPSHOT)
    figures = figures_in(table, "generated")
    assert len(figures) >= 5 * 29, len(figures)  # context + four rates for every priced row
    assert mismatches(figures) == []
    qwen = catalogue()["Qwen/Qwen3-8B"]
    stale = ("| model | context | prefill | cached | sample | train |\n|---|---|---|---|---|---|\n"
             f"| `Qwen/Qwen3-8B` | 32K | 0.13 | {qwen['cached_prefill']} | 0.40 | 0.40 |\n"
             "Qwen3-8B (`Qwen/Qwen3-8B`) trains at $0.40/M.\n")
    wrong = mismatches(figures_in(stale, "stale"))
    assert len(wrong) == 4, wrong  # prefill, sample, train in the table, and the inline rate
    assert any("prefill is 0.13" in w for w in wrong)


def test_quoted_prices_and_context_windows_equal_the_catalogue():
    figures = []
    for path in doc_files():
        figures += figures_in(path.read_text(encoding="utf-8"), rel(path))
    if figures:
        wrong = mismatches(figures)
        assert not wrong, "\n".join(wrong)


# --------------------------------------------------------------------------- script flags

@functools.lru_cache(maxsize=None)
def script_help(*argv: str) -> tuple[int, str]:
    script = SCRIPTS / f"{argv[0]}.py"
    if not script.exists():
        return 127, ""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0", "NO_COLOR": "1",
           "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, str(script), *argv[1:], "--help"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


SCRIPT_CALL = re.compile(r"(?:\S*/)?(" + "|".join(SCRIPT_NAMES) + r")\.py\b")


def invocations_in(text: str, where: str) -> list[tuple[str, str, list[str]]]:
    """(where, script, args) for every command line in a document that runs one of the scripts."""
    blocks, prose = split_markdown(text)
    candidates = []
    for lang, line, code in blocks:
        if lang in ("", "bash", "sh", "shell", "console", "text", "zsh"):
            pending, start = "", line
            for offset, physical in enumerate(code.splitlines()):
                if not pending:
                    start = line + offset
                if physical.rstrip().endswith("\\"):
                    pending += physical.rstrip()[:-1] + " "
                    continue
                candidates.append((start, pending + physical))
                pending = ""
    for lineno, line in prose:
        candidates += [(lineno, span) for span in re.findall(r"`([^`]+)`", line)]
    found = []
    for lineno, line in candidates:
        for m in SCRIPT_CALL.finditer(line):
            rest = re.split(r"\s(?:&&|\|\||;|\||--)(?:\s|$)|[#`]", line[m.end():])[0]
            found.append((f"{where}:{lineno}", m.group(1), rest.split()))
    return found


def invocations() -> list[tuple[str, str, list[str]]]:
    found = []
    for path in [*doc_files(), ROOT / "README.md"]:
        if path.exists():
            found += invocations_in(path.read_text(encoding="utf-8"), rel(path))
    return found


def help_path(script: str, args: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """The deepest (sub)command whose --help works, and the flags given to it."""
    path = (script,)
    for token in args:
        if token.startswith("-") or not re.fullmatch(r"[a-z][a-z0-9-]*", token):
            break
        rc, _ = script_help(*path, token)
        if rc != 0:
            break
        path = (*path, token)
    flags = [a.split("=", 1)[0] for a in args if re.match(r"^--[a-z0-9][a-z0-9-]*", a)]
    return path, flags


def has_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def flag_errors(found) -> list[str]:
    wrong = []
    for where, script, args in found:
        if not (SCRIPTS / f"{script}.py").exists():
            wrong.append(f"{where}: scripts/{script}.py does not exist")
            continue
        path, flags = help_path(script, args)
        rc, text = script_help(*path)
        if rc != 0:
            wrong.append(f"{where}: `{' '.join(path)} --help` exits {rc}")
            continue
        wrong += [f"{where}: {' '.join(path)} has no {f}" for f in flags if not has_flag(text, f)]
    return wrong


def test_flag_check_reads_subcommands_and_catches_an_unknown_flag():
    text = ("```bash\n"
            "python scripts/tinker_pricing.py estimate-rl --model Qwen/Qwen3-8B \\\n"
            "    --iterations 50 --group-size 8 --bogus-flag 3\n"
            "```\n"
            "Then `tinker_pricing.py init --out . --force` and `tinker_pricing.py list --json`.\n")
    found = invocations_in(text, "doc")
    assert [(s, a[0]) for _, s, a in found] == [
        ("tinker_pricing", "estimate-rl"), ("tinker_pricing", "init"), ("tinker_pricing", "list")]
    assert flag_errors(found) == ["doc:2: tinker_pricing estimate-rl has no --bogus-flag"]


def test_flags_given_to_scripts_exist_in_their_help():
    wrong = flag_errors(invocations())
    assert not wrong, "\n".join(wrong)


# Flags of other tools the docs may name in prose (pip, the tinker CLI, uv, pytest).
OTHER_TOOLS_FLAGS = {
    "--no-deps", "--ignore-requires-python", "--help", "--format", "--run-id", "--limit",
    "--ttl", "--remove", "--output", "--force", "--repo", "--public", "--type", "--csv",
    "--url-only", "--columns", "--before", "--after",
    "--pid", "--idle", "--async-mode",  # py-spy and pyinstrument (debugging.md)
    "--enable-lora", "--lora-modules", "--lora-paths",  # vLLM and SGLang (checkpoints.md)
    "--extra-body", "--max-connections",  # inspect eval (testing.md; tests/test_eval_harness.py runs it)
    "--dist",  # pytest-xdist (pyproject's addopts; benchmarks/README.md's test suite)
}


def subcommands(script: str, help_text: str) -> set[str]:
    words = {w for group in re.findall(r"\{([a-z0-9,-]+)\}", help_text) for w in group.split(",")}
    words |= set(re.findall(rf"{script}\.py ([a-z][a-z0-9-]+)", help_text))
    return words


def all_script_flags() -> set[str]:
    flags: set[str] = set()
    flag_re = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")
    for script in SCRIPT_NAMES:
        rc, text = script_help(script)
        if rc != 0:
            continue
        flags |= set(flag_re.findall(text))
        for sub in subcommands(script, text):
            rc, sub_text = script_help(script, sub)
            if rc != 0:
                continue
            flags |= set(flag_re.findall(sub_text))
            for subsub in subcommands(script, sub_text) - {sub}:
                rc, deep = script_help(script, sub, subsub)
                if rc == 0:
                    flags |= set(flag_re.findall(deep))
    return flags


def test_flags_named_in_prose_exist_in_some_script_or_tool():
    named = []
    for path in doc_files():
        _, prose = split_markdown(path.read_text(encoding="utf-8"))
        for lineno, line in prose:
            for span in re.findall(r"`([^`]+)`", line):
                if re.search(r"\.py\b|\bpip\b|\btinker\s+[a-z]", span):
                    continue  # whole commands are checked against their own --help above
                named += [(f"{rel(path)}:{lineno}", f) for f in
                          re.findall(r"(?:^|\s)(--[a-z0-9][a-z0-9-]*)", span)]
    if not named:
        return
    known = all_script_flags() | OTHER_TOOLS_FLAGS
    wrong = [f"{where}: {flag} is in no script's --help" for where, flag in named if flag not in known]
    assert not wrong, "\n".join(wrong)


REQUIRED_REFERENCES = (
    "setup.md", "training-sft.md", "training-rl.md", "agentic-rl.md", "inference.md",
    "checkpoints.md", "hyperparameters.md", "chat-templates.md", "pricing.md",
    "troubleshooting.md", "reference-implementation.md",
)


def test_all_eleven_references_exist():
    missing = [name for name in REQUIRED_REFERENCES if not (REFERENCES / name).exists()]
    assert not missing, f"references/ lacks {missing}"


# --------------------------------------------------------------------------- model ids

MODEL_ORGS = ("Qwen", "meta-llama", "deepseek-ai", "openai", "moonshotai", "nvidia", "zai-org",
              "thinkingmachines")
TINKER_ID = re.compile(r"`((?:" + "|".join(map(re.escape, MODEL_ORGS)) + r")/[\w.-]+(?::peft:\d+)?(?::[\w-]+)?)`")
NOT_SERVED = re.compile(r"retired|not (?:in the catalogue|served)|deprecat", re.I)


def unserved_ids(text: str, where: str) -> list[str]:
    """Backticked Tinker model ids the catalogue does not hold, on a line that does not say so."""
    cat = catalogue()
    _, prose = split_markdown(text)
    return [f"{where}:{lineno}: {model}" for lineno, line in prose for model in TINKER_ID.findall(line)
            if model not in cat and not NOT_SERVED.search(line)]


def test_unserved_id_check_catches_a_retired_id_without_a_note():
    text = ("| `Qwen/Qwen3-32B` | 64 | 3e-4 |\n"
            "| `meta-llama/Llama-3.1-8B` | 128 | retired |\n"
            "Use `Qwen/Qwen3-8B`.\n")
    assert unserved_ids(text, "doc") == ["doc:1: Qwen/Qwen3-32B"]


def test_every_model_id_the_docs_name_is_served_or_marked_retired():
    wrong = []
    for path in doc_files():
        wrong += unserved_ids(path.read_text(encoding="utf-8"), rel(path))
    assert not wrong, "name the retirement on the same line, or use a catalogue id:\n" + "\n".join(wrong)


# --------------------------------------------------------------------------- claims that came back before

def hybrid_family_tokens() -> set[str]:
    """Short family names ("Qwen3.8", "Inkling") of catalogue rows typed Hybrid."""
    return {row["family"].replace(" ", "") for row in catalogue().values()
            if (row.get("type") or "").startswith("Hybrid")}


def test_no_line_calls_a_hybrid_family_always_thinking():
    tokens = hybrid_family_tokens()
    assert {"Qwen3.8", "Inkling"} <= tokens, tokens
    wrong = []
    for path in doc_files():
        _, prose = split_markdown(path.read_text(encoding="utf-8"))
        for lineno, line in prose:
            if not re.search(r"always[- ]think", line, re.I) or re.search(r"hybrid", line, re.I):
                continue
            wrong += [f"{rel(path)}:{lineno}: {tok}" for tok in tokens
                      if re.search(rf"\b{re.escape(tok)}(?![.\d])", line)]
    assert not wrong, "the catalogue lists these as hybrid:\n" + "\n".join(wrong)


def install_lines() -> list[tuple[str, str]]:
    found = []
    for path in [SKILL, REFERENCES / "setup.md"]:
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"pip install\s+'?tinker\b", line):
                found.append((f"{rel(path)}:{lineno}", line))
    return found


def test_install_lines_name_transformers_and_jinja2():
    """transformers 5 does not pull jinja2, which apply_chat_template needs."""
    from importlib.metadata import requires

    assert not any(r.split(";")[0].strip().lower().startswith("jinja2") for r in requires("transformers") or []
                   if "extra ==" not in r)
    lines = install_lines()
    assert len(lines) >= 2, lines
    wrong = [w for w, line in lines if not ("transformers" in line and "jinja2" in line)]
    assert not wrong, wrong


def test_stop_none_is_described_once_with_both_backends():
    homes = []
    for path in doc_files():
        text = " ".join(path.read_text(encoding="utf-8").split())
        for m in re.finditer(r"`stop=None`[^.]*\.", text):
            homes.append((rel(path), m.group(0)))
    describing = [(p, s) for p, s in homes if re.search(r"EOS|end-of-sequence|never stops|max_tokens", s)]
    assert {p for p, _ in describing} == {"references/inference.md"}, describing
    inference = " ".join((REFERENCES / "inference.md").read_text(encoding="utf-8").split())
    assert "implicit EOS stopping" in inference and "local backend" in inference
    import tinker.types._pydantic_types.sampling_params as sdk_params

    # The SDK documents the hosted behaviour in the attribute docstring of SamplingParams.stop.
    assert "``None`` keeps implicit EOS stopping" in inspect.getsource(sdk_params)


def test_setup_time_is_stated_once_with_its_measurement():
    statements = []
    for path in doc_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"setup|from nothing|first time", line, re.I) and \
                    re.search(r"\b\d+\s*(?:to|–|-)\s*\d+\s*min|≈\s*\d+\s*min|about \d+ min", line):
                statements.append(f"{rel(path)}:{lineno}: {line.strip()}")
    assert not statements, "state the measured setup time once (SKILL.md), not a range:\n" + "\n".join(statements)


def test_gsm8k_recipe_reads_as_the_cookbooks_32_groups_of_64():
    text = " ".join((REFERENCES / "hyperparameters.md").read_text(encoding="utf-8").split())
    assert "64 × 32" not in text and "64 x 32" not in text
    assert "GSM8K with 32 groups of 64" in text and "`group_size=64`" in text


def test_no_doc_says_tinker_model_list_shows_a_lora_rank():
    from tinker.cli.commands.model import ModelListOutput
    from tinker.types import SupportedModel

    assert ModelListOutput([]).get_table_columns() == ["Model", "Max Context", "Trainable", "Sampleable"]
    assert not [f for f in SupportedModel.model_fields if "rank" in f]
    wrong = []
    for path in doc_files():
        _, prose = split_markdown(path.read_text(encoding="utf-8"))
        for lineno, line in prose:
            if "tinker model list" in line and re.search(r"\brank\b", line, re.I) \
                    and not re.search(r"no (?:LoRA )?rank|no hosted maximum|no maximum LoRA rank|not .*rank", line, re.I):
                wrong.append(f"{rel(path)}:{lineno}")
    assert not wrong, wrong


DEPRECATED_IN_PROSE = re.compile(r"`[^`]*(?:\b\w+_async\b|\bload_state\w*|ServiceClient\.get_server_capabilities"
                                 r"|create_rest_client)[^`]*`")


def test_deprecated_sdk_forms_appear_in_prose_only_named_as_deprecated():
    wrong = []
    for path in doc_files():
        blocks, prose = split_markdown(path.read_text(encoding="utf-8"))
        for lineno, line in prose:
            for span in DEPRECATED_IN_PROSE.findall(line):
                if re.match(r"`_\w+_async`", span):
                    continue  # SDK-internal task names in a stack dump, not an API to call
                if not re.search(r"deprecat", line, re.I):
                    wrong.append(f"{rel(path)}:{lineno}: {span}")
    assert not wrong, "name these only as deprecated, with the current form:\n" + "\n".join(wrong)


def help_default(script: str, flag: str) -> str:
    _, text = script_help(script)
    m = re.search(rf"^  {re.escape(flag)}(?: [A-Z_]+)?(.*?)(?=\n  -|\Z)", text, re.S | re.M)
    assert m, f"{script} --help has no {flag}"
    d = re.search(r"\(default: ([^)]*)\)", " ".join(m.group(1).split()))
    assert d, f"{script} {flag}: no default in --help"
    return d.group(1)


def test_defaults_the_docs_explain_are_the_scripts_defaults():
    """hyperparameters.md explains each script default that differs from its table: the value
    it quotes must be what --help prints today."""
    text = (REFERENCES / "hyperparameters.md").read_text(encoding="utf-8")
    rows = [cells for _, header, body in markdown_tables(text) if header[:2] == ["script flag", "script default"]
            for _, cells in body]
    assert len(rows) >= 4, rows
    wrong = []
    for cells in rows:
        m = re.fullmatch(r"`(tinker_\w+)\.py (--[\w-]+)`", cells[0])
        assert m, cells[0]
        actual = help_default(m.group(1), m.group(2))
        if float(actual) != float(cells[1]):
            wrong.append(f"{cells[0]}: docs say {cells[1]}, --help says {actual}")
    assert not wrong, wrong


def test_merge_precision_is_stated_per_dtype_and_matches_what_the_tests_merge():
    text = (REFERENCES / "checkpoints.md").read_text(encoding="utf-8")
    rows = {cells[0].strip("`"): cells[1] for _, header, body in markdown_tables(text)
            if header and header[0] == "`--dtype`" for _, cells in body}
    assert {"float32", "bfloat16"} <= set(rows), rows
    assert float(rows["bfloat16"]) > 100 * float(rows["float32"])
    e2e = (ROOT / "tests" / "test_infer_e2e.py").read_text(encoding="utf-8")
    assert '"--dtype", "float32"' in e2e  # the test's figure is the float32 row's
    assert "also what `tests/test_infer_e2e.py` merges" in text


# --------------------------------------------------------------------------- vision.md

def test_vision_table_lists_exactly_the_catalogues_vision_models():
    text = (REFERENCES / "vision.md").read_text(encoding="utf-8")
    section = text[text.index("## Which models take images"):text.index("## An image is an")]
    named = set(TINKER_ID.findall(section))
    vision = {row["id"] for row in catalogue().values()
              if "Vision" in (row.get("type") or "") and row["id"].count(":") == 0}
    assert named == vision, (sorted(named - vision), sorted(vision - named))


def test_vision_placeholder_render_is_what_the_qwen35_template_writes(offline_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(offline_tokenizer("Qwen3.5-4B"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    first_turn = rendered[:rendered.index("<|im_end|>") + len("<|im_end|>")] + "\n"
    text = (REFERENCES / "vision.md").read_text(encoding="utf-8")
    assert first_turn.replace("\n", "\\n") in text
    ids = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    assert ids == [248053, 248056, 248054]
    for i in ids:
        assert str(i) in text
    assert tok.apply_chat_template(messages, tokenize=True, return_dict=False).count(248056) == 1


def paragraphs(path: Path) -> list[str]:
    _, prose = split_markdown(path.read_text(encoding="utf-8"))
    text = "\n".join(line for _, line in prose)
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]


def test_no_line_gives_tml_as_the_only_credential_form():
    wrong = [f"{rel(path)}: {p[:80]}" for path in doc_files() for p in paragraphs(path)
             if re.search(r"(?:must|always|keys?) start(?:s)? with .?tml-|without .?tml-.? (?:always )?fails", p, re.I)
             and not re.search(r"JWT|eyJ", p)]
    assert not wrong, "SDK 0.38 also takes JWTs and TINKER_CREDENTIAL_CMD:\n" + "\n".join(wrong)


def test_no_doc_or_template_prints_a_path_to_placeholder():
    """A command in the docs, and every one the template test file prints, names a real path (issue 44): a
    `PATH/TO/...` placeholder fails when pasted."""
    files = [*doc_files(), ROOT / "README.md", ROOT / "DEVELOPING.md", *sorted((ROOT / "templates").glob("*.py"))]
    found = [f"{rel(path)}:{n}: {line.strip()[:100]}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if "PATH/TO" in line and "`PATH/TO`" not in line]
    assert not found, "placeholders where a real path belongs:\n" + "\n".join(found)


def test_developing_states_the_local_backends_adapter_slots():
    import tinker_local

    slots = tinker_local.MAX_LORA_ADAPTERS - 1  # slot 0 is the base model
    text = " ".join((ROOT / "DEVELOPING.md").read_text(encoding="utf-8").split())
    assert f"{slots} per server" in text and f"MAX_LORA_ADAPTERS = {tinker_local.MAX_LORA_ADAPTERS}" in text
    server_src = (SCRIPTS / "tinker_local_server.py").read_text(encoding="utf-8")  # runs in the server venv
    sampler_slots = int(re.search(r"^SAMPLER_SLOTS = (\d+)", server_src, re.M).group(1))
    assert f"SAMPLER_SLOTS = {sampler_slots}" in text
    assert not re.search(r"\b(?!%d\b)\d+ per server" % slots, text)


def test_overwrite_advice_says_a_retried_save_usually_landed():
    wrong = [f"{rel(path)}: {p[:80]}" for path in doc_files() for p in paragraphs(path)
             if "overwrite=True" in p and "409" in p and "landed" not in p]
    assert not wrong, wrong


def test_no_line_says_every_rl_group_is_in_flight_without_the_bound():
    wrong = [f"{rel(path)}: {p[:80]}" for path in doc_files() for p in paragraphs(path)
             if re.search(r"every group in flight|all groups in flight at once", p, re.I)
             and "max-in-flight" not in p and "benchmarks/" not in p]
    assert not wrong, wrong


# --------------------------------------------------------------------------- debugging.md

def sdk_source_files():
    root = Path(tinker.__file__).parent
    return [p for p in root.rglob("*.py") if not p.name.endswith("_test.py")]


def test_debugging_lists_exactly_the_tinker_environment_variables_the_sdk_reads():
    read = set()
    for path in sdk_source_files():
        read |= set(re.findall(r"""["'](TINKER_[A-Z_]+)["']""", path.read_text(encoding="utf-8")))
    text = " ".join((REFERENCES / "debugging.md").read_text(encoding="utf-8").split())
    m = re.search(r"the only `TINKER_\*` variables it reads are (.*?)\)", text)
    assert m, "debugging.md must list the TINKER_* variables SDK 0.38 reads"
    listed = set(re.findall(r"`(TINKER_[A-Z_]+)`", m.group(1)))
    assert listed == read, (sorted(listed - read), sorted(read - listed))
    assert "TINKER_SUBPROCESS_SAMPLING" not in read


def test_debugging_quotes_the_sdks_heartbeat_warning_and_period():
    src = (Path(tinker.__file__).parent / "lib" / "internal_client_holder.py").read_text(encoding="utf-8")
    assert "SESSION_HEARTBEAT_PERIOD_SEC = 10" in src and "SESSION_MISSED_HEARTBEAT_WARNING_THRESHOLD_SEC = 60 * 2" in src
    assert "Your connection may be unreliable or Tinker is down. If this persists, the session will be terminated." in src
    text = " ".join((REFERENCES / "debugging.md").read_text(encoding="utf-8").split())
    assert "`Session heartbeat failed for N seconds for session SESSION_ID. Last exception: ...`" in text
    assert "`Your connection may be unreliable or Tinker is down. If this persists, the session will be terminated.`" in text
    assert "after 120 s without a successful heartbeat" in text and "heartbeat (every 10 s)" in text


def test_inference_concurrency_figures_are_the_sdks():
    lib = Path(tinker.__file__).parent / "lib"
    holder = (lib / "internal_client_holder.py").read_text(encoding="utf-8")
    sampling = (lib / "public_interfaces" / "sampling_client.py").read_text(encoding="utf-8")
    assert "_sample_dispatch_semaphore: asyncio.Semaphore = asyncio.Semaphore(400)" in holder
    assert "_sample_dispatch_throttled_semaphore: asyncio.Semaphore = asyncio.Semaphore(10)" in holder
    assert "time.monotonic() - self._sample_backoff_until < 10" in holder
    assert "backoff_duration = 1 if estimated_bytes_count <= 128 * 1024 else 5" in sampling
    from tinker.types.client_config_response import ClientConfigResponse

    assert ClientConfigResponse.model_fields["sample_max_concurrent_requests"].default == 2000
    text = " ".join((REFERENCES / "inference.md").read_text(encoding="utf-8").split())
    for phrase in ("at most 400 sample submissions", "(10 at once for 10 s after a 429)",
                   "`sample_max_concurrent_requests` (2000", "for 1 s (5 s for prompts over 128 KiB)"):
        assert phrase in text, phrase


def test_vision_imagechunk_claims_hold_in_the_sdk():
    from tinker import types

    chunk = types.ImageChunk(data=b"\xff\xd8jpeg", format="jpeg", expected_tokens=4)
    model_input = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), chunk,
                                           types.EncodedTextChunk(tokens=[3])])
    assert model_input.length == 2 + 4 + 1
    with pytest.raises(ValueError):
        types.ImageChunk(data=b"x", format="jpeg").length
    with pytest.raises(ValueError):
        model_input.to_ints()
    with pytest.raises(Exception):
        types.ImageChunk(data=b"x", format="gif")
    text = (REFERENCES / "vision.md").read_text(encoding="utf-8")
    assert '`ImageChunk(data=<bytes>, format="png" | "jpeg", expected_tokens=<int or None>)`' in text


def test_setup_apply_chat_template_claim_holds_for_the_installed_transformers(offline_tokenizer):
    """setup.md: tokenize=True returns a BatchEncoding in transformers 5; return_dict=False a list."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(offline_tokenizer("Qwen3-8B"))
    messages = [{"role": "user", "content": "hi"}]
    as_dict = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    as_list = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert isinstance(as_list, list) and all(isinstance(i, int) for i in as_list)
    assert list(as_dict["input_ids"]) == as_list and "attention_mask" in as_dict
    text = " ".join((REFERENCES / "setup.md").read_text(encoding="utf-8").split())
    assert "returns a `BatchEncoding` (a dict with `input_ids`, `attention_mask`)" in text
    assert "pass `return_dict=False`" in text


def test_skill_json_keys_are_keys_the_scripts_emit():
    """Every key SKILL.md lists after 'JSON:' for a script is a dict key in that script's source."""
    bullets = re.split(r"\n- ", "\n".join(section_lines(SKILL.read_text(encoding="utf-8"), "scripts")))
    checked = 0
    for bullet in bullets:
        m = re.match(r"`scripts/(tinker_\w+)\.py", bullet)
        if not m or "JSON:" not in bullet:
            continue
        source = (SCRIPTS / f"{m.group(1)}.py").read_text(encoding="utf-8")
        json_part = " ".join(bullet.split("JSON:", 1)[1].split())
        json_part = re.split(r"\.\s", json_part)[0]
        keys = re.findall(r"`([a-z_]+)`", json_part)
        missing = [k for k in keys if not re.search(rf"""["']{k}["']\s*[:\]]|\b{k}=""", source)]
        assert not missing, f"{m.group(1)}: SKILL.md lists {missing}, which the script never emits"
        checked += 1
    assert checked >= 6, checked
