"""One request's state inside the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.protocol import GenerateRequest


@dataclass(eq=False)
class Sequence:
    request: GenerateRequest
    seed: int
    arrival: int  # admission order; the newest is preempted first
    adapter: object = None  # LoraWeights, or None for the base model
    lora_slot: int = -1  # pool slot while running, −1 for the base model
    output_ids: list[int] = field(default_factory=list)  # resumed tokens first, then new ones
    num_computed: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its first full blocks
    num_published: int = 0  # leading blocks of block_table offered to the prefix cache
    detok: object = None
    grammar: object = None  # GrammarState (app/engine/grammar.py) of a constrained request
    index: int = 0  # its choice's index in its request (docs/n_choices.md)
    forks: list[Sequence] = field(default_factory=list)  # sibling choices waiting to share its prompt blocks
    fork_of: Sequence | None = None  # the sibling whose prompt blocks it waits to share

    def __post_init__(self):
        self.output_ids = list(self.request.resume_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def key(self) -> tuple[str, int]:
        """Its name in the engine: request id and choice index."""
        return self.request.request_id, self.index

    @property
    def params(self):
        return self.request.params

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed
