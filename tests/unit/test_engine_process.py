"""The engine in a child process (app/engine/process_engine.py), without Serve, on the tiny chat
model in float64: every choice's output equals the in-process engine's (stop strings, logprobs,
n > 1, a grammar, an adapter registered through the replica's store calls); rejections raise
before the first chunk; leaving a stream aborts it there; a drain moves every request; the
child's death ends every stream with an error and says why; and the child never outlives
its parent, however the parent dies (SIGKILL included)."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from app.engine.async_engine import build_async_engine
from app.engine.config import EngineConfig
from app.engine.process_engine import ProcessEngine
from app.errors import InvalidRequestError, UnknownAdapterError
from app.protocol import ErrorChunk, GenerateRequest, Guide, Migrate, SamplingParams, TokenChunk
from app.serving.registry import AdapterSpec
from app.serving.replica import ReplicaSettings
from tests.support.cluster_fixtures import make_tiny_chat_llama
from tests.support.helpers import make_random_adapter

CONFIG = EngineConfig(max_num_seqs=8, num_kv_blocks=256, block_size=4, max_model_len=256, dtype=torch.float64)
DEADLINE_S = 120  # a bound only a broken process reaches (the machine is a loaded 2-core box)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-process")
    model = make_tiny_chat_llama(root / "model")
    make_random_adapter(model, root / "a1", rank=4, targets=["q_proj", "v_proj"], seed=1)
    make_random_adapter(model, root / "a2", rank=4, targets=["q_proj", "v_proj"], seed=2)
    return model


@pytest.fixture(scope="module")
def settings(model):
    return ReplicaSettings(str(model), CONFIG, (AdapterSpec("a1", str(model.parent / "a1"), 1),))


@pytest.fixture(scope="module")
def child(settings):
    engine = ProcessEngine(build_async_engine, settings)
    yield engine
    engine.shutdown()


def _requests():
    out = []
    for i in range(6):
        params = SamplingParams(
            max_tokens=12 + i,
            temperature=0.0 if i % 2 else 0.8,
            seed=100 + i,
            logprobs=2 if i % 3 == 0 else None,
            stop=(" the", "ing") if i % 3 == 1 else (),
        )
        out.append(GenerateRequest(f"r{i}", (100 + i, 2000, 3000 + i), params, "a1" if i % 2 == 0 else None))
    out.append(GenerateRequest("n3", (5, 6, 7, 8, 9), SamplingParams(max_tokens=10, seed=7), n=3))
    guide = Guide("choice", json.dumps(["alpha", "beta", "gamma"]))
    out.append(GenerateRequest("g", (11, 12, 13), SamplingParams(max_tokens=16, seed=3, guide=guide)))
    return out


async def _collect(engine, request):
    """{choice: (tokens, text, finish reason, completion tokens, logprobs)}, and the items' kinds."""
    by_choice: dict[int, list] = {}
    async for chunk in engine.generate(request):
        by_choice.setdefault(chunk.index, []).append(chunk)
    return {
        i: (
            [t for c in cs for t in c.token_ids],
            "".join(c.text for c in cs),
            cs[-1].finish_reason,
            cs[-1].completion_tokens,
            [lp for c in cs for lp in (c.logprobs or ())],
        )
        for i, cs in by_choice.items()
    }


async def _run_all(engine, adapter_path):
    await engine.store.register("a1", str(adapter_path))  # as the replica re-registers a changed spec
    return await asyncio.gather(*(_collect(engine, r) for r in _requests()))


def test_outputs_equal_the_in_process_engine(child, settings, model):
    local = build_async_engine(settings)
    try:
        want = asyncio.run(_run_all(local, model.parent / "a1"))
    finally:
        local.shutdown()
    got = asyncio.run(_run_all(child, model.parent / "a1"))
    assert got == want
    assert all(out[i][2] in ("stop", "length") for out in got for i in out)
    assert any(out[0][2] == "stop" for out in got)  # a stop string or the grammar ended one
    report = child.stats().result(DEADLINE_S)
    assert report.stats.running == report.stats.waiting == 0 and "a1" in report.adapters
    snapshot, telemetry = child.metrics_sample()
    assert telemetry.generation_tokens == sum(len(o[i][0]) for o in got for i in o)
    assert snapshot.total_kv_blocks == CONFIG.num_kv_blocks


def test_rejections_raise_before_the_first_chunk(child):
    async def first(request):
        async for chunk in child.generate(request):
            return chunk

    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        asyncio.run(first(GenerateRequest("bad", (10**9,), SamplingParams(max_tokens=4))))
    with pytest.raises(UnknownAdapterError) as caught:
        asyncio.run(first(GenerateRequest("bad", (10,), SamplingParams(max_tokens=4), "no-such-adapter")))
    assert caught.value.adapter == "no-such-adapter"


def test_leaving_a_stream_aborts_it_and_a_drain_moves_the_rest(child):
    async def scenario():
        leaver = child.generate(GenerateRequest("leave", (1, 2, 3), SamplingParams(max_tokens=200, seed=1)))
        await leaver.__anext__()
        await leaver.aclose()  # the client went away
        stays = child.generate(GenerateRequest("stay", (4, 5, 6), SamplingParams(max_tokens=200, seed=2)))
        first = await stays.__anext__()
        moved = await asyncio.wrap_future(child.drain())
        rest = [c async for c in stays]
        return first, moved, rest

    first, moved, rest = asyncio.run(scenario())
    assert isinstance(first, TokenChunk) and moved == 1
    assert isinstance(rest[-1], Migrate) and rest[-1].reason == "draining"
    stats = child.stats().result(DEADLINE_S).stats
    assert stats.running == stats.waiting == 0  # the aborted one holds nothing either


def test_a_request_left_while_its_adapter_loads_never_runs(child, model):
    async def scenario():
        await child.store.register("a2", str(model.parent / "a2"))  # registered, not loaded
        request = GenerateRequest("early", (1, 2, 3), SamplingParams(max_tokens=200, seed=1), "a2")
        task = asyncio.ensure_future(child.generate(request).__anext__())
        await asyncio.sleep(0)  # the add is sent; its adapter loads in the engine process
        task.cancel()
        await child.store.load("a2")  # the same load: done only after the add's preparation
        short = GenerateRequest("after", (4, 5, 6), SamplingParams(max_tokens=2, seed=2))
        return [c async for c in child.generate(short)]

    after = asyncio.run(scenario())
    assert after[-1].finish_reason == "length"
    stats = child.stats().result(DEADLINE_S).stats
    # a 200-token request added before the 2-token one would still be running now
    assert stats.running == stats.waiting == 0


def test_the_childs_death_ends_every_stream_and_is_reported(settings):
    deaths = []
    engine = ProcessEngine(build_async_engine, settings, on_death=deaths.append)

    async def scenario():
        stream = engine.generate(GenerateRequest("x", (1, 2, 3), SamplingParams(max_tokens=200, seed=1)))
        await stream.__anext__()
        os.kill(engine.pid, signal.SIGKILL)
        return [c async for c in stream]

    rest = asyncio.run(scenario())
    assert isinstance(rest[-1], ErrorChunk) and rest[-1].status == 503
    assert "exited" in engine.failure() and deaths == [engine.failure()]
    engine.shutdown()


_PARENT = """
import sys, time
import torch
from app.engine.async_engine import build_async_engine
from app.engine.config import EngineConfig
from app.engine.process_engine import ProcessEngine
from app.serving.replica import ReplicaSettings
if __name__ == "__main__":
    config = EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=256, dtype=torch.float64)
    engine = ProcessEngine(build_async_engine, ReplicaSettings(sys.argv[1], config, ()))
    print(engine.pid, flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """In the process table and not a zombie (a reaped or exited child is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_child_never_outlives_its_parent(model, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(_PARENT))
    parent = subprocess.Popen(
        [sys.executable, str(script), str(model)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child_pid), "the engine process outlived its parent"
    finally:
        parent.kill()
