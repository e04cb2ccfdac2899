"""Token sampling for every row of a step at once: greedy, temperature, top-k, top-p, seeded,
min_tokens (suppressed stop tokens), logit_bias, penalties, grammar masks, logprobs.

`draw` is a few batched torch ops over the step's logits [n, vocab], the same on CPU and CUDA, with
no per-row Python and no host sync (CUDA-graph replays and steps launched ahead queue it behind them;
the host reads only its results, app/engine/step_tokens.py). Per row, from its parameters
(app/engine/step_sampling.py):

1. logit_bias is added; suppressed tokens (stop tokens before min_tokens) are set to −inf; then the
   repetition, frequency and presence penalties (app/engine/penalties.py): vLLM's order, on a copy;
   last, tokens a row's grammar does not allow (its bitmask, app/engine/grammar.py) are set to −inf,
   so that no bias or penalty can lift one back into reach;
2. greedy rows take the argmax (the first on ties, as torch.argmax);
3. sampled rows: s = (z − max z) / T ≤ 0, the best token at exactly 0; top-k keeps s ≥ its k-th
   largest value, top-p the largest values whose mass before them is < top_p (ranked by one sort per
   step, only when a row asks); then inverse-CDF sampling in vocabulary order: the token is the first
   whose cumulative exp(s) (float64) exceeds u · total, u the row's counter-based uniform for
   (seed, absolute position). A token of zero mass is never drawn (the cumulative sum does not rise
   there). Keeping everything ≥ a threshold keeps ties at the cut-off together, so no rank order of
   equal values (which a sort or top-k may give in any order) decides a token. On CUDA one kernel
   draws every sampled row (ops/sampling.py: the floors by bisecting the float keys, no sort; one
   launch instead of ~20 and a sort of the vocabulary); these torch ops are its reference and the
   CPU path, and the two agree token for token up to float64 rounding of the sums.

Every value the API accepts is safe: 1/T is clamped to float32's normal range (a temperature as small
as 5e-324 leaves only the best token(s) at 0 and the rest at −inf: greedy by arithmetic, never
inf/inf = nan); top_p keeps at least the best token; top_k beyond the vocabulary is off. A row that
holds a non-finite logit (an adapter that drives the model out of range) yields a token index that is
still in range, and its finite flag fails its own request (``SampleError``), never the batch.

Logprobs are those of the model's own distribution, log_softmax of the raw logits: before logit_bias,
suppression, penalties, grammar masks and temperature, as vLLM returns them by default (logprobs_mode "raw_logprobs").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.penalties import penalize
from app.engine.sequence import Sequence
from app.engine.step_sampling import StepSampling
from ops import sampling


class SampleError(Exception):
    """One request cannot be sampled; its message is what its client is told."""


def nonfinite(seq: Sequence) -> SampleError:
    source = f"adapter {seq.request.adapter!r}" if seq.request.adapter else "the base model"
    return SampleError(f"{source} produced non-finite logits for this request; generation stopped")


@dataclass
class Drawn:
    """One step's results on the logits' device."""

    tokens: torch.Tensor  # [n] int64
    finite: torch.Tensor  # [n] bool: the row's logits were all finite
    logprob: torch.Tensor | None = None  # [m] float32, the drawn token's, for StepSampling.logprob_rows
    top_logprobs: torch.Tensor | None = None  # [m, top_n] float32, descending
    top_ids: torch.Tensor | None = None  # [m, top_n] int64


def draw(logits: torch.Tensor, sp: StepSampling) -> Drawn:
    """logits: [n, vocab] fp32, row i sampled by sp's row i (logits are not modified)."""
    z = adjusted(logits, sp)
    tokens = z.argmax(dim=-1)
    if sp.sampled and sampling.usable(z):  # one kernel, no sort: the same draw up to float64 rounding
        sampling.sample_rows(z, sp.greedy, sp.inv_temperature, sp.k, sp.p, sp.u, tokens)
    elif sp.sampled:
        tokens = torch.where(sp.greedy, tokens, _random(z, sp))
    out = Drawn(tokens, torch.isfinite(logits).all(dim=-1))
    if sp.logprob_rows:
        lp = torch.log_softmax(logits.index_select(0, sp.logprob_index), dim=-1)
        out.logprob = lp.gather(1, tokens.index_select(0, sp.logprob_index)[:, None]).squeeze(1)
        if sp.top_n:
            out.top_logprobs, out.top_ids = torch.topk(lp, sp.top_n, dim=-1)
    return out


def adjusted(logits: torch.Tensor, sp: StepSampling) -> torch.Tensor:
    """The logits the rows are drawn from: a copy with logit_bias, suppression and penalties applied
    (vLLM's order), then the grammar masks, or `logits` itself where the step has none of them."""
    if sp.bias is None and sp.banned is None and sp.penalties is None and sp.allowed is None:
        return logits
    z = logits.clone(memory_format=torch.contiguous_format)
    if sp.bias is not None:  # the pairs of a row are distinct (a dict), so accumulate only adds
        z.index_put_(sp.bias[:2], sp.bias[2], accumulate=True)
    if sp.banned is not None:
        z.index_put_(sp.banned, z.new_full((), float("-inf")))  # a device fill: no host copy, no sync
    if sp.penalties is not None:
        penalize(z, sp.penalties)
    if sp.allowed is not None:
        rows, bits = sp.allowed
        z.index_copy_(
            0, rows, torch.where(_unpack(bits, z.shape[-1]), z.index_select(0, rows), z.new_full((), float("-inf")))
        )
    return z


def _unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[m, ⌈vocab/32⌉] int32 bitmask → [m, vocab] bool (bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]


def _random(z: torch.Tensor, sp: StepSampling) -> torch.Tensor:
    s = (z - z.max(dim=-1, keepdim=True).values) * sp.inv_temperature[:, None]
    if sp.top_k or sp.top_p:
        s = s.masked_fill(s < _floor(s, sp)[:, None], float("-inf"))
    cdf = torch.cumsum(torch.exp(s), dim=-1, dtype=torch.float64)
    x = sp.u[:, None] * cdf[:, -1:]  # < the total: u ≤ 1 − 2⁻⁵³
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=z.shape[-1] - 1)


def _floor(s: torch.Tensor, sp: StepSampling) -> torch.Tensor:
    """[n] the smallest s each row keeps after top-k, then top-p (−inf: all)."""
    if sp.top_p:
        ranked = torch.sort(s, dim=-1, descending=True).values
    else:
        ranked = torch.topk(s, sp.top_k, dim=-1).values
    last = ranked.shape[-1] - 1
    none = s.new_full((), float("-inf"))
    floor = none.expand(s.shape[0])
    if sp.top_k:
        kth = ranked.gather(1, (sp.k - 1).clamp(0, last)[:, None]).squeeze(1)
        floor = torch.where(sp.k > 0, kth, none)
    if sp.top_p:
        mass = torch.exp(ranked).double().masked_fill_(ranked < floor[:, None], 0.0)
        cum = mass.cumsum(dim=-1)
        kept = ((cum - mass) < sp.p[:, None] * cum[:, -1:]).sum(dim=-1).clamp_(1, last + 1)
        pth = ranked.gather(1, (kept - 1)[:, None]).squeeze(1)
        floor = torch.where(sp.p < 1.0, torch.maximum(floor, pth), floor)
    return floor
