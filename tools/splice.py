#!/usr/bin/env python3
"""Splice into each script the shared code from common/ that its hand-written part uses, or check that it is there.

Run:
    python tools/splice.py            # rewrite every script's SHARED CODE region from common/
    python tools/splice.py --check    # exit 1 naming each script whose region differs (tests run this)
    python tools/splice.py --explain scripts/tinker_rl.py   # why each spliced definition is there

Why: each copy-and-edit script must run when copied alone into an empty project, yet each shared rule
(run record, resume guard, rendering and masking, stop tokens, errors and exit codes, connection and
cost checks) must have one source. The source is common/*.py; each script carries a generated copy
between these markers, naming the modules it takes definitions from:

    # ==== SHARED CODE (generated from common/: errors, render) ====
    ...
    # ==== END SHARED CODE (sha256 <12 hex of the region>) ====

What is copied: the closure of what the hand-written part (everything outside the region) uses. Each
top-level statement of a common/ module (a def, a class whole, a constant, an import) is one unit; a unit
is copied when a copied unit or the hand-written part refers to a name it binds; a statement that binds
nothing (a call made at import) is copied with its module. Names are followed the way Python resolves them
(symtable): in function bodies and nested functions, in decorators, default arguments, class bases and
class bodies, module-level constants; a name is looked up in the module that
uses it, and a `from other import name  # splice: drop` line leads to the other module. A string constant
that is exactly a shared function, class or constant name counts as a use too (getattr or globals() by
name). Annotations are not followed (the scripts use `from __future__ import annotations`). Units keep
their source order and the comments right above them; modules follow their dependencies (a module after
the ones it imports from, ties alphabetical). Nothing is hard-coded: add a call in a script or a helper
in common/, run this, and the region follows.

Rules for common/ modules: stdlib imports at the top; names from another common module are imported
with a trailing `# splice: drop` (kept importable alone, dropped in the script); no `if __name__`; no
two modules define the same name. The region goes at the end of a script, before its
`if __name__ == "__main__":` line, so hand-written code must not use shared names at import time (inside
functions is fine), and must not define a name the copied shared code also defines (refused here).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import hashlib
import re
import symtable
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ROOT / "common"
SCRIPTS = ROOT / "scripts"
START = re.compile(r"^# ==== SHARED CODE \(generated from common/: ([a-z_, ]+)\) ====$", re.M)
END = re.compile(r"^# ==== END SHARED CODE \(sha256 ([0-9a-f]{12})\) ====$", re.M)
NOTE = ("# Edit the files in common/ of the tinker-training-inference bundle, then run `python tools/splice.py`;\n"
        "# tests/test_shared_code.py fails when this copy differs from its source. Only the definitions the code\n"
        "# above uses (directly or through each other) are copied.\n")
DROP = "# splice: drop"


class SpliceError(Exception):
    """A script or common/ module that cannot be spliced as it stands (one line: what and how to fix)."""


@dataclasses.dataclass
class Unit:
    """One top-level statement: its text (with the comments right above it) and the names it binds and uses."""

    module: str
    index: int
    text: str
    gap: int  # blank lines above it in the source
    binds: set
    uses: set
    strings: set  # string constants that are identifiers (getattr / globals() by name)
    is_import: bool
    node: ast.stmt


def _scope_uses(table) -> set:
    """Names a nested scope looks up in the module namespace (referenced globals, `global` declarations)."""
    out = set()
    for sym in table.get_symbols():
        if sym.is_declared_global() or (sym.is_global() and sym.is_referenced()):
            out.add(sym.get_name())
    for child in table.get_children():
        out |= _scope_uses(child)
    return out


def statement_names(text: str) -> tuple[set, set]:
    """(names bound at module level, module-level names used) by one top-level statement's source."""
    table = symtable.symtable("from __future__ import annotations\n" + text, "<unit>", "exec")
    binds, uses = set(), set()
    for sym in table.get_symbols():
        name = sym.get_name()
        if name == "annotations":
            continue
        if sym.is_local() or sym.is_imported():
            binds.add(name)
        if sym.is_referenced():
            uses.add(name)
    for child in table.get_children():
        uses |= _scope_uses(child)
    return binds, uses


def string_names(node) -> set:
    return {n.value for n in ast.walk(node)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier()}


def units_of(source: str, module: str = "") -> list[Unit]:
    """The top-level statements of a module's source, in order, each with the comment lines right above it."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out, prev_end = [], 0
    for i, node in enumerate(tree.body):
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        above = lines[prev_end:start - 1]
        while above and not above[0].strip():  # blank lines before the comments
            above.pop(0)
        gap = (start - 1 - prev_end) - len(above)
        code = "\n".join(lines[start - 1:node.end_lineno])
        binds, uses = statement_names(code)
        out.append(Unit(module, i, "\n".join(above + [code]), gap, binds, uses, string_names(node),
                        isinstance(node, (ast.Import, ast.ImportFrom)), node))
        prev_end = node.end_lineno
    return out


@dataclasses.dataclass
class Module:
    name: str
    doc: str  # the docstring as comment lines
    units: list
    drops: dict  # name -> module it comes from (`from m import name  # splice: drop`)
    binders: dict  # name -> [unit index], in source order


@functools.lru_cache(maxsize=None)
def _load_module(name: str, src: str) -> Module:
    m = re.match(r'\s*"""(.*?)"""\n', src, re.S)
    doc = ""
    if m:
        doc = "".join(f"# {line}".rstrip() + "\n" for line in m.group(1).strip().splitlines())
        src = src[m.end():]
    drops, kept = {}, []
    for line in src.splitlines():
        if line.rstrip().endswith(DROP):
            node = ast.parse(line.strip()).body[0]
            if not isinstance(node, ast.ImportFrom) or node.level:
                raise SpliceError(f"common/{name}.py: {line.strip()!r}: only `from module import names {DROP}` "
                                  "lines can be dropped")
            for alias in node.names:
                drops[alias.asname or alias.name] = node.module
            kept.append("")  # keep line numbers (and blank-line gaps) as in the source
        elif line.startswith("from __future__ import"):
            kept.append("")
        else:
            kept.append(line)
    units = units_of("\n".join(kept), name)
    binders = {}
    for u in units:
        for n in u.binds:
            binders.setdefault(n, []).append(u.index)
    return Module(name, doc, units, drops, binders)


def load_module(name: str) -> Module:
    path = COMMON / f"{name}.py"
    if not path.exists():
        raise SpliceError(f"common/{name}.py does not exist (named by a `{DROP}` import)")
    return _load_module(name, path.read_text())


def common_modules() -> dict:
    """Every common/ module, in dependency order (a module after those it imports from; ties alphabetical)."""
    names = sorted(p.stem for p in COMMON.glob("*.py"))
    mods = {n: load_module(n) for n in names}
    deps = {n: set(mods[n].drops.values()) - {n} for n in names}
    order = []
    while len(order) < len(names):
        ready = [n for n in names if n not in order and deps[n] <= set(order)]
        if not ready:
            left = [n for n in names if n not in order]
            raise SpliceError(f"common/ modules import each other in a cycle: {', '.join(left)}")
        order.append(ready[0])
    return {n: mods[n] for n in order}


def resolve(mods: dict, module: str, name: str, seen=()) -> list[tuple[str, int]]:
    """The units a module-level `name` in `module` refers to: its own bindings, or through a dropped import
    the other module's; [] for builtins and names nothing binds."""
    mod = mods[module]
    if name in mod.binders:
        return [(module, i) for i in mod.binders[name]]
    if name in mod.drops and (module, name) not in seen:
        source = mod.drops[name]
        if source not in mods:
            raise SpliceError(f"common/{module}.py imports {name} from {source}, which is not in common/")
        found = resolve(mods, source, name, seen + ((module, name),))
        if not found:
            raise SpliceError(f"common/{module}.py imports {name} from common/{source}.py, which does not define it")
        return found
    return []


def resolve_hand_written(mods: dict, name: str, *, strings: bool = False) -> list[tuple[str, int]]:
    """What a name the hand-written part uses (and does not bind) refers to in the shared code: the one
    def, class or constant of that name; else (a module only imported by the shared code, e.g. json) the
    first module's import of it. strings: a string constant, which only ever means a def, class or constant."""
    defs = [(m, i) for m, mod in mods.items() for i in mod.binders.get(name, [])
            if not mod.units[i].is_import]
    if defs:
        modules = sorted({m for m, _ in defs})
        if len(modules) > 1:
            raise SpliceError(f"{name} is defined in more than one common/ module ({', '.join(modules)}); keep one")
        return defs
    if strings:
        return []
    for m, mod in mods.items():
        imports = [(m, i) for i in mod.binders.get(name, []) if mod.units[i].is_import]
        if imports:
            return imports[:1]
    return []


def hand_written(text: str) -> str:
    """A script's text outside its region (what the user edits)."""
    found = find_region(text)
    if found is None:
        return text
    start, end, _ = found
    return text[:start] + text[end:]


def closure(hand: str, mods: dict | None = None) -> dict:
    """{(module, unit index): reason} of every unit the hand-written text needs, directly or transitively.
    A reason is "script uses NAME" or "common/M.py:UNIT uses NAME" (for --explain)."""
    mods = mods or common_modules()
    units = units_of(hand)
    bound = set().union(*(u.binds for u in units)) if units else set()
    needed, queue = {}, []

    def want(targets, reason):
        for t in targets:
            if t not in needed:
                needed[t] = reason
                queue.append(t)

    for u in units:
        for name in sorted(u.uses - bound):
            want(resolve_hand_written(mods, name), f"script uses {name}")
        for name in sorted(u.strings - bound - u.uses):
            want(resolve_hand_written(mods, name, strings=True), f"script names {name!r}")
    while queue:
        while queue:
            module, index = queue.pop()
            unit = mods[module].units[index]
            label = f"common/{module}.py:{unit_label(unit)}"
            for name in sorted(unit.uses):
                want(resolve(mods, module, name), f"{label} uses {name}")
            for name in sorted(unit.strings - unit.uses):
                want([t for t in resolve(mods, module, name) if not mods[t[0]].units[t[1]].is_import],
                     f"{label} names {name!r}")
        # A statement that binds nothing (a call at module level) runs for its effect: it goes with its module.
        for module in sorted({m for m, _ in needed}):
            want([(module, u.index) for u in mods[module].units if not u.binds],
                 f"common/{module}.py runs it on import")
    clashes = sorted(n for (m, i) in needed for n in mods[m].units[i].binds & bound
                     if not mods[m].units[i].is_import)
    if clashes:
        raise SpliceError(f"the hand-written part defines {', '.join(clashes)}, which the copied shared code "
                          "also defines (the shared one would win); rename the script's")
    return needed


def unit_label(unit: Unit) -> str:
    node = unit.node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if unit.binds:
        return ", ".join(sorted(unit.binds))
    code = ast.unparse(node).splitlines()[0]  # a statement run for its effect: its code names it
    return code if len(code) <= 60 else code[:57] + "..."


def import_text(unit: Unit, needed_names: set) -> str:
    """An import statement with only the names something uses (its comments kept when nothing is cut)."""
    node = unit.node
    keep = [a for a in node.names if (a.asname or a.name.split(".")[0]) in needed_names]
    if len(keep) == len(node.names):
        return unit.text
    comments = [line for line in unit.text.splitlines() if line.startswith("#")]
    pruned = type(node)(**{**{f: getattr(node, f) for f in node._fields}, "names": keep})
    return "\n".join(comments + [ast.unparse(pruned)])


def module_section(mod: Module, indices: list[int], used_names: set) -> str:
    parts = []
    for k, i in enumerate(indices):
        unit = mod.units[i]
        text = import_text(unit, used_names) if unit.is_import else unit.text
        if k:
            parts.append("\n" * (min(max(unit.gap, 0), 2) + 1))
        parts.append(text)
    return f"# ---- common/{mod.name}.py ----\n{mod.doc}{''.join(parts)}\n"


def region_for(hand: str) -> str:
    """Full text of the generated region for a script whose hand-written text is `hand`, markers included."""
    mods = common_modules()
    needed = closure(hand, mods)
    if not needed:
        raise SpliceError("the hand-written part uses nothing from common/; remove the SHARED CODE markers")
    # names the copied code (and the script) look up, so an import keeps only the names someone uses
    used = set().union(*(u.uses | u.strings for u in units_of(hand)))
    for m, i in needed:
        used |= mods[m].units[i].uses
    sections, names = [], []
    for name, mod in mods.items():
        indices = sorted(i for m, i in needed if m == name)
        if indices:
            names.append(name)
            sections.append(module_section(mod, indices, used))
    body = NOTE + "\n\n" + "\n\n".join(sections)
    digest = hashlib.sha256(body.encode()).hexdigest()[:12]
    return (f"# ==== SHARED CODE (generated from common/: {', '.join(names)}) ====\n{body}"
            f"# ==== END SHARED CODE (sha256 {digest}) ====")


def find_region(text: str):
    """(start, end, module names) of the region in a script's text, or None."""
    start = START.search(text)
    if not start:
        return None
    end = END.search(text, start.end())
    if not end:
        raise SpliceError("a SHARED CODE start marker without its END marker")
    names = [n.strip() for n in start.group(1).split(",") if n.strip()]
    return start.start(), end.end(), names


def spliced(text: str) -> str:
    found = find_region(text)
    if found is None:
        return text
    start, end, _ = found
    return text[:start] + region_for(text[:start] + text[end:]) + text[end:]


def targets() -> list[Path]:
    return sorted(p for p in SCRIPTS.glob("*.py") if START.search(p.read_text()))


def explain(path: Path) -> None:
    """Print each spliced unit and the first reason it was copied."""
    mods = common_modules()
    needed = closure(hand_written(path.read_text()), mods)
    for name, mod in mods.items():
        for i in sorted(i for m, i in needed if m == name):
            print(f"common/{name}.py:{unit_label(mod.units[i])}  <-  {needed[(name, i)]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if any script's region differs; change nothing")
    p.add_argument("--explain", metavar="SCRIPT", help="print why each definition spliced into SCRIPT is there")
    args = p.parse_args(argv)
    try:
        if args.explain:
            explain(Path(args.explain))
            return 0
        stale = []
        for path in targets():
            text = path.read_text()
            try:
                new = spliced(text)
            except SyntaxError as e:
                raise SpliceError(f"{path.name} line {e.lineno}: {e.msg}") from None
            except SpliceError as e:
                raise SpliceError(f"{path.name}: {e}") from None
            if new != text:
                stale.append(path)
                if not args.check:
                    path.write_text(new)
    except SpliceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rel = [str(p.relative_to(ROOT)) for p in stale]
    if args.check:
        if stale:
            print(f"shared code out of date in {', '.join(rel)}: edit common/, then run python tools/splice.py",
                  file=sys.stderr)
            return 1
        print(f"shared code in sync in {len(targets())} script(s)", file=sys.stderr)
        return 0
    print(f"spliced {', '.join(rel) or 'nothing (all in sync)'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
