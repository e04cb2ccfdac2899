"""On-demand names under an S3 prefix (moto on 127.0.0.1 behind the counting proxy), at the
store and engine layers: an object that changes under a name is served with its new weights
from the next cold load on, under a new (name, version) key in every tier; a missing name is
looked up once for a burst and its error names no location; and the args → StoreConfig
mapping refuses budgets that cannot fit, by field name."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from adapters_store.errors import AdapterNotFoundError
from adapters_store.host_cache import HostCacheConfig
from adapters_store.store import AdapterStore, StoreConfig
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.protocol import GenerateRequest, SamplingParams
from app.serving.config import ConfigError, parse_args
from tests.support.helpers import make_tiny_llama, run_to_completion
from tests.support.store_helpers import TINY_SHAPE, one_torch_thread, store_config, upload_dir, write_adapter  # noqa: F401

pytest_plugins = ["tests.support.s3_fixtures"]

PROMPT = (5, 17, 42, 99, 3, 250)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny")


def _generate(engine, name: str, rid: str) -> list[int]:
    tokens, _, _ = run_to_completion(
        engine,
        {0: [GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), name)]},
    )
    return tokens[rid]


def test_a_changed_object_is_a_new_version_at_the_next_cold_load(tmp_path, s3, model):
    bucket = s3.bucket("mutable")
    every = tuple(TINY_SHAPE.dims)  # rank 16 on every module: the largest adapter, which the budget must hold
    first, second, other = (
        write_adapter(tmp_path / n, TINY_SHAPE, rank=16, targets=every, seed=s, alpha=1.0)
        for n, s in (("v1", 1), ("v2", 2), ("other", 3))
    )
    upload_dir(s3.client, bucket, "t/x", first)
    upload_dir(s3.client, bucket, "t/y", other)
    size = 3 * 16 * sum(i + o for i, o in TINY_SHAPE.dims.values()) * 4  # fp32: the host cache holds one
    cfg = store_config(s3.endpoint, tmp_path, default_root=f"s3://{bucket}/t/", host=HostCacheConfig(budget_bytes=size))
    engine = build_engine(model, EngineConfig(max_loras=2, max_lora_rank=16), tokenizer=None, store_config=cfg)
    local = AdapterStore(TINY_SHAPE, StoreConfig(max_rank=16))
    local.register("x1", first)
    local.register("x2", second)
    reference = build_engine(model, EngineConfig(max_loras=2, max_lora_rank=16), tokenizer=None, store=local)
    want1, want2 = _generate(reference, "x1", "a"), _generate(reference, "x2", "b")
    assert want1 != want2

    assert _generate(engine, "x", "r1") == want1
    v1 = engine.adapters.version("x")
    upload_dir(s3.client, bucket, "t/x", second)  # same name, new content
    assert _generate(engine, "x", "r2") == want1  # still hot in the host cache: served as loaded
    _generate(engine, "y", "r3")  # pushes x out of the one-adapter host cache: x is cold now
    assert _generate(engine, "x", "r4") == want2
    v2 = engine.adapters.version("x")
    assert v2 != v1 and ("x", v2) in engine.model.lora_pool.resident()  # a new key: the old slot is never reused
    assert [k for k in engine.adapters.host.keys() if k[0] == "x"] == [("x", v2)]
    engine.adapters.close()
    local.close()


def test_a_missing_name_is_one_lookup_for_a_burst_and_names_no_location(tmp_path, s3):
    bucket = s3.bucket("sparse")
    st = AdapterStore(
        TINY_SHAPE, store_config(s3.proxy.url, tmp_path, default_root=f"s3://{bucket}/p/", miss_ttl_s=600)
    )
    before = len(s3.proxy.state.requests)
    with ThreadPoolExecutor(16) as pool:
        errors = list(pool.map(lambda _: st.prefetch("nobody").exception(), range(50)))
    assert all(isinstance(e, AdapterNotFoundError) and str(e) == "adapter 'nobody' does not exist" for e in errors)
    wire = [r for r in s3.proxy.state.requests[before:] if "nobody" in r[1]]
    assert 1 <= len(wire) <= 2  # one flight; boto3 may resend it at the transport level (see test_store_s3)
    assert st.tiers()["host"]["resident"] == 0 and st.metrics.snapshot()["error.AdapterNotFoundError"] == 1
    st.close()


def test_adapter_cache_args_become_the_store_config(tmp_path):
    args = {
        "adapter_source": "s3://tenant-bucket/adapters",
        "max_lora_rank": 8,
        "adapter_cache": {"host_gb": 0.5, "disk_gb": 2.0, "disk_dir": str(tmp_path / "c"), "miss_ttl_s": 30.0},
    }
    store = parse_args(args, "base").adapter_store
    assert store.default_root == "s3://tenant-bucket/adapters/" and store.max_rank == 8
    assert store.host.budget_bytes == 2**29 and store.disk.budget_bytes == 2 * 2**30
    assert store.disk.root == tmp_path / "c" and store.miss_ttl_s == 30.0
    default = parse_args({}, "base").adapter_store
    assert default.default_root is None and 0 < default.host.budget_bytes <= 8 * 2**30
    with pytest.raises(ConfigError, match="adapter_cache.host_gb"):
        parse_args({"adapter_cache": {"host_gb": 1e6}}, "base")
    with pytest.raises(ConfigError, match="adapter_cache.disk_gb"):
        parse_args({"adapter_cache": {"disk_gb": 1e9, "disk_dir": str(tmp_path)}}, "base")
    with pytest.raises(ConfigError, match="adapter_source"):
        parse_args({"adapter_source": str(tmp_path / "absent")}, "base")
    with pytest.raises(ConfigError, match="adapter_source"):
        parse_args({"adapter_source": "gs://bucket/x"}, "base")
    # A budget that holds no adapter of the largest rank is refused when the engine is built.
    tiny = {"adapter_cache": {"host_gb": 1e-6}, "max_lora_rank": 16}
    with pytest.raises(ValueError, match="adapter_cache.host_gb"):
        build_engine(
            make_tiny_llama(tmp_path / "m"),
            EngineConfig(),
            tokenizer=None,
            store_config=parse_args(tiny, "base").adapter_store,
        )
