"""The questions index resolves, and every measured figure has one value and one home (issue 30).

1. `references/questions.md` maps questions users ask to sections: every row's link must name a
   file and heading that exist, and the section must open (its first OPENING_LINES prose lines)
   with the row's "opens with" words, so the answer is where the index says.
2. Named figures: a measured figure that more than one document talks about has one home
   (file#anchor, the place that states it with its shape, load and date) and patterns that find
   any statement of it. Every statement must carry the home's value, and one outside the home file
   must link the home. A figure stated twice with two values fails, naming both places.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_docs import REFERENCES, ROOT, SKILL, github_slug, rel, split_markdown

INDEX = REFERENCES / "questions.md"
OPENING_LINES = 6
MIN_QUESTIONS = 40
INDEX_LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)#([^)\s]+)\)")


# --------------------------------------------------------------------------- 1. the questions index

def section_opening(path: Path, anchor: str, n: int = OPENING_LINES) -> list[str] | None:
    """The first n non-empty prose lines under the heading whose slug is `anchor` (None: no such
    heading). Duplicate headings get GitHub's -1, -2 suffixes, as test_docs.anchors_of does."""
    _, prose = split_markdown(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    start = None
    for i, (_, line) in enumerate(prose):
        m = re.match(r"^(#{1,6})\s+(.*)$", line)
        if not m:
            continue
        slug = github_slug(m.group(2).strip())
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        if (slug if k == 0 else f"{slug}-{k}") == anchor:
            start = i + 1
            break
    if start is None:
        return None
    out: list[str] = []
    for _, line in prose[start:]:
        if re.match(r"^#{1,6}\s", line):
            break
        if line.strip():
            out.append(line)
        if len(out) == n:
            break
    return out


def index_rows(path: Path) -> list[tuple[int, str, str, str, str]]:
    """(line, question, file, anchor, opens-with) for every table row with a link."""
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("|") or line.startswith("| ---") or line.startswith("| question"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3:
            continue
        for file_part, anchor in INDEX_LINK.findall(cells[1]):
            rows.append((lineno, cells[0], file_part, anchor, cells[2].strip("`")))
    return rows


def index_problems(path: Path, references: Path = REFERENCES, label=rel, minimum: int = MIN_QUESTIONS) -> list[str]:
    problems = []
    rows = index_rows(path)
    if len(rows) < minimum:
        problems.append(f"{label(path)}: {len(rows)} linked questions; the index should hold {minimum} or more")
    for lineno, question, file_part, anchor, opens_with in rows:
        dest = (references / file_part).resolve()
        where = f"{label(path)}:{lineno} ({question[:50]})"
        if not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
            continue
        opening = section_opening(dest, anchor)
        if opening is None:
            problems.append(f"{where}: {file_part} has no heading #{anchor}")
        elif opens_with.lower() not in " ".join(opening).lower():
            problems.append(f"{where}: {file_part}#{anchor} does not open with '{opens_with}' "
                            f"(first {OPENING_LINES} lines)")
    return problems


def test_index_check_catches_a_missing_file_a_missing_section_and_a_buried_answer(tmp_path):
    ref = tmp_path / "references"
    ref.mkdir()
    (ref / "a.md").write_text("# A\n\n## Found here\n\nThe key fact is here.\n\n## Buried\n\n"
                              + "filler\n" * 8 + "the key fact\n")
    index = ref / "questions.md"
    index.write_text("| question | where | opens with |\n| --- | --- | --- |\n"
                     "| q1 | [a.md](a.md#found-here) | key fact |\n"
                     "| q2 | [a.md](a.md#buried) | key fact |\n"
                     "| q3 | [a.md](a.md#gone) | x |\n"
                     "| q4 | [b.md](b.md#any) | x |\n")
    problems = index_problems(index, ref, label=lambda p: p.name, minimum=5)
    assert len(problems) == 4, problems
    assert "4 linked questions; the index should hold 5 or more" in problems[0]
    assert any("#buried does not open with 'key fact'" in p for p in problems)
    assert any("no heading #gone" in p for p in problems)
    assert any("b.md does not exist" in p for p in problems)


def test_every_question_in_the_index_leads_to_a_section_that_opens_with_its_answer():
    problems = index_problems(INDEX)
    assert not problems, "\n".join(problems)


def test_skill_routes_to_the_questions_index_with_a_read_when_condition():
    lines = [l for l in SKILL.read_text(encoding="utf-8").splitlines() if "references/questions.md" in l]
    assert lines, "SKILL.md must link references/questions.md"
    assert any(re.search(r"\bwhen\b", l) for l in lines), lines


# --------------------------------------------------------------------------- 2. one home per figure

NUM = r"(\d+(?:\.\d+)?)"
# name -> (home "path#anchor" from the repository root, patterns capturing the value in any statement)
NAMED_FIGURES: dict[str, tuple[str, list[str]]] = {
    "RL iteration, 8 groups x 4 samples, all groups in flight (s)": (
        "references/training-rl.md#measured-on-the-local-backend-tiny-random-qwen3-2-core-cpu", [
            rf"all groups in flight \(one group after another\) \| {NUM} s",
            rf"all groups in flight {NUM}",
        ]),
    "local setup from nothing (s)": ("benchmarks/README.md#speed-december-2026", [
        rf"setup[^.|]{{0,40}}?{NUM} s from nothing",
        rf"from nothing took {NUM} s",
        rf"from nothing[^.|]{{0,20}}?\| {NUM} s",
    ]),
    "local server ready after serve / run starts (s)": ("benchmarks/README.md#speed-december-2026", [
        rf"server ready after serve / run starts \| [\d.]+ s \| {NUM} s",
        rf"start until it takes requests \| {NUM} s",
        rf"ready in (?:about )?{NUM} s",
        rf"{NUM} s to a ready server",
    ]),
    "local warm forward_backward + optim_step, 4 x 32 tokens (s)": ("benchmarks/README.md#speed-december-2026", [
        rf"warm forward_backward \+ optim_step, 4 x 32 tokens, rank 8 \| [^|]*\| {NUM} s",
        rf"warm step[^.|]{{0,30}}?{NUM} s",
    ]),
    "SDK in-flight sampling requests per SamplingClient": (
        "references/inference.md#limits-the-sdks-caps-not-a-service-quota", [
            rf"about {NUM} concurrent sampling requests",
            rf"sample_max_concurrent_requests[^.]{{0,40}}?\(?{NUM}\b",
        ]),
}


# statements of a named figure that are a different measurement on purpose:
# (file, words in the statement's paragraph) -> why
OTHER_MEASUREMENTS: dict[tuple[str, str], str] = {
    ("benchmarks/README.md", "| install from nothing |"):
        "the bake-off table: SkyRL and hatchery installed side by side in one earlier run; the Speed "
        "section states today's figure",
    ("benchmarks/README.md", "| start until it takes requests |"):
        "the bake-off table: SkyRL and hatchery started side by side in one earlier run",
}


def other_measurement(statement) -> bool:
    path, _, _, text = statement
    return any(path == p and words in text for p, words in OTHER_MEASUREMENTS)


def paragraphs(path: Path) -> list[tuple[int, str]]:
    """Prose joined across wrapped lines: (first line, text); a blank line, heading, list item or
    table row starts a new one, and each table row is its own."""
    _, prose = split_markdown(path.read_text(encoding="utf-8"))
    out: list[tuple[int, str]] = []
    last = None
    for lineno, line in prose:
        if not line.strip():
            last = None
            continue
        starts = (re.match(r"^(#{1,6}\s|\s*[-*]\s|\s*\d+\.\s|\|)", line) or last is None
                  or lineno != last + 1 or out[-1][1].startswith(("#", "|")))
        if starts:
            out.append((lineno, line.strip()))
        else:
            out[-1] = (out[-1][0], out[-1][1] + " " + line.strip())
        last = lineno
    return out


def doc_paths() -> list[Path]:
    return [SKILL, ROOT / "README.md", ROOT / "DEVELOPING.md", ROOT / "benchmarks" / "README.md",
            *sorted(REFERENCES.glob("*.md"))]


def named_figure_statements(name: str, paths=None) -> list[tuple[str, int, float, str]]:
    """(file, line, value, paragraph) of every statement of a named figure."""
    _, patterns = NAMED_FIGURES[name]
    found = []
    for path in paths or doc_paths():
        for lineno, text in paragraphs(path):
            plain = text.replace("`", "")
            for pattern in patterns:
                for m in re.finditer(pattern, plain):
                    found.append((rel(path), lineno, float(m.group(1)), plain))
    return found


def linked_as(home_file: str) -> str:
    """What a link to the home contains from any doc: a reference's own name (references link each other
    by name), else its path from the root (`../benchmarks/README.md` from references/)."""
    return home_file.removeprefix("references/")


def named_figure_problems(name: str, statements) -> list[str]:
    home, _ = NAMED_FIGURES[name]
    home_file = home.split("#")[0]
    at_home = [s for s in statements if s[0] == home_file]
    if not at_home:
        return [f"{name}: no statement in its home {home}"]
    value = at_home[0][2]
    problems = []
    for path, lineno, found, text in statements:
        if found != value:
            problems.append(f"{name}: {path}:{lineno} says {found:g}, its home {home_file} says {value:g}")
        elif path != home_file and linked_as(home_file) not in text:
            problems.append(f"{name}: {path}:{lineno} restates {found:g} without linking {home}")
    return problems


def test_named_figure_check_catches_a_second_value_and_an_unlinked_copy(monkeypatch):
    monkeypatch.setitem(NAMED_FIGURES, "demo", ("references/setup.md#x", [rf"{NUM} s from nothing"]))
    rows = [("references/setup.md", 1, 114.0, "install: 114 s from nothing"),
            ("SKILL.md", 2, 94.0, "94 s from nothing"),
            ("README.md", 3, 114.0, "114 s from nothing"),
            ("references/debugging.md", 4, 114.0, "114 s from nothing ([setup.md](setup.md#x))")]
    assert named_figure_problems("demo", rows) == [
        "demo: SKILL.md:2 says 94, its home references/setup.md says 114",
        "demo: README.md:3 restates 114 without linking references/setup.md#x"]


def test_named_figure_patterns_find_a_wrapped_statement(tmp_path, monkeypatch):
    doc = tmp_path / "setup.md"
    doc.write_text("# S\n\nThe first local setup takes\n`114` s from nothing on this machine.\n")
    monkeypatch.setattr("test_docs_index.rel", lambda p: p.name)
    assert [s[2] for s in named_figure_statements("local setup from nothing (s)", [doc])] == [114.0]


@pytest.mark.parametrize("name", sorted(NAMED_FIGURES))
def test_a_named_figure_has_one_value_and_one_home(name):
    home_file, anchor = NAMED_FIGURES[name][0].split("#")
    assert section_opening(ROOT / home_file, anchor), f"{name}: its home {home_file}#{anchor} is not a heading"
    statements = [s for s in named_figure_statements(name) if not other_measurement(s)]
    problems = named_figure_problems(name, statements)
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- 3. README's layout

def test_readme_layout_names_every_script_and_reference():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    missing = [p.name for p in [*sorted((ROOT / "scripts").glob("*.py")), *sorted(REFERENCES.glob("*.md"))]
               if p.name not in layout]
    assert not missing, f"README.md's Layout table does not name: {', '.join(missing)}"
