"""Adapter administration behind the admin routes: register a PEFT directory (or an
s3:// URI), list, unregister. A new adapter is loaded by one replica first (that
validates it: a bad adapter is a 400 and never enters the registry); the others load
it from its spec on their first request for it (see app/registry.py)."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from adapters_store.paths import NAME
from app.errors import AdapterNotFoundError, InvalidAdapterError, InvalidRequestError
from app.registry import AdapterSpec


class RegisterAdapter(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(pattern=NAME.pattern)
    path: str = Field(min_length=1)  # a PEFT directory on the replicas' machines, or s3://bucket/prefix/


def spec_json(spec: AdapterSpec) -> dict:
    return {"name": spec.name, "path": spec.path}


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
        uri = body.path if body.path.startswith("s3://") else str(Path(body.path).expanduser())
        if not (uri.startswith("s3://") or Path(uri).is_absolute()):  # replicas run elsewhere
            raise InvalidAdapterError(f"adapter path must be absolute (or s3://), got {body.path!r}")
        try:
            version = await self.replica.load_adapter.remote(body.name, uri)  # InvalidAdapterError if bad
        except AdapterNotFoundError as exc:  # nothing at that path: a bad request here, not a 404
            raise InvalidAdapterError(str(exc)) from None
        spec = await self.registry.put.remote(body.name, uri)
        return {**spec_json(spec), "version": version}

    async def unregister(self, name: str) -> dict:
        if not await self.registry.remove.remote(name):
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return {"name": name, "deleted": True}
