"""What both OpenAI request bodies (completions and chat) share: the strict body, the sampling
fields with their limits and validators, and the conversion to the engine's SamplingParams.

Wrong types and out-of-range values fail validation (→ 400); extensions the engine does not
implement (guided_grammar, …) are rejected by name rather than silently ignored; unknown extra
fields are ignored, as OpenAI-compatible servers do. Structured output (`response_format`
json_object / json_schema, and vLLM's `guided_json` / `guided_regex` / `guided_choice`) becomes
the request's Guide; whether the engine can compile it is checked before generation starts.
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


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictBody):
    include_usage: bool = False


class JsonSchemaFormat(StrictBody):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


def _canonical(schema: dict) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class SamplingFields(StrictBody):
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
