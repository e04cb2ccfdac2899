"""The store's tiers under load: 200 adapters through a host cache of 20 (LRU, no leak, every
result right), single flight (50 concurrent first requests → one download), disk budget,
crash safety of the disk cache, packing, and metrics."""

import asyncio
import gc
import logging
import os
import subprocess
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from adapters_store.disk_cache import DiskCache, DiskCacheConfig, ObjectInfo, VerifyingSink
from adapters_store.errors import AdapterFetchError, SourceResponseError
from adapters_store.host_cache import HostCacheConfig, pack
from adapters_store.metrics import Progress, StoreMetrics
from adapters_store.store import AdapterStore, StoreConfig
from tests.support.fault_proxy import Fault
from tests.support.store_helpers import assert_same_weights, load_local, store_config, upload_dir, write_adapter

pytest_plugins = ["tests.support.s3_fixtures"]  # fixtures: s3, shape

N, HELD = 200, 20


def test_200_adapters_through_a_host_cache_of_20(tmp_path, s3, shape):
    bucket = s3.bucket("many")
    names = [f"a{i}" for i in range(N)]
    dirs = {n: write_adapter(tmp_path / "src" / n, shape, seed=i) for i, n in enumerate(names)}
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda n: upload_dir(s3.client, bucket, f"fleet/{n}", dirs[n]), names))
    local = {n: load_local(n, d, 16, shape) for n, d in dirs.items()}
    size = local["a0"].nbytes  # all the same rank and targets: the budget holds exactly HELD
    # Straight to moto (the proxy only doubles the requests' cost here); loads counted by the store.
    st = AdapterStore(
        shape, store_config(s3.endpoint, tmp_path, host=HostCacheConfig(budget_bytes=HELD * size), workers=8)
    )
    for n in names:
        st.register(n, f"s3://{bucket}/fleet/{n}/")

    # Cold, concurrent: S3 → verified disk copy → host. Every result right, the cache never over budget.
    futures = {n: st.prefetch(n) for n in names}
    for n, fut in futures.items():
        assert_same_weights(fut.result(), local[n])
    del futures, fut
    assert len(st.host) == HELD and st.host.nbytes == HELD * size
    assert st.stats()["load.s3"] == N

    # In order (now disk hits): the cache holds exactly the most recent HELD, oldest first.
    refs = []
    for n in names:
        w = st.get(n)
        assert_same_weights(w, local[n])
        refs.append(weakref.ref(w))
    del w
    assert [k[0] for k in st.host.keys()] == names[-HELD:]
    gc.collect()
    assert sum(r() is not None for r in refs) == HELD  # evicted adapters are freed: no leak

    # LRU, not FIFO: a touched adapter survives the next load, the least recent one goes.
    st.get(names[-HELD])
    st.get(names[0])
    held = [k[0] for k in st.host.keys()]
    assert names[-HELD] in held and names[-HELD + 1] not in held and held[-1] == names[0]

    stats = st.stats()
    assert stats["load.s3"] == N and stats["disk.hit"] == stats["load.disk"] >= N - HELD
    assert stats["host.eviction"] == stats["load.s3"] + stats["load.disk"] - HELD
    assert stats["loading"] == 0 and stats["host_bytes"] == HELD * size
    st.close()


def test_50_concurrent_first_requests_make_one_download(tmp_path, s3, shape):
    bucket = s3.bucket("flight")
    src = write_adapter(tmp_path / "a", shape, seed=5)
    st = AdapterStore(shape, store_config(s3.proxy.url, tmp_path))
    st.register("a", upload_dir(s3.client, bucket, "a", src))
    st.register("b", f"s3://{bucket}/a")  # another name, same objects: its own identity
    s3.proxy.state.fault = Fault("slow", delay_s=0.3, times=1)  # keep the download in flight a while
    start = threading.Barrier(50)

    def first_request(_):
        start.wait()
        return st.get("a")

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(first_request, range(50)))
    assert all(w is results[0] for w in results)
    assert_same_weights(results[0], load_local("a", src, 16, shape))
    assert s3.proxy.state.count("GET", f"{bucket}/a/adapter_model.safetensors") == 1
    assert s3.proxy.state.count("HEAD", f"{bucket}/a/adapter_model.safetensors") == 1
    assert s3.proxy.state.count("GET", f"{bucket}/a/adapter_config.json") == 1

    async def many():  # the async API shares the flight too; a cancelled waiter cancels only itself
        waiters = [asyncio.ensure_future(st.aget("b")) for _ in range(50)]
        waiters[0].cancel()
        return await asyncio.gather(*waiters[1:])

    s3.proxy.state.fault = Fault("slow", delay_s=0.3, times=1)
    got = asyncio.run(many())
    assert all(w is got[0] for w in got) and got[0].name == "b"
    assert s3.proxy.state.count("GET", f"{bucket}/a/adapter_model.safetensors") == 1  # b: a disk hit
    st.close()


def test_disk_cache_stays_within_its_budget(tmp_path, s3, shape):
    bucket = s3.bucket("diskbudget")
    one = len((write_adapter(tmp_path / "probe", shape) / "adapter_model.safetensors").read_bytes())
    st = AdapterStore(shape, store_config(s3.proxy.url, tmp_path, disk=DiskCacheConfig(tmp_path / "cache", 2 * one)))
    for i in range(5):
        st.register(f"a{i}", upload_dir(s3.client, bucket, f"a{i}", write_adapter(tmp_path / f"a{i}", shape, seed=i)))
        st.get(f"a{i}")
    files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert len(files) == 2 and st.stats()["disk_bytes"] == 2 * one
    assert st.stats()["disk.eviction"] == 3
    assert not [p for p in (tmp_path / "cache").rglob("@*") if not any(p.iterdir())]  # no empty dirs left
    st.close()


def _info(blob: bytes, **digests) -> ObjectInfo:
    return ObjectInfo(len(blob), **digests)


def test_verification_rejects_bad_bytes_and_leaves_nothing(tmp_path):
    import hashlib
    import zlib

    cache = DiskCache(DiskCacheConfig(tmp_path / "c"))
    blob = os.urandom(10_000)
    target = cache.root / "s3" / "b" / "k" / ("@" + "0" * 16) / "adapter_model.safetensors"
    good = {
        "md5": hashlib.md5(blob).hexdigest(),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "crc32": f"{zlib.crc32(blob):08x}",
    }
    bad_bytes = blob[:-1] + bytes([blob[-1] ^ 1])
    for digest in good:
        with pytest.raises(AdapterFetchError, match="mismatch") as err:
            cache.fill(target, _info(blob, **{digest: good[digest]}), lambda sink: sink.write(bad_bytes))
        assert type(err.value) is SourceResponseError
    for body in (blob[:-10], blob + b"x"):
        with pytest.raises(AdapterFetchError, match="bytes"):
            cache.fill(target, _info(blob, **good), lambda sink, body=body: sink.write(body))
    with pytest.raises(KeyboardInterrupt):  # any interruption mid-write removes the temp file
        cache.fill(target, _info(blob), lambda sink: (sink.write(blob[:100]), (_ for _ in ()).throw(KeyboardInterrupt)))
    assert [p for p in cache.root.rglob("*") if p.is_file()] == []
    assert cache.fill(target, _info(blob, **good), lambda sink: sink.write(blob)) == blob
    assert cache.read(target, _info(blob)) == blob
    assert isinstance(VerifyingSink(None, _info(b""), "x").finish(), bytes)


_CRASH = """
import os, signal, sys
from pathlib import Path
from adapters_store.disk_cache import DiskCache, DiskCacheConfig, ObjectInfo
cache = DiskCache(DiskCacheConfig(Path(sys.argv[1])))
target = Path(sys.argv[2])
def download(sink):
    sink.write(b"x" * 5000)
    sink.file.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # the process dies mid-download
cache.fill(target, ObjectInfo(10000), download)
"""


def test_a_crash_mid_download_never_serves_a_partial_file(tmp_path):
    root = tmp_path / "c"
    target = root / "s3" / "b" / "k" / ("@" + "1" * 16) / "adapter_model.safetensors"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH, str(root), str(target)], cwd=Path(__file__).resolve().parents[2]
    )
    assert proc.returncode == -9
    leftovers = [p for p in root.rglob("*") if p.is_file()]
    assert len(leftovers) == 1 and leftovers[0].name.endswith(".partial") and not target.exists()
    cache = DiskCache(DiskCacheConfig(root))  # a restart: the partial is never a hit
    assert cache.read(target, ObjectInfo(10000)) is None and leftovers[0].exists()
    DiskCache(DiskCacheConfig(root, stale_partial_s=0))  # old temp files are swept at start
    assert not leftovers[0].exists()


def test_pack_makes_one_buffer_with_equal_views(tmp_path, shape):
    w = load_local("a", write_adapter(tmp_path / "a", shape, targets=("q_proj", "down_proj")), 16, shape)
    packed = pack(w)
    assert_same_weights(packed, w)
    storages = {t.untyped_storage().data_ptr() for pair in packed.tensors.values() for t in pair}
    assert len(storages) == 1 and packed.nbytes == w.nbytes and packed.version == w.version


def test_metrics_export_through_ray_serve_metrics():
    m = StoreMetrics(export=True)  # real ray.serve.metrics objects; outside a cluster they record nothing
    m.event("host", "hit")
    m.event("disk", "eviction")
    m.error("AdapterFetchError")
    m.load("s3", 80 << 20, 1.5)
    snap = m.snapshot()
    assert snap["host.hit"] == 1 and snap["load.s3.bytes"] == 80 << 20 and snap["error.AdapterFetchError"] == 1
    ray = sys.modules.get("ray")  # another test of this session may have started Ray in this process
    inside = ray is not None and ray.is_initialized()
    assert (StoreMetrics()._ray is not None) == inside  # outside Ray: no export, and Ray is not imported for it


def test_long_downloads_log_progress(caplog):
    progress = Progress("s3://bkt/a/adapter_model.safetensors", 4 << 20, every_s=0.0)
    with caplog.at_level(logging.INFO, logger="loraplex.adapters"):
        progress.update(1 << 20)
    assert "1.0 / 4.2 MB (25%" in caplog.text


def test_unregister_frees_host_memory(tmp_path, shape):
    st = AdapterStore(shape, StoreConfig(max_rank=16, disk=DiskCacheConfig(tmp_path / "cache")))
    st.register("a", write_adapter(tmp_path / "a", shape))
    assert st.get("a").manifest.rank == 2 and st.host.nbytes > 0
    st.unregister("a")
    assert st.host.nbytes == 0 and st.names() == [] and st.peek("a") is None
    st.close()
