"""The admin surface closed by default and telling nothing about the server's disks:
registrations must resolve inside `adapter_roots` (one uniform 400 otherwise), the admin
routes without an admin key answer only on a loopback bind (a non-loopback bind without
one stops the start-up), and a tenant whose adapter fails to load is told its name only."""

import asyncio
import json

import pytest

from app.errors import AdapterNotFoundError, InvalidAdapterError, PermissionDeniedError
from app.openai.admin import OUTSIDE_ROOTS, AdapterAdmin, RegisterAdapter
from app.openai.auth import Auth, check_bind, is_loopback
from app.openai.http_errors import answer
from app.serving.config import ConfigError, parse_args
from app.serving.registry import AdapterSpec
from tests.support.error_hygiene import leaks


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    async def remote(self, *args):
        return self.fn(*args)


class _Replica:
    def __init__(self):
        self.loaded = []
        self.load_adapter = _Remote(lambda name, uri: self.loaded.append((name, uri)) or "v1")


class _Registry:
    put = _Remote(lambda name, path, version: AdapterSpec(name, path, 1, version))


def _adapter(path):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    return path


@pytest.fixture
def roots(tmp_path):
    root = tmp_path / "adapters"
    _adapter(root / "pirate")
    outside = _adapter(tmp_path / "elsewhere" / "secret")
    (root / "escape").symlink_to(outside)
    (root / "notes.txt").write_text("not an adapter")
    settings = parse_args({"adapter_dirs": [str(root)]}, "base")
    return root, outside, settings


def _register(admin, path):
    try:
        return asyncio.run(admin.register(RegisterAdapter(name="tenant", path=path)))
    except InvalidAdapterError as exc:
        return answer(exc)


def test_paths_outside_the_roots_get_one_answer(roots):
    root, outside, settings = roots
    assert settings.adapter_roots == (str(root.resolve()), "s3://")  # default: adapter_dirs and s3://
    replica = _Replica()
    admin = AdapterAdmin("base", replica, _Registry(), settings.adapter_roots)
    refused = [
        "/etc",
        f"{root}/../elsewhere/secret",
        f"{root}/escape",
        f"{root}/notes.txt",
        f"{root}/nothing-here",
        str(outside),
        "relative/pirate",
        f"{root}/pirate\0x",
        "/" + "b" * 300,
    ]
    answers = [_register(admin, p) for p in refused]
    assert {(a.status_code, a.body) for a in answers} == {(400, answers[0].body)}
    assert json.loads(answers[0].body)["error"]["message"] == OUTSIDE_ROOTS and replica.loaded == []

    ok = _register(admin, f"{root}/../adapters/./pirate")  # inside once resolved
    assert ok["path"] == str((root / "pirate").resolve()) and ok["available"] is True
    assert replica.loaded == [("tenant", str((root / "pirate").resolve()))]


def test_a_local_adapter_source_is_a_default_root(roots, tmp_path):
    root, _, _ = roots
    source = tmp_path / "on-demand"
    source.mkdir()
    settings = parse_args({"adapter_dirs": [str(root)], "adapter_source": str(source)}, "base")
    assert settings.adapter_roots == (str(root.resolve()), str(source.resolve()), "s3://")


def test_s3_roots_narrow_s3_registrations(roots):
    root, _, _ = roots
    settings = parse_args({"adapter_dirs": [str(root)], "adapter_roots": ["s3://team-bucket/tenants"]}, "base")
    assert settings.adapter_roots == ("s3://team-bucket/tenants",)  # no local root: adapter_dirs not implied
    admin = AdapterAdmin("base", _Replica(), _Registry(), settings.adapter_roots)
    assert _register(admin, "s3://team-bucket/tenants/a/")["path"] == "s3://team-bucket/tenants/a/"
    for path in ("s3://team-bucket/tenants-evil/a/", "s3://other/a/", f"{root}/pirate"):
        assert json.loads(_register(admin, path).body)["error"]["message"] == OUTSIDE_ROOTS


def test_admin_routes_without_a_key_answer_on_loopback_only():
    assert Auth((), None, loopback=True).caller(None).admin
    exposed = Auth((), None, loopback=False)
    assert not exposed.caller(None).admin  # inference stays open
    with pytest.raises(PermissionDeniedError, match="closed"):
        exposed.admin(None)
    Auth((), "sk-the-admin", loopback=False).admin("Bearer sk-the-admin")

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.1.2.3")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "sk-the-admin")
    with pytest.raises(ConfigError, match="admin_key"):
        check_bind("0.0.0.0", None)


def test_a_tenant_is_told_which_adapter_failed_never_where_it_lives(tmp_path):
    from adapters_store.store import AdapterStore
    from tests.support.store_helpers import TINY_SHAPE

    gone = tmp_path / "adapters" / "pirate2"
    store = AdapterStore(TINY_SHAPE)
    store.register("pirate2", str(gone))
    with pytest.raises(AdapterNotFoundError) as err:
        asyncio.run(store.aget("pirate2"))
    assert str(gone) in str(err.value)  # the log and the admin see where
    response = answer(err.value)
    body = json.loads(response.body)["error"]
    assert response.status_code == 503 and body["message"] == "adapter 'pirate2' is unavailable"
    assert not leaks(response.body.decode())
    assert (
        answer(AdapterNotFoundError(f"adapter directory {gone} does not exist")).status_code == 404
    )  # unnamed: as before


def test_build_app_refuses_a_public_bind_without_an_admin_key(monkeypatch, roots):
    import app.builder

    root, _, _ = roots
    monkeypatch.setattr(app.builder, "serve_bind_host", lambda: "0.0.0.0")  # what Serve's controller would report
    with pytest.raises(ConfigError, match="http_options.host is '0.0.0.0'"):
        app.builder.app_from_args({"adapter_dirs": [str(root)]})


def test_an_adapter_whose_directory_is_gone_is_listed_unavailable(tmp_path):
    from app.openai.admin import spec_json

    here = _adapter(tmp_path / "here")
    assert spec_json(AdapterSpec("here", str(here), 0, "v"))["available"] is True
    assert spec_json(AdapterSpec("gone", str(tmp_path / "gone"), 0, "v"))["available"] is False
    assert spec_json(AdapterSpec("remote", "s3://b/a/", 0, "v"))["available"] is None  # not probed


class _Names:
    """A registry that keeps what it is told."""

    def __init__(self):
        self.specs, self.serial = {}, 0
        self.list = _Remote(lambda: (list(self.specs.values()), self.serial))
        self.put = _Remote(self._put)
        self.remove = _Remote(lambda name: self.specs.pop(name, None) is not None)

    def _put(self, name, path, version):
        self.serial += 1
        self.specs[name] = AdapterSpec(name, path, self.serial, version)
        return self.specs[name]


def test_vllm_load_and_unload_routes_are_register_and_unregister(roots):
    """vLLM's bodies and plain-text answers; the same path checks and errors as the admin API; a
    loaded name is replaced only with load_inplace (vLLM's rule)."""
    from pydantic import ValidationError

    from app.openai.admin import LoadLoraAdapter, UnloadLoraAdapter

    root, outside, settings = roots
    replica, registry = _Replica(), _Names()
    admin = AdapterAdmin("base", replica, registry, settings.adapter_roots)

    def load(**body):
        try:
            return asyncio.run(admin.load_lora_adapter(LoadLoraAdapter(**body)))
        except Exception as exc:
            return answer(exc)

    assert load(lora_name="tenant", lora_path=f"{root}/pirate") == "Success: LoRA adapter 'tenant' added successfully."
    assert registry.specs["tenant"].path == str((root / "pirate").resolve())
    again = load(lora_name="tenant", lora_path=f"{root}/pirate")
    assert again.status_code == 400 and "already loaded" in json.loads(again.body)["error"]["message"]
    assert load(lora_name="tenant", lora_path=f"{root}/pirate", load_inplace=True).startswith("Success")
    assert registry.specs["tenant"].serial == 2 and len(replica.loaded) == 2
    for path in (str(outside), f"{root}/escape", "relative/pirate"):
        refused = load(lora_name="other", lora_path=path)
        assert (refused.status_code, json.loads(refused.body)["error"]["message"]) == (400, OUTSIDE_ROOTS)
    base = load(lora_name="base", lora_path=f"{root}/pirate")
    assert base.status_code == 400 and "base model" in json.loads(base.body)["error"]["message"]
    with pytest.raises(ValidationError):  # an unknown field is named, not ignored
        LoadLoraAdapter(lora_name="x", lora_path="/p", is_3d_lora_weight=True)

    unload = asyncio.run(admin.unload_lora_adapter(UnloadLoraAdapter(lora_name="tenant", lora_int_id=1)))
    assert unload == "Success: LoRA adapter 'tenant' removed successfully." and "tenant" not in registry.specs
    with pytest.raises(AdapterNotFoundError):
        asyncio.run(admin.unload_lora_adapter(UnloadLoraAdapter(lora_name="tenant")))
    assert answer(AdapterNotFoundError("adapter 'tenant' is not registered")).status_code == 404
