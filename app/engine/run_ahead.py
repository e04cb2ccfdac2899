"""Decode steps launched one step ahead, so the host's work between steps hides behind the GPU.

After step N is queued, and before its tokens reach the host, step N+1 is queued behind it when
it can only be a plain decode step of the same requests: every running request was sampled by
step N, the free KV blocks cover the requests whose next token starts a block (the scheduler gives
them now, as it would first thing next step, so it then allocates and preempts nothing:
Scheduler.reserve_next_decode), and no waiting request could join (none waits, or the batch stays
full). Requests that step N ends by length are left out. Step N+1 is a CUDA-graph decode step whose input tokens are step N's drawn tokens, read on
the device; everything else it needs (positions, slots, block tables, adapter segments, and its
sampling parameters: each row one token further, app/engine/step_sampling.py) is known.

The engine's next step takes it if what the scheduler then plans is a decode step of a subset of
those requests, each still at the position and with the token the step ran on; rows of requests
that ended meanwhile (stop token, abort) are dropped, as a smaller batch would compute the others
(row results, sampled tokens included, do not depend on each other). Otherwise it is discarded: its
KV writes went to slots that the real step rewrites, or to blocks of ended requests, which later
owners write after it in stream order; its cost is one wasted decode step on the GPU.

A constrained request (structured output, app/engine/grammar.py) goes ahead too, but its step's
draw waits: a row's token mask depends on step N's token, which the host has not read when step
N+1 is queued. Only the forward is queued then; `take` draws the step's rows from its logits once
step N's tokens have advanced the matchers, with each row's mask (so the host fills the masks while
the device still runs the forward, and step N+2 is queued behind that draw). Leaving the row out
would not do: the next schedule holds it, so the step would be discarded, and a second forward for
it alone would read the weights twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.engine.sequence import Sequence
from app.engine.step_tokens import StepTokens


@dataclass
class DecodeAhead:
    """A decode step launched before the previous step's tokens reached the host: its rows and what it ran on."""

    order: list[Sequence]  # the rows of the step launched ahead
    positions: list[int]  # each row's num_computed it ran at
    src_rows: list[int]  # each row's row in `previous`, whose drawn token was its input token
    previous: StepTokens
    output: StepTokens | None  # None: drawn when taken, by draw_later(rows, sequences)
    draw_later: Callable[[list[int], list[Sequence]], object] | None = None

    def take(self, scheduled: list[tuple[Sequence, int]]) -> StepTokens | None:
        """The output for this schedule if the step launched ahead computed it, else None."""
        index = {id(s): i for i, s in enumerate(self.order)}
        rows = []
        for seq, n in scheduled:
            i = index.get(id(seq), -1)
            if (
                n != 1
                or i < 0
                or seq.num_computed != self.positions[i]
                or not seq.output_ids
                or seq.output_ids[-1] != self.previous.token_of_row(self.src_rows[i])
            ):
                return None
            rows.append(i)
        rows.sort()
        seqs = [self.order[i] for i in rows]
        if self.output is None:
            return StepTokens(seqs, self.draw_later(rows, seqs))
        return StepTokens(seqs, self.output.drawn, rows)
