"""No starvation for a cold adapter: two hot adapters keep both GPU slots pinned at every step
(a new request for each arrives before the last one finishes). A request for a third adapter
waits without blocking them, and once it has waited MAX_SLOT_WAIT_STEPS schedules nothing new
is admitted until it has a slot. Without the aging rule it would wait forever: shown by
turning it off. Steps are counted, never timed."""

import pytest

from adapters_store.gpu_pool import LoraPool, PoolConfig
from adapters_store.store import AdapterStore, StoreConfig
from app.engine import scheduler as scheduler_module
from app.engine.config import EngineConfig
from app.engine.kv_cache import BlockAllocator
from app.engine.scheduler import Scheduler
from app.engine.sequence import Sequence
from app.protocol import GenerateRequest, SamplingParams
from tests.support.store_helpers import TINY_SHAPE, write_adapter

RUN_STEPS = 5  # each request runs this many schedules, then finishes
HORIZON = 400


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("aging")
    store = AdapterStore(TINY_SHAPE, StoreConfig(max_rank=16))
    for i, name in enumerate(("hot0", "hot1", "cold")):
        store.register(name, write_adapter(root / name, TINY_SHAPE, seed=i))
    yield {n: store.get(n) for n in ("hot0", "hot1", "cold")}
    store.close()


def _first_admission_of_cold(weights) -> int | None:
    """Schedules until the cold request runs (None: not within HORIZON)."""
    config = EngineConfig(max_num_seqs=16, max_tokens_per_step=256, num_kv_blocks=512, block_size=16, max_loras=2)
    sched = Scheduler(config, BlockAllocator(config.num_kv_blocks), LoraPool(TINY_SHAPE, PoolConfig(num_slots=2)))
    ran: dict[Sequence, int] = {}
    for step in range(HORIZON):
        hot = f"hot{step % 2}"
        sched.waiting.append(
            Sequence(GenerateRequest(f"{hot}-{step}", (1, 2, 3), SamplingParams(), hot), 0, step, weights[hot])
        )
        if step == 1:
            sched.waiting.append(
                Sequence(GenerateRequest("cold", (1, 2, 3), SamplingParams(), "cold"), 0, step, weights["cold"])
            )
        plan = sched.schedule()
        for seq, n in plan.scheduled:
            if seq.request_id == "cold":
                return step
            seq.num_computed += n
            ran[seq] = ran.get(seq, 0) + 1
            if ran[seq] == RUN_STEPS:
                sched.remove(seq)
    return None


def test_hot_adapters_never_starve_a_cold_one(weights, monkeypatch):
    admitted = _first_admission_of_cold(weights)
    assert admitted is not None
    # refused from step 1; ages for MAX_SLOT_WAIT_STEPS; the running requests then finish within RUN_STEPS
    assert admitted <= 1 + scheduler_module.MAX_SLOT_WAIT_STEPS + RUN_STEPS + 1, admitted
    monkeypatch.setattr(scheduler_module, "MAX_SLOT_WAIT_STEPS", 10**9)
    assert _first_admission_of_cold(weights) is None  # the rule is what bounds it: without it, starved
