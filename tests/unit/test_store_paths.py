"""Names, URIs and cache paths: traversal is rejected (plain, URL-encoded, absolute, via
symlinks), cache paths keep the bucket and never collide, and nothing is ever written
outside the cache root."""

import os

import pytest
import torch

from adapters_store.disk_cache import DiskCache, DiskCacheConfig, ObjectInfo
from adapters_store.errors import AdapterUriError
from adapters_store.paths import S3Uri, UnsafePathError, cache_file, check_name, parse_uri
from adapters_store.store import AdapterStore
from tests.support.store_helpers import store_config, upload_dir, write_adapter

pytest_plugins = ["tests.support.s3_fixtures"]  # fixtures: s3, shape

V = "0123456789abcdef"
BAD_URIS = [
    "s3://bkt/../etc/",
    "s3://bkt/a/../../b",
    "s3://bkt/a/./b",
    "s3://bkt//a",
    "s3://bkt/a//b",
    "s3://bkt/%2e%2e/x",
    "s3://bkt/a/%2E%2E%2Fb",
    "s3://bkt/a%2fb",
    "s3://bkt/a/..%5c..%5cb",
    "s3://bkt/a\\..\\b",
    "s3://bkt/a/.hidden",
    "s3://bkt/a/@0123456789abcdef",
    "s3://bkt/a b",
    "s3://../x",
    "s3://BKT/x",
    "s3:///x",
    "s3://b/x",
    "s3://bkt..x/y",
    "s3://bkt/a\x00b",
    "http://bkt/x",
    "gs://bkt/x",
]
BAD_NAMES = ["", "..", "../x", "/abs", "a/b", ".hidden", "%2e%2e", "a\\b", "a b", "x" * 129, "-lead"]


@pytest.mark.parametrize("uri", BAD_URIS)
def test_unsafe_uris_are_rejected(uri):
    with pytest.raises(AdapterUriError):
        parse_uri(uri)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_unsafe_names_are_rejected(name, tmp_path, shape):
    with pytest.raises(AdapterUriError):
        check_name(name)
    st = AdapterStore(shape, store_config("http://127.0.0.1:9", tmp_path))
    with pytest.raises(AdapterUriError):
        st.register(name, "s3://bkt/a/")
    assert st.names() == []
    st.close()


def test_good_uris_parse():
    assert parse_uri("s3://my-bkt.v2/team/a--b/lora_1.0/") == S3Uri("my-bkt.v2", ("team", "a--b", "lora_1.0"))
    assert parse_uri("s3://bkt/a") == parse_uri("s3://bkt/a/")
    assert parse_uri("s3://bkt/a").prefix == "a/"  # listings use "a/": never "a10/…"


def test_cache_paths_keep_the_bucket_and_never_collide(tmp_path):
    uris = [
        "s3://bkt/a--b/c",
        "s3://bkt/a/b--c",
        "s3://bkt/a-b/c",
        "s3://bkt/a/b-c",
        "s3://bkt-a/b/c",
        "s3://bkt/a-b-c",
        "s3://bkt.a/b/c",
        "s3://bkt/a.b/c",
        "s3://bkt/lora1",
        "s3://bkt/lora10",
        "s3://bkt/lora1/0",
        "s3://bkt/a/b/c",
        "s3://other/a/b/c",
    ]
    paths = [cache_file(tmp_path, parse_uri(u), V, "adapter_model.safetensors") for u in uris]
    assert len(set(paths)) == len(uris)
    for u, p in zip(uris, paths):
        bucket = u.split("/")[2]
        assert p.relative_to(tmp_path).parts[:2] == ("s3", bucket)
        assert os.path.commonpath([tmp_path, p]) == str(tmp_path)
    for bad in ("../../x", "ABC", "0123"):
        with pytest.raises(UnsafePathError):
            cache_file(tmp_path, parse_uri("s3://bkt/a"), bad, "f")
    with pytest.raises(UnsafePathError):
        cache_file(tmp_path, parse_uri("s3://bkt/a"), V, "../f")


def _tree(root):
    return sorted(str(p) for p in root.rglob("*"))


def test_symlinks_never_lead_out_of_the_cache_root(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"keep me")
    cache = DiskCache(DiskCacheConfig(tmp_path / "cache"))
    before = _tree(outside)

    # A symlinked directory inside the root (planted, or left by an operator): never descended into.
    os.makedirs(cache.root / "s3")
    os.symlink(outside, cache.root / "s3" / "bkt")
    target = cache_file(cache.root, parse_uri("s3://bkt/team/a"), V, "adapter_model.safetensors")
    with pytest.raises(UnsafePathError, match="symlink"):
        cache.fill(target, ObjectInfo(3), lambda sink: sink.write(b"abc"))
    assert _tree(outside) == before

    # A symlink planted at a final file name: never followed, removed, treated as a miss.
    os.unlink(cache.root / "s3" / "bkt")
    target.parent.mkdir(parents=True)
    os.symlink(outside / "secret", target)
    assert cache.read(target, ObjectInfo(7)) is None and not os.path.lexists(target)
    assert (outside / "secret").read_bytes() == b"keep me"
    assert cache.fill(target, ObjectInfo(3), lambda sink: sink.write(b"abc")) == b"abc"
    assert _tree(outside) == before


def test_store_writes_nothing_outside_its_cache_root(tmp_path, s3, shape):
    bucket = s3.bucket("confined")
    for seed, prefix in enumerate(("a--b/c", "a/b--c")):  # would collide if "/" were flattened to "--"
        upload_dir(s3.client, bucket, prefix, write_adapter(tmp_path / "src" / str(seed), shape, seed=seed))
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    st = AdapterStore(shape, store_config(s3.proxy.url, sandbox, default_root=f"s3://{bucket}/"))
    st.register("x", f"s3://{bucket}/a--b/c")
    st.register("y", f"s3://{bucket}/a/b--c")
    x, y = st.get("x"), st.get("y")
    assert x.version != y.version and not torch.equal(x.tensors[0, "q_proj"][0], y.tensors[0, "q_proj"][0])
    for attempt in ("../x", "..%2fx", "%2e%2e", "/etc/passwd", "a/../../x"):
        with pytest.raises(AdapterUriError):
            st.register(attempt, f"s3://{bucket}/a/")
        with pytest.raises(AdapterUriError):
            st.register("ok", f"s3://{bucket}/{attempt}")
    files = [p for p in sandbox.rglob("*") if p.is_file()]
    assert len(files) == 2 and all(p.is_relative_to(sandbox / "cache" / "s3" / bucket) for p in files)
    assert {p.parent.parent.relative_to(sandbox / "cache" / "s3" / bucket).as_posix() for p in files} == {
        "a--b/c",
        "a/b--c",
    }
    st.close()
