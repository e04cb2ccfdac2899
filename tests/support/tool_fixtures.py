"""A tiny chat model whose chat template renders tools, and tool definitions for the tests.

transformers ships no tools-aware template offline, so HERMES_TEMPLATE is written here: a
small template of the Hermes / Qwen2.5 format (tools listed in the system turn inside
<tools></tools>, calls as <tool_call>{"name", "arguments"}</tool_call>, results as
<tool_response> in a user turn), faithful to that format but not a copy of Qwen's file. It
uses the SmolLM2 tokenizer's ChatML tokens, which are Qwen's too.
"""

from __future__ import annotations

import json
from pathlib import Path

HERMES_TEMPLATE = r"""
{%- set system = messages[0].content if messages and messages[0].role == 'system' else 'You are a helpful assistant.' %}
{{- '<|im_start|>system\n' + system }}
{%- if tools %}
{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
{{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]


def make_tiny_tool_llama(path: Path, seed: int = 0) -> Path:
    """tests/support/cluster_fixtures.py's tiny chat Llama with HERMES_TEMPLATE as its chat template and a
    1024-token context (a prompt listing two tools is ~400 tokens; RoPE has no position weights)."""
    from tests.support.cluster_fixtures import make_tiny_chat_llama

    make_tiny_chat_llama(path, seed)
    (path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return path
