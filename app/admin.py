"""Adapter administration behind the admin routes: register a PEFT directory (or an
s3:// URI), list, unregister. A new adapter is loaded by one replica first (that
validates it: a bad adapter is a 400 and never enters the registry); the others load
it from its spec on their first request for it (see app/registry.py)."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from adapters_store.paths import NAME
from app.errors import AdapterNotFoundError, InvalidAdapterError, InvalidRequestError
from app.http_errors import loraplex_cause
from app.registry import AdapterSpec


_MAX_PATH, _MAX_PART = 4096, 255  # Linux's PATH_MAX and NAME_MAX: longer fails in the OS (ENAMETOOLONG)


class RegisterAdapter(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(pattern=NAME.pattern)
    path: str = Field(min_length=1, max_length=_MAX_PATH)  # a PEFT directory on the replicas' machines, or s3://bucket/prefix/


def spec_json(spec: AdapterSpec) -> dict:
    return {"name": spec.name, "path": spec.path, "version": spec.version}


def _check_path(path: str) -> str:
    """The adapter's location as the replicas read it; InvalidAdapterError for one they cannot."""
    if path.startswith("s3://"):
        return path
    if "\0" in path or any(len(part.encode()) > _MAX_PART for part in path.split("/")):
        raise InvalidAdapterError(f"adapter path has a component longer than {_MAX_PART} bytes or a NUL byte")
    uri = str(Path(path).expanduser())
    if not Path(uri).is_absolute():  # replicas run elsewhere
        raise InvalidAdapterError(f"adapter path must be absolute (or s3://), got {path!r}")
    return uri


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
        uri = _check_path(body.path)
        try:
            version = await self.replica.load_adapter.remote(body.name, uri)  # InvalidAdapterError if bad
        except Exception as exc:  # a RayTaskError: its str() is the replica's traceback, never shown
            cause = loraplex_cause(exc)
            if cause is None and isinstance(getattr(exc, "cause", None), OSError):  # unreadable, not a bug
                raise InvalidAdapterError(f"cannot read an adapter at {body.path!r}: {exc.cause.strerror}") from None
            if cause is None:
                raise
            if isinstance(cause, AdapterNotFoundError):  # nothing at that path: a bad request here, not a 404
                raise InvalidAdapterError(str(cause)) from None
            raise cause from None
        return spec_json(await self.registry.put.remote(body.name, uri, version))

    async def unregister(self, name: str) -> dict:
        if not await self.registry.remove.remote(name):
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return {"name": name, "deleted": True}
