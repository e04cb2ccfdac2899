"""Token sampling: greedy, temperature, top-k, top-p, seeded, min_tokens, logprobs.

Seeded sampling draws from a generator seeded by (seed, absolute position of the
token), so a request resumed after a migration samples exactly what it would
have sampled uninterrupted.

Every value the API accepts is safe here (temperature and top_p down to the
smallest positive float, top_k beyond the vocabulary): rows are shifted by their
maximum before the division by the temperature, in float64, so the best token
sits at 0 and the others at ≤ 0 (−inf once exp would underflow anyway): a tiny
temperature becomes greedy by arithmetic, never inf/inf = nan. Rejecting tiny
values instead would refuse requests OpenAI accepts. A row that still holds a
non-finite logit (an adapter that drives the model out of range) fails its own
request (``SampleError``), never the batch.
"""
from __future__ import annotations

import torch

from app.engine.sequence import Sequence

_MASK64 = (1 << 63) - 1


class SampleError(Exception):
    """One request cannot be sampled; its message is what its client is told."""


def _suppress_stops(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> None:
    """Until min_tokens are out, EOS and stop token ids cannot be drawn."""
    for i, seq in enumerate(seqs):
        p = seq.params
        if len(seq.output_ids) < p.min_tokens:
            banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos_ids)]
            logits[i, [t for t in banned if t < logits.shape[1]]] = float("-inf")


def _draw(row: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    row = row.double()
    row = (row - row.max()) / p.temperature  # ≤ 0, the best token(s) exactly 0
    if p.top_k:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
        drop[0] = False
        probs = probs.scatter(0, idx[drop], 0.0)
    gen = torch.Generator(device=row.device).manual_seed(hash((seq.seed, seq.num_tokens)) & _MASK64)
    return int(torch.multinomial(probs, 1, generator=gen))


def _logprobs(logprobs_row: torch.Tensor, token: int, n: int) -> dict:
    top = torch.topk(logprobs_row, n) if n else None
    return {
        "token_id": token,
        "logprob": float(logprobs_row[token]),
        "top": [(int(i), float(v)) for v, i in zip(*top)] if top is not None else [],
    }


def _nonfinite(seq: Sequence) -> SampleError:
    source = f"adapter {seq.request.adapter!r}" if seq.request.adapter else "the base model"
    return SampleError(f"{source} produced non-finite logits for this request; generation stopped")


def fast_greedy(seq: Sequence) -> bool:
    """Whether sample() gives this row its logits' argmax as is: greedy, no token to suppress, no logprobs."""
    p = seq.params
    return p.greedy and p.logprobs is None and len(seq.output_ids) >= p.min_tokens


def greedy_tokens(argmax: list[int], finite: list[bool], seqs: list[Sequence]) -> list[int | SampleError]:
    """sample()'s tokens for fast_greedy rows, from each row's argmax and finite flag computed elsewhere."""
    return [t if ok else _nonfinite(s) for t, ok, s in zip(argmax, finite, seqs)]


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]):
    """logits: [n, vocab] fp32, one row per sequence → (tokens, logprob dicts or None),
    each list holding a SampleError instead for a request that could not be sampled."""
    raw = logits
    finite = torch.isfinite(raw).all(dim=-1).tolist()
    logits = logits.clone()
    _suppress_stops(logits, seqs, eos_ids)
    greedy = logits.argmax(dim=-1).tolist()
    tokens: list[int | SampleError] = []
    for i, s in enumerate(seqs):
        if not finite[i]:
            tokens.append(_nonfinite(s))
            continue
        try:
            tokens.append(greedy[i] if s.params.greedy else _draw(logits[i], s))
        except RuntimeError as exc:  # torch's own checks (e.g. multinomial's): this request's alone
            tokens.append(SampleError(f"sampling failed for this request: {exc}"))
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and isinstance(tokens[i], int)]
    info: list[dict | None] = [None] * len(seqs)
    if want:
        lp = torch.log_softmax(raw[want], dim=-1).cpu()
        for j, i in enumerate(want):
            info[i] = _logprobs(lp[j], tokens[i], seqs[i].params.logprobs)
    return tokens, info
