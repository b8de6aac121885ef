"""Tool calls at the gateway: the parsers (whole text and streamed in arbitrary pieces), which
format a chat template implies, and how tools and a tool-call history render through a
template (native Qwen/Hermes- and Llama 3.1-style templates written here in their formats,
and SmolLM2's real template, which knows no tools: the Hermes-style fallback)."""
from __future__ import annotations

import json

import pytest

from services.gateway.openai_api.prompt_builder import PromptBuilder
from services.gateway.openai_api.tool_call_parsing import (
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    RequiredParser,
    ToolStream,
)
from services.gateway.openai_api.tool_prompt import ToolTemplate

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
]

# Written for these tests in the formats those model families use (not copies of theirs).
HERMES_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "</tools>\nCall with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tc in message.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
LLAMA31_STYLE = (
    "<|begin_of_text|>{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for tc in message.tool_calls %}{\"name\": \"{{ tc.function.name }}\", \"parameters\": "
    "{{ tc.function.arguments | tojson }}}{%- endfor %}<|eot_id|>"
    "{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def run_stream(parser, text: str, size: int) -> ToolStream:
    stream = ToolStream(parser)
    deltas = []
    for piece in pieces(text, size):
        deltas += stream.feed(piece)
    deltas += stream.finish()
    stream.deltas = deltas
    return stream


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_parser_streams_content_and_calls_in_any_pieces(size):
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> <tool_call>not json</tool_call>')
    stream = run_stream(HermesParser(), text, size)
    assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == [("get_weather", {"city": "Paris"}),
                                                                         ("get_time", {})]
    assert stream.content == "Let me check.  <tool_call>not json</tool_call>"
    headers = [d["tool_calls"][0] for d in stream.deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [h["index"] for h in headers] == [0, 1] and all(h["id"].startswith("call_") for h in headers)


def test_hermes_parser_keeps_a_possible_tag_start_until_known_and_takes_an_unclosed_call():
    parser = HermesParser()
    assert parser.feed("a <tool") == [("content", "a ")]
    assert parser.feed("box>") == [("content", "<toolbox>")]
    events = parser.feed('<tool_call>{"name": "f", "arguments": {"x": 1}}') + parser.finish()
    assert events[0][0] == "call" and events[0][1].name == "f"


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_llama3_json_parser(size):
    calls = run_stream(Llama3JsonParser(), '{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", "parameters": {}}',
                       size)
    assert [(c.name, json.loads(c.arguments)) for c in calls.calls] == [("a", {"q": "x;y"}), ("b", {})]
    text = run_stream(Llama3JsonParser(), "Paris is sunny.", size)
    assert not text.calls and text.content == "Paris is sunny."


def test_forced_output_parsers():
    required = run_stream(RequiredParser(), '[{"name": "get_weather", "parameters": {"city": "Rome"}}]', 4)
    assert [(c.name, json.loads(c.arguments)) for c in required.calls] == [("get_weather", {"city": "Rome"})]
    cut = run_stream(RequiredParser(), '[{"name": "get_wea', 4)  # max_tokens hit mid-call
    assert not cut.calls and cut.content == '[{"name": "get_wea'
    named = ToolStream(NamedParser("get_weather"), named="get_weather")
    deltas = named.feed('{"city": ') + named.feed('"Oslo"}') + named.finish()
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Oslo"}'
    assert json.loads(named.calls[0].arguments) == {"city": "Oslo"}


def test_parser_follows_the_template():
    from tests.helpers.stack import model_dir
    smol = PromptBuilder.from_model_dir(model_dir()).chat_template
    assert ToolTemplate.detect(smol) == ToolTemplate(native=False, parser="hermes")
    assert ToolTemplate.detect(HERMES_STYLE) == ToolTemplate(native=True, parser="hermes")
    assert ToolTemplate.detect(LLAMA31_STYLE) == ToolTemplate(native=True, parser="llama3_json")
    assert ToolTemplate.detect(LLAMA31_STYLE, "hermes").parser == "hermes"  # --tool-call-parser wins


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tests.helpers.stack import model_dir
    return AutoTokenizer.from_pretrained(str(model_dir()))


def render(tokenizer, template: str | None, messages, tools) -> str:
    if template is not None:
        tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
        tokenizer.chat_template = template
    builder = PromptBuilder(tokenizer)
    msgs, template_tools = ToolTemplate.detect(builder.chat_template).render(messages, tools)
    return tokenizer.decode(builder.chat_prompt_ids(msgs, None, template_tools))


def test_native_templates_render_tools_and_the_call_history(tokenizer):
    text = render(tokenizer, HERMES_STYLE, HISTORY, [WEATHER])
    assert json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    llama = render(tokenizer, LLAMA31_STYLE, HISTORY, [WEATHER])
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in llama
    assert "ipython" in llama and json.dumps(WEATHER) in llama


def test_smollm2_gets_the_hermes_fallback(tokenizer):
    text = render(tokenizer, None, [{"role": "system", "content": "Be brief."}, *HISTORY], [WEATHER])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.") and json.dumps(WEATHER) in system
    assert "<tool_call>" in system  # the format it is asked to answer in
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in text
    no_tools = render(tokenizer, None, HISTORY, None)  # tool_choice none: history still readable
    assert "<tools>" not in no_tools and "<tool_response>" in no_tools
