"""Block-level prefix caching that cannot mix tenants.

A full KV block is named by a key chained over the request's tokens:
    key_0 = sha256(root ‖ tokens of block 0),  key_i = sha256(key_{i-1} ‖ tokens of block i)
    root  = sha256(base model, adapter name and content version (or none: the base model), block size)
so a key names the KV of exactly one token prefix computed under one set of weights. Two
adapters, the base model, or one adapter name re-registered with new weights (a new
content version) never share a key, and nothing needs invalidating: an old version's blocks
are simply never asked for again and age out of the LRU (app/engine/kv_cache.py).

A new request takes the cached blocks of its longest cached run of leading full blocks and
its prefill starts after them. Never the block holding its last token: at least that token is
computed, for its logits, and a shared block is never written. Blocks are published as they
fill (prompt, resumed and generated tokens alike), so a preempted request that comes back,
or the next turn of a conversation, finds them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from array import array
from collections import Counter, OrderedDict

from app.engine.kv_cache import BlockAllocator
from app.engine.sequence import Sequence
from cluster.stats import prefix_head

RECENT_HEADS = 64  # prefix heads a replica reports to the router


def model_key(cfg) -> str:
    """The base model's part of every root key: its configuration (one engine serves one base
    model, and its KV cache lives in that engine)."""
    return json.dumps(vars(cfg), sort_keys=True, default=_plain)


def _plain(value):
    """JSON for the config's tensors (inv_freq) and nested dataclasses (the family's traits)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} in the model config has no key form")


def root_key(model_key: str, adapter, block_size: int) -> bytes:
    """The chain's start for one set of weights: LoraWeights (name, content version) or None."""
    weights = None if adapter is None else [adapter.name, adapter.version]
    return hashlib.sha256(json.dumps([model_key, weights, block_size]).encode()).digest()


def block_key(previous: bytes, tokens) -> bytes:
    return hashlib.sha256(previous + array("q", tokens).tobytes()).digest()


class PrefixCache:
    """The engine's side of the cache: keys of a request's blocks, lookup at admission,
    publishing blocks as they fill, and what it counts (hits per adapter, recent heads)."""

    def __init__(self, allocator: BlockAllocator, model_key: str, block_size: int):
        self.allocator = allocator
        self.model_key = model_key
        self.block_size = block_size
        self.enabled = allocator.max_cached > 0
        self.hit_tokens: Counter[str] = Counter()  # adapter name ("" = base model) → tokens read from the cache
        self.query_tokens: Counter[str] = Counter()  # … → tokens of admitted requests looked up
        self._heads: OrderedDict[str, None] = OrderedDict()  # most recent last

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq`` may start from (referenced for it); its last token is left out."""
        if not self.enabled:
            return []
        return self.allocator.lookup(self._keys(seq, (seq.num_tokens - 1) // self.block_size))

    def admitted(self, seq: Sequence, hits: int) -> None:
        """Count an admitted request that found ``hits`` cached blocks."""
        name = seq.adapter.name if seq.adapter is not None else ""
        self.hit_tokens[name] += hits * self.block_size
        self.query_tokens[name] += seq.num_tokens
        head = prefix_head(seq.request.adapter, seq.prompt_ids)
        if head is not None:
            self._heads.pop(head, None)
            self._heads[head] = None
            if len(self._heads) > RECENT_HEADS:
                self._heads.popitem(last=False)

    def publish(self, seq: Sequence) -> None:
        """Offer the blocks ``seq`` filled since the last call to the cache."""
        full = seq.num_computed // self.block_size
        if not self.enabled or full <= seq.num_published:
            return
        keys = self._keys(seq, full)
        for i in range(seq.num_published, full):
            self.allocator.cache(seq.block_table[i], keys[i])
        seq.num_published = full

    def recent_heads(self) -> list[str]:
        return list(self._heads)

    def _keys(self, seq: Sequence, n: int) -> list[bytes]:
        """The keys of seq's first n blocks (extending those computed before)."""
        keys, bs = seq.block_keys, self.block_size
        if len(keys) < n:
            tokens = seq.token_ids()
            prev = keys[-1] if keys else root_key(self.model_key, seq.adapter, bs)
            for i in range(len(keys), n):
                prev = block_key(prev, tokens[i * bs : (i + 1) * bs])
                keys.append(prev)
        return keys
