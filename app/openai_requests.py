"""OpenAI request bodies (what the official client sends), validated strictly.

Wrong types and out-of-range values fail validation (→ 400). Features the
engine does not implement (echo, suffix, guided_grammar, …) are
rejected by name rather than silently ignored; unknown extra fields are ignored,
as OpenAI-compatible servers do. Structured output (`response_format` json_object /
json_schema, and vLLM's `guided_json` / `guided_regex` / `guided_choice`) becomes the
request's Guide; whether the engine can compile it is checked before generation starts.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.errors import ContextLengthError
from app.protocol import Guide, SamplingParams

_INT64 = 2**63 - 1
# Every stop string is checked against the text after each token: bounded so one request's
# stop list cannot make every decode step slow (OpenAI itself takes 4; vLLM has no cap).
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
# logit_bias goes to the device with every step of the request: bounded like the stop strings.
MAX_LOGIT_BIAS = 1024
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # OpenAI's range
_Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
# Choices of one request (n, best_of) run side by side in one replica's batch: bounded so one request
# cannot take a replica's whole batch (OpenAI allows n up to 128; vLLM has no cap). docs/n_choices.md
MAX_CHOICES = 16


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


def _canonical(schema: dict) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class _Sampling(_Body):
    """Fields both endpoints share."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # an extension (vLLM's); 0 = off
    min_tokens: int = Field(0, ge=0)  # an extension (vLLM's)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)  # on chat an extension (vLLM's)
    seed: int | None = Field(None, ge=-_INT64 - 1, le=_INT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: _Penalty | None = 0.0
    frequency_penalty: _Penalty | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = 1.0  # vLLM's; 1 = off
    logit_bias: dict[str, _Bias] | None = None  # token id (as OpenAI's JSON keys: a string) → bias
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # extensions (vLLM's)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: Any = None  # these three are refused by name
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, value):
        """Keys are token ids; whether the model has them is the engine's check (it knows the vocabulary)."""
        if value and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are supported, got {len(value)}")
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"logit_bias keys must be token ids, got {key[:20]!r}")
        if value and len({int(key) for key in value}) < len(value):
            raise ValueError("logit_bias names a token id twice")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _one_guide(self):
        for name in ("guided_grammar", "guided_whitespace_pattern", "structured_outputs"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name} is not supported (use response_format, guided_json, guided_regex or guided_choice)"
                )
        if self.guided_choice is not None and (not self.guided_choice or not all(self.guided_choice)):
            raise ValueError("guided_choice must be a non-empty list of non-empty strings")
        if self.guided_regex == "":
            raise ValueError("guided_regex is empty")
        given = [
            self.response_format is not None and self.response_format.type != "text",
            self.guided_json is not None,
            self.guided_regex is not None,
            self.guided_choice is not None,
        ]
        if sum(given) > 1:
            raise ValueError(
                "give at most one of response_format (json_object / json_schema), guided_json, "
                "guided_regex and guided_choice"
            )
        self.guide()  # guided_json text that is not a JSON object fails here
        return self

    def guide(self) -> Guide | None:
        """The constraint on the output, if any (its spec canonical: the same schema, the same cache entry)."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return Guide("json_object", "")
        if fmt is not None and fmt.type == "json_schema":
            return Guide("json_schema", _canonical(fmt.json_schema.schema_))
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError:
                    raise ValueError("guided_json is not valid JSON") from None
            if not isinstance(schema, dict):
                raise ValueError("guided_json must be a JSON schema (an object)")
            return Guide("json_schema", _canonical(schema))
        if self.guided_regex is not None:
            return Guide("regex", self.guided_regex)
        if self.guided_choice is not None:
            return Guide("choice", json.dumps(self.guided_choice, ensure_ascii=False))
        return None

    @model_validator(mode="after")
    def _options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @model_validator(mode="after")
    def _choices(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.stream and self.generated > self.n:
            raise ValueError("best_of > n cannot be streamed: the best choices are known only at the end")
        return self

    @property
    def generated(self) -> int:
        """Choices generated (best_of); the n best are returned."""
        return self.best_of or self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _requested_max(self) -> int | None:
        return self.max_tokens

    def sampling(
        self, prompt_len: int, context_limit: int, default_max: int | None, logprobs: int | None
    ) -> SamplingParams:
        """default_max None: up to the rest of the context (what chat clients expect)."""
        room = context_limit - prompt_len
        if room < 1:
            raise ContextLengthError(
                f"the prompt ({prompt_len} tokens) leaves no room in the context ({context_limit} tokens)"
            )
        max_tokens = self._requested_max() or default_max or room
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            min_tokens=min(self.min_tokens, max_tokens),
            stop=stop,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=tuple((int(t), float(b)) for t, b in (self.logit_bias or {}).items()),
            guide=self.guide(),
        )


class CompletionRequest(_Sampling):
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
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
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


class Message(_Body):
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


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; omitted: no parameters
    strict: bool | None = None  # accepted; enforced only with tool_choice required / named (docs/tool_calling.md)


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.functions or self.function_call is not None:
            raise ValueError("functions and function_call (deprecated) are not supported: use tools and tool_choice")
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
