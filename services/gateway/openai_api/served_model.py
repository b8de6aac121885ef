"""One base model the gateway serves: its name, its own tokenizer and chat template, its context
length, and the helpers that render and judge prompts with that tokenizer.

A gateway may serve several base models behind one router (`--model` then `--extra-model`,
services/gateway/config.py): each request is tokenized with the tokenizer of the model it
names, never another's, and goes to that model's workers (the router filters by the request's
`model`). The tokenizer comes from the model folder given to the gateway, the same folder (or a
copy of it) its workers load."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.openai_api.chat_renderer import ChatRenderer
from services.gateway.openai_api.prompt_builder import PromptBuilder
from services.gateway.openai_api.template_config import ChatTemplateConfig
from services.gateway.openai_api.token_strings import TokenStrings
from services.gateway.openai_api.tool_prompt import ToolTemplate
from shared.engine.grammar_guard import GrammarGuard
from shared.engine.grammar_limits import GrammarLimits


@dataclass
class ModelFiles:
    """What the gateway reads for a model at start: the name clients use, its tokenizer and chat
    template, its context length."""

    name: str
    prompts: PromptBuilder
    max_context_len: int


@dataclass
class ServedModel:
    name: str
    prompts: PromptBuilder
    max_context_len: int
    template: ChatTemplateConfig = field(default_factory=ChatTemplateConfig)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)
    tool_call_parser: str = "auto"  # auto | hermes | llama3_json | none (GatewayConfig)

    def __post_init__(self) -> None:
        self.token_strings = TokenStrings(self.prompts.tokenizer)
        parser = "auto" if self.tool_call_parser == "none" else self.tool_call_parser
        self.tool_template = ToolTemplate.detect(self.prompts.chat_template, parser)
        # helper processes (started on first use): chat templates and grammar compiles run
        # there with a time budget, never on the event loop; each holds this model's tokenizer
        self.renderer = ChatRenderer(self.prompts, self.template)
        self.grammar_guard = GrammarGuard.for_tokenizer(self.grammar, self.prompts.tokenizer)

    @classmethod
    def of(cls, files: ModelFiles, template: ChatTemplateConfig, grammar: GrammarLimits,
           tool_call_parser: str) -> "ServedModel":
        return cls(files.name, files.prompts, files.max_context_len, template, grammar, tool_call_parser)

    def stop_helpers(self) -> None:
        """Stop the helper processes (a later request starts them again)."""
        self.renderer.pool.stop()
        self.grammar_guard.pool.stop()
