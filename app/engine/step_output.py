"""One forward step's output: the sequences whose next token it gives, and those tokens on request.

On CUDA, when every row is `fast_greedy` (greedy, nothing to suppress, no logprobs), each row's
argmax and finite flag are computed on the device and copied into pinned host memory behind an
event: reading them waits for this step's kernels only, so the next decode step can already be
queued behind them (app/engine/run_ahead.py), fed by the device argmax. Any other step samples its
logits with app.engine.sampler.sample, exactly as on the CPU.
"""
from __future__ import annotations

import torch

from app.engine.sampler import greedy_tokens, sample
from app.engine.sequence import Sequence


class DeviceGreedy:
    """One step's per-row argmax [n] int64 on the device and its copy (argmax, finite) on the host."""

    def __init__(self, argmax: torch.Tensor, host: torch.Tensor, done: torch.cuda.Event):
        self.argmax, self._host, self._done = argmax, host, done
        self._values: list[int] | None = None

    def read(self) -> tuple[list[int], list[int]]:
        """(argmax, finite) per row; waits for the step that computed them."""
        if self._values is None:
            self._done.synchronize()
            self._values = self._host.tolist()
        n = len(self._values) // 2
        return self._values[:n], self._values[n:]


class GreedyReadback:
    """Pinned host slots for DeviceGreedy copies, used in turn: two, so the host reads one step's
    while the step launched ahead copies into the other (a slot is reused only after its read)."""

    def __init__(self, rows: int):
        self._host = [torch.empty(2 * rows, dtype=torch.int64).pin_memory() for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)]
        self._turn = 0

    def start(self, logits: torch.Tensor) -> DeviceGreedy:
        """Queue the argmax and finite flag of each row of logits [n, vocab] and their copy to the host."""
        k, n = self._turn, logits.shape[0]
        self._turn ^= 1
        argmax = logits.argmax(dim=-1)
        both = torch.cat((argmax, torch.isfinite(logits).all(dim=-1).long()))
        host = self._host[k][: 2 * n]
        host.copy_(both, non_blocking=True)
        self._events[k].record()
        return DeviceGreedy(argmax, host, self._events[k])


class StepOutput:
    """`sampled[i]`'s next token is row rows[i] (default i) of logits or of greedy."""

    def __init__(self, sampled: list[Sequence], logits: torch.Tensor | None = None,
                 greedy: DeviceGreedy | None = None, rows: list[int] | None = None):
        self.sampled, self.logits, self.greedy = sampled, logits, greedy
        self.rows = rows if rows is not None else list(range(len(sampled)))

    def sample(self, eos_ids: tuple[int, ...]):
        """(tokens, logprob dicts or None) as app.engine.sampler.sample gives them, one per sampled row."""
        if self.greedy is None:
            return sample(self.logits, self.sampled, eos_ids)
        argmax, finite = self.greedy.read()
        tokens = greedy_tokens([argmax[r] for r in self.rows], [bool(finite[r]) for r in self.rows], self.sampled)
        return tokens, [None] * len(self.sampled)

    def token_of_row(self, row: int) -> int:
        """The device argmax of a row (after sample())."""
        return self.greedy.read()[0][row]
