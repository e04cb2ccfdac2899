"""Fault injection between the store and S3 (a proxy in front of moto): 5xx, throttling, a
connection reset mid-body, corrupt or truncated bodies, a server slower than the read timeout.
Each must give bounded latency, an explicit error of the fault's kind (answered with a gateway
status: unavailable 503, bad answer 502, timed out 504), no file in the cache
(partial or not), and a clean load on the next attempt once the fault is gone."""

import socket
from dataclasses import replace

import pytest

from adapters_store.errors import AdapterFetchError, SourceResponseError, SourceTimeoutError
from adapters_store.store import AdapterStore
from tests.support.fault_proxy import WEIGHTS, Fault
from tests.support.store_helpers import (
    assert_same_weights,
    load_local,
    store_config,
    upload_client,
    upload_dir,
    write_adapter,
)

pytest_plugins = ["tests.support.s3_fixtures"]  # fixtures: s3, shape

FAULTS = {
    "500": (Fault("status", 500, "InternalError"), AdapterFetchError),
    "throttled": (Fault("status", 503, "SlowDown"), AdapterFetchError),
    "reset-mid-body": (Fault("reset"), AdapterFetchError),
    "corrupt": (Fault("corrupt"), SourceResponseError),
    "truncated": (Fault("truncate"), SourceResponseError),
    "slow": (Fault("slow", delay_s=2.5), SourceTimeoutError),
    "stall-mid-body": (Fault("stall", delay_s=2.5), SourceTimeoutError),
}


def _cache_files(root):
    return sorted(p for p in (root / "cache").rglob("*") if p.is_file())


def _unsigned_client(s3):
    """Uploads without the CRC32 boto3 adds by default: only the ETag (MD5) can verify the body."""
    from botocore.config import Config

    return upload_client(
        s3.endpoint, Config(request_checksum_calculation="when_required", response_checksum_validation="when_required")
    )


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_gives_a_bounded_explicit_error_then_recovers(tmp_path, s3, shape, fault):
    injected, kind = FAULTS[fault]
    src = write_adapter(tmp_path / "a", shape, seed=3)
    uri = upload_dir(s3.client, s3.bucket(f"fault-{fault}"), "a", src)
    st = AdapterStore(shape, store_config(s3.proxy.url, tmp_path))
    st.register("a", uri)
    s3.proxy.state.fault = injected  # every matching request, retries included, until cleared
    gets = s3.proxy.state.count("GET", WEIGHTS)
    try:
        with pytest.raises(AdapterFetchError) as err:
            st.get("a")
    finally:
        s3.proxy.state.fault = None
    # bounded without a clock: at most the configured attempts, each ended by an error or, where
    # the server falls silent, by the read timeout (SourceTimeoutError: waited out, the silence
    # would end in the reply or a reset, not in this error)
    attempts = s3.proxy.state.count("GET", WEIGHTS) - gets
    assert 1 <= attempts <= st.config.s3.max_attempts, f"{fault}: {attempts} attempts"
    assert type(err.value) is kind, f"{type(err.value).__name__}: {err.value}"
    assert _cache_files(tmp_path) == []  # nothing partial, nothing corrupt, no temp file
    assert st.peek("a") is None

    assert_same_weights(st.get("a"), load_local("a", src, 16, shape))  # the next attempt just works
    assert [p.name for p in _cache_files(tmp_path)] == ["adapter_model.safetensors"]
    st.close()


@pytest.mark.parametrize("fault", ["corrupt", "truncated"])
def test_our_own_checksum_catches_bad_bodies_without_s3_checksums(tmp_path, s3, shape, fault):
    """boto3 verifies S3's CRC32 when the object has one; without it, the ETag MD5 check must."""
    src = write_adapter(tmp_path / "a", shape, seed=4)
    uri = upload_dir(_unsigned_client(s3), s3.bucket(f"md5-{fault}"), "a", src)
    st = AdapterStore(shape, store_config(s3.proxy.url, tmp_path))
    st.register("a", uri)
    s3.proxy.state.fault = FAULTS[fault][0]
    try:
        with pytest.raises(AdapterFetchError, match="verification") as err:
            st.get("a")
    finally:
        s3.proxy.state.fault = None
    assert type(err.value) is SourceResponseError and _cache_files(tmp_path) == []
    assert_same_weights(st.get("a"), load_local("a", src, 16, shape))
    st.close()


def test_a_transient_fault_is_retried_by_boto3(tmp_path, s3, shape):
    src = write_adapter(tmp_path / "a", shape, seed=6)
    st = AdapterStore(shape, store_config(s3.proxy.url, tmp_path))
    st.register("a", upload_dir(s3.client, s3.bucket("retried"), "a", src))
    s3.proxy.state.fault = Fault("status", 503, "SlowDown", times=1)  # one throttled reply, then fine
    assert_same_weights(st.get("a"), load_local("a", src, 16, shape))
    assert st.stats().get("error.AdapterFetchError", 0) == 0
    st.close()


def test_a_download_deadline_bounds_a_trickling_server(tmp_path, s3, shape):
    config = store_config(s3.proxy.url, tmp_path)
    st = AdapterStore(shape, replace(config, s3=replace(config.s3, download_deadline_s=0.0, chunk_bytes=1024)))
    st.register("a", upload_dir(s3.client, s3.bucket("deadline"), "a", write_adapter(tmp_path / "a", shape)))
    with pytest.raises(AdapterFetchError, match="exceeded") as err:
        st.get("a")
    assert type(err.value) is SourceTimeoutError and _cache_files(tmp_path) == []
    st.close()


def test_s3_unreachable_is_503_quickly(tmp_path, s3, shape, monkeypatch):
    """Quick by construction, not by a clock: one connection attempt (max_attempts=1) at a port
    that refuses it at once, then the error; no retry loop, no wait for a timeout."""
    import urllib3.util.connection

    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    connects, connect = [], urllib3.util.connection.create_connection

    def counted(address, *args, **kwargs):
        connects.append(address)
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(urllib3.util.connection, "create_connection", counted)  # botocore's connections
    config = store_config(f"http://127.0.0.1:{port}", tmp_path)
    st = AdapterStore(shape, replace(config, s3=replace(config.s3, max_attempts=1)))
    st.register("a", "s3://nobody-home/a/")
    with pytest.raises(AdapterFetchError) as err:
        st.get("a")
    assert type(err.value) is AdapterFetchError
    assert [a for a in connects if a[1] == port] == [("127.0.0.1", port)], connects
    st.close()
