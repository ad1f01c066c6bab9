"""A user's tool environment written only inside tinker_rl.py's EDIT ME block (issue 33): an in-memory
inventory, a `lookup(item)` tool, up to 3 turns, reward 1 for the right number. `inventory_script(folder)`
copies tinker_rl.py (and tinker_pricing.py) there with this block in place of the shipped one."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

INVENTORY_BLOCK = '''# ==== EDIT ME: an inventory agent with a lookup tool ====
INVENTORY = {"apples": 12, "pears": 7, "plums": 30, "figs": 4, "limes": 19, "kiwis": 8}
TASKS = [{"item": item, "answer": count} for item, count in INVENTORY.items()]
EVAL_TASKS = []
PASS_REWARD = 1.0
ENV_NAME = "inventory"
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "How many of an item are in stock.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}]
SYSTEM_PROMPT = "You answer stock questions. Call lookup first, then reply with only the number."


def render_prompt(task):
    return [{"role": "user", "content": f"How many {task['item']} are in stock?"}]


def reward(task, completion):
    numbers = re.findall(r"-?\\d+", completion)
    return 1.0 if numbers and int(numbers[-1]) == task["answer"] else 0.0


def env_step(task, conversation, model_turn, rng):
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", model_turn, flags=re.S)
    if not calls:
        return None, reward(task, model_turn), True, {"answers": 1}
    try:
        call = json.loads(calls[0])
        item = call["arguments"]["item"]
    except Exception:
        return ({"role": "tool", "content": 'error: expected {"name": "lookup", "arguments": {"item": "..."}}'},
                0.0, False, {"tool_parse_errors": 1})
    return {"role": "tool", "content": str(INVENTORY.get(item, "unknown item"))}, 0.0, False, {"tool_calls": 1}


def REHEARSAL_TURNS(task):
    """What a good agent writes: the scripted assistant turns the rehearsal plays through the real paths."""
    call = json.dumps({"name": "lookup", "arguments": {"item": task["item"]}})
    return [f"<tool_call>\\n{call}\\n</tool_call>", str(task["answer"])]

# ==== END OF EDIT ME ===='''

_BLOCK = re.compile(r"^# ==== EDIT ME.*?^# ==== END OF EDIT ME ====", re.S | re.M)


def inventory_script(folder: Path, block: str = INVENTORY_BLOCK) -> Path:
    """tinker_rl.py with `block` as its EDIT ME block (nothing else changed), beside tinker_pricing.py."""
    folder.mkdir(parents=True, exist_ok=True)
    text = (SCRIPTS / "tinker_rl.py").read_text()
    assert len(_BLOCK.findall(text)) == 1
    script = folder / "tinker_rl.py"
    script.write_text(_BLOCK.sub(lambda m: block, text))
    shutil.copy(SCRIPTS / "tinker_pricing.py", folder / "tinker_pricing.py")
    return script
