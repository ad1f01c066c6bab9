"""The free rehearsal (--rehearse) on the local backend: which model stands in, each script's preset for it, and the
shape of the rehearsal's checks.

`tinker_local.py run` exports TINKER_LOCAL_STAND_IN, the model standing in for the named one:
- the tiny random Qwen3 (default): the named model's exact tokenizer and chat template, so masks, token counts and
  datums are Qwen3's; it memorises a few short answers and nothing more;
- SmolLM2-135M-Instruct (`tinker_local.py run --real`): a real, weak instruct model with its own tokenizer and ChatML
  template; it follows a prompt, learns a user's answers, earns a user's reward and calls a tool after a warm-up.
Each preset below was measured on its model (references/setup.md, "Which model to rehearse on").
"""
from __future__ import annotations

import os
from urllib.parse import urlsplit

STAND_IN_ENV = "TINKER_LOCAL_STAND_IN"
TINY_STAND_IN = "tiny-qwen3"


def stand_in() -> str | None:
    """The model standing in on the local backend (from the launcher), or None (Tinker, or an unknown server)."""
    return os.environ.get(STAND_IN_ENV) or None


def real_stand_in() -> bool:
    """True when a real model (`tinker_local.py run --real`) stands in: the rehearsal judges the user's task."""
    return stand_in() not in (None, TINY_STAND_IN)


def backend_record() -> dict:
    """What config.json says about where a run trained: {"kind": "local"|"tinker", "stand_in", "stand_in_kind"}.
    A loopback TINKER_BASE_URL without the launcher's variable is local with an unknown stand-in."""
    name = stand_in()
    host = urlsplit(os.environ.get("TINKER_BASE_URL") or "").hostname or ""
    local = name is not None or host in ("127.0.0.1", "localhost", "::1")
    return {"kind": "local" if local else "tinker", "stand_in": name,
            "stand_in_kind": None if name is None else "real" if real_stand_in() else "tiny"}


def preset(presets: dict) -> dict:
    """The rehearsal preset for the model standing in now: presets["real"] on the real model, else presets["tiny"]."""
    return dict(presets["real" if real_stand_in() else "tiny"])


def rehearsal_check(text: str, passed) -> dict:
    return {"check": text, "passed": bool(passed)}


def rehearsal_result(checks: list[dict], reported=(), **extra) -> dict:
    """A rehearsal's verdict: passed when every check passed; `reported` lines are figures shown, not judged."""
    return {"passed": all(c["passed"] for c in checks), "checks": checks, "reported": list(reported),
            "stand_in": stand_in(), **extra}


# ---- tinker_sft.py --rehearse
# tiny: four one-line facts memorised in 40 steps (probes 0/4 -> 4/4; held-out NLL 18.2 -> 3.3).
# real (SmolLM2, measured 2026-12-06, 2 cores shared): the built-in facts 4/4 in 16 steps at 5e-4; the 32-row
# help-desk set (templates/sft_example.jsonl without its reasoning row) 4/4 training probes reproduced word for
# word after 48 steps at 2e-3 linear, rank 32 (2/4 at 2e-3 constant x 32 steps, 0/4 at 5e-4 x 40); held-out NLL
# 1.91 -> 1.50 at step 8 (then it memorises: 2.65 at step 48); 118 s in the script, 2 min 13 s with the server.
SFT_REHEARSAL = {
    "tiny": {"learning_rate": 1e-2, "lr_schedule": "constant", "batch_size": 4, "max_steps": 40, "epochs": 1000,
             "lora_rank": 32, "num_probes": 4, "max_tokens": 8, "save_every": 0, "log_path": "runs/rehearsal"},
    "real": {"learning_rate": 2e-3, "lr_schedule": "linear", "batch_size": 4, "max_steps": 48, "epochs": 1000,
             "lora_rank": 32, "num_probes": 4, "max_tokens": 8, "save_every": 0, "log_path": "runs/rehearsal",
             "eval_every": 8, "eval_samples": 0},
}
# The real model passes an own-data rehearsal when at least this share of its probes (training prompts) answer
# their trained answer word for word.
REAL_PROBE_SHARE = 0.75
