"""presence, frequency and repetition penalties for the rows of a step that ask, on the device.

vLLM's semantics and order (vllm/model_executor/layers/utils.py, apply_penalties), per row, after
logit_bias and the suppressed tokens and before temperature (docs/sampling.md):

1. repetition_penalty r, over every token in the prompt or the output so far: a logit > 0 is divided
   by r, any other multiplied by r (r > 1 discourages a token seen, r < 1 favours it; 1 is off);
2. frequency_penalty f: logit −= f · (times the token was generated so far);
3. presence_penalty p: logit −= p · (the token was generated so far), OpenAI's definitions.

Only the m penalised rows are touched: their token ids go up padded into [m, L] tensors (a pad id is
`vocab`, counted into a column that is then dropped), one scatter_add gives the counts [m, vocab],
and a few elementwise ops over [m, vocab] do the rest. Nothing per row or per token runs in Python on
the device side; a step without a penalised row builds and runs none of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from app.engine.sequence import Sequence

_FLT_MAX = float(np.finfo(np.float32).max)
_FLT_MIN = float(np.finfo(np.float32).tiny)


def _factor(r: float) -> float:
    """r within float32's normal range: never 0 or inf on the device (0 · inf = nan at a zero logit)."""
    return min(max(r, _FLT_MIN), _FLT_MAX)


@dataclass
class Penalties:
    """The penalised rows of one step, on the device."""

    index: torch.Tensor  # [m] int64, their rows
    presence: torch.Tensor  # [m] float32
    frequency: torch.Tensor  # [m] float32
    repetition: torch.Tensor  # [m] float32
    output_ids: torch.Tensor  # [m, Lo] int64: tokens generated so far, `vocab` pads
    prompt_ids: torch.Tensor | None  # [m, Lp] int64: prompt tokens of rows with r ≠ 1; None: no row has one


class Layout:
    """The host side of one step's Penalties: what to upload (`parts`, float64, in order), and how the
    uploaded values become Penalties (`device`)."""

    def __init__(self, seqs: list[Sequence], vocab: int, pending_src: list[int] | None):
        self.rows = [i for i, s in enumerate(seqs) if s.params.penalized]
        pars = [seqs[i].params for i in self.rows]
        outputs = [seqs[i].output_ids for i in self.rows]
        repeats = [p.repetition_penalty != 1.0 for p in pars]
        self.parts = [
            np.array(self.rows, dtype=np.float64),
            np.array(
                [[p.presence_penalty, p.frequency_penalty, _factor(p.repetition_penalty)] for p in pars]
            ).T.ravel(),
            _padded(outputs, vocab),
        ]
        self.out_len = self.parts[-1].size // max(len(self.rows), 1)
        self.prompt_len = 0
        if any(repeats):
            prompts = [seqs[i].prompt_ids if rep else () for i, rep in zip(self.rows, repeats)]
            self.parts.append(_padded(prompts, vocab))
            self.prompt_len = self.parts[-1].size // len(self.rows)
        self.pending = pending_src is not None
        if self.pending:
            self.parts.append(np.array([pending_src[i] for i in self.rows], dtype=np.float64))

    def device(self, values: torch.Tensor, drawn: torch.Tensor | None) -> Penalties:
        """values: the uploaded parts; drawn: the previous step's tokens on the device (`pending_src`
        indexes them), the token each row gains before this step runs."""
        m = len(self.rows)
        index, par = values[:m].long(), values[m : 4 * m].float()
        at = 4 * m + m * self.out_len
        output_ids = values[4 * m : at].long().view(m, self.out_len)
        prompt_ids = None
        if self.prompt_len:
            prompt_ids = values[at : at + m * self.prompt_len].long().view(m, self.prompt_len)
            at += m * self.prompt_len
        if self.pending:
            output_ids = torch.cat([output_ids, drawn.index_select(0, values[at : at + m].long())[:, None]], dim=1)
        return Penalties(index, par[:m], par[m : 2 * m], par[2 * m :], output_ids, prompt_ids)


def _padded(rows: list, vocab: int) -> np.ndarray:
    """Token id lists as one [len(rows), longest] float64 array, flattened, padded with `vocab`."""
    out = np.full((len(rows), max((len(r) for r in rows), default=0)), float(vocab))
    for j, ids in enumerate(rows):
        out[j, : len(ids)] = ids
    return out.ravel()


def penalize(z: torch.Tensor, pen: Penalties) -> None:
    """Apply pen to its rows of z [n, vocab] (fp32), in place."""
    m, vocab = pen.index.numel(), z.shape[1]
    rows = z.index_select(0, pen.index)
    counts = rows.new_zeros(m, vocab + 1).scatter_add_(1, pen.output_ids, rows.new_ones(pen.output_ids.shape))
    counts = counts[:, :vocab]
    generated = counts > 0
    if pen.prompt_ids is not None:
        seen = torch.zeros(m, vocab + 1, dtype=torch.bool, device=z.device).scatter_(1, pen.prompt_ids, True)
        r = torch.where(seen[:, :vocab] | generated, pen.repetition[:, None], 1.0)
        rows = torch.where(rows > 0, rows / r, rows * r)
    rows -= pen.frequency[:, None] * counts
    rows -= pen.presence[:, None] * generated
    # a tiny r can push a large logit past float32's range: +inf would make a sampled row's z − max z nan
    z.index_copy_(0, pen.index, rows.clamp_(max=_FLT_MAX))
