"""Chat prompts rendered and tokenized in helper processes (shared/process_pool), each with a
copy of the tokenizer: the model's template on a huge message list (or a slow tokenizer) runs
off the serving event loop and the gateway's own memory, and a render past its budget
(ChatTemplateConfig.timeout_s) kills its helper and is a 400 that says so."""
from __future__ import annotations

import pickle
from typing import Any

from services.gateway.openai_api.prompt_builder import PromptBuilder
from services.gateway.openai_api.template_config import ChatTemplateConfig
from shared.openai_protocol.errors import InvalidRequest
from shared.process_pool.pool import CallTimeout, ProcessPool

_HERE = "services.gateway.openai_api.chat_renderer"


class ChatRenderer:
    def __init__(self, prompts: PromptBuilder, config: ChatTemplateConfig):
        self.config = config
        self.pool = ProcessPool("chat-template", f"{_HERE}:helper_setup",
                                lambda: (pickle.dumps(prompts.tokenizer),), processes=config.processes)

    async def chat_prompt_ids(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None,
                              tools: list[dict[str, Any]] | None) -> list[int]:
        try:
            return await self.pool.call(f"{_HERE}:helper_render", messages, template_kwargs, tools,
                                        timeout_s=self.config.timeout_s)
        except CallTimeout:
            raise InvalidRequest(f"rendering the chat template for these messages took longer than "
                                 f"{self.config.timeout_s:g}s", "messages") from None

    def close(self) -> None:
        self.pool.close()


# -- in the helper process --------------------------------------------------------------------

def helper_setup(tokenizer_pickle: bytes) -> PromptBuilder:
    return PromptBuilder(pickle.loads(tokenizer_pickle))


def helper_render(builder: PromptBuilder, messages, template_kwargs, tools) -> list[int]:
    return builder.chat_prompt_ids(messages, template_kwargs, tools)
