"""Agent sessions (the prompt shape of coding and operations agents): one long system prompt and
tool set shared by every session, then many short turns, each adding a tool result (a few
hundred tokens) after the model's previous answer. Requests carry the tools with tool_choice
"none", so small models still answer in text; the history attaches a synthetic call to each
answer, so the next tool message answers a real tool_call id."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from loadtest.multiturn.agentic_tools import tool_set
from loadtest.multiturn.dialog import Dialog, TurnSpec
from loadtest.workloads.synthetic_text import SyntheticText

SYSTEM_HEAD = ("You are an autonomous engineering agent working in a sandboxed repository. Use the tools "
               "to inspect, change and test the code; after each tool result, say briefly what you learned "
               "and what you will do next. Project handbook follows.\n\n")


@dataclass
class AgenticShape:
    sessions: int = 16
    system_len: int = 2000  # tokens of synthetic handbook after the fixed head, shared by all sessions
    num_tools: int = 8
    turns: int = 8
    task_len: int = 64  # tokens of the user's task (the first turn)
    tool_output_len: int = 300  # mean tokens of a tool result; uniform over +-50%
    output_len: int = 64


def agentic_dialogs(shape: AgenticShape, text: SyntheticText, rng: random.Random) -> list[Dialog]:
    tools = tool_set(shape.num_tools)
    system = [{"role": "system", "content": SYSTEM_HEAD + text.text(shape.system_len)}]
    out = []
    for s in range(shape.sessions):
        turns = [TurnSpec(output_len=shape.output_len, user="Task: " + text.text(shape.task_len))]
        for t in range(1, shape.turns):
            tool = rng.choice(tools)["function"]
            call = {"id": f"call_{s}_{t}", "type": "function",
                    "function": {"name": tool["name"], "arguments": json.dumps(_arguments(tool, text, rng))}}
            n = max(1, round(shape.tool_output_len * rng.uniform(0.5, 1.5)))
            turns.append(TurnSpec(output_len=shape.output_len, tool_call=call, tool_result=text.text(n)))
        out.append(Dialog(s, system, turns, tools))
    return out


def _arguments(fn: dict, text: SyntheticText, rng: random.Random) -> dict:
    """Plausible arguments from the schema: required fields, and each optional one half the time."""
    params = fn["parameters"]
    out = {}
    for name, prop in params["properties"].items():
        if name not in params.get("required", []) and rng.random() < 0.5:
            continue
        kind = prop.get("type")
        if "enum" in prop:
            out[name] = rng.choice(prop["enum"])
        elif kind == "integer":
            out[name] = rng.randint(1, 200)
        elif kind == "boolean":
            out[name] = rng.random() < 0.5
        elif kind == "object":
            out[name] = {}
        else:
            out[name] = text.text(rng.randint(2, 8)).strip()
    return out
