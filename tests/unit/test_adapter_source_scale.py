"""A thousand adapters under an S3 prefix (moto on 127.0.0.1), resolved on demand by name:
3,000 Zipf(1.1) requests through the engine and its AdapterStore with 8 GPU slots, a host
cache of 128 adapters and a disk cache of 160. Every output equals the same adapter served
from a local registration; every tier loads at most once per miss; no request waits longer
than the scheduler's aging bound (counted in engine steps, so it holds on any machine);
afterwards no slot is pinned and every cache is within its budget.

The engine is driven step by step (as tests.support.helpers.run_to_completion does) with 16 requests
in flight, a new one joining as each finishes; the HTTP/Ray layers above it are covered for
on-demand names by tests/serve/test_adapter_source_app.py.
"""

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from adapters_store.disk_cache import DiskCacheConfig
from adapters_store.host_cache import HostCacheConfig
from adapters_store.store import AdapterStore, StoreConfig
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.engine.scheduler import MAX_SLOT_WAIT_STEPS
from app.protocol import GenerateRequest, SamplingParams, TokenChunk
from tests.support.helpers import make_tiny_llama, run_to_completion
from tests.support.store_helpers import TINY_SHAPE, one_torch_thread, store_config, upload_dir, write_adapter  # noqa: F401

pytestmark = pytest.mark.slow  # a thousand adapters through moto S3

pytest_plugins = ["tests.support.s3_fixtures"]

N_ADAPTERS, N_REQUESTS, IN_FLIGHT, SLOTS = 1000, 3000, 16, 8
HOST_HELD, DISK_HELD = 128, 160  # budgets, in adapters of the largest size written here
MAX_TOKENS, PROMPT_LEN = 4, 6
TARGETS = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("v_proj", "down_proj")]
RANKS = (4, 8, 16)
LARGEST = (
    3 * 16 * (64 + 64 + 64 + 16 + 64 + 16 + 64 + 64) * 4
)  # rank 16 on q, k, v, o; fp32 (a safetensors file is a few hundred bytes more)


def _engine_config() -> EngineConfig:
    return EngineConfig(
        max_num_seqs=IN_FLIGHT,
        max_tokens_per_step=256,
        num_kv_blocks=256,
        block_size=8,
        max_loras=SLOTS,
        max_lora_rank=16,
    )


def _prompt(i: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(i).integers(0, 320, PROMPT_LEN))


def _request(rid: str, name: str) -> GenerateRequest:
    return GenerateRequest(
        rid, _prompt(int(name[1:])), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), name
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, s3):
    """1,000 distinct adapters (own seed, rank 4/8/16, three target sets), written locally and under s3://fleet/a/."""
    root = tmp_path_factory.mktemp("fleet")
    model = make_tiny_llama(root / "model")
    dirs = {
        f"a{i}": write_adapter(
            root / "src" / f"a{i}",
            TINY_SHAPE,
            rank=RANKS[i % 3],
            targets=TARGETS[i // 3 % 3],
            seed=i,
            alpha=RANKS[i % 3] / 8,
        )
        for i in range(N_ADAPTERS)
    }
    bucket = s3.bucket("fleet")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: upload_dir(s3.client, bucket, f"a/{n}", dirs[n]), dirs))
    return model, dirs, f"s3://{bucket}/a/"


def _trace() -> list[str]:
    """3,000 names, Zipf(1.1) popularity over the 1,000 adapters (rank 1 = a0), fixed seed."""
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, N_ADAPTERS + 1) ** 1.1
    return [f"a{k}" for k in rng.choice(N_ADAPTERS, N_REQUESTS, p=weights / weights.sum())]


def _serve_closed_loop(engine, names: list[str]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """IN_FLIGHT requests at a time; (tokens by request id, steps each waited before its first token)."""
    pending = list(enumerate(names))[::-1]
    for _, name in pending[-IN_FLIGHT:]:
        engine.adapters.prefetch(name)
    tokens, added, waited, live = {}, {}, {}, 0
    step = 0
    while pending or engine.has_work():
        while pending and live < IN_FLIGHT:
            if len(pending) > IN_FLIGHT:  # as the async engine does: loads overlap, off the step
                engine.adapters.prefetch(pending[-IN_FLIGHT - 1][1])
            i, name = pending.pop()
            engine.add(_request(f"r{i}", name))
            tokens[f"r{i}"], added[f"r{i}"] = [], step
            live += 1
        for chunk in engine.step():
            assert isinstance(chunk, TokenChunk), chunk
            if not tokens[chunk.request_id]:
                waited[chunk.request_id] = step - added[chunk.request_id]  # steps before the one that prefilled it
            tokens[chunk.request_id] += chunk.token_ids
            live -= chunk.finish_reason is not None
        step += 1
    return tokens, waited


def test_a_thousand_adapters_on_demand_from_s3(tmp_path, s3, fleet):
    model, dirs, prefix = fleet
    cfg = store_config(
        s3.endpoint,
        tmp_path,
        default_root=prefix,
        host=HostCacheConfig(budget_bytes=HOST_HELD * LARGEST),
        disk=DiskCacheConfig(tmp_path / "cache", budget_bytes=DISK_HELD * (LARGEST + 1024)),
        workers=4,
    )
    engine = build_engine(model, _engine_config(), tokenizer=None, store_config=cfg)
    store, pool = engine.adapters, engine.model.lora_pool
    names = _trace()
    tokens, waited = _serve_closed_loop(engine, names)

    # The same adapters registered from their local directories, each asked its prompt once.
    used = sorted(set(names), key=lambda n: int(n[1:]))
    local = AdapterStore(TINY_SHAPE, StoreConfig(max_rank=16, host=HostCacheConfig(budget_bytes=1 << 30)))
    for n in used:
        local.register(n, dirs[n])
    reference = build_engine(model, _engine_config(), tokenizer=None, store=local)
    want, _, _ = run_to_completion(reference, {0: [_request(f"ref-{n}", n) for n in used]})
    assert (
        len({tuple(t) for t in want.values()}) > len(used) // 2
    )  # adapters change the output: equality means something
    for i, name in enumerate(names):
        assert tokens[f"r{i}"] == want[f"ref-{name}"], (i, name)

    tiers = store.tiers(pool)
    gpu, host, disk = tiers["gpu"], tiers["host"], tiers["disk"]
    assert len(used) > 300 and min(gpu["eviction"], host["eviction"], disk["eviction"]) > 0  # every tier thrashes
    assert gpu["load"] <= gpu["miss"] and gpu["hit"] + gpu["miss"] >= N_REQUESTS
    assert host["load"] <= host["miss"] and disk["load"] <= disk["miss"]
    assert host["load"] >= len(used)  # each adapter was loaded from S3 (or the disk copy) at least once
    # Bound by construction (app/engine/scheduler.py, _starving): a request refused a slot ages for
    # MAX_SLOT_WAIT_STEPS schedules; then nothing behind it is admitted, the running requests finish
    # within one prefill + MAX_TOKENS steps, and each such round admits the next SLOTS adapters.
    bound = MAX_SLOT_WAIT_STEPS + (1 + MAX_TOKENS + 1) * math.ceil(IN_FLIGHT / SLOTS) + 1
    assert max(waited.values()) <= bound, (max(waited.values()), bound)
    assert pool.pinned() == 0 and gpu["resident"] <= SLOTS
    assert host["bytes"] <= host["budget_bytes"] and disk["bytes"] <= disk["budget_bytes"]
    assert sum(tiers["load_seconds"]["s3"].values()) == int(store.metrics.snapshot()["load.s3"])
    store.close()
    local.close()
