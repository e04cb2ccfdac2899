"""Adapter administration behind the admin routes: register a local PEFT directory,
list, unregister. A new adapter is loaded by one replica first (that validates it:
a bad adapter is a 400 and never enters the registry); the others load it from
its spec on their first request for it (see app/registry.py)."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from app.errors import AdapterNotFoundError, InvalidAdapterError, InvalidRequestError
from app.registry import AdapterSpec

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class RegisterAdapter(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(pattern=_NAME)
    path: str = Field(min_length=1)  # a local PEFT directory on the replicas' machines


def spec_json(spec: AdapterSpec) -> dict:
    return {"name": spec.name, "path": spec.path, "version": spec.version}


class AdapterAdmin:
    def __init__(self, base_name: str, replica, registry):
        self.base_name = base_name
        self.replica = replica
        self.registry = registry

    async def list(self) -> dict:
        specs, _ = await self.registry.list.remote()
        return {"object": "list", "data": [spec_json(s) for s in specs]}

    async def register(self, body: RegisterAdapter) -> dict:
        if body.name == self.base_name:
            raise InvalidRequestError(f"{body.name!r} is the base model's name")
        path = Path(body.path).expanduser()
        if not path.is_absolute():  # replicas run elsewhere: a relative path means nothing there
            raise InvalidAdapterError(f"adapter path must be absolute, got {body.path!r}")
        spec = await self.replica.load_adapter.remote(body.name, str(path))  # InvalidAdapterError if bad
        await self.registry.put.remote(spec)
        return spec_json(spec)

    async def unregister(self, name: str) -> dict:
        if not await self.registry.remove.remote(name):
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return {"name": name, "deleted": True}
