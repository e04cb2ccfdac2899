"""The Ingress's copy of the adapter registry (app/openai/adapter_view.py) against the real
registry class, run here without Serve: names resolve with no call to the registry (even
while it is blocked), an admin change is in every copy before the admin call returns, a copy
cut off past its lease is not waited for and refuses adapter requests until it hears again,
and a restarted registry or a copy too far behind is given the whole table."""

import asyncio
import inspect
import json
from collections import deque

import pytest

from app.errors import RegistryUnavailableError
from app.openai.adapter_view import AdapterView
from app.openai.admin import AdapterAdmin, LoadLoraAdapter, RegisterAdapter
from app.serving.registry import AdapterRegistry, AdapterSpec

Registry = AdapterRegistry.func_or_class  # the deployment's class, run here without Serve


class _Handle:
    """A registry's methods as a DeploymentHandle offers them (`handle.method.remote(...)`);
    every call first passes `gate`: cleared, the registry is unreachable until it is set."""

    def __init__(self, registry):
        self.registry, self.gate, self.calls = registry, asyncio.Event(), 0
        self.gate.set()

    def __getattr__(self, name):
        handle = self

        class _Method:
            async def remote(self, *args):
                handle.calls += 1
                await handle.gate.wait()
                result = getattr(handle.registry, name)(*args)
                return await result if inspect.isawaitable(result) else result

        return _Method()


def now(coro):
    """Run a coroutine that must finish without suspending (so without awaiting any actor)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("suspended: it waited for something")


def _registry(**kw):
    return Registry([AdapterSpec("pirate", "/adapters/pirate", 0, "v-pirate")], **kw)


async def _synced(view: AdapterView) -> AdapterView:
    view.start()
    await view.specs()  # the first answer
    return view


class _Replica:
    class load_adapter:  # noqa: N801 (a handle's method)
        @staticmethod
        async def remote(name, uri):
            return "v-" + name


def _adapter(root, name):
    (root / name).mkdir(parents=True)
    (root / name / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    return str(root / name)


def test_known_names_resolve_while_the_registry_is_blocked():
    async def run():
        handle = _Handle(_registry(source="s3://tenants/"))
        view = await _synced(AdapterView(handle))
        handle.gate.clear()  # from here on every registry call waits
        calls = handle.calls
        spec, epoch = now(view.resolve("pirate"))
        assert (spec.name, spec.path, epoch) == ("pirate", "/adapters/pirate", 0)
        assert now(view.resolve("t-7")) == (AdapterSpec("t-7", "s3://tenants/t-7", 0, on_demand=True), 0)
        assert now(view.resolve("../x")) == (None, 0)  # not a name: unknown, as the registry says
        assert handle.calls == calls  # nothing was asked of the registry
        view.stop()

    asyncio.run(run())


def test_a_change_is_in_every_copy_before_the_admin_call_returns(tmp_path):
    """Two Ingress copies; the admin call goes through the first; the second resolves the
    change with no await between the admin call's return and its lookup."""

    async def run():
        handle = _Handle(_registry())
        first, second = await _synced(AdapterView(handle)), await _synced(AdapterView(handle))
        admin = AdapterAdmin("base", _Replica(), handle, (str(tmp_path),), first)
        path = _adapter(tmp_path, "new")

        await admin.register(RegisterAdapter(name="new", path=path))
        for view in (first, second):
            spec, epoch = now(view.resolve("new"))
            assert (spec.path, spec.version, epoch) == (path, "v-new", 1)

        moved = _adapter(tmp_path, "moved")
        await admin.load_lora_adapter(LoadLoraAdapter(lora_name="new", lora_path=moved, load_inplace=True))
        assert [now(v.resolve("new"))[0].path for v in (first, second)] == [moved, moved]

        await admin.unregister("new")
        await admin.unregister("pirate")  # from adapter_dirs
        for view in (first, second):
            assert now(view.resolve("new")) == (None, 4) and now(view.resolve("pirate")) == (None, 4)
            assert now(view.specs()) == []
        first.stop(), second.stop()

    asyncio.run(run())


def test_a_copy_cut_off_past_its_lease_is_not_waited_for_and_refuses_until_it_hears_again():
    async def run():
        registry = _registry(lease_s=0.5)
        handle = _Handle(registry)
        view = await _synced(AdapterView(handle, poll_s=0.1))
        handle.gate.clear()  # this copy can no longer reach the registry
        registry.put("new", "/adapters/new", "v1")
        assert await registry.settle() == 1  # not waited for past its lease: one copy lapsed
        with pytest.raises(RegistryUnavailableError):  # it may lack the change: it says so
            await view.resolve("pirate")
        handle.gate.set()
        assert (await view.resolve("new"))[0].path == "/adapters/new"
        view.stop()

    asyncio.run(run())


def test_a_restarted_registry_gives_the_whole_table():
    async def run():
        old = _registry()
        old.put("runtime", "/adapters/runtime")
        handle = _Handle(old)
        view = await _synced(AdapterView(handle, poll_s=0.1))
        assert now(view.resolve("runtime"))[0] is not None
        handle.registry = _registry()  # in memory only: its runtime registrations are gone
        for _ in range(600):  # until the next poll reaches the new one (a bound, not a timing)
            if now(view.resolve("runtime"))[0] is None:
                break
            await asyncio.sleep(0.05)
        assert [s.name for s in now(view.specs())] == ["pirate"]
        view.stop()

    asyncio.run(run())


def test_a_copy_behind_the_log_gets_the_table_and_one_within_it_the_changes():
    async def run():
        registry = _registry()
        registry.feed._log = deque(maxlen=2)
        for name in ("a", "b", "c"):
            registry.put(name, f"/adapters/{name}")
        me = registry.feed.incarnation
        behind = await registry.changes("v", me, 0, 0)
        assert behind.table is not None and sorted(s.name for s in behind.table) == ["a", "b", "c", "pirate"]
        within = await registry.changes("v", me, 2, 0)
        assert within.table is None and [(n, s.path) for n, s in within.changes] == [("c", "/adapters/c")]
        idle = await registry.changes("v", me, 3, 0)  # nothing new: an empty answer once the wait is up
        assert idle.table is None and idle.changes == () and idle.epoch == 3

    asyncio.run(run())
