"""The symptom index (references/troubleshooting.md) and the pages that route to it (issue 45).

1. Every error text and silent symptom users report has a row, and SKILL.md links the page that holds it
   (one hop from the router).
2. A script message the index quotes exists verbatim in scripts/ or common/, so the index cannot drift from
   what the scripts print; a text the index marks "not SDK 0.38" is absent from the installed SDK's source.
3. setup.md stays a user's page (under 250 lines); the cookbook map is routed from SKILL.md.
"""
from __future__ import annotations

import re
from pathlib import Path

import tinker

from test_docs import REFERENCES, ROOT, SKILL, split_row

DOC = REFERENCES / "troubleshooting.md"
SYMPTOMS = (  # what users report (issue 45), each must be findable in the index's first column
    "Unknown client error",
    "Failed to sample after exhausting retries",
    "httpx.ConnectError",
    "max number of clients + cluster connections reached",
    "KL high from step 0",
    "tool calls malformed after training",
    "garbled output after export",
)


def section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    body = text.split(f"\n{title}\n", 1)[1]
    return re.split(r"\n#{2,3} ", body, maxsplit=1)[0]


def rows(text: str) -> list[list[str]]:
    out = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            out.append(split_row(line))
    return out[1:]  # the header


def script_messages() -> list[str]:
    return [re.fullmatch(r"`(.*)`", cells[0]).group(1) for cells in rows(section("### Messages the scripts print"))]


def source_text() -> str:
    files = [*sorted((ROOT / "scripts").glob("*.py")), *sorted((ROOT / "common").glob("*.py"))]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def test_every_reported_symptom_has_a_row_in_the_index():
    first_column = " ".join(cells[0] for cells in rows(section("## Symptom index")))
    missing = [s for s in SYMPTOMS if s.lower() not in first_column.lower()]
    assert not missing, f"no symptom-index row for: {missing}"


def test_skill_links_the_page_holding_every_indexed_text():
    skill = SKILL.read_text(encoding="utf-8")
    assert "](references/troubleshooting.md#symptom-index)" in skill
    assert "## Symptom index" in DOC.read_text(encoding="utf-8")


def test_every_index_row_names_a_cause_and_a_fix():
    for cells in rows(section("## Symptom index")):
        assert len(cells) == 3 and all(c.strip() for c in cells), cells


def test_quoted_script_messages_are_printed_by_the_scripts():
    messages = script_messages()
    assert len(messages) >= 20, messages
    src = source_text()
    drifted = [m for m in messages if m not in src]
    assert not drifted, f"quoted in troubleshooting.md but in no script or common/ module: {drifted}"


def test_the_drift_check_catches_a_reworded_message():
    assert "error: no Tinker key found" not in source_text()
    assert "no Tinker credentials: set TINKER_API_KEY (tml-...), " in source_text()


def test_texts_marked_not_sdk_038_are_absent_from_the_installed_sdk():
    sdk = "\n".join(p.read_text(encoding="utf-8", errors="replace")
                    for p in Path(tinker.__file__).parent.rglob("*.py"))
    marked = [re.findall(r"`([^`]+)`", cells[0]) for cells in rows(section("## Symptom index"))
              if "not SDK 0.38" in cells[0]]
    texts = [t for found in marked for t in found if not t.endswith("Error")]  # class names are the SDK's
    assert len(texts) >= 3, texts
    present = [t for t in texts if t in sdk]
    assert not present, f"marked 'not SDK 0.38' but in the SDK's source: {present}"
    assert "No progress made in" in sdk  # the check reads the right files


def test_setup_md_is_under_250_lines_and_keeps_the_rehearsal():
    text = (REFERENCES / "setup.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 250
    for heading in ("## Install and keys", "## Local rehearsal", "### Which model to rehearse on",
                    "### How long it takes"):
        assert heading in text
    assert "setup --real" in text and "SmolLM2-135M-Instruct" in text
    assert "while other engineers' jobs" not in text  # the measurement logs live in benchmarks/README.md


def test_skill_routes_cookbook_names_to_the_cookbook_map():
    line = next(l for l in SKILL.read_text(encoding="utf-8").splitlines() if "references/cookbook.md" in l)
    assert "when" in line
    cookbook = (REFERENCES / "cookbook.md").read_text(encoding="utf-8")
    for name in ("sl_basic", "rl_basic", "math_rl", "code_rl", "tool_use", "rlhf", "distillation",
                 "rl/train.py", "`Env`", "EnvGroupBuilder", "RLDataset", "ProblemEnv", "renderers",
                 "get_lr", "hyperparam_utils", "max_steps_off_policy", "StreamMinibatch", "checkpoint_utils"):
        assert name in cookbook, name
