"""The batched sampler on fixed logits (CPU, the code the CUDA engine runs on device tensors):
20,000 seeded draws per setting follow the reference distribution (chi-square) and never leave the
top-k / top-p set; a row's token depends only on its own logits and parameters, not on the batch;
suppressed tokens, logprobs and every accepted extreme value behave."""

import math
from types import SimpleNamespace

import pytest
import torch

from app.engine.sampler import draw
from app.engine.sequence import Sequence
from app.engine.step_sampling import Staging, step_sampling, uniform
from app.protocol import GenerateRequest, SamplingParams

VOCAB = 40
DRAWS = 20_000
CPU = Staging("cpu")


def _logits(seed=0, rows=1, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 2.0


def _seq(params: SamplingParams, seed=0, prompt=(1, 2, 3), outputs=0) -> Sequence:
    seq = Sequence(GenerateRequest("r", prompt, params), seed, 0)
    seq.output_ids = list(range(outputs))
    return seq


def _at_position(params: SamplingParams, seed: int, position: int) -> SimpleNamespace:
    """What step_sampling reads of a Sequence, at any absolute position without a prompt that long."""
    return SimpleNamespace(params=params, seed=seed, output_ids=[], num_tokens=position, grammar=None)


def _draw(logits, seqs, eos=()):
    sp = step_sampling(seqs, eos, logits.shape[-1], CPU)
    return draw(logits, sp), sp


def _reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the parameters define, in float64 (top-k, then top-p on the renormalised rest)."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    if 0 < p.top_k < probs.numel():
        probs[probs < probs.topk(p.top_k).values[-1]] = 0
        probs /= probs.sum()
    if p.top_p < 1:
        ranked, order = probs.sort(descending=True)
        drop = ranked.cumsum(0) - ranked >= p.top_p  # the smallest prefix whose mass reaches top_p stays
        probs[order[drop]] = 0
        probs /= probs.sum()
    return probs


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's test; bins expected below 5 are pooled into one."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


SETTINGS = {
    "temperature-0.5": SamplingParams(temperature=0.5),
    "temperature-1.0": SamplingParams(temperature=1.0),
    "top-k-5": SamplingParams(temperature=1.0, top_k=5),
    "top-p-0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "combined": SamplingParams(temperature=1.5, top_k=12, top_p=0.8),
}


@pytest.mark.parametrize("over", ["seeds", "positions"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_draws_follow_the_reference_distribution(name, over):
    """20,000 draws: seeds 0..19,999 at one position, or seed 7 at positions 0..19,999."""
    params = SETTINGS[name]
    logits = _logits(1)
    if over == "seeds":
        seqs = [_seq(params, seed=i) for i in range(DRAWS)]
    else:
        seqs = [_at_position(params, 7, i) for i in range(DRAWS)]
    drawn, _ = _draw(logits.expand(DRAWS, VOCAB).contiguous(), seqs)
    counts = torch.bincount(drawn.tokens, minlength=VOCAB).double()
    ref = _reference(logits[0], params)
    assert counts[ref == 0].sum() == 0, "a token outside the top-k / top-p set was drawn"
    assert (ref > 0).sum() >= 3, "the setting leaves too few tokens to test"
    p = _chi_square_p(counts, ref * DRAWS)
    assert p > 0.001, (name, over, p)


def test_the_chi_square_check_rejects_a_wrong_distribution():
    """The same check on draws at temperature 1.0 against the temperature 0.5 reference fails."""
    logits = _logits(1)
    seqs = [_seq(SETTINGS["temperature-1.0"], seed=i) for i in range(DRAWS)]
    drawn, _ = _draw(logits.expand(DRAWS, VOCAB).contiguous(), seqs)
    counts = torch.bincount(drawn.tokens, minlength=VOCAB).double()
    assert _chi_square_p(counts, _reference(logits[0], SETTINGS["temperature-0.5"]) * DRAWS) < 1e-6


def _mixed_batch(n=64, vocab=300):
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=7),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.95, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0, min_tokens=5, stop_token_ids=(4, 9)),
        SamplingParams(temperature=1.0, min_tokens=9, stop_token_ids=(11,)),
    ]
    seqs = [_seq(kinds[i % len(kinds)], seed=1000 + i, outputs=i % 13) for i in range(n)]
    return _logits(2, n, vocab), seqs


def test_a_rows_token_does_not_depend_on_the_batch():
    """Each row of a mixed batch draws alone, and in the batch reversed, what it draws in the batch."""
    logits, seqs = _mixed_batch()
    batch, _ = _draw(logits, seqs, eos=(0,))
    alone = [int(_draw(logits[i : i + 1], [s], eos=(0,))[0].tokens[0]) for i, s in enumerate(seqs)]
    reverse, _ = _draw(logits.flip(0), seqs[::-1], eos=(0,))
    assert batch.tokens.tolist() == alone == reverse.tokens.flip(0).tolist()
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    assert len({alone[i] for i in sampled}) > 10, "sampled rows all drew the same token"


def test_the_draw_is_keyed_by_seed_and_position():
    assert uniform(1, 5) == uniform(1, 5)
    draws = {uniform(s, p) for s in (0, 1, -1, 2**62, -(2**63), 10**30) for p in range(50)}
    assert len(draws) == 300 and all(0 < u < 1 for u in draws)
    logits = _logits(3, 1, 1000).expand(2, 1000).contiguous() * 0.1  # nearly flat: seeds decide
    params = SamplingParams(temperature=1.0)
    a = [
        int(_draw(logits, [_seq(params, 1, outputs=i), _seq(params, 2, outputs=i)])[0].tokens[k])
        for i in range(20)
        for k in (0, 1)
    ]
    assert a[0::2] != a[1::2], "two seeds drew the same 20 tokens"


def test_suppressed_tokens_are_never_drawn_before_min_tokens():
    logits = _logits(4, 1, 50)
    logits[0, 7] = logits[0, 8] = 50.0  # 7 is EOS, 8 a stop token id: both far above the rest
    for params in (
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(8,)),
        SamplingParams(temperature=1.0, top_p=0.5, min_tokens=3, stop_token_ids=(8,)),
    ):
        rows = [_seq(params, seed=i, outputs=i % 3) for i in range(30)]
        assert not {7, 8} & set(_draw(logits.expand(30, 50).contiguous(), rows, eos=(7,))[0].tokens.tolist())
        done = [_seq(params, seed=i, outputs=3) for i in range(30)]  # min_tokens reached
        assert set(_draw(logits.expand(30, 50).contiguous(), done, eos=(7,))[0].tokens.tolist()) <= {7, 8}
    ignore = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(8,), ignore_eos=True)
    assert int(_draw(logits, [_seq(ignore)], eos=(7,))[0].tokens[0]) == 7  # EOS is not suppressed then


def test_logprobs_are_the_raw_distributions_top_n():
    logits, seqs = _mixed_batch()
    drawn, sp = _draw(logits, seqs, eos=(0,))
    lp = torch.log_softmax(logits, dim=-1)
    assert sp.logprob_rows and len(set(sp.logprob_counts)) == 2
    for j, (row, n) in enumerate(zip(sp.logprob_rows, sp.logprob_counts)):
        assert float(drawn.logprob[j]) == pytest.approx(float(lp[row, drawn.tokens[row]]), abs=1e-6)
        top = lp[row].topk(n)
        assert drawn.top_ids[j, :n].tolist() == top.indices.tolist()
        assert torch.allclose(drawn.top_logprobs[j, :n], top.values, atol=1e-6)


def test_every_accepted_extreme_value_is_safe():
    """Temperature and top_p down to the smallest positive float give the argmax; top_k beyond the
    vocabulary is off; a huge or infinite temperature is uniform; nothing is nan or out of range."""
    logits = _logits(5, 1, 64)
    best = int(logits.argmax())
    tiny = [
        {"temperature": 5e-324},
        {"temperature": 1e-38, "top_k": 10**18},
        {"top_p": 5e-324, "temperature": 2.0},
        {"top_p": 1e-46},
        {"temperature": 1e-300, "top_p": 1e-300, "top_k": 2**62, "logprobs": 20},
    ]
    for kw in tiny:
        rows = [_seq(SamplingParams(**kw), seed=s) for s in range(50)]
        drawn, _ = _draw(logits.expand(50, 64).contiguous(), rows)
        assert set(drawn.tokens.tolist()) == {best}, kw
        if drawn.logprob is not None:
            assert drawn.logprob.isfinite().all() and drawn.top_logprobs.isfinite().all()
    for t in (1e308, math.inf):
        rows = [_seq(SamplingParams(temperature=t, top_k=10**18), seed=s) for s in range(2000)]
        counts = torch.bincount(_draw(logits.expand(2000, 64).contiguous(), rows)[0].tokens, minlength=64)
        assert counts.min() > 0 and _chi_square_p(counts.double(), torch.full((64,), 2000 / 64)) > 0.001


def test_a_non_finite_row_is_flagged_and_leaves_the_others_alone():
    logits, seqs = _mixed_batch(14, 100)
    clean, _ = _draw(logits, seqs)
    bad = logits.clone()
    bad[3, ::3] = float("nan")
    bad[8, 5] = float("inf")
    bad[12] = float("-inf")
    drawn, _ = _draw(bad, seqs)
    assert drawn.finite.tolist() == [i not in (3, 8, 12) for i in range(14)]
    assert ((drawn.tokens >= 0) & (drawn.tokens < 100)).all()
    keep = [i for i in range(14) if i not in (3, 8, 12)]
    assert drawn.tokens[keep].tolist() == clean.tokens[keep].tolist()
