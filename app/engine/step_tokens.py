"""One forward step's drawn tokens (StepTokens): the sequences whose next token it gives, and those tokens on request.

Every step's rows are sampled on the logits' device as soon as the step is queued
(app/engine/sampler.py). On CUDA the drawn tokens, finite flags and logprobs are copied into pinned
host memory behind an event: reading them waits for this step's kernels only, so the next decode
step can already be queued behind them (app/engine/run_ahead.py), fed by the drawn tokens on the device.
"""

from __future__ import annotations

import torch

from app.engine.sampler import Drawn, SampleError, nonfinite
from app.engine.sequence import Sequence
from app.engine.step_sampling import StepSampling


def _packed(drawn: Drawn) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens, finite flags, top ids) as one int64 tensor and (logprob, top logprobs) as one float32 one."""
    ints = [drawn.tokens, drawn.finite.long()]
    if drawn.top_ids is not None:
        ints.append(drawn.top_ids.flatten())
    floats = None
    if drawn.logprob is not None:
        floats = torch.cat([drawn.logprob] + ([drawn.top_logprobs.flatten()] if drawn.top_logprobs is not None else []))
    return torch.cat(ints), floats


class DrawnRows:
    """One step's drawn rows: the tokens on the device, and their host copies read on request."""

    def __init__(
        self,
        drawn: Drawn,
        sampling: StepSampling,
        ints: torch.Tensor,
        floats: torch.Tensor | None,
        done: torch.cuda.Event | None = None,
    ):
        self.tokens = drawn.tokens  # [n] int64 on the device: the next step's input tokens
        self._sampling, self._ints, self._floats, self._done = sampling, ints, floats, done
        self._values = None

    def read(self) -> tuple[list[int], list[int], list[dict | None]]:
        """(token, finite flag, logprob dict or None) per row; waits for the step that drew them."""
        if self._values is None:
            if self._done is not None:
                self._done.synchronize()
            self._values = self._unpack(self._ints.tolist(), [] if self._floats is None else self._floats.tolist())
        return self._values

    def _unpack(self, ints: list[int], floats: list[float]):
        sp = self._sampling
        n, m, top = sp.rows, len(sp.logprob_rows), sp.top_n
        tokens, finite, ids = ints[:n], ints[n : 2 * n], ints[2 * n :]
        info: list[dict | None] = [None] * n
        for j, (row, count) in enumerate(zip(sp.logprob_rows, sp.logprob_counts)):
            values = floats[m + j * top : m + j * top + count]
            info[row] = {
                "token_id": tokens[row],
                "logprob": floats[j],
                "top": list(zip(ids[j * top : j * top + count], values)),
            }
        return tokens, finite, info


def host_rows(drawn: Drawn, sampling: StepSampling) -> DrawnRows:
    """DrawnRows read from the device tensors themselves (CPU, or a CUDA step the host waits for anyway)."""
    return DrawnRows(drawn, sampling, *_packed(drawn))


class Readback:
    """Pinned host slots for DrawnRows copies, used in turn: two, so the host reads one step's while
    the step launched ahead copies into the other (a slot is reused only after its read)."""

    def __init__(self, rows: int, max_top: int = 20):
        self._ints = [torch.empty(rows * (2 + max_top), dtype=torch.int64).pin_memory() for _ in range(2)]
        self._floats = [torch.empty(rows * (1 + max_top), dtype=torch.float32).pin_memory() for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)]
        self._turn = 0

    def start(self, drawn: Drawn, sampling: StepSampling) -> DrawnRows:
        """Queue the copy of one step's drawn rows to the host."""
        k = self._turn
        self._turn ^= 1
        ints, floats = _packed(drawn)
        host_ints = self._ints[k][: ints.numel()]
        host_ints.copy_(ints, non_blocking=True)
        host_floats = None
        if floats is not None:
            host_floats = self._floats[k][: floats.numel()]
            host_floats.copy_(floats, non_blocking=True)
        self._events[k].record()
        return DrawnRows(drawn, sampling, host_ints, host_floats, self._events[k])


class StepTokens:
    """`sampled[i]`'s next token is row rows[i] (default i) of `drawn`."""

    def __init__(self, sampled: list[Sequence], drawn: DrawnRows, rows: list[int] | None = None, prompt_logprobs=None):
        """prompt_logprobs: Sequence → its prompt logprob entries computed by this step (app/engine/prompt_logprobs.py)."""
        self.sampled, self.drawn = sampled, drawn
        self.prompt_logprobs = prompt_logprobs or {}
        self.rows = rows if rows is not None else list(range(len(sampled)))

    def sample(self) -> tuple[list[int | SampleError], list[dict | None]]:
        """(token or SampleError, logprob dict or None) for each sampled row."""
        tokens, finite, info = self.drawn.read()
        return (
            [tokens[r] if finite[r] else nonfinite(s) for r, s in zip(self.rows, self.sampled)],
            [info[r] if finite[r] else None for r in self.rows],
        )

    def token_of_row(self, row: int) -> int:
        """The token drawn for a row (after sample())."""
        return self.drawn.read()[0][row]
