"""What flows between ingress, replica and engine: requests in, chunks out."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from app.errors import InvalidRequestError
from cluster.routing_key import RoutingKey
from cluster.stats import arrival_key, prefix_head


@dataclass(frozen=True)
class Guide:
    """A constraint on a request's output, compiled by the grammar engine (app/engine/grammar.py)."""

    kind: str  # "json_schema" | "json_object" | "regex" | "choice"
    spec: str  # the schema as canonical JSON text (sorted keys), the regex, or a JSON list of the choices


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
    guide: Guide | None = None  # structured output: the grammar every generated token must follow
    # None = off; n: each prompt token's logprob (the first's None) + top-n, on the first chunk (echo)
    prompt_logprobs: int | None = None

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty < math.inf, "repetition_penalty must be > 0 and finite (1 disables it)"),
            (
                all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
                "logit_bias maps token ids >= 0 to biases in [-100, 100]",
            ),
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
    client (None: all of it). The router reads its ``routing_key()``: among it
    ``avoid_replicas`` (never these: they failed) and ``migrated_from`` (not this
    one while another has room)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None
    resume_token_ids: tuple[int, ...] = ()
    resume_text_chars: int | None = None
    avoid_replicas: tuple[str, ...] = ()
    migrated_from: str | None = None
    n: int = 1  # choices generated from the prompt, with indices index … index+n−1 (docs/n_choices.md)
    index: int = 0  # its first choice's index (a choice re-submitted alone keeps its own)

    def choice(self, j: int) -> GenerateRequest:
        """Its j-th choice as a request of its own: what that choice equals, token for token."""
        seed = None if self.params.seed is None else choice_seed(self.params.seed, j)
        return dataclasses.replace(self, params=dataclasses.replace(self.params, seed=seed), n=1, index=self.index + j)

    def routing_key(self) -> RoutingKey:
        """What it asks of a replica (cluster/routing_key.py): this submission's prompt and
        resumed tokens, KV blocks for its n choices, its adapter and prefix head, where not to go."""
        return RoutingKey(
            len(self.prompt_token_ids) + len(self.resume_token_ids) + 1,
            arrival_key(self.request_id, len(self.resume_token_ids)),
            self.adapter,
            prefix_head(self.adapter, self.prompt_token_ids),
            frozenset(self.avoid_replicas),
            self.migrated_from,
            self.n,
        )

    def resumed(self, migrate: Migrate) -> GenerateRequest:
        """The request to re-submit after ``migrate``: same id and params, the choice it ended,
        alone, with its seed."""
        params = dataclasses.replace(self.params, seed=migrate.seed)
        return dataclasses.replace(
            self, params=params, resume_token_ids=migrate.output_token_ids, n=1, index=migrate.index
        )


def choice_seed(seed: int, j: int) -> int:
    """The seed of the j-th choice of a request seeded ``seed``: seed + j, wrapped into the signed 64-bit
    range the API accepts, so every choice can be asked for alone with its own seed."""
    return (seed + j + 2**63) % 2**64 - 2**63


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
    completion_tokens: int = 0  # of this choice
    index: int = 0  # the choice it belongs to
    prompt_logprobs: tuple[dict | None, ...] | None = None  # SamplingParams.prompt_logprobs: the first chunk's

    def then(self, later: TokenChunk) -> TokenChunk:
        """This chunk followed by ``later`` as one: tokens, text and logprobs concatenated;
        finish reason and usage from ``later``."""
        logprobs = (
            None if self.logprobs is None and later.logprobs is None else (self.logprobs or ()) + (later.logprobs or ())
        )
        return TokenChunk(
            self.request_id,
            self.token_ids + later.token_ids,
            self.text + later.text,
            logprobs,
            later.finish_reason,
            later.prompt_tokens,
            later.completion_tokens,
            later.index,
            self.prompt_logprobs or later.prompt_logprobs,
        )


@dataclass(frozen=True)
class Migrate:
    """The request left this engine unfinished (KV exhausted, replica draining):
    re-submit it with ``GenerateRequest.resumed`` here or elsewhere."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    seed: int  # the choice's own
    reason: str
    index: int = 0  # the choice that left


@dataclass(frozen=True)
class Accepted:
    """The first item of a replica's stream: which replica took the request."""

    replica_id: str


@dataclass(frozen=True)
class ErrorChunk:
    request_id: str
    message: str
    status: int = 500
    index: int = 0  # the choice it ends


Chunk = TokenChunk | Migrate | ErrorChunk


def is_final(item) -> bool:
    """Whether ``item`` ends its choice (its request's stream once every choice has ended): the one definition."""
    return isinstance(item, (Migrate, ErrorChunk)) or (isinstance(item, TokenChunk) and item.finish_reason is not None)


def coalesce(chunks: list[Chunk]) -> list[Chunk]:
    """``chunks`` with each choice's run of consecutive TokenChunks merged into one: every choice's
    items keep their order (choices interleave, and their relative order carries no meaning)."""
    out: list[Chunk] = []
    open_at: dict[int, int] = {}  # choice → where in `out` its unfinished TokenChunk is
    for chunk in chunks:
        at = open_at.pop(chunk.index, None)
        if at is not None and isinstance(chunk, TokenChunk):
            out[at] = out[at].then(chunk)
        else:
            at = len(out)
            out.append(chunk)
        if isinstance(chunk, TokenChunk) and not is_final(out[at]):
            open_at[chunk.index] = at
    return out
