"""The cluster layer on real Ray Serve: consolidation (3 replicas, max batch 4), migration
equivalence under small KV caches, failover on replica kills (3 replicas, and 1 replica
waiting for its replacement), and drain on scale-down. Every output is compared with the
same request run alone on one uninterrupted engine (in this process, same checkpoint)."""
import asyncio
import dataclasses
import random
import time

import pytest
import ray
from openai import OpenAI

from app.builder import app_from_args
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import ErrorChunk, GenerateRequest, SamplingParams, TokenChunk
from cluster.migration import MigrationPolicy, ResubmittingStream, with_fixed_seed
from tests.app_fixtures import config_args, serving, wait_for
from tests.cluster_fixtures import make_tiny_chat_llama, replica_actor, replica_ids, replica_report, slowed_engine
from tests.helpers import make_random_adapter

ADAPTERS = ("a1", "a2")
POLICY = MigrationPolicy(max_migrations=16, failover_wait_s=60)
# app → (num_replicas, block_size, num_kv_blocks, slowed): small KV on "move" forces preemption
APPS = {"pack": (3, 16, 64, True), "move": (3, 4, 12, False), "solo": (1, 16, 64, True)}


def _args(model, adapters, replicas, block, blocks):
    return config_args(
        model=str(model), max_batch_size=4, num_kv_blocks=blocks, block_size=block, max_model_len=256,
        max_tokens_per_step=256, adapter_dirs=[str(adapters)], max_loras=4, max_lora_rank=8,
        replica={"num_replicas": replicas, "ray_actor_options": {"num_cpus": 0.5}},
        ingress={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
        cluster={"routing_stats_period_s": 0.2, "failover_wait_s": 60, "max_migrations": 16})


def _app(name, model, adapters, replicas=None):
    n, block, blocks, slowed = APPS[name]
    factory = {"engine_factory": slowed_engine} if slowed else {}
    return app_from_args(_args(model, adapters, replicas or n, block, blocks), **factory)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    model = make_tiny_chat_llama(root / "model")
    adapters = root / "adapters"
    for i, name in enumerate(ADAPTERS):
        make_random_adapter(model, adapters / name, rank=4 * (i + 1), targets=["q_proj", "v_proj", "down_proj"], seed=i)
    apps = {name: (_app(name, model, adapters), f"/{name}") for name in APPS}
    with serving(apps, num_cpus=8) as url:
        yield {"url": url, "model": model, "adapters": adapters}


class Reference:
    """Each request alone on one engine with room to spare: the uninterrupted output."""

    def __init__(self, model, adapters, block_size):
        paths = {n: str(adapters / n) for n in ADAPTERS}
        self.core = build_engine(model, EngineConfig(max_num_seqs=4, num_kv_blocks=512, block_size=block_size,
                                                     max_model_len=256, max_loras=4, max_lora_rank=8), paths)

    def __call__(self, request: GenerateRequest) -> list[TokenChunk]:
        self.core.add(request)
        out = []
        while self.core.has_work():
            out += [c for c in self.core.step() if isinstance(c, TokenChunk)]
        return out


def _summary(chunks):
    tokens = [t for c in chunks for t in c.token_ids]
    last = chunks[-1]
    return tokens, "".join(c.text for c in chunks), last.finish_reason, last.completion_tokens, \
        [lp for c in chunks for lp in (c.logprobs or ())]


def _assert_same(got, want, request_id):
    g, w = _summary(got), _summary(want)
    assert g[:4] == w[:4], request_id
    assert len(g[4]) == len(w[4])
    for a, b in zip(g[4], w[4]):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a), request_id


def _submit(app):
    from ray import serve

    handle = serve.get_deployment_handle("LoraReplica", app).options(stream=True).generate
    registry = serve.get_deployment_handle("AdapterRegistry", app)
    specs = {n: registry.lookup.remote(n).result() for n in ADAPTERS}

    def submit(request):
        spec, epoch = specs[request.adapter] if request.adapter else (None, 0)
        return handle.remote(request, spec, epoch)

    return submit


async def _stream(submit, request, on_chunk=None):
    stream = await ResubmittingStream.open(submit, request, POLICY)
    chunks = []
    async for chunk in stream.chunks():
        chunks.append(chunk)
        if on_chunk:
            await on_chunk(stream, chunk)
    return stream, chunks


def _requests(n, rng, prompt_len, max_tokens, prefix="r"):
    out = []
    for i in range(n):
        greedy = i % 2 == 0
        params = SamplingParams(
            max_tokens=rng.randint(*max_tokens), temperature=0.0 if greedy else 0.9, top_p=1.0 if greedy else 0.9,
            seed=None if greedy else rng.randrange(2**31), logprobs=2 if i % 3 == 0 else None,
            stop=(" the", "ing") if i % 4 == 1 else ())
        prompt = tuple(rng.randrange(100, 49000) for _ in range(rng.randint(*prompt_len)))
        out.append(with_fixed_seed(GenerateRequest(f"{prefix}{i}", prompt, params, ADAPTERS[i % 3] if i % 3 < 2 else None)))
    return out


def _batch(app, requests, on_chunk=None):
    submit = _submit(app)

    async def go():
        return await asyncio.gather(*(_stream(submit, r, on_chunk) for r in requests))

    return asyncio.run(go())


def _idle(app):
    """Every replica: nothing running or waiting, every KV block free."""
    def check():
        reports = [replica_report(app, r) for r in replica_ids(app)]
        return all(s.batch == 0 and s.free_kv_blocks == s.total_kv_blocks for s in reports) and reports
    return wait_for(check, timeout=30)


# -- 1. consolidation ---------------------------------------------------------------

def test_requests_fill_the_oldest_replica_first_and_an_emptied_replica_stays_empty(cluster):
    from ray import serve

    handle = serve.get_deployment_handle("LoraReplica", "pack").options(stream=True).generate
    ids = replica_ids("pack")
    order = sorted(ids, key=lambda r: replica_report("pack", r).started_at)  # oldest first
    streams, placed = [], []

    def open_one(i):
        request = GenerateRequest(f"c{i}", (101, 202, 303 + i), SamplingParams(max_tokens=240, temperature=0.0))
        gen = handle.remote(request, None, 0)
        accepted = next(gen)
        next(gen)  # its first token: it runs, so the next report counts it
        streams.append(gen)
        placed.append(accepted.replica_id)

    for i in range(12):
        open_one(i)
    assert placed == [order[0]] * 4 + [order[1]] * 4 + [order[2]] * 4
    assert [replica_report("pack", r).running for r in order] == [4, 4, 4]

    # load drops: the newest replica empties completely, the oldest keeps 2
    for gen in streams[8:12] + streams[0:2]:
        gen.cancel()
    assert wait_for(lambda: [replica_report("pack", r).batch for r in order] == [2, 4, 0], timeout=20)
    time.sleep(0.6)  # the router's copy of the stats is up to one period old
    for i in range(12, 14):
        open_one(i)
    assert placed[12:] == [order[0]] * 2  # the busiest with room, not the empty one
    assert replica_report("pack", order[2]).batch == 0
    for gen in streams:
        gen.cancel()
    assert _idle("pack")


# -- 2. migration equivalence --------------------------------------------------------

def test_forced_migrations_are_invisible_to_clients(cluster):
    rng = random.Random(7)
    requests = _requests(60, rng, prompt_len=(3, 8), max_tokens=(16, 30))
    reference = Reference(cluster["model"], cluster["adapters"], block_size=4)
    results = _batch("move", requests)
    moves = sum(len(s.moves) for s, _ in results)
    assert moves >= 100, moves
    for request, (stream, chunks) in zip(requests, results):
        _assert_same(chunks, reference(request), request.request_id)
    assert _idle("move")


def test_openai_clients_see_one_stream_through_migrations(cluster):
    """Streaming and not, logprobs and stop strings, over HTTP while the cluster is loaded."""
    rng = random.Random(11)
    client = OpenAI(base_url=cluster["url"] + "/move/v1", api_key="none", max_retries=0, timeout=120)
    reference = Reference(cluster["model"], cluster["adapters"], block_size=4)
    load = _requests(20, rng, prompt_len=(3, 8), max_tokens=(16, 30), prefix="bg")
    cases = [(list(rng.randrange(100, 49000) for _ in range(5)), 30, seed, stream, stop)
             for seed, stream, stop in [(3, True, None), (5, False, [" the"]), (9, True, ["ing"]), (13, False, None)]]

    def http_case(prompt, max_tokens, seed, stream, stop):
        kw = dict(model="model", prompt=prompt, max_tokens=max_tokens, temperature=0.8, seed=seed, stop=stop, logprobs=1)
        if not stream:
            r = client.completions.create(**kw)
            return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason, r.id
        parts = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        ids = {p.id for p in parts}
        assert len(ids) == 1
        return "".join(p.choices[0].text for p in parts if p.choices), parts[-1].usage.completion_tokens, \
            [p.choices[0].finish_reason for p in parts if p.choices][-1], ids.pop()

    async def go():
        background = asyncio.gather(*(_stream(_submit("move"), r) for r in load))
        loop = asyncio.get_running_loop()
        answers = await asyncio.gather(*(loop.run_in_executor(None, http_case, *c) for c in cases))
        await background
        return answers

    answers = asyncio.run(go())
    for (prompt, max_tokens, seed, _, stop), (text, usage, finish, _) in zip(cases, answers):
        want = reference(GenerateRequest("ref", tuple(prompt), SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=seed, stop=tuple(stop or ()), logprobs=1)))
        summary = _summary(want)
        assert (text, usage, finish) == (summary[1], summary[3], summary[2])


# -- 3. failover -----------------------------------------------------------------------

def test_replica_kills_lose_no_stream(cluster):
    rng = random.Random(3)
    requests = _requests(20, rng, prompt_len=(3, 6), max_tokens=(120, 200), prefix="k")
    edge = GenerateRequest("edge", (11, 12, 13, 14, 15, 16), SamplingParams(max_tokens=250, temperature=0.0))
    requests.append(edge)  # prompt + max_tokens = the context length: killed at its last token
    kills = []

    async def maybe_kill(stream, chunk):
        due = len(kills) < 5 and stream.replica is not None and (
            (stream.request is edge and len(stream.token_ids) == 249)
            or (stream.request is not edge and len(stream.token_ids) in (30, 90) and time.monotonic() > kills_at[0]))
        if due and stream.replica not in kills:
            kills.append(stream.replica)
            kills_at[0] = time.monotonic() + 1.0
            ray.kill(replica_actor("pack", stream.replica), no_restart=True)

    kills_at = [0.0]
    results = _batch("pack", requests, maybe_kill)
    assert len(kills) == 5, kills
    reference = Reference(cluster["model"], cluster["adapters"], block_size=16)
    for request, (stream, chunks) in zip(requests, results):
        _assert_same(chunks, reference(request), request.request_id)
    edge_stream = results[-1][0]
    assert ("failover", 249) in edge_stream.moves
    assert sum(r == "failover" for s, _ in results for r, _ in s.moves) >= 5
    assert wait_for(lambda: len(replica_ids("pack")) == 3, timeout=60)
    assert _idle("pack")


def test_single_replica_failover_waits_for_the_replacement(cluster):
    request = with_fixed_seed(GenerateRequest("solo", (5, 6, 7), SamplingParams(max_tokens=80, temperature=0.7)))
    killed = []

    async def kill_once(stream, chunk):
        if not killed and len(stream.token_ids) == 20:
            killed.append(stream.replica)
            ray.kill(replica_actor("solo", stream.replica), no_restart=True)

    [(stream, chunks)] = _batch("solo", [request], kill_once)
    assert killed and [r for r, _ in stream.moves] == ["failover"] and stream.replica != killed[0]
    _assert_same(chunks, Reference(cluster["model"], cluster["adapters"], block_size=16)(request), "solo")


# -- 4. drain ------------------------------------------------------------------------

def test_scale_down_moves_streams_off_the_stopped_replica(cluster):
    from ray import serve

    rng = random.Random(5)
    requests = _requests(10, rng, prompt_len=(3, 6), max_tokens=(150, 200), prefix="d")
    before = set(replica_ids("pack"))
    started = asyncio.Event()

    async def note(stream, chunk):
        if len(stream.token_ids) == 10:
            started.set()

    async def go():
        submit = _submit("pack")
        tasks = asyncio.gather(*(_stream(submit, r, note) for r in requests))
        await started.wait()
        await asyncio.sleep(0.5)
        n, block, blocks, _ = APPS["pack"]
        app = app_from_args(_args(cluster["model"], cluster["adapters"], 2, block, blocks), engine_factory=slowed_engine)
        await asyncio.get_running_loop().run_in_executor(None, lambda: serve.run(app, name="pack", route_prefix="/pack"))
        return await tasks

    results = asyncio.run(go())
    assert wait_for(lambda: len(replica_ids("pack")) == 2, timeout=60)
    assert set(replica_ids("pack")) < before
    reference = Reference(cluster["model"], cluster["adapters"], block_size=16)
    for request, (stream, chunks) in zip(requests, results):
        assert not isinstance(chunks[-1], ErrorChunk), chunks[-1]
        _assert_same(chunks, reference(dataclasses.replace(request)), request.request_id)
    assert any(r == "replica_stopped" for s, _ in results for r, _ in s.moves)
    assert _idle("pack")
