"""A gate for the adapter registry, for tests/serve/test_adapter_view_serve.py: a named actor that,
closed, holds every call the gated registry deployment receives (an importable module:
Serve's workers load these classes by name)."""

import asyncio

from app.serving.registry import AdapterRegistry

GATE = ("registry-gate", "loraplex-tests")  # a named actor (name, namespace): test and registry meet there


class Gate:
    """Closed, every registry call waits in pass_through until it opens; held counts them."""

    def __init__(self):
        self.opened, self.held = asyncio.Event(), 0
        self.opened.set()

    async def close(self):
        self.opened.clear()

    async def open(self):
        self.opened.set()

    async def pass_through(self):
        if not self.opened.is_set():
            self.held += 1
            try:
                await self.opened.wait()
            finally:
                self.held -= 1

    async def holding(self) -> int:
        return self.held


class GatedRegistry(AdapterRegistry.func_or_class):
    """The registry, with every read the Ingress or a replica might make passing the gate first."""

    async def _gate(self):
        import ray

        await ray.get_actor(GATE[0], namespace=GATE[1]).pass_through.remote()

    async def changes(self, *args):
        await self._gate()
        return await super().changes(*args)

    async def lookup(self, name):
        await self._gate()
        return super().lookup(name)

    async def list(self):
        await self._gate()
        return super().list()
