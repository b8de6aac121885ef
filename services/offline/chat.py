"""`duet chat`: an interactive multi-turn chat with the model's chat template.

Each line on stdin is a user turn; the answer streams to stdout, token by token,
followed by a newline. `/exit`, `/quit` or end of input quits; `/reset` forgets
the history. Prompts and logs go to stderr so stdout holds only the answers.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass, field
from typing import Iterator

from .options import UsageError, add_model_options, add_sampling_options, fail, open_model, setup_logging

PROG = "duet chat"
EXIT_COMMANDS = {"/exit", "/quit"}
RESET_COMMAND = "/reset"


@dataclass
class Conversation:
    """The message history; old turns are dropped when the prompt no longer fits."""

    system: str | None = None
    turns: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def drop_oldest_exchange(self) -> bool:
        """Forget the oldest user/assistant pair; False when only the current question is left."""
        if len(self.turns) <= 1:
            return False
        del self.turns[:2]
        return True


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Render the chat template to text, then tokenize without adding special tokens twice."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def fit_prompt(tokenizer, conversation: Conversation, budget: int) -> list[int]:
    """Token ids of the conversation, dropping old exchanges until it fits `budget` tokens."""
    ids = encode_chat(tokenizer, conversation.messages())
    while len(ids) > budget and conversation.drop_oldest_exchange():
        ids = encode_chat(tokenizer, conversation.messages())
    if len(ids) > budget:
        raise ValueError(f"the message is too long: {len(ids)} tokens, at most {budget} fit")
    return ids


def stream_answer(llm, prompt_ids: list[int], params) -> Iterator[str]:
    """Yield the answer's text as it is generated (engine step by step), else all at once."""
    engine = getattr(llm, "engine", None)
    streamable = engine is not None and hasattr(engine, "add_request") and hasattr(engine, "step")
    # With stop strings the engine trims the text itself; take its final answer then.
    if not streamable or params.stop:
        yield llm.generate([prompt_ids], params)[0].text
        return
    from shared.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(llm.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
    rid = engine.add_request(prompt_ids, params)
    finished = False
    try:
        while not finished:
            for out in engine.step():
                if out.rid != rid:
                    continue
                piece = detok.push(out.token_ids)
                if piece:
                    yield piece
                finished = finished or out.finished
            if not finished and not engine.has_work:
                raise RuntimeError("the engine stopped without finishing the request")
        tail = detok.flush()
        if tail:
            yield tail
    finally:
        if not finished:
            engine.abort(rid)


def read_user_line(prompt: str | None) -> str | None:
    """One user line, None at end of input. On a terminal, input() gives line editing."""
    if prompt is not None and sys.stdout.isatty():
        try:
            return input(prompt)
        except EOFError:
            return None
    if prompt is not None:
        sys.stderr.write(prompt)
        sys.stderr.flush()
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\r\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Chat with the model (chat template, multi-turn). /exit or end of input quits, /reset clears the history.")
    parser.add_argument("--system", default=None, help="system message (default: the chat template's own)")
    add_model_options(parser)
    add_sampling_options(parser, max_tokens=256, temperature=0.0)
    return parser


def chat_loop(llm, conversation: Conversation, params, max_model_len: int, interactive: bool) -> int:
    out = sys.stdout
    while True:
        line = read_user_line("you> " if interactive else None)
        if line is None or line.strip() in EXIT_COMMANDS:
            if interactive:
                sys.stderr.write("\n")
            return 0
        if line.strip() == RESET_COMMAND:
            conversation.turns.clear()
            continue
        if not line.strip():
            continue
        conversation.turns.append({"role": "user", "content": line})
        try:
            prompt_ids = fit_prompt(llm.tokenizer, conversation, max_model_len - (params.max_tokens or 1))
        except ValueError as exc:
            conversation.turns.pop()
            print(f"{PROG}: {exc}", file=sys.stderr)
            continue
        pieces = []
        try:
            for piece in stream_answer(llm, prompt_ids, params):
                pieces.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            sys.stderr.write("\n[interrupted]\n")
        out.write("\n")
        out.flush()
        conversation.turns.append({"role": "assistant", "content": "".join(pieces)})


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)

    with contextlib.redirect_stdout(sys.stderr):
        try:
            model = open_model(args)
        except UsageError as exc:
            return fail(PROG, str(exc))
        llm, params, model_dir = model.llm, model.params, model.model_dir
        llm.tokenizer  # load it now, not on the first question
    max_model_len = getattr(getattr(llm, "engine", None), "max_model_len", None) or 2048
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  line editing and history for input
        print(f"chatting with {model_dir} (/exit to quit, /reset to forget)", file=sys.stderr)
    try:
        return chat_loop(llm, Conversation(system=args.system), params, max_model_len, interactive)
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
