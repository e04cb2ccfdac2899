"""Tensor parallelism on the CPU: sharding round-trips exactly, and a TP-2 engine (two
processes over gloo) generates what the single-process engine does, token for token, for
batches mixing several adapters (LoRA on all seven projections) and base rows; under
Ray Serve a TP-2 replica is one replica (one placement group of two bundles) whose
answers equal the single-process engine's."""

import dataclasses
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from adapters_store.manifest import TARGET_MODULES
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.engine.tp.sharding import COLUMN, Shard, load_shard_weights, shard_adapter, shard_config
from app.model.config import ModelConfig
from app.model.weights import load_weights
from app.protocol import GenerateRequest, SamplingParams
from tests.support.error_hygiene import checked_openai
from tests.support.helpers import make_random_adapter, run_to_completion
from tests.support.store_helpers import load_local

RANKS = {"a": 4, "b": 8, "c": 16, "d": 2}


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir))


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-adapters")
    return {
        name: make_random_adapter(tiny_model_dir, root / name, rank=r, targets=TARGET_MODULES, seed=10 + i)
        for i, (name, r) in enumerate(RANKS.items())
    }


def gather_lora_pair(module: str, shards: list[tuple[torch.Tensor, torch.Tensor]]):
    """The inverse of shard_lora_pair over all ranks' pairs (the replicated matrix from rank 0)."""
    a, b = zip(*shards)
    return (a[0], torch.cat(b, 0)) if module in COLUMN else (torch.cat(a, 1), b[0])


def test_adapter_shards_gather_to_the_original_bit_for_bit(cfg, adapters):
    full = load_local("a", adapters["a"], 64, cfg.shape)
    world = 2
    shards = [shard_adapter(full, Shard(r, world), torch.float32) for r in range(world)]
    for (layer, m), (a, b) in full.tensors.items():
        parts = [s.tensors[layer, m] for s in shards]
        ga, gb = gather_lora_pair(m, parts)
        assert torch.equal(ga, a) and torch.equal(gb, b), (layer, m)
        split = parts[0][1] if m in COLUMN else parts[0][0]
        assert split.shape[0 if m in COLUMN else 1] * world == (b.shape[0] if m in COLUMN else a.shape[1])
        assert not torch.equal(*(p[1] if m in COLUMN else p[0] for p in parts)), "shards must differ"
    # each shard fits the sharded model's slots exactly
    dims = shard_config(cfg, world).module_dims
    for s in shards:
        for m, st in s.stacks.items():
            assert (st.A.shape[-1], st.Bt.shape[-1]) == dims[m]


def test_weight_shards_gather_to_the_checkpoint(tiny_model_dir, cfg):
    full = load_weights(tiny_model_dir, cfg, torch.float32, "cpu")
    shards = [load_shard_weights(tiny_model_dir, cfg, Shard(r, 2), torch.float32, "cpu") for r in range(2)]
    c = shard_config(cfg, 2)
    q, kv, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    for layer, w0 in enumerate(full.layers):
        qkv = [s.layers[layer].proj["qkv"].split([q, kv, kv]) for s in shards]
        assert torch.equal(w0.proj["qkv"], torch.cat([torch.cat(p) for p in zip(*qkv)]))
        gate_up = [s.layers[layer].proj["gate_up"].split([i, i]) for s in shards]
        assert torch.equal(w0.proj["gate_up"], torch.cat([torch.cat(p) for p in zip(*gate_up)]))
        for fused in ("o", "down"):
            assert torch.equal(w0.proj[fused], torch.cat([s.layers[layer].proj[fused] for s in shards], dim=1))
    assert all(torch.equal(s.embed, full.embed) and torch.equal(s.lm_head, full.lm_head) for s in shards)


def test_step_messages_rebuild_the_inputs_exactly():
    """Every kind of step (prefill + decode, decode only, with and without LoRA) comes out of
    encode → decode equal, dtypes and shapes included."""
    from app.engine.tp.wire import decode, encode
    from app.model.inputs import LoraSegments, StepInputs
    from ops.paged_attention import DecodeRows, PagedBatch, PrefillRows

    g = torch.Generator().manual_seed(3)
    ints = lambda *shape, dtype=torch.long: torch.randint(0, 99, shape, generator=g, dtype=dtype)  # noqa: E731
    lora = LoraSegments(
        ints(4, dtype=torch.int32),
        {m: ints(3, dtype=torch.int32) for m in TARGET_MODULES},
        {m: ((0, 5, 1, 8, 0.3 / 7), (5, 9, 2, 16, 2.0)) for m in TARGET_MODULES},
    )
    paged = PagedBatch(
        PrefillRows(ints(), ints(3, dtype=torch.int32), ints(3, dtype=torch.int32), ints(40), 7, 33),
        DecodeRows(9, ints(2, 5, dtype=torch.int32), ints(2, dtype=torch.int32), 4),
    )
    for attention, segs in ((paged, lora), (paged, None), (PagedBatch(None, paged.decode), lora)):
        inputs = StepInputs(ints(9), ints(9), ints(9), attention, ints(2), segs)
        out = decode(*encode(inputs, "cpu"))

        def same(a, b):
            if isinstance(a, torch.Tensor):
                return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            if dataclasses.is_dataclass(a):
                return type(a) is type(b) and all(
                    same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
                )
            if isinstance(a, dict):
                return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
            if isinstance(a, tuple):
                return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
            return a == b and type(a) is type(b)

        assert same(inputs, out)


def _jobs():
    rng = random.Random(7)
    jobs = []  # (join step, request id, adapter, prompt, max_tokens)
    for i, adapter in enumerate([None, *RANKS, None, *RANKS, "a", "c"]):
        prompt = [rng.randrange(320) for _ in range(rng.randint(3, 30))]
        jobs.append((rng.randint(0, 10), f"q{i}", adapter, prompt, rng.randint(12, 28)))
    return jobs


def _generate(engine, jobs, base_only=False):
    requests = {}
    for step, rid, adapter, prompt, n in jobs:
        params = SamplingParams(max_tokens=n, temperature=0.0)
        requests.setdefault(step, []).append(
            GenerateRequest(rid, tuple(prompt), params, None if base_only else adapter)
        )
    tokens, _, migrates = run_to_completion(engine, requests)
    assert not migrates
    return tokens


def _fail_one_step(engine):
    """Rank 0 fails after the worker started the step: the ranks are out of step for good."""

    def fail(inputs, kv):
        raise RuntimeError("injected")

    engine.model.local.forward = fail
    engine.add(GenerateRequest("late", (1, 2, 3), SamplingParams(max_tokens=2, temperature=0.0)))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.model.broken is not None
    with pytest.raises(RuntimeError, match="out of step"):
        engine.model.forward(None, None)


# 3 slots for 4 adapters: slots are re-used mid-run, so shards are sent while steps run
ENGINE = EngineConfig(max_lora_rank=16, max_loras=3, num_kv_blocks=96, block_size=8, max_tokens_per_step=96)


@pytest.fixture(scope="module")
def single(tiny_model_dir, adapters):
    """The single-process engine's greedy tokens for _jobs(), with and without the adapters."""
    engine = build_engine(tiny_model_dir, ENGINE, {k: str(v) for k, v in adapters.items()}, tokenizer=None)
    return _generate(engine, _jobs()), _generate(engine, _jobs(), base_only=True)


def test_tp2_over_gloo_equals_single_process_engine(tiny_model_dir, adapters, single):
    names = {k: str(v) for k, v in adapters.items()}
    jobs, (expected, base) = _jobs(), single
    tp = build_engine(tiny_model_dir, dataclasses.replace(ENGINE, tensor_parallel_size=2), names, tokenizer=None)
    try:
        assert tp.model.cfg.num_heads == 4 and tp.model.cfg.num_kv_heads == 1  # rank 0 holds half the heads
        got = _generate(tp, jobs)
        assert tp.max_batch_seen >= 8, "requests were not batched together"
        assert tp.model.lora_pool.evictions > 0, "no adapter was loaded mid-run"
        _fail_one_step(tp)
    finally:
        tp.model.shutdown()
    for _, rid, adapter, _, _ in jobs:
        assert got[rid] == expected[rid], f"{rid} ({adapter}): TP-2 differs from the single-process engine"
    changed = sum(adapter is not None and expected[rid] != base[rid] for _, rid, adapter, _, _ in jobs)
    assert changed >= 8, "the random adapters barely change the output: the test would not catch a dropped shard"


def _word_tokenizer(out):
    """A word-level tokenizer over the tiny model's 320 ids ("t0" … "t319"): the app needs one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(320)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(out)


def test_serve_runs_a_tp2_replica_as_one_replica(tiny_model_dir, adapters, single, tmp_path):
    import ray
    from ray import serve

    from app.builder import build_app
    from app.serving.config import parse_args
    from tests.support.app_fixtures import APP, config_args, replica_stats, serving

    model = shutil.copytree(tiny_model_dir, tmp_path / "tiny-tp")
    _word_tokenizer(model)
    args = config_args(
        model=str(model),
        model_name="tiny",
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        max_lora_rank=ENGINE.max_lora_rank,
        max_loras=ENGINE.max_loras,
        num_kv_blocks=ENGINE.num_kv_blocks,
        block_size=ENGINE.block_size,
        max_tokens_per_step=ENGINE.max_tokens_per_step,
        adapter_dirs=[str(next(iter(adapters.values())).parent)],
        api_keys=[],
        admin_key=None,
        replica={"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
        ingress={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
    )
    assert parse_args(args, "tiny").replica_options["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 1}]
    jobs = [(rid, adapter, prompt, n) for _, rid, adapter, prompt, n in _jobs()[:7]]
    with serving({APP: (build_app(args), "/")}, num_cpus=3) as url:
        client = checked_openai(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(job):
            rid, adapter, prompt, n = job
            return client.completions.create(model=adapter or "tiny", prompt=prompt, max_tokens=n, temperature=0.0)

        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(complete, jobs))
        status = serve.status().applications[APP].deployments["LoraReplica"]
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        stats = replica_stats()
        workers = [
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("tp-worker-")
        ]
    for (rid, adapter, _, _), answer in zip(jobs, answers):
        assert [int(word[1:]) for word in answer.choices[0].text.split()] == single[0][rid], f"{rid} ({adapter})"
    assert status.replica_states == {"RUNNING": 1}
    assert [(len(g["bundles"]), g["strategy"]) for g in groups] == [(2, "STRICT_PACK")]
    assert len(workers) == 1 and workers[0].endswith("-rank1"), "rank 1 is not a child actor in the group"
    assert stats["max_batch_seen"] >= 2, "the requests did not share a batch"


def test_replica_options_and_degrees_that_do_not_divide(cfg):
    from app.engine.tp.placement import tensor_parallel_options

    gpu = tensor_parallel_options({"ray_actor_options": {"num_cpus": 4}, "num_replicas": 2}, 4, "cuda")
    assert gpu["placement_group_bundles"] == [{"CPU": 4, "GPU": 1}] + [{"CPU": 1, "GPU": 1}] * 3
    assert gpu["placement_group_strategy"] == "STRICT_PACK" and gpu["ray_actor_options"]["num_gpus"] == 1
    assert gpu["num_replicas"] == 2  # replicas still scale as whole groups
    assert tensor_parallel_options({"num_replicas": 1}, 1, "cuda") == {"num_replicas": 1}
    with pytest.raises(ValueError, match="does not divide the model's 8 attention heads"):
        shard_config(cfg, 3)
