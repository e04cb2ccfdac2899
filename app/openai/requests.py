"""OpenAI request bodies (what the official client sends), validated strictly: completions
and chat, on the fields both share (app/openai/sampling.py). Features the engine does not
implement (echo, suffix, functions, …) are rejected by name rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from app.openai.chat_template import check_kwargs
from app.openai.sampling import SamplingFields, StrictBody


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @model_validator(mode="after")
    def _unsupported(self):
        if self.echo and self.stream:
            raise ValueError("echo cannot be streamed")
        if self.echo and self.generated > 1:
            raise ValueError("echo is supported for one choice (n and best_of 1)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def sampling(self, prompt_len: int, context_limit: int, default_max: int | None, logprobs: int | None):
        """With echo and logprobs, the prompt's tokens are scored too (app/engine/prompt_logprobs.py)."""
        params = super().sampling(prompt_len, context_limit, default_max, logprobs)
        if self.echo and self.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        return params


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class FunctionCall(StrictBody):
    name: str
    arguments: str


class ToolCall(StrictBody):
    id: str
    type: Literal["function"]
    function: FunctionCall

    def for_template(self) -> dict:
        """As chat templates take it (transformers' convention): the arguments as an object."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:  # not JSON: what the client sent
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class Message(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this is the result of

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id (and only a tool message has one)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """`developer` is the newer name of `system`."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(StrictBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; omitted: no parameters
    strict: bool | None = None  # accepted; enforced only with tool_choice required / named (docs/tool_calling.md)


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    chat_template: Any = None  # vLLM's per-request template: refused (the app's chat_template arg sets it)

    @model_validator(mode="after")
    def _unsupported(self):
        if self.functions or self.function_call is not None:
            raise ValueError("functions and function_call (deprecated) are not supported: use tools and tool_choice")
        if self.chat_template is not None:
            raise ValueError("a per-request chat_template is not supported: the server's chat_template arg sets it")
        check_kwargs(self.chat_template_kwargs)
        self._check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def _requested_max(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not in tools")
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")

    def chat(self) -> list[dict]:
        """Messages for the chat template."""
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """`tools` as chat templates take them (OpenAI's shape, which transformers documents)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def choice(self) -> str | dict:
        """tool_choice, defaulted as OpenAI does: "auto" with tools, "none" without."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    @property
    def has_tool_messages(self) -> bool:
        return any(m.role == "tool" or m.tool_calls for m in self.messages)

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
