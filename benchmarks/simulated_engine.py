"""An engine core that schedules for real but computes nothing: for cluster tests and
benchmarks that need exact control of step time, or more replicas than CPU cores.

The real Scheduler and BlockAllocator decide batches, KV use and preemptions; a step
then sleeps ``StepTime(batch, tokens)`` instead of running a model, and each request's
next token is a fixed function of its prompt and position, so a migrated or resumed
stream continues exactly as the uninterrupted one would; its text is " <token id>" per
token. Adapters are names only.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

from app.engine.config import EngineConfig
from app.engine.engine_stats import EngineReport, EngineStats
from app.engine.kv_cache import BlockAllocator
from app.engine.scheduler import Scheduler
from app.engine.sequence import Sequence
from app.errors import ContextLengthError, InvalidRequestError
from app.protocol import Chunk, GenerateRequest, Migrate, TokenChunk


@dataclass(frozen=True)
class StepTime:
    """seconds = base_s + per_request_s · batch + per_prefill_token_s · prefill tokens."""

    base_s: float
    per_request_s: float = 0.0
    per_prefill_token_s: float = 0.0

    def __call__(self, batch: int, prefill_tokens: int) -> float:
        return self.base_s + self.per_request_s * batch + self.per_prefill_token_s * prefill_tokens


def simulated_token(prompt: tuple[int, ...], position: int, vocab: int = 32000) -> int:
    return (sum(prompt) * 31 + position * 7919 + 17) % vocab


class _Names:
    """The AdapterStore surface a replica uses, holding names only (no weights)."""

    def __init__(self):
        self._paths: dict[str, str] = {}

    def register(self, name: str, path: str) -> None:
        self._paths[name] = path

    def unregister(self, name: str) -> None:
        self._paths.pop(name, None)

    async def aget(self, name: str):
        return None

    def get(self, name: str):
        return None

    def prefetch(self, name: str) -> Future:
        done: Future = Future()
        done.set_result(None)
        return done

    def version(self, name: str) -> str:
        return "simulated"

    def names(self) -> list[str]:
        return sorted(self._paths)


class _NoGrammars:
    """Grammars' surface: its tokens are a fixed function, so no output can be constrained."""

    def warm(self) -> None:
        pass

    def compile(self, guide):
        raise InvalidRequestError("structured output is not simulated")


class SimulatedCore:
    """A Core (app/engine/interface.py) whose steps sleep instead of running a model."""

    def __init__(self, config: EngineConfig, step_time: StepTime, max_model_len: int = 4096):
        self.config = config
        self.step_time = step_time
        self.max_model_len = max_model_len
        self.adapters = _Names()
        self.grammars = _NoGrammars()
        self.allocator = BlockAllocator(config.num_kv_blocks)
        self.scheduler = Scheduler(config, self.allocator, pool=None)
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = 0
        self.steps = 0
        self.idle = False
        self.max_batch_seen = 0
        self.last_batch_size = 0
        self.last_preempted = 0
        self.preemptions = 0

    def add(self, request: GenerateRequest, adapter=None, grammar=None) -> None:
        if request.params.guide is not None:
            self.grammars.compile(request.params.guide)
        if request.request_id in self._seqs:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        if request.n != 1:  # its streams would wait for choices it never makes
            raise InvalidRequestError("the simulated engine generates one choice per request (n=1)")
        if len(request.prompt_token_ids) + request.params.max_tokens > self.max_model_len:
            raise ContextLengthError("prompt + max_tokens exceed the context length")
        self._arrivals += 1
        seq = Sequence(request, request.params.seed or 0, self._arrivals, None)
        self._seqs[request.request_id] = seq
        self.scheduler.waiting.append(seq)

    def abort(self, request_id: str) -> list[Chunk]:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return []
        self._remove(seq)
        return [TokenChunk(request_id, (), "", None, "abort", len(seq.prompt_ids), len(seq.output_ids))]

    def has_work(self) -> bool:
        return bool(self._seqs)

    def step(self) -> list[Chunk]:
        plan = self.scheduler.schedule()
        self.idle = not plan.scheduled
        out: list[Chunk] = []
        for seq in plan.preempted:
            del self._seqs[seq.request_id]
            out.append(Migrate(seq.request_id, seq.prompt_ids, tuple(seq.output_ids), seq.seed, "kv_cache_exhausted"))
        self.last_preempted = len(plan.preempted) + len(plan.requeued)  # requeued ones stay, to be recomputed
        self.preemptions += self.last_preempted
        if plan.scheduled:
            prefill = sum(n for _, n in plan.scheduled if n > 1)
            time.sleep(self.step_time(len(plan.scheduled), prefill))
            for seq, n in plan.scheduled:
                seq.num_computed += n
                if seq.num_computed == seq.num_tokens:
                    out.append(self._next_token(seq))
            self.steps += 1
            self.max_batch_seen = max(self.max_batch_seen, len(plan.scheduled))
        self.last_batch_size = len(plan.scheduled)
        return out

    def evict_all(self, reason: str) -> list[Migrate]:
        out = []
        for seq in list(self._seqs.values()):
            del self._seqs[seq.request_id]
            self._remove(seq)
            out.append(Migrate(seq.request_id, seq.prompt_ids, tuple(seq.output_ids), seq.seed, reason))
        return out

    def _next_token(self, seq: Sequence) -> TokenChunk:
        token = simulated_token(seq.prompt_ids, len(seq.output_ids))
        seq.output_ids.append(token)
        done = len(seq.output_ids) >= seq.params.max_tokens
        if done:
            del self._seqs[seq.request_id]
            self._remove(seq)
        return TokenChunk(
            seq.request_id,
            (token,),
            f" {token}",
            None,
            "length" if done else None,
            len(seq.prompt_ids),
            len(seq.output_ids),
        )

    def _remove(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)

    def stats(self) -> EngineStats:
        return self.scheduler.stats(steps=self.steps, max_batch_seen=self.max_batch_seen, preemptions=self.preemptions)

    def report(self) -> EngineReport:
        return EngineReport(self.stats(), tuple(self.adapters.names()))

    def failure(self) -> str | None:
        return None


def simulated_engine(step_time: StepTime, settings):
    """An engine_factory for LoraReplica (bind it with functools.partial)."""
    from app.engine.async_engine import AsyncEngine

    return AsyncEngine(SimulatedCore(settings.core_config, step_time))
