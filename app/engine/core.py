"""The engine: add / abort requests, and step() = schedule → run → postprocess."""

from __future__ import annotations

import itertools
import random

from app.engine import determinism
from app.engine.config import EngineConfig
from app.engine.detokenizer import Detokenizer
from app.engine.engine_stats import EngineReport, EngineStats
from app.engine.grammar import GrammarError, Grammars
from app.engine.interface import Model
from app.engine.kv_cache import BlockAllocator, allocate_kv
from app.engine.prefix_cache import PrefixCache, model_key
from app.engine.prompt_logprobs import wanted
from app.engine.runner import ModelRunner
from app.engine.sampler import SampleError
from app.engine.scheduler import Scheduler, blocks_for, shared_blocks
from app.engine.sequence import Sequence
from app.errors import ContextLengthError, InvalidRequestError
from app.protocol import Chunk, ErrorChunk, GenerateRequest, Migrate, TokenChunk, choice_seed
from ops.lora import prepare as prepare_lora_kernels


class EngineCore:
    def __init__(self, model: Model, adapters, tokenizer, config: EngineConfig):
        self.model = model
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.config = config
        c = model.cfg
        self.max_model_len = config.max_model_len or c.max_position_embeddings
        self.allocator = BlockAllocator(
            config.num_kv_blocks, config.prefix_cache_max_blocks if config.prefix_caching else 0
        )
        self.kv = allocate_kv(
            c.num_layers,
            config.num_kv_blocks,
            config.block_size,
            c.num_kv_heads,
            c.head_dim,
            config.dtype,
            config.device,
        )
        self.prefix = PrefixCache(self.allocator, model_key(c), config.block_size)
        self.scheduler = Scheduler(config, self.allocator, model.lora_pool, self.prefix)
        if model.lora_pool is not None:  # a first-use kernel compile would stall a step mid-serving
            pool = model.lora_pool.config
            prepare_lora_kernels(pool.dtype, pool.max_rank, pool.device)
        determinism.apply(model, config)  # before the runner captures graphs of the forward
        self.runner = ModelRunner(model, self.kv, config, self.max_model_len)
        self.grammars = Grammars(tokenizer, c.vocab_size, c.eos_token_ids)
        self._arrivals = itertools.count()
        self._seqs: dict[tuple[str, int], Sequence] = {}  # (request id, choice index) → its sequence
        self._prompt_lp: dict[tuple[str, int], list] = {}  # its prompt logprobs until its first chunk carries them
        self.steps = 0
        self.idle = False
        self.max_batch_seen = 0  # most requests in one forward pass
        self.last_batch_size = 0  # requests in the latest forward pass
        self.last_preempted = 0  # requests the latest step preempted (moved out or requeued)
        self.preemptions = 0  # requests preempted, ever
        self.tokens_computed = 0  # prefill + decode tokens through the model, ever
        self.startup_report: dict = {}  # the KV plan and start-up times (app/engine/factory.py), in stats()

    # -- requests -------------------------------------------------------------
    def add(self, request: GenerateRequest, adapter=None, grammar=None) -> None:
        """Validate and queue; raises (before any compute) on unknown adapter or bad input.
        ``adapter``: the request's LoraWeights if the caller resolved them already (the
        async engine does, off this thread); else they are fetched here, blocking. ``grammar``:
        likewise its compiled guide (Grammars.compile), else compiled here (cached).
        A request of n choices becomes n sequences, choice j seeded choice_seed(seed, j), each with a
        grammar state of its own; the others fork from the first's prompt blocks (app/engine/scheduler.py)."""
        if request.adapter and adapter is None:
            adapter = self.adapters.get(request.adapter)
        self._validate(request)
        guide = request.params.guide
        if guide is not None and grammar is None:
            grammar = self.grammars.compile(guide)
        seed = request.params.seed if request.params.seed is not None else random.getrandbits(63)
        seqs = [
            self._sequence(request, choice_seed(seed, j), request.index + j, adapter, grammar) for j in range(request.n)
        ]
        if shared_blocks(seqs[0], self.config.block_size):  # the others fork from the first's prompt blocks
            seqs[0].forks = seqs[1:]
            for seq in seqs[1:]:
                seq.fork_of = seqs[0]
        for seq in seqs:
            self._seqs[seq.key] = seq
            if wanted(seq):
                self._prompt_lp[seq.key] = [None]  # the first prompt token has no logprob
        self.scheduler.waiting.extend(seqs)

    def _sequence(self, request: GenerateRequest, seed: int, index: int, adapter, grammar) -> Sequence:
        seq = Sequence(request, seed, next(self._arrivals), adapter, index=index)
        if grammar is not None:
            seq.grammar = self.grammars.state(grammar, request.resume_token_ids)
        seq.detok = Detokenizer(self.tokenizer, request.params.stop, seq.output_ids, request.resume_text_chars)
        return seq

    def _validate(self, r: GenerateRequest) -> None:
        if r.n < 1:
            raise InvalidRequestError("n must be >= 1")
        if r.params.prompt_logprobs is not None and r.n > 1:
            raise InvalidRequestError("prompt logprobs are computed for requests of one choice")
        if any((r.request_id, r.index + j) in self._seqs for j in range(r.n)):
            raise InvalidRequestError(f"request id {r.request_id!r} is already running")
        if not r.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        if any(not 0 <= t < self.model.cfg.vocab_size for t in (*r.prompt_token_ids, *r.resume_token_ids)):
            raise InvalidRequestError("prompt holds token ids outside the vocabulary")
        r.params.check_vocabulary(self.model.cfg.vocab_size)
        if r.params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer")
        total = len(r.prompt_token_ids) + r.params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({len(r.prompt_token_ids)} tokens) + max_tokens ({r.params.max_tokens}) = {total} "
                f"exceeds the model's context length {self.max_model_len}"
            )
        if blocks_for(total, self.config.block_size) > self.config.num_kv_blocks:
            raise ContextLengthError(
                f"{total} tokens exceed this replica's KV cache ({self.config.num_kv_blocks} blocks)"
            )

    def abort(self, request_id: str) -> list[Chunk]:
        """End every choice of the request still here."""
        seqs = [seq for key, seq in self._seqs.items() if key[0] == request_id]
        for seq in seqs:
            self._drop(seq)
        return [self._chunk(seq, (), "", None, "abort") for seq in seqs]

    def has_work(self) -> bool:
        return bool(self._seqs)

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[Chunk]:
        plan = self.scheduler.schedule()
        self.idle = not plan.scheduled  # nothing runnable: only waiting for adapter copies or KV
        out: list[Chunk] = [self._migrate(seq) for seq in plan.preempted]
        for seq in plan.requeued:  # recomputed from its first token: so are its prompt logprobs
            if seq.key in self._prompt_lp:
                self._prompt_lp[seq.key] = [None]
        self.last_preempted = len(plan.preempted) + len(plan.requeued)
        self.preemptions += self.last_preempted
        out += [self._fail(seq, message) for seq, message in plan.failed]
        if plan.scheduled:
            result = self.runner.step(plan.scheduled)
            for seq, got in result.prompt_logprobs.items():
                self._prompt_lp[seq.key] += got
            for seq, n in plan.scheduled:
                self.scheduler.computed(seq, n)
                self.tokens_computed += n
            ahead = self.scheduler.reserve_next_decode(result, self.runner.max_ahead) if self.runner.max_ahead else None
            self.runner.run_ahead(result, ahead)  # the GPU works on while the host samples
            tokens, logprobs = result.sample()
            out += [
                self._fail(s, str(t)) if isinstance(t, SampleError) else self._postprocess(s, t, lp)
                for s, t, lp in zip(result.sampled, tokens, logprobs)
            ]
            self.steps += 1
            self.max_batch_seen = max(self.max_batch_seen, len(plan.scheduled))
        self.last_batch_size = len(plan.scheduled)
        return out

    def _postprocess(self, seq: Sequence, token: int, logprob: dict | None) -> Chunk:
        try:  # a constrained output ends where its grammar is complete (its EOS is no text)
            complete = seq.grammar is not None and seq.grammar.advance(token)
        except GrammarError as exc:
            return self._fail(seq, str(exc))
        seq.output_ids.append(token)
        p = seq.params
        past_min = len(seq.output_ids) >= p.min_tokens
        stop_token = past_min and (
            token in p.stop_token_ids or (not p.ignore_eos and token in self.model.cfg.eos_token_ids)
        )
        stop_token = stop_token or (complete and token in seq.grammar.eos_ids)
        visible = seq.output_ids[:-1] if stop_token else seq.output_ids  # a stop token is not text
        text, stop_hit = seq.detok.update(visible, check_stop=past_min)
        reason = (
            "stop" if stop_token or stop_hit or complete else "length" if len(seq.output_ids) >= p.max_tokens else None
        )
        if reason is not None:
            text += "" if stop_hit else seq.detok.flush(visible)
            self._drop(seq)
        return self._chunk(seq, (token,), text, (logprob,) if logprob else None, reason)

    def _chunk(self, seq, token_ids, text, logprobs, finish_reason) -> TokenChunk:
        prompt = self._prompt_lp.pop(seq.key, None)
        return TokenChunk(
            seq.request_id,
            token_ids,
            text,
            logprobs,
            finish_reason,
            len(seq.prompt_ids),
            len(seq.output_ids),
            seq.index,
            None if prompt is None else tuple(prompt),
        )

    def _migrate(self, seq: Sequence, reason: str = "kv_cache_exhausted") -> Migrate:
        del self._seqs[seq.key]
        self._prompt_lp.pop(seq.key, None)
        return Migrate(seq.request_id, seq.prompt_ids, tuple(seq.output_ids), seq.seed, reason, seq.index)

    def evict_all(self, reason: str) -> list[Migrate]:
        """End every request unfinished (the replica is draining): each Migrate carries what it
        generated so far, its KV blocks are freed."""
        out = []
        for seq in list(self._seqs.values()):
            self._drop(seq)
            self._seqs[seq.key] = seq  # _migrate removes it again
            out.append(self._migrate(seq, reason))
        return out

    def _fail(self, seq: Sequence, message: str) -> ErrorChunk:
        """End one request for a reason of its own (its sampling, its adapter); the rest carry on."""
        self._drop(seq)
        self._prompt_lp.pop(seq.key, None)
        return ErrorChunk(seq.request_id, message, 500, seq.index)

    def _drop(self, seq: Sequence) -> None:
        del self._seqs[seq.key]
        self.scheduler.remove(seq)

    # -- introspection ------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.model.lora_pool
        return self.scheduler.stats(
            resident_adapters=tuple(name for name, _ in pool.resident()) if pool else (),
            steps=self.steps,
            max_batch_seen=self.max_batch_seen,
            tokens_computed=self.tokens_computed,
            preemptions=self.preemptions,
            prefix_hit_tokens=dict(self.prefix.hit_tokens),
            prefix_query_tokens=dict(self.prefix.query_tokens),
            prefix_heads=tuple(self.prefix.recent_heads()),
            kv_cache=self.startup_report.get("kv_cache"),
            startup_seconds=self.startup_report.get("startup_seconds"),
            **determinism.stats(self.config),  # the switch and the op paths it selected
        )

    def report(self) -> EngineReport:
        """The counters and the adapter store's names, tiers and counts (run on the loop: exact)."""
        store = self.adapters
        tiers = {**store.describe(), "tiers": store.tiers(self.model.lora_pool)}
        return EngineReport(self.stats(), tuple(store.names()), tiers)

    def failure(self) -> str | None:
        """Why this engine can serve nothing more (None: it can): only the tensor-parallel model
        (app/engine/tp/model.py) can fall out of step, in a failed step."""
        broken = self.model.broken
        return None if broken is None else f"tensor-parallel shards out of step: {broken}"
