"""Structured output through the engine (tiny random Llama with SmolLM2's real 49k tokenizer, CPU):
50 random JSON schemas on the base model and an adapter, each output parsed and validated with
jsonschema; json_object, regex and choice guides; a constrained request equals itself alone in a
mixed batch, after a migration, and as each of n choices (with penalties and logit_bias beside the
guide); a token its grammar rejects ends that request alone; bad guides fail at compile with the
problem named, off the engine thread."""

import asyncio
import dataclasses
import json
import random
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch

from app.engine import runner as runner_module
from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.errors import InvalidRequestError
from app.protocol import ErrorChunk, GenerateRequest, Guide, SamplingParams
from benchmarks.random_schemas import random_schemas
from tests.support.cluster_fixtures import make_tiny_chat_llama
from tests.support.helpers import make_random_adapter, run_to_completion
from tests.unit.test_sampler_engine import _EagerGraphs

MAX_TOKENS = 200  # the longest of the 100 outputs below is under 80 tokens: every one ends by its grammar


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_chat_llama(tmp_path_factory.mktemp("structured") / "model")


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("structured-adapter") / "a"
    return {"a": str(make_random_adapter(model, out, rank=4, targets=["q_proj", "v_proj", "down_proj"], seed=7))}


def _engine(model, adapters, **kw):
    return build_engine(model, EngineConfig(**{"num_kv_blocks": 1024, "block_size": 8, "max_loras": 2, **kw}), adapters)


def _schema_guide(schema: dict) -> Guide:
    return Guide("json_schema", json.dumps(schema, sort_keys=True))


def _prompt(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(100, 49000) for _ in range(rng.randint(3, 16)))


def test_fifty_random_schemas_validate_on_the_base_model_and_an_adapter(model, adapters):
    schemas = random_schemas(50, seed=0)
    rng = random.Random(1)
    requests, expected = [], {}
    for i, schema in enumerate(schemas):
        for adapter in (None, "a"):
            params = SamplingParams(
                max_tokens=MAX_TOKENS, temperature=(0.0, 1.0)[i % 2], seed=i, guide=_schema_guide(schema)
            )
            rid = f"s{i}-{adapter}"
            requests.append(GenerateRequest(rid, _prompt(rng), params, adapter))
            expected[rid] = schema
    engine = _engine(model, adapters, max_num_seqs=len(requests))
    outputs = _run(engine, requests)
    assert engine.max_batch_seen == len(requests)
    filled = 0
    for rid, schema in expected.items():
        text, reason = outputs[rid]
        assert reason == "stop", (rid, reason, text)
        value = json.loads(text)
        jsonschema.validate(value, schema)
        filled += bool(value)
    assert filled >= 80, f"only {filled} of 100 outputs hold a property"  # required ones, mostly


def _run(engine, requests) -> dict[str, tuple[str, str]]:
    """(text, finish reason) of each request, all queued at once (the text the client gets: no EOS)."""
    for r in requests:
        engine.add(r)
    text, reasons = {r.request_id: "" for r in requests}, {}
    while engine.has_work():
        for chunk in engine.step():
            text[chunk.request_id] += chunk.text
            reasons[chunk.request_id] = chunk.finish_reason
    return {rid: (text[rid], reasons[rid]) for rid in text}


def test_regex_and_choice_guides(model, adapters):
    engine = _engine(model, adapters)
    choices = ["red", "green", 'a "quoted" blue', "ünïcode ✓"]
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9])?"
    kinds = {"re": Guide("regex", pattern), "choice": Guide("choice", json.dumps(choices))}
    requests = [
        GenerateRequest(
            f"{k}{seed}",
            (500 + seed, 77, 901),
            SamplingParams(max_tokens=MAX_TOKENS, seed=seed, guide=g),
            "a" if seed % 2 else None,
        )
        for k, g in kinds.items()
        for seed in range(4)
    ]
    for rid, (text, reason) in _run(engine, requests).items():
        assert reason == "stop", (rid, text)
        assert re.fullmatch(pattern, text) if rid.startswith("re") else text in choices, (rid, text)


def test_json_object_accepts_any_object_and_nothing_else(model, adapters):
    """Teacher-forced: a random model writes endless keys under json_object (its strings are unbounded),
    so generation is shown on the real model over HTTP (tests/serve/test_structured_serve.py)."""
    engine = _engine(model, adapters)
    compiled = engine.grammars.compile(Guide("json_object", ""))
    encode = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for text in ['{"a": [1, 2.5, {"b": null}], "c": "x"}', "{}", '{"k": {"n": -1e3, "t": true}}']:
        state = engine.grammars.state(compiled)
        assert all(not state.advance(t) for t in encode(text)[:-1]) and state.advance(encode(text)[-1]), text
    for text in ["[1, 2]", '"a string"', '{"a" : 1}', '{"a": 1,}']:  # not an object, free whitespace, a trailing comma
        with pytest.raises(InvalidRequestError, match="do not follow"):
            engine.grammars.state(compiled, tuple(encode(text)))


def test_constrained_plain_and_sampled_requests_in_one_batch_equal_their_solo_outputs(model, adapters):
    rng = random.Random(3)
    schema = random_schemas(3, seed=11)[2]
    mine = [
        GenerateRequest(
            "json",
            _prompt(rng),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=5, guide=_schema_guide(schema)),
            "a",
        ),
        GenerateRequest("plain", _prompt(rng), SamplingParams(max_tokens=30, temperature=0.0)),
        GenerateRequest(
            "sampled", _prompt(rng), SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=6), "a"
        ),
    ]
    others = [
        GenerateRequest(
            f"o{i}",
            _prompt(rng),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, guide=_schema_guide(s)),
            [None, "a"][i % 2],
        )
        for i, s in enumerate(random_schemas(6, seed=12))
    ]
    alone = {r.request_id: _run(_engine(model, adapters, prefix_caching=False), [r])[r.request_id] for r in mine}
    together = _run(_engine(model, adapters, prefix_caching=False), mine + others)
    assert {k: together[k] for k in alone} == alone
    jsonschema.validate(json.loads(alone["json"][0]), schema)


def test_a_resumed_constrained_request_continues_where_it_left_off(model, adapters):
    schema = random_schemas(5, seed=21)[4]
    request = GenerateRequest(
        "r",
        (300, 301, 302, 303),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=9, guide=_schema_guide(schema)),
        "a",
    )
    config = dict(prefix_caching=False, dtype=torch.float64)  # recomputed in another shape: no fp32 near-tie flips
    full, reasons, _ = run_to_completion(_engine(model, adapters, **config), {0: [request]})
    assert reasons["r"] == "stop" and len(full["r"]) > 6
    resumed = dataclasses.replace(request, resume_token_ids=tuple(full["r"][:5]))
    rest, reasons, _ = run_to_completion(_engine(model, adapters, **config), {0: [resumed]})
    assert rest["r"] == full["r"][5:] and reasons["r"] == "stop"
    engine = _engine(model, adapters)
    off_grammar = dataclasses.replace(request, resume_token_ids=tuple(engine.tokenizer("hello")["input_ids"]))
    with pytest.raises(InvalidRequestError, match="do not follow"):
        engine.add(off_grammar)


def test_a_token_the_grammar_rejects_ends_that_request_alone(model, adapters, monkeypatch):
    """A drawn token outside the mask (forced here into one row) fails that request; the rest finish."""
    engine = _engine(model, adapters)
    rng = random.Random(4)
    schemas = random_schemas(4, seed=31)
    requests = [
        GenerateRequest(f"r{i}", _prompt(rng), SamplingParams(max_tokens=MAX_TOKENS, seed=i, guide=_schema_guide(s)))
        for i, s in enumerate(schemas)
    ] + [GenerateRequest("plain", _prompt(rng), SamplingParams(max_tokens=12))]
    draw, steps = runner_module.draw, []

    def faulty_draw(logits, sp):
        drawn = draw(logits, sp)
        steps.append(1)
        if len(steps) == 3:  # third step: row 0 (r0, on prefill order) gets a token no JSON grammar allows
            drawn.tokens[0] = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
        return drawn

    monkeypatch.setattr(runner_module, "draw", faulty_draw)
    for r in requests:
        engine.add(r)
    chunks = []
    while engine.has_work():
        chunks += engine.step()
    errors = [c for c in chunks if isinstance(c, ErrorChunk)]
    assert len(errors) == 1 and "does not follow the request's grammar" in errors[0].message, errors
    finished = {
        c.request_id
        for c in chunks
        if getattr(c, "finish_reason", None) == "stop" or getattr(c, "finish_reason", None) == "length"
    }
    assert finished == {r.request_id for r in requests} - {errors[0].request_id}


def test_bad_guides_fail_at_compile_naming_the_problem_and_compiles_are_cached(model, adapters):
    grammars = _engine(model, adapters).grammars
    bad = {
        Guide("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "strng"}}})): "strng",
        Guide("json_schema", json.dumps({"type": "object", "if": {"type": "object"}})): "if",
        Guide("json_schema", json.dumps({"$ref": "#/$defs/missing"})): "missing",
        Guide("regex", "[a-z"): "regex",
        Guide("json_schema", json.dumps({"type": "string", "pattern": "(("})): "unclosed",
    }
    for guide, named in bad.items():
        with pytest.raises(InvalidRequestError, match=re.escape(named)):
            grammars.compile(guide)
    good = _schema_guide(random_schemas(1)[0])
    assert grammars.compile(good) is grammars.compile(Guide(good.kind, good.spec))


def test_the_async_engine_compiles_off_the_engine_thread_and_rejects_before_any_chunk(model, adapters):
    core = _engine(model, adapters)
    threads, compile_ = [], core.grammars.compile
    core.grammars.compile = lambda guide: threads.append(threading.current_thread().name) or compile_(guide)
    engine = AsyncEngine(core)

    async def collect(request):
        return [c async for c in engine.generate(request)]

    try:
        ok = GenerateRequest(
            "ok", (5, 6, 7), SamplingParams(max_tokens=MAX_TOKENS, guide=Guide("choice", '["yes", "no"]'))
        )
        chunks = asyncio.run(collect(ok))
        assert "".join(c.text for c in chunks) in ("yes", "no") and chunks[-1].finish_reason == "stop"
        bad = GenerateRequest("bad", (5, 6, 7), SamplingParams(guide=Guide("regex", "(")))
        with pytest.raises(InvalidRequestError, match="invalid regex"):
            asyncio.run(collect(bad))
    finally:
        engine.shutdown()
    assert len(threads) == 2 and "engine" not in threads


def test_steps_launched_ahead_with_constrained_rows_draw_what_steps_run_in_turn_do(model, adapters):
    """The run-ahead path on the CPU (an eager stand-in for the decode graphs): a step with constrained
    rows is launched ahead and drawn once the previous tokens advanced the matchers; requests end
    meanwhile (their rows are dropped from the step taken)."""
    rng = random.Random(8)
    requests = [
        GenerateRequest(
            f"g{i}",
            _prompt(rng),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=i, guide=_schema_guide(s)),
            [None, "a"][i % 2],
        )
        for i, s in enumerate(random_schemas(5, seed=41))
    ]
    requests += [
        GenerateRequest("p", _prompt(rng), SamplingParams(max_tokens=9, temperature=0.0), "a"),
        GenerateRequest("s", _prompt(rng), SamplingParams(max_tokens=25, temperature=1.0, seed=3)),
    ]
    out = {}
    for ahead in (True, False):
        engine = _engine(model, adapters, max_num_seqs=8, prefix_caching=False)
        engine.runner.graphs = _EagerGraphs(engine)
        if not ahead:
            engine.runner.run_ahead = lambda result, scheduler: None
        out[ahead] = _run(engine, requests), engine.runner.steps_taken_ahead
    assert out[True][0] == out[False][0]
    assert all(reason == "stop" for rid, (_, reason) in out[True][0].items() if rid.startswith("g"))
    assert out[True][1] >= 10, out[True][1]


def test_masked_rows_draw_only_allowed_tokens_and_greedy_ones_the_reference_argmax(monkeypatch):
    """sampler.draw with a bitmask on some rows (greedy and seeded), against numpy's masked argmax."""
    from app.engine.sampler import draw
    from app.engine.sequence import Sequence
    from app.engine.step_sampling import Staging, step_sampling

    vocab, n, gen = 1000, 12, torch.Generator().manual_seed(3)
    logits = torch.randn(n, vocab, generator=gen) * 4

    class Allow:  # a GrammarState stand-in: allows the tokens of its set
        def __init__(self, tokens):
            self.tokens = tokens

    rng = random.Random(4)
    seqs = []
    for i in range(n):
        params = SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 1.0, seed=i)
        seq = Sequence(GenerateRequest(f"r{i}", (1, 2), params), i, i)
        seq.grammar = Allow(set(rng.sample(range(vocab), rng.randint(1, 40)))) if i % 3 else None
        seqs.append(seq)

    def fill(states, width):
        bits = np.zeros((len(states), width), dtype=bool)
        for j, s in enumerate(states):
            bits[j, list(s.tokens)] = True
        return np.packbits(np.pad(bits, ((0, 0), (0, -width % 32))), axis=1, bitorder="little").view(np.int32)

    monkeypatch.setattr("app.engine.step_sampling.fill_masks", fill)
    tokens = draw(logits, step_sampling(seqs, (), vocab, Staging("cpu"))).tokens.tolist()
    for i, seq in enumerate(seqs):
        allowed = seq.grammar.tokens if seq.grammar else set(range(vocab))
        assert tokens[i] in allowed
        if seq.params.greedy:
            assert tokens[i] == max(allowed, key=lambda t: logits[i, t].item())


def test_n_choices_with_penalties_each_follow_their_own_grammar_as_alone(model, adapters):
    """n = 2 with penalties and logit_bias beside the guide: each choice has a grammar state of its own
    (the forks share prompt blocks, not matchers), is valid, and equals that choice requested alone."""
    schema = random_schemas(4, seed=31)[3]
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=13,
        guide=_schema_guide(schema),
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias=((90, 5.0), (1000, -3.0)),
    )
    request = GenerateRequest("n", tuple(range(400, 420)), params, "a", n=2)
    config = dict(prefix_caching=False, dtype=torch.float64)  # a fork recomputes its last prompt block: no fp32 flips
    together = _choices(_engine(model, adapters, **config), request)
    for j in range(2):
        text, reason = together[j]
        assert reason == "stop", (j, text)
        jsonschema.validate(json.loads(text), schema)
        assert _choices(_engine(model, adapters, **config), request.choice(j)) == {j: together[j]}
    assert together[0] != together[1]  # the choices are seeded apart


def _choices(engine, request) -> dict[int, tuple[str, str]]:
    """(text, finish reason) of each choice of `request`."""
    engine.add(request)
    text, reasons = {}, {}
    while engine.has_work():
        for chunk in engine.step():
            text[chunk.index] = text.get(chunk.index, "") + chunk.text
            reasons[chunk.index] = chunk.finish_reason
    return {i: (text[i], reasons[i]) for i in text}
