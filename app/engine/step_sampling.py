"""One step's sampling parameters as per-row tensors, built once per step from its sequences.

Every row of a step is sampled by the same batched ops (app/engine/sampler.py); what differs between
requests is data in these tensors, never code run per row. Host flags say which ops the step needs
at all (a random draw, a top-k or top-p filter, suppressed tokens, logit_bias, penalties, grammar
masks, logprobs), so an all-greedy step costs an argmax as before. Per-token constraints (logit_bias,
penalties: app/engine/penalties.py; a constrained row's allowed tokens: its grammar's bitmask,
app/engine/grammar.py) are further per-row tensors here, applied where the sampler applies the
suppressed tokens.

The random draw of a row is a counter-based uniform keyed by (seed, absolute position of the token):
output `position` of SplitMix64 started at the mixed seed, computed on the host in integer arithmetic.
It depends on nothing else: not the batch, its order or size, the CUDA-graph bucket, the device, or
whether the tokens before were generated here or on another replica before a migration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from app.engine.grammar import fill_masks
from app.engine.penalties import Layout, Penalties
from app.engine.sequence import Sequence

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment
# 1/temperature is kept within float32's normal range: 0 · FLT_MAX = 0 at the best token (a tiny
# temperature is greedy by arithmetic, not inf/inf = nan), −inf · FLT_MIN = −inf for a suppressed one.
_INV_T_MAX = float(np.finfo(np.float32).max)
_INV_T_MIN = float(np.finfo(np.float32).tiny)


def _mix64(z: int) -> int:
    """SplitMix64's finalizer (a bijection of 64-bit integers)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """The draw in (0, 1) of the token at absolute `position` of a request seeded `seed` (any int)."""
    z = _mix64((_mix64(seed & _M64) + (position + 1) * _GAMMA) & _M64)
    return ((z >> 12) + 0.5) * 2.0**-52  # 52 bits: 1 − 2⁻⁵³ at most, exactly representable


def inverse_temperature(t: float) -> float:
    return min(max(1.0 / t, _INV_T_MIN), _INV_T_MAX) if t > 0 else _INV_T_MAX


@dataclass
class StepSampling:
    """What sampler.draw needs for the n rows of one step. Device tensors are None where no row uses them."""

    rows: int
    sampled: bool = False  # some row draws at random (the others take their argmax)
    top_k: int = 0  # the largest top_k of a row that filters by it (0: none does)
    top_p: bool = False  # some row filters by top_p
    logprob_rows: list[int] = field(default_factory=list)  # rows returning logprobs (host)
    logprob_counts: list[int] = field(default_factory=list)  # their top-n each
    greedy: torch.Tensor | None = None  # [n] bool: the argmax, whatever the draw says
    inv_temperature: torch.Tensor | None = None  # [n] float32
    k: torch.Tensor | None = None  # [n] int64, 0: no top-k
    p: torch.Tensor | None = None  # [n] float64, 1: no top-p
    u: torch.Tensor | None = None  # [n] float64 in (0, 1)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) that cannot be drawn now
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # logit_bias: (rows, token ids, biases)
    penalties: Penalties | None = None  # the rows with presence / frequency / repetition penalties
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [m], bitmask [m, ⌈vocab/32⌉] int32): grammars
    logprob_index: torch.Tensor | None = None  # [m] int64, logprob_rows on the device

    @property
    def top_n(self) -> int:
        return max(self.logprob_counts, default=0)


class Staging:
    """Where the step's parameters are copied to the device from. On CUDA, per dtype: two pinned host
    buffers in turn (the step launched ahead fills one while the other's copy may still be queued),
    each refilled only once its previous copy is done, so a copy never blocks the host behind queued
    kernels."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._slots: dict = {}  # numpy dtype → [[buffer, buffer], [event, event], turn]

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """values (1-D; float64, or int32 for token masks) on the device."""
        if not self.cuda:
            return torch.from_numpy(values).to(self.device)
        slot = self._slots.get(values.dtype)
        if slot is None:
            slot = self._slots[values.dtype] = [[None, None], [torch.cuda.Event(), torch.cuda.Event()], 0]
        buffers, copied, k = slot
        slot[2] ^= 1
        copied[k].synchronize()
        buf = buffers[k]
        if buf is None or buf.numel() < values.size:
            buf = buffers[k] = torch.from_numpy(np.empty(max(values.size, 1024), values.dtype)).pin_memory()
        buf.numpy()[: values.size] = values
        out = buf[: values.size].to(self.device, non_blocking=True)
        copied[k].record()
        return out


def step_sampling(
    seqs: list[Sequence],
    eos_ids: tuple[int, ...],
    vocab: int,
    staging: Staging,
    ahead: int = 0,
    pending: tuple[torch.Tensor, list[int]] | None = None,
) -> StepSampling:
    """The parameters of the step that samples the next token of each of `seqs` (its rows, in order).
    ahead: tokens each sequence will have gained by then (1 for a step launched before the current
    step's tokens reach the host); pending: then those tokens, on the device (the previous step's drawn
    tokens, and each row's row in them), which the penalties count."""
    n = len(seqs)
    s = StepSampling(n)
    greedy, inv_t, k, p, u = np.ones(n), np.ones(n), np.zeros(n), np.ones(n), np.full(n, 0.5)
    banned: list[tuple[int, int]] = []
    bias: list[tuple[int, int, float]] = []
    penalized = False
    guided = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    if guided and ahead:
        raise ValueError("a constrained row's mask needs its previous token: it cannot be sampled ahead")
    for i, seq in enumerate(seqs):
        par = seq.params
        if len(seq.output_ids) + ahead < par.min_tokens:  # EOS and stop token ids cannot end it yet
            banned += [(i, t) for t in (*par.stop_token_ids, *(() if par.ignore_eos else eos_ids)) if 0 <= t < vocab]
        bias += [(i, t, b) for t, b in par.logit_bias]
        penalized = penalized or par.penalized
        if par.logprobs is not None:
            s.logprob_rows.append(i)
            s.logprob_counts.append(min(par.logprobs, vocab))
        if par.greedy:
            continue
        s.sampled, greedy[i], inv_t[i] = True, 0, inverse_temperature(par.temperature)
        u[i] = uniform(seq.seed, seq.num_tokens + ahead)
        if 0 < par.top_k < vocab:
            k[i] = par.top_k
            s.top_k = max(s.top_k, par.top_k)
        if par.top_p < 1.0:
            p[i], s.top_p = par.top_p, True
    parts: dict[str, np.ndarray] = {}
    if s.sampled:
        parts["sampled"] = np.concatenate([greedy, inv_t, k, p, u])
    if banned:
        parts["banned"] = np.array(banned, dtype=np.float64).T.reshape(-1)
    if bias:
        parts["bias"] = np.array(bias, dtype=np.float64).T.reshape(-1)
    layout = Layout(seqs, vocab, pending[1] if pending else None) if penalized else None
    if layout is not None:
        parts["penalties"] = np.concatenate(layout.parts)
    if guided:
        parts["guided"] = np.array(guided, dtype=np.float64)
    if s.logprob_rows:
        parts["logprobs"] = np.array(s.logprob_rows, dtype=np.float64)
    if not parts:
        return s  # every row greedy, nothing suppressed or adjusted, no logprobs: the argmax as it is
    dev = _upload(staging, parts)
    if s.sampled:
        d = dev["sampled"]
        s.greedy, s.inv_temperature, s.k = d[:n] > 0.5, d[n : 2 * n].float(), d[2 * n : 3 * n].long()
        s.p, s.u = d[3 * n : 4 * n], d[4 * n : 5 * n]
    if banned:
        pairs = dev["banned"].long()
        s.banned = (pairs[: len(banned)], pairs[len(banned) :])
    if bias:
        triples = dev["bias"]
        s.bias = (
            triples[: len(bias)].long(),
            triples[len(bias) : 2 * len(bias)].long(),
            triples[2 * len(bias) :].float(),
        )
    if layout is not None:
        s.penalties = layout.device(dev["penalties"], pending[0] if pending else None)
    if guided:  # filled here, on the host, while the device runs the step's forward
        bits = fill_masks([seqs[i].grammar for i in guided], vocab)
        s.allowed = (dev["guided"].long(), staging.upload(bits.reshape(-1)).view(bits.shape))
    if s.logprob_rows:
        s.logprob_index = dev["logprobs"].long()
    return s


def _upload(staging: Staging, parts: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Every part on the device in one copy, as slices of it by name."""
    dev = staging.upload(np.concatenate(list(parts.values())))
    out, at = {}, 0
    for name, values in parts.items():
        out[name], at = dev[at : at + values.size], at + values.size
    return out
