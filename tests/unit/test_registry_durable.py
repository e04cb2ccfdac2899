"""The adapter registry's state survives a restart: written atomically (a local file or
an s3:// object on moto at 127.0.0.1) on every change, read back at start-up, a failed
write changing nothing. (The end-to-end restart through Ray Serve is in
tests/serve/test_isolation.py, which shares its cluster.)"""

import json

import pytest

from app.serving.registry import AdapterRegistry, AdapterSpec, RegistryUnavailableError
from app.serving.registry_store import LocalFile, RegistryStoreError, open_store

pytest_plugins = ["tests.support.s3_fixtures"]

Registry = AdapterRegistry.func_or_class  # the deployment's class, run here without Serve


def _scanned():
    return [
        AdapterSpec("pirate", "/adapters/pirate", 0, "v-pirate"),
        AdapterSpec("shout", "/adapters/shout", 0, "v-shout"),
    ]


def test_changes_persist_and_come_back(tmp_path):
    where = str(tmp_path / "state" / "registry.json")
    first = Registry(_scanned(), where)
    first.put("tenant-a", "/data/a", "v1")
    first.put("tenant-b", "/data/b", "v2")
    first.remove("tenant-b")
    first.remove("shout")  # from adapter_dirs: stays removed after a restart too
    _, epoch = first.list()

    again = Registry(_scanned(), where)
    specs, restored_epoch = again.list()
    assert [(s.name, s.path, s.version) for s in specs] == [
        ("pirate", "/adapters/pirate", "v-pirate"),
        ("tenant-a", "/data/a", "v1"),
    ]
    assert restored_epoch == epoch == 4  # replicas that synced before the restart still see later changes
    assert json.loads((tmp_path / "state" / "registry.json").read_text())["removed"] == ["shout"]
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["registry.json"]  # no temporary left behind


def test_a_failed_save_changes_nothing(tmp_path):
    where = tmp_path / "registry.json"
    registry = Registry(_scanned(), str(where))
    registry.put("tenant-a", "/data/a", "v1")
    before = where.read_text()

    def unreachable(state):
        raise OSError("the disk is gone")

    registry._store.save = unreachable
    with pytest.raises(RegistryUnavailableError, match="could not be saved"):
        registry.put("tenant-b", "/data/b", "v2")
    with pytest.raises(RegistryUnavailableError):
        registry.remove("pirate")
    assert where.read_text() == before
    assert [s.name for s in registry.list()[0]] == ["pirate", "shout", "tenant-a"] and registry.list()[1] == 1


def test_local_file_is_replaced_whole(tmp_path):
    store = open_store(str(tmp_path / "r.json"))
    assert isinstance(store, LocalFile) and store.load() is None
    store.save({"epoch": 1})
    with pytest.raises(TypeError):
        store.save({"epoch": object()})  # fails mid-serialisation
    assert store.load() == {"epoch": 1} and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_an_s3_object_holds_the_state(s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)  # boto3's own chain, as in the app: moto on 127.0.0.1
    s3.bucket("registry")
    where = "s3://registry/loraplex/adapters.json"
    assert open_store(where).load() is None
    registry = Registry(_scanned(), where)
    sent = []
    registry._store._s3().meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(request))
    registry.put("tenant-a", "s3://tenants/a/", "v1")
    registry.remove("pirate")
    # moto may answer `Expect: 100-continue` twice, which botocore reads as a closed connection: never sent
    assert len(sent) == 2 and not any("Expect" in r.headers for r in sent)
    saved = json.loads(s3.client.get_object(Bucket="registry", Key="loraplex/adapters.json")["Body"].read())
    assert saved["adapters"] == {"tenant-a": {"path": "s3://tenants/a/", "version": "v1"}} and saved["removed"] == [
        "pirate"
    ]
    restored = Registry(_scanned(), where)
    assert [(s.name, s.path) for s in restored.list()[0]] == [
        ("shout", "/adapters/shout"),
        ("tenant-a", "s3://tenants/a/"),
    ]
    with pytest.raises(RegistryStoreError):
        open_store("s3://registry/")  # a prefix, not an object
