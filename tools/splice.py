#!/usr/bin/env python3
"""Splice the shared code in common/ into each script's generated region, or check that it is there.

Run:
    python tools/splice.py            # rewrite every script's SHARED CODE region from common/
    python tools/splice.py --check    # exit 1 naming each script whose region differs (tests run this)

Why: each copy-and-edit script must run when copied alone into an empty project, yet each shared rule
(run record, resume guard, rendering and masking, stop tokens, errors and exit codes, connection and
cost checks) must have one source. The source is common/*.py; each script carries a generated copy
between these markers, listing the modules it takes:

    # ==== SHARED CODE (generated from common/: errors, render) ====
    ...
    # ==== END SHARED CODE (sha256 <12 hex of the region>) ====

Rules for common/ modules: stdlib imports at the top; names from another common module are imported
with a trailing `# splice: drop` (kept importable alone, dropped in the script); no `if __name__`.
The region goes at the end of a script, before its `if __name__ == "__main__":` line, so hand-written
code must not use shared names at import time (inside functions is fine).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ROOT / "common"
SCRIPTS = ROOT / "scripts"
START = re.compile(r"^# ==== SHARED CODE \(generated from common/: ([a-z_, ]+)\) ====$", re.M)
END = re.compile(r"^# ==== END SHARED CODE \(sha256 ([0-9a-f]{12})\) ====$", re.M)
NOTE = ("# Edit the files in common/ of the tinker-training-inference bundle, then run `python tools/splice.py`;\n"
        "# tests/test_shared_code.py fails when this copy differs from its source.\n")


def module_text(name: str) -> str:
    """A common/ module as it appears in a script: docstring as comments, no __future__, no dropped lines."""
    src = (COMMON / f"{name}.py").read_text()
    m = re.match(r'\s*"""(.*?)"""\n', src, re.S)
    doc = ""
    if m:
        doc = "".join(f"# {line}".rstrip() + "\n" for line in m.group(1).strip().splitlines())
        src = src[m.end():]
    lines = [line for line in src.splitlines()
             if not line.startswith("from __future__ import") and not line.rstrip().endswith("# splice: drop")]
    body = "\n".join(lines).strip("\n")
    body = re.sub(r"\n{4,}", "\n\n\n", body)
    return f"# ---- common/{name}.py ----\n{doc}{body}\n"


def region(names: list[str]) -> str:
    """Full text of the generated region, markers included."""
    body = NOTE + "\n\n" + "\n\n".join(module_text(n) for n in names)
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
        raise SystemExit(f"a SHARED CODE start marker without its END marker")
    names = [n.strip() for n in start.group(1).split(",") if n.strip()]
    return start.start(), end.end(), names


def spliced(text: str) -> str:
    found = find_region(text)
    if found is None:
        return text
    start, end, names = found
    return text[:start] + region(names) + text[end:]


def targets() -> list[Path]:
    return sorted(p for p in SCRIPTS.glob("*.py") if START.search(p.read_text()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if any script's region differs; change nothing")
    args = p.parse_args(argv)
    stale = []
    for path in targets():
        text = path.read_text()
        new = spliced(text)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
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
