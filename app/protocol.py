"""What flows between ingress, replica and engine: requests in, chunks out."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from app.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n = chosen token + top-n alternatives
    # OpenAI's penalties, over the tokens generated so far; vLLM's repetition_penalty over prompt and output
    # (1 = off); logit_bias as (token id, bias) pairs. Semantics and order: docs/sampling.md.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty < math.inf, "repetition_penalty must be > 0 and finite (1 disables it)"),
            (all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
             "logit_bias maps token ids >= 0 to biases in [-100, 100]"),
            (len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias names a token id twice"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def check_vocabulary(self, vocab: int) -> None:
        """Refuse logit_bias token ids the model does not have (the one check that needs the model)."""
        bad = [t for t, _ in self.logit_bias if t >= vocab]
        if bad:
            raise InvalidRequestError(f"logit_bias names token id {bad[0]}, outside the vocabulary (0..{vocab - 1})")


@dataclass(frozen=True)
class GenerateRequest:
    """One generation. ``resume_token_ids`` are tokens already generated elsewhere
    (before a migration): they are recomputed by prefill, count towards
    max_tokens / min_tokens and take part in stop-string matching, but are not
    streamed again; ``resume_text_chars`` of their text already reached the
    client (None: all of it). The router reads ``avoid_replicas`` (never these:
    they failed) and ``migrated_from`` (not this one while another has room)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None
    resume_token_ids: tuple[int, ...] = ()
    resume_text_chars: int | None = None
    avoid_replicas: tuple[str, ...] = ()
    migrated_from: str | None = None

    def resumed(self, migrate: "Migrate") -> "GenerateRequest":
        """The request to re-submit after ``migrate`` (same id, params and seed)."""
        params = dataclasses.replace(self.params, seed=migrate.seed)
        return dataclasses.replace(self, params=params, resume_token_ids=migrate.output_token_ids)


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """New tokens of one request; ``finish_reason`` set on its last chunk. One chunk may
    carry several tokens (a stream coalesces what accumulated since its last item)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str = ""
    logprobs: tuple[dict, ...] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def then(self, later: "TokenChunk") -> "TokenChunk":
        """This chunk followed by ``later`` as one: tokens, text and logprobs concatenated;
        finish reason and usage from ``later``."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or ()) + (later.logprobs or ())
        return TokenChunk(self.request_id, self.token_ids + later.token_ids, self.text + later.text, logprobs,
                          later.finish_reason, later.prompt_tokens, later.completion_tokens)


@dataclass(frozen=True)
class Migrate:
    """The request left this engine unfinished (KV exhausted, replica draining):
    re-submit it with ``GenerateRequest.resumed`` here or elsewhere."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    seed: int
    reason: str


@dataclass(frozen=True)
class Accepted:
    """The first item of a replica's stream: which replica took the request."""

    replica_id: str


@dataclass(frozen=True)
class ErrorChunk:
    request_id: str
    message: str
    status: int = 500


Chunk = TokenChunk | Migrate | ErrorChunk


def is_final(item) -> bool:
    """Whether ``item`` ends a replica's stream for its request: the one definition."""
    return isinstance(item, (Migrate, ErrorChunk)) or (isinstance(item, TokenChunk) and item.finish_reason is not None)


def coalesce(chunks: list[Chunk]) -> list[Chunk]:
    """``chunks`` with each run of consecutive TokenChunks merged into one (in order)."""
    out: list[Chunk] = []
    for chunk in chunks:
        if out and isinstance(chunk, TokenChunk) and isinstance(out[-1], TokenChunk) and not is_final(out[-1]):
            out[-1] = out[-1].then(chunk)
        else:
            out.append(chunk)
    return out
