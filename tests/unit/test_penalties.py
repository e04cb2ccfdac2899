"""presence / frequency / repetition penalties and logit_bias (app/engine/penalties.py, sampler.adjusted).

1. The batched device path equals a plain per-row float64 reference on random logits, token
   histories (with repeats), parameters (negative penalties, r < 1 and > 1, biases of ±100) and
   suppressed tokens, for steps run in turn and steps launched ahead (the pending token on the device).
2. Through the engine (tiny random Llama, CPU): a penalised, a biased and a plain request in one batch
   each generate what they do alone; penalised greedy tokens are the reference's argmax at every step
   (raw logits from HF transformers); logit_bias +100 forces its token; steps launched ahead generate
   what steps run in turn do.
3. The HTTP boundary: out-of-range values are 400s in OpenAI's shape with a one-line reason naming the
   field; a token id outside the vocabulary is a 400 naming the id.
"""

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.engine.sampler import adjusted, draw
from app.engine.sequence import Sequence
from app.engine.step_sampling import Staging, step_sampling
from app.errors import InvalidRequestError
from app.openai import http_errors
from app.openai.requests import ChatCompletionRequest, CompletionRequest
from app.protocol import GenerateRequest, SamplingParams
from tests.support.helpers import run_to_completion
from tests.unit.test_sampler_engine import _EagerGraphs

VOCAB = 300


def reference(row: torch.Tensor, seq: Sequence, banned: set[int], pending: int | None = None) -> torch.Tensor:
    """One row's adjusted logits, float64, written plainly: bias, suppression, repetition, frequency, presence."""
    p = seq.params
    z = row.double().clone()
    for t, b in p.logit_bias:
        z[t] += b
    for t in banned:
        z[t] = -math.inf
    output = seq.output_ids + ([pending] if pending is not None else [])
    counts = Counter(output)
    for t in set(seq.prompt_ids) | set(output):
        if p.repetition_penalty != 1.0:
            z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
        z[t] -= p.frequency_penalty * counts[t]
        z[t] -= p.presence_penalty * (counts[t] > 0)
    return z


def _random_params(rng: random.Random, greedy: bool) -> SamplingParams:
    kind = rng.randrange(5)  # plain, penalties only, bias only, both, min_tokens with everything
    pen = kind in (1, 3, 4)
    bias = kind in (2, 3, 4)
    ids = rng.sample(range(VOCAB), rng.randint(1, 12))
    return SamplingParams(
        max_tokens=64,
        temperature=0.0 if greedy else rng.choice([0.3, 1.0, 1.7]),
        top_p=rng.choice([1.0, 0.9]),
        seed=rng.randrange(1 << 30),
        min_tokens=64 if kind == 4 else 0,
        stop_token_ids=(3, 9) if kind == 4 else (),
        presence_penalty=rng.uniform(-2, 2) if pen else 0.0,
        frequency_penalty=rng.uniform(-2, 2) if pen else 0.0,
        repetition_penalty=rng.choice([1.0, 0.5, 0.83, 1.3, 2.0]) if pen else 1.0,
        logit_bias=tuple((t, rng.choice([100.0, -100.0, rng.uniform(-5, 5)])) for t in ids) if bias else (),
    )


def _history(rng: random.Random, few: list[int], length: int) -> list[int]:
    """Token ids mostly from a few: repeats, and ids in both prompt and output."""
    return [rng.choice(few) if rng.random() < 0.6 else rng.randrange(VOCAB) for _ in range(length)]


def _random_step(rng: random.Random, n: int) -> list[Sequence]:
    seqs = []
    for i in range(n):
        few = rng.sample(range(VOCAB), 8)
        prompt = tuple(_history(rng, few, rng.randint(1, 40)))
        seq = Sequence(GenerateRequest(f"r{i}", prompt, _random_params(rng, greedy=i % 2 == 0)), 7, i)
        seq.output_ids = _history(rng, few, rng.randint(0, 30))
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("ahead", [0, 1], ids=["in-turn", "launched-ahead"])
def test_batched_adjustments_equal_the_per_row_reference(ahead):
    rng = random.Random(20260501 + ahead)
    torch.manual_seed(ahead)
    close_calls = 0
    for _ in range(20):
        n = rng.randint(1, 24)
        seqs = _random_step(rng, n)
        logits = torch.randn(n, VOCAB) * rng.choice([1.0, 4.0])
        pending = None
        if ahead:  # the previous step's tokens, on the device, in another row order
            drawn = torch.randint(0, VOCAB, (n + 3,))
            src = rng.sample(range(n + 3), n)
            pending = (drawn, src)
        sp = step_sampling(seqs, (5,), VOCAB, Staging("cpu"), ahead, pending)
        z = adjusted(logits, sp)
        tokens = draw(logits, sp).tokens
        for i, seq in enumerate(seqs):
            banned = {3, 9, 5} if len(seq.output_ids) + ahead < seq.params.min_tokens else set()
            ref = reference(logits[i], seq, banned, int(pending[0][pending[1][i]]) if ahead else None)
            torch.testing.assert_close(z[i].double(), ref, rtol=1e-6, atol=1e-5)
            if seq.params.greedy:
                top2 = ref.topk(2).values
                if top2[0] - top2[1] > 1e-3:
                    assert tokens[i] == ref.argmax(), (i, seq.params)
                else:
                    close_calls += 1
        assert not torch.equal(z, logits) or not any(s.params.penalized or s.params.logit_bias for s in seqs)
    assert close_calls < 10


@pytest.mark.gpu
def test_cuda_adjustments_equal_the_cpu_ones():
    rng = random.Random(4)
    seqs = _random_step(rng, 32)
    logits = torch.randn(32, VOCAB)
    pending = (torch.randint(0, VOCAB, (32,)), list(range(32))[::-1])
    cpu = adjusted(logits, step_sampling(seqs, (5,), VOCAB, Staging("cpu"), 1, pending))
    on_gpu = (pending[0].cuda(), pending[1])
    gpu = adjusted(logits.cuda(), step_sampling(seqs, (5,), VOCAB, Staging("cuda"), 1, on_gpu))
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-6, atol=1e-5)


def test_plain_steps_adjust_nothing_and_extremes_stay_finite():
    seqs = _random_step(random.Random(3), 6)
    for seq in seqs:
        seq.request = dataclasses.replace(seq.request, params=SamplingParams(temperature=0.0))
    sp = step_sampling(seqs, (), VOCAB, Staging("cpu"))
    logits = torch.randn(6, VOCAB)
    assert sp.bias is None and sp.penalties is None and adjusted(logits, sp) is logits
    for r in (1e-300, 1e-40, 1e30, 1e300):  # beyond float32: the device factor is clamped to its normal range
        for seq in seqs:
            seq.request = dataclasses.replace(seq.request, params=SamplingParams(temperature=1.0, repetition_penalty=r))
        logits = torch.randn(6, VOCAB) * 50
        logits[:, 0] = 0.0
        seqs[0].output_ids = [0, 1, 2]
        sp = step_sampling(seqs, (), VOCAB, Staging("cpu"))
        z = adjusted(logits, sp)
        assert not z.isnan().any() and not (z == math.inf).any(), r
        assert ((draw(logits, sp).tokens >= 0) & (draw(logits, sp).tokens < VOCAB)).all()


# -- through the engine -----------------------------------------------------------------------------
PROMPT = (17, 4, 250, 3, 99, 41, 8, 17, 4)


def _engine(model_dir, **kw):
    return build_engine(model_dir, EngineConfig(**{"num_kv_blocks": 256, "block_size": 4, **kw}), {}, tokenizer=None)


def _alone(model_dir, request):
    return run_to_completion(_engine(model_dir), {0: [request]})[0][request.request_id]


def test_penalised_biased_and_plain_requests_in_one_batch_equal_their_solo_runs(tiny_model_dir):
    rng = random.Random(11)
    requests = [
        GenerateRequest(
            "pen",
            PROMPT,
            SamplingParams(
                max_tokens=12,
                temperature=0.9,
                seed=4,
                presence_penalty=1.5,
                frequency_penalty=0.7,
                repetition_penalty=1.4,
            ),
        ),
        GenerateRequest(
            "pen-greedy",
            PROMPT,
            SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=-1.0, repetition_penalty=0.7),
        ),
        GenerateRequest(
            "bias", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, logit_bias=((5, 3.0), (17, -100.0)))
        ),
        GenerateRequest("plain", PROMPT, SamplingParams(max_tokens=12, temperature=0.9, seed=4)),
    ]
    others = [
        GenerateRequest(
            f"o{i}",
            tuple(rng.randrange(320) for _ in range(rng.randint(2, 20))),
            SamplingParams(
                max_tokens=10, temperature=rng.choice([0.0, 1.0]), seed=i, presence_penalty=rng.choice([0.0, 2.0])
            ),
        )
        for i in range(6)
    ]
    engine = _engine(tiny_model_dir)
    batched = run_to_completion(engine, {0: requests[:2] + others[:3], 2: requests[2:] + others[3:]})[0]
    assert engine.max_batch_seen >= 8
    for r in requests:
        assert batched[r.request_id] == _alone(tiny_model_dir, r), r.request_id
    assert batched["pen"] != batched["plain"]  # same seed: only the penalties differ


def _hf_logits(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1]

    return logits


def test_penalised_greedy_tokens_are_the_reference_argmax_at_every_step(tiny_model_dir):
    hf = _hf_logits(tiny_model_dir)
    plain = SamplingParams(max_tokens=16, temperature=0.0)
    free = _alone(tiny_model_dir, GenerateRequest("free", PROMPT, plain))
    for penalties in (
        {"frequency_penalty": 2.0, "presence_penalty": 2.0},
        {"repetition_penalty": 3.0},
        {"repetition_penalty": 0.4, "presence_penalty": -2.0},
    ):
        params = dataclasses.replace(plain, **penalties)
        got = _alone(tiny_model_dir, GenerateRequest("p", PROMPT, params))
        seq = Sequence(GenerateRequest("ref", PROMPT, params), 0, 0)
        for token in got:  # the engine's history, checked token by token against the reference's choice
            ref = reference(hf(list(PROMPT) + seq.output_ids), seq, set())
            top2 = ref.topk(2).values
            assert top2[0] - top2[1] < 1e-4 or token == ref.argmax(), (penalties, seq.output_ids)
            seq.output_ids.append(token)
        # where the reference's choice first differs from the raw argmax, the unpenalised run goes elsewhere
        seq.output_ids = []
        for t, token in enumerate(got):
            raw = hf(list(PROMPT) + seq.output_ids)
            if reference(raw, seq, set()).argmax() != raw.argmax():
                assert got[: t + 1] != free[: t + 1], penalties
                break
            seq.output_ids.append(token)
        else:
            pytest.fail(f"{penalties} never changed the argmax: the test shows nothing")


def test_logit_bias_forces_and_forbids_tokens_under_greedy(tiny_model_dir):
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    free = _alone(tiny_model_dir, GenerateRequest("free", PROMPT, plain))
    forced = next(t for t in range(320) if t not in free)
    assert (
        _alone(tiny_model_dir, GenerateRequest("f", PROMPT, dataclasses.replace(plain, logit_bias=((forced, 100.0),))))
        == [forced] * 12
    )
    banned = _alone(
        tiny_model_dir,
        GenerateRequest("b", PROMPT, dataclasses.replace(plain, logit_bias=tuple((t, -100.0) for t in set(free)))),
    )
    assert not set(banned) & set(free)
    with pytest.raises(InvalidRequestError, match="token id 320"):
        _engine(tiny_model_dir).add(GenerateRequest("v", PROMPT, dataclasses.replace(plain, logit_bias=((320, 1.0),))))


def test_penalised_steps_launched_ahead_draw_what_steps_run_in_turn_do(tiny_model_dir):
    """Launched ahead, a penalised row counts the token it gains from the device (out.drawn.tokens)."""
    rng = random.Random(8)
    kinds = [
        SamplingParams(max_tokens=14, temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0),
        SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=0.3, presence_penalty=-2.0),
        SamplingParams(max_tokens=14, temperature=0.9, seed=3, repetition_penalty=1.8, logit_bias=((4, 2.0),)),
        SamplingParams(max_tokens=14, temperature=0.0),
    ]
    requests = [
        GenerateRequest(f"a{i}", tuple(rng.randrange(320) for _ in range(rng.randint(2, 12))), kinds[i % len(kinds)])
        for i in range(8)
    ]
    out = {}
    for ahead in (True, False):
        engine = _engine(tiny_model_dir, max_num_seqs=8)
        engine.runner.graphs = _EagerGraphs(engine)
        if not ahead:
            engine.runner.run_ahead = lambda result, scheduler: None
        out[ahead] = run_to_completion(engine, {0: requests})[0], engine.runner.steps_taken_ahead
    assert out[True][0] == out[False][0]
    assert out[True][1] >= 10, out[True][1]


# -- the HTTP boundary --------------------------------------------------------------------------------
def _client() -> TestClient:
    app = FastAPI()
    http_errors.install(app)

    @app.post("/{kind}")
    async def parse(kind: str, request: Request):
        model = CompletionRequest if kind == "completions" else ChatCompletionRequest
        body = await http_errors.parse_body(request, model)
        params = body.sampling(4, 100, 16, None)
        params.check_vocabulary(VOCAB)  # what the engine checks when the request is added
        return {k: getattr(params, k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")} | {
            "logit_bias": [list(p) for p in params.logit_bias]
        }

    return TestClient(app)


BODIES = {
    "completions": {"model": "m", "prompt": "p"},
    "chat": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
}
BAD = [
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"7": 1, "007": 2}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
]


@pytest.mark.parametrize("kind", list(BODIES))
def test_out_of_range_values_are_400s_naming_the_field(kind):
    client = _client()
    for fields, param in BAD:
        response = client.post(f"/{kind}", json=BODIES[kind] | fields)
        assert response.status_code == 400, (fields, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["code"] == "invalid_value" and "\n" not in error["message"], error
    response = client.post(f"/{kind}", json=BODIES[kind] | {"logit_bias": {"12": 5, str(VOCAB): -3}})
    error = response.json()["error"]
    assert response.status_code == 400 and f"token id {VOCAB}" in error["message"] and "\n" not in error["message"]


@pytest.mark.parametrize("kind", list(BODIES))
def test_valid_values_reach_the_sampling_parameters(kind):
    body = BODIES[kind] | {
        "presence_penalty": -2,
        "frequency_penalty": 1.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"12": 100, "0": -100, "299": 0.5},
    }
    got = _client().post(f"/{kind}", json=body).json()
    assert got == {
        "presence_penalty": -2.0,
        "frequency_penalty": 1.5,
        "repetition_penalty": 1.2,
        "logit_bias": [[12, 100.0], [0, -100.0], [299, 0.5]],
    }
    nulls = (
        _client().post(f"/{kind}", json=BODIES[kind] | {"presence_penalty": None, "repetition_penalty": None}).json()
    )
    assert nulls == {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": []}


def test_sampling_params_refuse_what_the_api_would():
    for fields in (
        {"presence_penalty": 3.0},
        {"frequency_penalty": math.nan},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": math.inf},
        {"logit_bias": ((1, 101.0),)},
        {"logit_bias": ((-1, 1.0),)},
        {"logit_bias": ((1, 1.0), (1, 2.0))},
    ):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**fields)
