"""The sampling kernel (ops/sampling.py) against the sampler's torch ops (its reference, the CPU
path): on fresh random logits at vocabularies 1k-152k, every mix of temperature, top-k and top-p,
with ties at the cut-offs and greedy rows between, each row draws the token the torch ops draw;
a graph replay draws what the eager launch draws; a row with non-finite logits draws a token in range
and leaves its neighbours' draws alone."""

import numpy as np
import pytest
import torch

from app.engine import sampler
from app.engine.step_sampling import StepSampling, inverse_temperature
from ops import sampling

pytestmark = pytest.mark.gpu
TEMPERATURES = (0.3, 0.8, 1.0, 1.7, 1e-30)
TOP_K = (0, 1, 5, 50, 1000)
TOP_P = (1.0, 0.95, 0.9, 0.5, 1e-6)


def _step(rng, n, vocab, device="cuda") -> StepSampling:
    greedy = torch.from_numpy(rng.random(n) < 0.15)
    t = rng.choice(TEMPERATURES, n)
    k = np.where(rng.random(n) < 0.5, rng.choice(TOP_K, n), 0).clip(max=vocab - 1)
    p = np.where(rng.random(n) < 0.6, rng.choice(TOP_P, n), 1.0)
    sp = StepSampling(n, sampled=True, top_k=int(k.max()), top_p=bool((p < 1).any()))
    sp.greedy = greedy.to(device)
    sp.inv_temperature = torch.tensor([inverse_temperature(x) for x in t], dtype=torch.float32, device=device)
    sp.k = torch.from_numpy(k).long().to(device)
    sp.p = torch.from_numpy(p).double().to(device)
    sp.u = torch.from_numpy(rng.random(n) * (1 - 2**-53)).double().to(device)
    return sp


def _logits(rng, n, vocab):
    z = rng.standard_normal((n, vocab)) * rng.choice([0.5, 2.0, 8.0])
    ties = rng.random(n) < 0.3
    z[ties] = np.round(z[ties] * 2) / 2  # many equal values at every cut-off
    return torch.from_numpy(z.astype(np.float32)).cuda()


def _torch_draw(z, sp):
    return torch.where(sp.greedy, z.argmax(dim=-1), sampler._random(z, sp))


def _kernel_draw(z, sp):
    tokens = z.argmax(dim=-1)
    sampling.sample_rows(z, sp.greedy, sp.inv_temperature, sp.k, sp.p, sp.u, tokens)
    return tokens


@pytest.mark.parametrize("vocab", [1000, 32000, 128256, 151936])
def test_kernel_draws_what_the_torch_ops_draw(vocab):
    rng = np.random.default_rng(vocab)
    rows = 0
    for n in (1, 7, 64):
        for _ in range(3):
            z, sp = _logits(rng, n, vocab), _step(rng, n, vocab)
            assert _kernel_draw(z, sp).tolist() == _torch_draw(z, sp).tolist(), (vocab, n)
            rows += n
    assert rows == 3 * 72


def test_graph_replay_draws_what_the_eager_launch_draws():
    rng = np.random.default_rng(3)
    n, vocab = 48, 32000
    z, sp = _logits(rng, n, vocab), _step(rng, n, vocab)
    tokens = torch.zeros(n, dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sampling.sample_rows(z, sp.greedy, sp.inv_temperature, sp.k, sp.p, sp.u, tokens)  # load outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens.copy_(z.argmax(dim=-1))
        sampling.sample_rows(z, sp.greedy, sp.inv_temperature, sp.k, sp.p, sp.u, tokens)
    for _ in range(3):
        z.copy_(_logits(rng, n, vocab))
        sp.u.copy_(torch.from_numpy(rng.random(n)).double())
        graph.replay()
        assert tokens.tolist() == _kernel_draw(z, sp).tolist() == _torch_draw(z, sp).tolist()


def test_a_non_finite_row_draws_in_range_and_leaves_its_neighbours_alone():
    rng = np.random.default_rng(4)
    n, vocab = 6, 32000
    z, sp = _logits(rng, n, vocab), _step(rng, n, vocab)
    sp.greedy.zero_()
    want = _kernel_draw(z, sp).tolist()
    z[1, 7], z[3, :] = float("nan"), float("inf")
    z[4, 100] = float("-inf")
    got = _kernel_draw(z, sp).tolist()
    assert all(0 <= t < vocab for t in got)
    assert [got[i] for i in (0, 2, 5)] == [want[i] for i in (0, 2, 5)]
