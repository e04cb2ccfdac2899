"""LoraReplica with its engine in a child process (`engine_process: true`) on real Ray Serve, two
replicas of the tiny chat model in float64 (the engines slowed so streams stay in flight):
- the engine process killed with SIGKILL mid-stream: its replica exits, every stream resumes on
  the other replica by migration and equals the request run alone on one uninterrupted engine,
  and Serve starts a replacement;
- the replica's process killed with SIGKILL: its engine process is gone from the process table
  soon after (polled against a generous deadline: a property, not a timing)."""

import asyncio
import os
import random
import signal
import time

import pytest
import ray
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.openai.client_stream import with_fixed_seed
from app.protocol import GenerateRequest, SamplingParams, TokenChunk
from tests.support.app_fixtures import config_args, delete_apps, shared_serve, wait_for
from tests.support.cluster_checks import assert_same, client_stream, idle, submit_to
from tests.support.cluster_fixtures import (
    deploy_replicas,
    make_tiny_chat_llama,
    replica_actor,
    replica_ids,
    slowed_engine,
)

APP = "eproc"
BLOCK = 16
DEADLINE_S = 120  # bounds only a broken system reaches


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_chat_llama(tmp_path_factory.mktemp("eproc") / "model")
    args = config_args(
        model=str(model),
        dtype="float64",
        max_batch_size=8,
        num_kv_blocks=128,
        block_size=BLOCK,
        max_model_len=256,
        adapter_dirs=[],
        engine_process=True,
        replica={"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}},
        cluster={"routing_stats_period_s": 0.2, "failover_wait_s": 120},
    )
    shared_serve()
    try:
        deploy_replicas(APP, args, (), slowed_engine)
        yield {"model": model}
    finally:
        delete_apps()


def _reference(model, request: GenerateRequest) -> list[TokenChunk]:
    config = EngineConfig(max_num_seqs=8, num_kv_blocks=512, block_size=BLOCK, max_model_len=256, dtype=torch.float64)
    core = build_engine(model, config, {})
    core.add(request)
    out = []
    while core.has_work():
        out += [c for c in core.step() if isinstance(c, TokenChunk)]
    return out


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``, from /proc (not zombies)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _replica_pid(replica_id: str) -> int:
    return ray.get(replica_actor(APP, replica_id).__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def _engine_pid(replica_id: str) -> int:
    """The replica's engine process: its one child that runs multiprocessing's spawn entry."""
    pid = _replica_pid(replica_id)
    engines = [c for c in _children(pid) if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
    assert len(engines) == 1, (pid, _children(pid))
    return engines[0]


def _requests(n: int):
    rng = random.Random(43)
    out = []
    for i in range(n):
        greedy = i % 2 == 0
        params = SamplingParams(
            max_tokens=60,
            temperature=0.0 if greedy else 0.9,
            top_p=1.0 if greedy else 0.9,
            seed=None if greedy else rng.randrange(2**31),
            stop=(" the",) if i == 3 else (),
        )
        prompt = tuple(rng.randrange(100, 49000) for _ in range(8))
        out.append(with_fixed_seed(GenerateRequest(f"k{i}", prompt, params)))
    return out


def test_a_killed_engine_process_fails_its_replica_over_and_streams_resume_exactly(cluster):
    before = set(replica_ids(APP))
    assert len(before) == 2
    requests = _requests(4)
    killed = []

    async def kill_engine_once(stream, chunk):
        if not killed and len(stream.token_ids) >= 10:  # mid-stream: an item may carry several tokens
            killed.append(stream.replica)
            os.kill(await asyncio.to_thread(_engine_pid, stream.replica), signal.SIGKILL)

    submit = submit_to(APP, {})

    async def run():
        return await asyncio.gather(*(client_stream(submit, r, kill_engine_once) for r in requests))

    results = asyncio.run(run())
    assert killed
    moved = [stream for stream, _ in results if stream.moves]
    assert moved and all(reason == "failover" for s in moved for reason, _ in s.moves)
    for request, (_, chunks) in zip(requests, results):
        assert_same(chunks, _reference(cluster["model"], request), request.request_id)
    replaced = wait_for(lambda: (lambda now: len(now) == 2 and killed[0] not in now)(set(replica_ids(APP))), DEADLINE_S)
    assert replaced, f"no replacement for {killed[0]}: {replica_ids(APP)}"
    assert idle(APP), "a replica's routing stats show work left behind"  # both answer record_routing_stats


def test_the_engine_process_never_outlives_its_replica(cluster):
    replica = wait_for(lambda: replica_ids(APP), DEADLINE_S)[0]
    pid, engine = _replica_pid(replica), _engine_pid(replica)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + DEADLINE_S
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine), "the engine process outlived its replica"
