"""`POST /v1/responses` request bodies (OpenAI's Responses API, as vLLM serves it): what the
ingress implements, validated strictly. Any other field (hosted tools, reasoning, background,
conversations, include, …) is refused by name; the body then becomes a chat request
(`to_chat`), which the chat path renders, generates and parses as any other."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from app.openai.sampling import StrictBody

# Fields accepted beyond the models' own, when they ask for nothing this server does not do.
_IGNORED_WHEN_DEFAULT = {"background": (None, False), "truncation": (None, "disabled"), "include": (None, [])}


class InputText(StrictBody):
    type: Literal["input_text", "output_text"]  # output_text: an assistant turn given back as history
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(StrictBody):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_chat(self) -> dict:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class NamedFunction(StrictBody):
    type: Literal["function"]
    name: str


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("text.format of type json_schema needs name and schema")
        return self

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(StrictBody):
    format: TextFormat | None = None


class ResponsesRequest(StrictBody):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None  # vLLM's extension
    background: Any = None
    truncation: Any = None
    include: Any = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data):
        """Fields this server does not implement are refused by name, not ignored."""
        if isinstance(data, dict):
            unknown = sorted(k for k in data if k not in cls.model_fields)
            if unknown:
                raise ValueError(f"not supported by /v1/responses: {', '.join(unknown)}")
            for name, allowed in _IGNORED_WHEN_DEFAULT.items():
                if data.get(name) not in allowed:
                    raise ValueError(f"{name}={json.dumps(data[name])} is not supported by /v1/responses")
        return data

    @model_validator(mode="after")
    def _tools(self):
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if not self.input:
            raise ValueError("input is empty")
        return self

    @property
    def stored(self) -> bool:
        return self.store is not False

    def input_items(self) -> list[InputItem]:
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)

    def to_chat(self, history: list[dict]) -> dict:
        """The chat request this response runs as: instructions (not carried over from an earlier
        response, as OpenAI does), the earlier response's conversation, then this input."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history
        messages += chat_messages(self.input_items())
        chat: dict[str, Any] = {"model": self.model, "messages": messages}
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
        }
        chat.update({k: v for k, v in optional.items() if v is not None})
        if self.tools:
            chat["tools"] = [t.for_chat() for t in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            chat["tool_choice"] = (
                choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
            )
        if self.text is not None and self.text.format is not None:
            chat["response_format"] = self.text.format.response_format()
        return chat


def chat_messages(items: list[InputItem]) -> list[dict]:
    """Responses input items as chat messages: consecutive function calls join the assistant turn
    before them, each output is a tool message."""
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out
