"""Multi-turn chat conversations for benchmarks/prefix_cache.py: each turn resends the whole conversation.

A conversation belongs to one tenant (its adapter, its system prompt) and has a few turns. Turn k's
prompt is the system prompt, then every earlier turn's user message and the answer the engine
actually generated for it (token ids, taken from the engine's output), then turn k's own user
message; so turn k+1 extends turn k's prompt and answer, whose full KV blocks the cache keeps.
Turns of one conversation are sequential: turn k+1 is sent when turn k's answer is complete,
plus a think time. Conversations arrive Poisson. Everything random (tenants, lengths, user
tokens, think times) is drawn up front from seeds, so cache off and cache on replay the same
conversations; only the answers come from each engine.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np


@dataclasses.dataclass(frozen=True)
class Conversation:
    cid: int
    tenant: int
    start: float  # arrival of its first turn, seconds from the part's start
    users: tuple[tuple[int, ...], ...]  # one user message per turn
    thinks: tuple[float, ...]  # pause between turn k-1's answer and turn k (thinks[0] unused)


def conversations(
    seconds: float, rate: float, tenants: int, turns: tuple[int, int], user: int, vocab: int, think_s: float, seed: int
) -> list[Conversation]:
    """Poisson arrivals at `rate` conversations/s for `seconds`; turns uniform in [turns[0], turns[1]];
    think times exponential with mean `think_s` (0: none)."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, size=int(rate * seconds * 2) + 16)
    starts = [float(a) for a in np.cumsum(gaps) if a < seconds]
    rng = random.Random(seed)
    out = []
    for cid, start in enumerate(starts):
        n = rng.randint(*turns)
        users = tuple(tuple(rng.randrange(vocab) for _ in range(user)) for _ in range(n))
        thinks = tuple(rng.expovariate(1 / think_s) if think_s > 0 else 0.0 for _ in range(n))
        out.append(Conversation(cid, rng.randrange(tenants), start, users, thinks))
    return out


def capacity_prompts(rng: random.Random, systems, n: int, turns: tuple[int, int], user: int, new: int, vocab: int):
    """n (prompt, tenant) pairs shaped like a trace's turns, for a cache-off capacity run (only
    the lengths matter there): a tenant's system prompt + random tokens, the length of a turn
    drawn in the proportion a trace holds them (each conversation length equally likely, a
    conversation of m turns contributing turns 1..m)."""
    system = len(systems[0])
    lengths = [system + (k + 1) * user + k * new for m in range(turns[0], turns[1] + 1) for k in range(m)]
    out = []
    for _ in range(n):
        t, length = rng.randrange(len(systems)), rng.choice(lengths)
        out.append((tuple(systems[t]) + tuple(rng.randrange(vocab) for _ in range(length - system)), t))
    return out


class ChatTrace:
    """One replay of `convs` on one engine: the first turns with their arrivals, and the next
    turn of a conversation once the engine has answered the previous one."""

    def __init__(self, convs: list[Conversation], systems, new_tokens: int, tag: str):
        self.convs = {c.cid: c for c in convs}
        self.systems, self.new_tokens, self.tag = systems, new_tokens, tag
        self.answers: dict[int, list[tuple[int, ...]]] = {c.cid: [] for c in convs}

    def first(self) -> tuple[list[tuple[object, int]], list[float]]:
        """Every conversation's first turn: (request, tenant) pairs and their arrivals (s)."""
        convs = list(self.convs.values())
        return [(self._request(c, 0), c.tenant) for c in convs], [c.start for c in convs]

    def finished(self, request_id: str, answer) -> list[tuple[float, object, int]]:
        """Turn `request_id` answered with token ids `answer`: (delay s, request, tenant) of the
        conversation's next turn, or nothing after its last."""
        cid, k = (int(x) for x in request_id[len(self.tag) :].split("."))
        conv = self.convs[cid]
        assert len(self.answers[cid]) == k, "turns of one conversation are sequential"
        self.answers[cid].append(tuple(answer))
        if k + 1 == len(conv.users):
            return []
        return [(conv.thinks[k + 1], self._request(conv, k + 1), conv.tenant)]

    def turns(self) -> int:
        return sum(len(c.users) for c in self.convs.values())

    def ttft_by_turn(self, ttft: dict[str, float]) -> dict[int, float]:
        """Median TTFT (s) of each turn number (1-based) from {request id: TTFT}."""
        by_turn: dict[int, list[float]] = {}
        for rid, v in ttft.items():
            by_turn.setdefault(int(rid.rsplit(".", 1)[1]) + 1, []).append(v)
        return {k: float(np.median(v)) for k, v in sorted(by_turn.items())}

    def same_answers(self, other: ChatTrace) -> float:
        """Share of turns answered alike here and in `other` (a replay of the same conversations)."""
        pairs = [(a, b) for cid, mine in self.answers.items() for a, b in zip(mine, other.answers[cid])]
        return sum(a == b for a, b in pairs) / len(pairs)

    def _request(self, conv: Conversation, k: int):
        from app.protocol import GenerateRequest, SamplingParams

        prompt = list(self.systems[conv.tenant])
        for user, answer in zip(conv.users[:k], self.answers[conv.cid]):
            prompt += user
            prompt += answer
        prompt += conv.users[k]
        params = SamplingParams(max_tokens=self.new_tokens, temperature=0.0)
        return GenerateRequest(f"{self.tag}{conv.cid}.{k}", tuple(prompt), params, f"a{conv.tenant}")
