"""One conversation: what it starts with, what each turn adds, and the history as it grows. The
history holds the model's real answers, not a dataset's: turn t+1's prompt is what a chat client
would send after turn t, so prefix caches and KV kept across turns see the traffic they are for."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

FINISHED, CONTEXT_LIMIT, ERROR, TIME_UP, INTERRUPTED = "finished", "context_limit", "error", "time_up", "interrupted"


@dataclass
class TurnSpec:
    output_len: int  # max_tokens for this turn's answer
    user: str | None = None  # a user message this turn adds
    # Agentic turns: the call the previous answer is taken to have made (attached to that
    # assistant message, so the history is well-formed OpenAI), and the tool's result.
    tool_call: dict | None = None
    tool_result: str | None = None


@dataclass
class Dialog:
    id: int
    opening: list[dict]  # messages before the first turn (system prompts)
    turns: list[TurnSpec]
    tools: list[dict] | None = None  # OpenAI `tools`, sent with every turn


@dataclass
class DialogState:
    plan: Dialog
    history: list[dict] = field(default_factory=list)
    turn: int = 0  # the next turn to send
    ended: str | None = None  # why it stopped: finished, context_limit, error, time_up, interrupted

    @classmethod
    def start(cls, plan: Dialog) -> "DialogState":
        state = cls(plan, copy.deepcopy(plan.opening))
        if not plan.turns:
            state.ended = FINISHED
        return state

    @property
    def active(self) -> bool:
        return self.ended is None

    @property
    def spec(self) -> TurnSpec:
        return self.plan.turns[self.turn]

    def pending(self) -> list[dict]:
        """The messages the next turn adds after the history."""
        spec, out = self.spec, []
        if spec.tool_result is not None:
            call_id = (spec.tool_call or {}).get("id", f"call_{self.plan.id}_{self.turn}")
            out.append({"role": "tool", "tool_call_id": call_id, "content": spec.tool_result})
        if spec.user is not None:
            out.append({"role": "user", "content": spec.user})
        return out

    def request_messages(self) -> list[dict]:
        return self.history + self.pending()

    def accept(self, answer: str) -> None:
        """The turn went through: its messages and the model's answer join the history."""
        self.history += self.pending()
        self.turn += 1
        message = {"role": "assistant", "content": answer}
        if self.turn < len(self.plan.turns) and self.plan.turns[self.turn].tool_call is not None:
            message["tool_calls"] = [self.plan.turns[self.turn].tool_call]
        self.history.append(message)
        if self.turn >= len(self.plan.turns):
            self.ended = FINISHED

    def end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason
