"""The cluster layer on real Ray Serve, 3 replicas each: consolidation (max batch 4),
migration equivalence under small KV caches (and its bound), clients of the HTTP API
through migrations, failover on replica kills amid client disconnects, a scale-down
that stops replicas holding streams, and one replica waiting for its replacement.
Every output is compared with the same request run alone on one uninterrupted engine
(in this process, same checkpoint). Engines compute in float64: a moved request is recomputed
in another batch shape, and the tiny model's near-uniform 49k-token distributions put fp32's
rounding within reach of a sampled draw's boundary (3 of 100 resumed streams differed)."""

import asyncio
import random
import time

import pytest
import ray

from app.builder import app_from_args
from app.openai.client_stream import MigrationPolicy, with_fixed_seed
from app.protocol import ErrorChunk, GenerateRequest, SamplingParams
from app.serving.registry import scan
from tests.support.app_fixtures import config_args, serving, wait_for
from tests.support.cluster_checks import (
    ADAPTERS,
    POLICY,
    Reference,
    assert_same,
    client_stream,
    idle,
    make_requests,
    submit_to,
    summary,
)
from tests.support.cluster_fixtures import (
    deploy_replicas,
    make_tiny_chat_llama,
    replica_actor,
    replica_ids,
    replica_report,
    router_order,
    router_reports,
    scale,
    slowed_engine,
)
from tests.support.error_hygiene import checked_openai
from tests.support.helpers import make_random_adapter

PACK_LEN = 256  # the "pack" replicas' context length


def _args(model, adapters, block, blocks, batch, max_len):
    return config_args(
        model=str(model),
        dtype="float64",
        max_batch_size=batch,
        num_kv_blocks=blocks,
        block_size=block,
        max_model_len=max_len,
        max_tokens_per_step=256,
        adapter_dirs=[str(adapters)],
        max_loras=4,
        max_lora_rank=8,
        replica={"num_replicas": 3, "ray_actor_options": {"num_cpus": 0.5}},
        ingress={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
        cluster={"routing_stats_period_s": 0.2, "failover_wait_s": 60, "max_migrations": 32},
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """ "pack": slowed engines of batch 4 with room (placement, kills, scale-down); "move":
    the whole app (ingress included) on engines of batch 4 and 40 KV tokens, so requests
    are preempted."""
    root = tmp_path_factory.mktemp("cluster")
    model = make_tiny_chat_llama(root / "model")
    adapters = root / "adapters"
    for i, name in enumerate(ADAPTERS):
        make_random_adapter(model, adapters / name, rank=4 * (i + 1), targets=["q_proj", "v_proj", "down_proj"], seed=i)
    specs = {s.name: s for s in scan([adapters])}
    with serving({"move": (app_from_args(_args(model, adapters, 4, 10, 4, 256)), "/move")}, num_cpus=8) as url:
        deploy_replicas("pack", _args(model, adapters, 16, 64, 4, PACK_LEN), tuple(specs.values()), slowed_engine)
        yield {"url": url, "model": model, "adapters": adapters, "specs": specs}


def _batches(reports: dict, order: list[str]) -> list[int | None]:
    return [reports[r].batch if r in reports else None for r in order]


# -- 1. consolidation ---------------------------------------------------------------


def test_requests_fill_the_oldest_replica_first_and_an_emptied_replica_stays_empty(cluster):
    from ray import serve

    handle = serve.get_deployment_handle("LoraReplica", "pack").options(stream=True).generate
    assert wait_for(lambda: sorted(router_order("pack")) == replica_ids("pack"), timeout=60)
    order = router_order("pack")  # Serve's running order, oldest first: the age the router ranks by
    assert wait_for(lambda: None not in _batches(router_reports("pack"), order), timeout=60)  # it has their reports
    streams, placed = [], []

    def open_one(i):
        request = GenerateRequest(f"c{i}", (101, 202, 303 + i), SamplingParams(max_tokens=240, temperature=0.0))
        gen = handle.remote(request, None, 0)
        placed.append(next(gen).replica_id)  # Accepted: where the router sent it
        next(gen)  # its first token: it runs
        streams.append(gen)

    for i in range(12):
        open_one(i)
    assert placed == [order[0]] * 4 + [order[1]] * 4 + [order[2]] * 4
    assert [replica_report("pack", r).running for r in order] == [4, 4, 4]

    # load drops: the newest replica empties completely, the oldest keeps 2
    for gen in streams[8:12] + streams[0:2]:
        gen.cancel()
    assert wait_for(lambda: [replica_report("pack", r).batch for r in order] == [2, 4, 0], timeout=20)
    # the router routes on its copy of the reports (up to a polling period old): once that shows
    # the same, the next choices are made on the drop (a generous deadline, no fixed sleep)
    assert wait_for(lambda: _batches(router_reports("pack"), order) == [2, 4, 0], timeout=60)
    for i in range(12, 14):
        open_one(i)
    assert placed[12:] == [order[0]] * 2  # the busiest with room, not the empty one
    assert replica_report("pack", order[2]).batch == 0
    for gen in streams:
        gen.cancel()
    assert idle("pack")


# -- 2. migration equivalence, and its bound ------------------------------------------


def test_forced_migrations_are_invisible_to_clients_and_bounded(cluster):
    rng = random.Random(7)
    requests = make_requests(110, rng, prompt_len=(3, 6), max_tokens=(26, 34))  # 29-40 tokens: one fits a replica's 40
    bounded = {r.request_id for r in requests[:12]}  # these may move once only
    one_move = MigrationPolicy(max_migrations=1, failover_wait_s=60)
    submit = submit_to("move", cluster["specs"])

    async def go():
        return await asyncio.gather(
            *(client_stream(submit, r, policy=one_move if r.request_id in bounded else POLICY) for r in requests)
        )

    results = asyncio.run(go())
    reference = Reference(cluster["model"], cluster["adapters"], block_size=4)
    # 110 requests of 29-40 tokens on replicas of 40 KV tokens and batch 4: a replica running
    # two of them runs out of KV, so requests move (how many depends on timing: not asserted)
    assert sum(len(s.moves) for s, _ in results) > 0
    for request, (stream, chunks) in zip(requests, results):
        past_bound = request.request_id in bounded and len(stream.moves) == 2
        if isinstance(chunks[-1], ErrorChunk) or past_bound:  # exactly those past the bound, and said so
            assert past_bound and isinstance(chunks[-1], ErrorChunk), request.request_id
            assert chunks[-1].status == 503 and "max_migrations" in chunks[-1].message
        else:
            assert_same(chunks, reference(request), request.request_id)
    assert idle("move")


def test_openai_clients_see_one_stream_through_migrations(cluster):
    """Streaming and not, logprobs and stop strings, over HTTP while the cluster is loaded."""
    rng = random.Random(11)
    client = checked_openai(base_url=cluster["url"] + "/move/v1", api_key="none", max_retries=0, timeout=120)
    reference = Reference(cluster["model"], cluster["adapters"], block_size=4)
    load = make_requests(16, rng, prompt_len=(3, 6), max_tokens=(16, 30), prefix="bg")
    cases = [
        (list(rng.randrange(100, 49000) for _ in range(5)), 30, seed, stream, stop)
        for seed, stream, stop in [(3, True, None), (5, False, [" the"]), (9, True, ["ing"]), (13, False, None)]
    ]

    def http_case(prompt, max_tokens, seed, stream, stop):
        kw = dict(
            model="model", prompt=prompt, max_tokens=max_tokens, temperature=0.8, seed=seed, stop=stop, logprobs=1
        )
        if not stream:
            r = client.completions.create(**kw)
            return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason
        parts = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        assert len({p.id for p in parts}) == 1
        return (
            "".join(p.choices[0].text for p in parts if p.choices),
            parts[-1].usage.completion_tokens,
            [p.choices[0].finish_reason for p in parts if p.choices][-1],
        )

    async def go():
        submit = submit_to("move", cluster["specs"])
        background = asyncio.gather(*(client_stream(submit, r) for r in load))
        loop = asyncio.get_running_loop()
        answers = await asyncio.gather(*(loop.run_in_executor(None, http_case, *c) for c in cases))
        return answers, await background

    answers, background = asyncio.run(go())
    assert sum(len(s.moves) for s, _ in background) > 0
    for (prompt, max_tokens, seed, _, stop), got in zip(cases, answers):
        want = summary(
            reference(
                GenerateRequest(
                    "ref",
                    tuple(prompt),
                    SamplingParams(
                        max_tokens=max_tokens, temperature=0.8, seed=seed, stop=tuple(stop or ()), logprobs=1
                    ),
                )
            )
        )
        assert got == (want[1], want[3], want[2])


# -- 3. failover ---------------------------------------------------------------------


def test_replica_kills_amid_disconnects_lose_no_stream(cluster):
    rng = random.Random(3)
    requests = make_requests(12, rng, prompt_len=(3, 6), max_tokens=(60, 100), prefix="k")
    edge = GenerateRequest("edge", (11, 12, 13, 14, 15, 16), SamplingParams(max_tokens=PACK_LEN - 6, temperature=0.0))
    requests.append(edge)  # prompt + max_tokens = the context length: killed at its last token
    leave = {f"k{i}": 25 + 5 * i for i in (2, 5, 7, 10)}  # these clients hang up mid-stream
    kills, kills_at = [], [0.0]

    async def maybe_kill(stream, chunk):
        n = len(stream.token_ids)
        crossed = lambda x: n - len(chunk.token_ids) < x <= n  # noqa: E731 (an item may carry several tokens)
        others = sum(k != "edge" for _, k, _ in kills)
        due = (
            stream.replica is not None
            and not chunk.finish_reason
            and (
                (stream.request is edge and crossed(PACK_LEN - 7))  # at its last token (or the item holding it)
                or (
                    stream.request is not edge
                    and others < 4
                    and (crossed(20) or crossed(50))
                    and time.monotonic() > kills_at[0]
                )
            )
        )
        if due and stream.replica not in [r for r, _, _ in kills]:
            kills.append((stream.replica, stream.request.request_id, n))
            kills_at[0] = time.monotonic() + 1.0
            ray.kill(replica_actor("pack", stream.replica), no_restart=True)

    async def go():
        submit = submit_to("pack", cluster["specs"])
        return await asyncio.gather(
            *(client_stream(submit, r, maybe_kill, leave_at=leave.get(r.request_id)) for r in requests)
        )

    results = asyncio.run(go())
    # up to 4 kills a second apart as streams cross tokens 20 and 50; how many land before the
    # streams end depends on the machine's pace, so the count asserted is the floor that makes
    # the property (no stream lost, each equal to its reference) one about repeated failover
    assert 2 <= sum(k != "edge" for _, k, _ in kills) <= 4, kills
    reference = Reference(cluster["model"], cluster["adapters"], block_size=16)
    for request, (stream, chunks) in zip(requests, results):
        want = reference(request)
        got = [t for c in chunks for t in c.token_ids]
        if request.request_id in leave and len(got) >= leave[request.request_id]:  # its client hung up there
            assert got == [t for c in want for t in c.token_ids][: len(got)], request.request_id
        else:
            assert_same(chunks, want, request.request_id)
    # the edge's replica is killed at its last token, unless the item that brought token
    # PACK_LEN - 7 also ended the stream (coalesced under load: then it finished there)
    if any(k == "edge" for _, k, _ in kills):
        assert ("failover", PACK_LEN - 7) in results[-1][0].moves
    assert sum(r == "failover" for s, _ in results for r, _ in s.moves) >= len(kills)
    assert wait_for(lambda: len(replica_ids("pack")) == 3, timeout=90)
    assert idle("pack")


# -- 4. scale-down: streams move off the stopped replica --------------------------------


def test_scale_down_moves_streams_off_the_stopped_replica(cluster):
    rng = random.Random(5)
    requests = make_requests(10, rng, prompt_len=(3, 6), max_tokens=(100, 120), prefix="d")
    assert len(idle("pack")) == 3  # all running: Serve stops a replica still starting first
    before = set(replica_ids("pack"))
    running, started = asyncio.Event(), set()

    async def note(stream, chunk):
        # 10 tokens in (an item may carry several), or ended early (a stop string)
        if len(stream.token_ids) >= 10 or chunk.finish_reason:
            started.add(stream.request.request_id)
            if len(started) == len(requests):  # every stream placed and under way: then scale down
                running.set()

    async def go():
        tasks = asyncio.gather(*(client_stream(submit_to("pack", cluster["specs"]), r, note) for r in requests))
        await asyncio.wait_for(running.wait(), timeout=300)  # a bound only a broken cluster reaches
        await asyncio.get_running_loop().run_in_executor(None, scale, "pack", 2)
        return await tasks

    results = asyncio.run(go())
    assert wait_for(lambda: len(replica_ids("pack")) == 2, timeout=60)
    assert set(replica_ids("pack")) < before
    reference = Reference(cluster["model"], cluster["adapters"], block_size=16)
    for request, (stream, chunks) in zip(requests, results):
        assert not isinstance(chunks[-1], ErrorChunk), chunks[-1]
        assert_same(chunks, reference(request), request.request_id)
    assert any(r == "replica_stopped" for s, _ in results for r, _ in s.moves)
    assert idle("pack")


def test_single_replica_failover_waits_for_the_replacement(cluster):
    scale("pack", 1)
    assert wait_for(lambda: len(replica_ids("pack")) == 1, timeout=60)
    request = with_fixed_seed(GenerateRequest("solo", (5, 6, 7), SamplingParams(max_tokens=80, temperature=0.7)))
    killed = []

    async def kill_once(stream, chunk):
        if not killed and len(stream.token_ids) >= 20:  # an item may carry several tokens
            killed.append(stream.replica)
            ray.kill(replica_actor("pack", stream.replica), no_restart=True)

    stream, chunks = asyncio.run(client_stream(submit_to("pack", cluster["specs"]), request, kill_once))
    assert killed and [r for r, _ in stream.moves] == ["failover"] and stream.replica != killed[0]
    assert_same(chunks, Reference(cluster["model"], cluster["adapters"], block_size=16)(request), "solo")
