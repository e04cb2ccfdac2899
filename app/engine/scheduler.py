"""Continuous batching: FCFS admission bounded by batch size, tokens per step,
free KV blocks and adapter slots; preempt the newest request when KV runs out (cached
prefix blocks count as free: they are evicted first). A preempted request goes back to the
front of the waiting queue to be recomputed (``EngineConfig.requeue_preempted``: a lone replica,
nowhere to move it; nano-vllm's ``preempt()``), else leaves in ``Schedule.preempted`` to move elsewhere. A request admitted with a cached
prefix (app/engine/prefix_cache.py) starts with those blocks, its prefill after them.
A request whose adapter finds every slot pinned waits without blocking others,
until it has waited MAX_SLOT_WAIT_STEPS schedules (aging, see ``_starving``).

The choices of one request (n > 1, docs/n_choices.md) fork from its first choice: they wait
until it has computed the prompt's full blocks (all but the block holding the prompt's last
token), then take references to them (``_fork``) and prefill only the rest, so the prompt's
KV is computed once and held once. A forked choice keeps its shared blocks while it waits for
a batch slot, and gives them back (becoming a plain request) if it waits for KV blocks or an
adapter copy (so it holds blocks only while the batch is full); if the first choice leaves
before its prompt is computed, the others become plain requests."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from app.engine.config import EngineConfig
from app.engine.engine_stats import EngineStats
from app.engine.kv_cache import BlockAllocator
from app.engine.prefix_cache import PrefixCache
from app.engine.sequence import Sequence
from app.engine.step_tokens import StepTokens


@dataclass
class Schedule:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)  # to move elsewhere (their KV is freed)
    requeued: list[Sequence] = field(default_factory=list)  # preempted, back at the waiting queue's front
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # (sequence, why): its adapter would not load


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def shared_blocks(seq: Sequence, block_size: int) -> int:
    """The prompt blocks a request's choices share: its full blocks before the one holding the
    prompt's last token (that token is computed by each choice, for its own first logits)."""
    return (len(seq.prompt_ids) - 1) // block_size


MAX_SLOT_WAIT_STEPS = 64


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: BlockAllocator, pool, prefix: PrefixCache | None = None):
        self.config = config
        self.allocator = allocator
        self.pool = pool
        self.prefix = prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self._clock = 0  # schedules so far
        self._slot_wait: dict[Sequence, int] = {}  # waiting request → the schedule that first found no slot for it

    def schedule(self) -> Schedule:
        self._clock += 1
        out = Schedule()
        budget = self.config.max_tokens_per_step
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted while making room for an older one
                continue
            n = min(seq.num_uncomputed, budget)
            if self._grow(seq, n, out):
                out.scheduled.append((seq, n))
                budget -= n
        self._admit(out, budget)
        return out

    def stats(self, **counters) -> EngineStats:
        """The queues' and KV cache's counts, with the engine's own ``counters`` (EngineStats fields)."""
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting),
            max_batch=self.config.max_num_seqs,
            free_kv_blocks=self.allocator.num_free,
            total_kv_blocks=self.allocator.num_blocks,
            cached_kv_blocks=self.allocator.num_cached,
            **counters,
        )

    def remove(self, seq: Sequence) -> None:
        """Take a request out of the running or waiting queue and free what it holds."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)

    def free(self, seq: Sequence) -> None:
        """Return a request's KV blocks and adapter pin (finish, abort, preemption); choices
        waiting to fork from it become plain requests."""
        self._slot_wait.pop(seq, None)
        if seq.fork_of is not None:  # it leaves before its fork (aborted)
            seq.fork_of.forks.remove(seq)
            seq.fork_of = None
        for child in seq.forks:
            child.fork_of = None
        seq.forks = []
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = seq.num_published = 0
        if seq.lora_slot >= 0:
            self.pool.release((seq.adapter.name, seq.adapter.version))
            seq.lora_slot = -1

    def reserve_next_decode(self, out: StepTokens, max_batch: int) -> tuple[list[Sequence], list[int]] | None:
        """The decode step that must follow step `out` (app/engine/run_ahead.py says when one must), as
        its sequences sorted by adapter and each one's row in `out`, or None; those whose next token
        starts a block are given it now, as the next schedule would first thing. Called once `out`'s
        rows' num_computed count it."""
        if len(out.sampled) != len(self.running):
            return None
        order, src = [], []
        for row, seq in zip(out.rows, out.sampled):
            if len(seq.output_ids) + 1 < seq.params.max_tokens:  # else step N's token ends it
                order.append(seq)
                src.append(row)
        if not order or len(order) > max_batch:
            return None
        if self.waiting and len(order) < self.config.max_num_seqs:
            return None
        growing = [s for s in order if s.num_computed >= len(s.block_table) * self.config.block_size]
        if len(growing) > self.allocator.num_free:
            return None
        for seq in growing:
            seq.block_table += self.allocator.allocate(1)
        by_adapter = sorted(range(len(order)), key=lambda i: order[i].lora_slot)  # one SGMV segment per adapter
        return [order[i] for i in by_adapter], [src[i] for i in by_adapter]

    def _grow(self, seq: Sequence, n: int, out: Schedule) -> bool:
        """Give ``seq`` blocks for n more tokens, preempting the newest requests if needed."""
        need = blocks_for(seq.num_computed + n, self.config.block_size) - len(seq.block_table)
        while need > self.allocator.num_free:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        seq.block_table += self.allocator.allocate(max(need, 0))
        return True

    def _preempt(self, seq: Sequence, out: Schedule) -> None:
        self.running.remove(seq)
        out.scheduled = [(s, n) for s, n in out.scheduled if s is not seq]
        self.free(seq)
        if self.config.requeue_preempted:  # its tokens so far stay: recomputed as one prefill when it is re-admitted
            self.waiting.appendleft(seq)
            out.requeued.append(seq)
        else:
            out.preempted.append(seq)

    def _admit(self, out: Schedule, budget: int) -> None:
        """FCFS; a request whose adapter has no free slot, or is still being copied, waits
        without blocking others."""
        skipped = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            if seq.fork_of is not None:  # its prompt's blocks are still being computed by a sibling
                skipped.append(seq)
                continue
            forked = bool(seq.block_table)  # a waiting request holds blocks only if forked
            if not forked:
                # prompt logprobs need every prompt position run: no cached prefix (app/engine/prompt_logprobs.py)
                cached = self.prefix and seq.params.prompt_logprobs is None
                seq.block_table = self.prefix.match(seq) if cached else []
            if blocks_for(seq.num_tokens + 1, self.config.block_size) - len(seq.block_table) > self.allocator.num_free:
                self._unmatch(seq)
                self.waiting.appendleft(seq)
                break
            try:
                ready = self._adapter_ready(seq)
            except Exception as exc:  # this request's adapter alone: the others are admitted as usual
                self.free(seq)
                out.failed.append((seq, f"adapter {seq.adapter.name!r} could not be loaded: {exc}"))
                continue
            if not ready:
                self._unmatch(seq)
                skipped.append(seq)
                if seq.lora_slot < 0 and self._starving(seq):
                    break
                continue
            self._start(seq, forked)
            self._slot_wait.pop(seq, None)
            n = min(seq.num_uncomputed, budget)
            seq.block_table += self.allocator.allocate(
                blocks_for(seq.num_computed + n, self.config.block_size) - len(seq.block_table)
            )
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _unmatch(self, seq: Sequence) -> None:
        """Give back the cached (or forked) blocks of a request that stays waiting."""
        self.allocator.free(seq.block_table)
        seq.block_table = []

    def _start(self, seq: Sequence, forked: bool) -> None:
        """An admitted request's computed tokens are those of the cached (or forked) blocks it starts from."""
        hits = len(seq.block_table)
        seq.num_computed = hits * self.config.block_size
        seq.num_published = hits
        if self.prefix and not forked:  # a fork is no cache hit: its first choice was counted
            self.prefix.admitted(seq, hits)

    def computed(self, seq: Sequence, n: int) -> None:
        """``seq``'s next n tokens have their KV written: its blocks that filled join the prefix cache,
        and its sibling choices fork once its prompt's full blocks are written."""
        seq.num_computed += n
        if self.prefix:
            self.prefix.publish(seq)
        if seq.forks and seq.num_computed >= shared_blocks(seq, self.config.block_size) * self.config.block_size:
            self._fork(seq)

    def _fork(self, seq: Sequence) -> None:
        """Give each sibling waiting on ``seq`` a reference to its prompt's full blocks."""
        shared = seq.block_table[: shared_blocks(seq, self.config.block_size)]
        for child in seq.forks:
            child.fork_of = None
            child.block_table = self.allocator.share(shared)
        seq.forks = []

    def _starving(self, seq: Sequence) -> bool:
        """Aging: once a request has found every slot pinned for MAX_SLOT_WAIT_STEPS schedules,
        nothing behind it is admitted (those would keep slots pinned), so the running requests
        drain, a slot unpins and this request, ahead of the others, takes it. Its wait is thus
        bounded by MAX_SLOT_WAIT_STEPS + the steps the running requests still need."""
        since = self._slot_wait.setdefault(seq, self._clock)
        return self._clock - since >= MAX_SLOT_WAIT_STEPS

    def _adapter_ready(self, seq: Sequence) -> bool:
        """Pin a slot for the request's adapter (starting its copy) and say whether the copy is done."""
        if seq.adapter is None:
            return True
        if seq.lora_slot < 0:
            slot = self.pool.acquire(seq.adapter)
            if slot is None:
                return False
            seq.lora_slot = slot
        return self.pool.ready(seq.lora_slot)
