"""Adapter administration behind the admin routes: register a PEFT directory (or an
s3:// URI), list, unregister; and vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (its bodies, its plain-text answers) as aliases of register and
unregister, so gateways written for vLLM drive this server unchanged. A new adapter is loaded by one replica first (that
validates it: a bad adapter is a 400 and never enters the registry); the others load
it from its spec on their first request for it (see app/serving/registry.py). A change is
in every Ingress's copy of the registry (app/openai/adapter_view.py) before its route answers.

A registration must lie inside one of `adapter_roots`: a local path is resolved first
(symlinks followed, `..` collapsed) and must be a directory holding adapter_config.json
under a root; what is registered is that resolved path. Every local path that fails this
(outside the roots, missing, a file, unreadable) gets the same answer, so the route tells
a caller nothing about the server's filesystem."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from adapters_store.paths import NAME
from app.errors import AdapterNotFoundError, InvalidAdapterError, InvalidRequestError
from app.openai.http_errors import loraplex_cause
from app.serving.registry import AdapterSpec

_MAX_PATH = 4096  # Linux's PATH_MAX: longer fails in the OS (ENAMETOOLONG)
OUTSIDE_ROOTS = "path: not an adapter directory inside the server's adapter_roots"


class RegisterAdapter(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(pattern=NAME.pattern)
    path: str = Field(
        min_length=1, max_length=_MAX_PATH
    )  # a PEFT directory on the replicas' machines, or s3://bucket/prefix/


class LoadLoraAdapter(BaseModel):
    """vLLM's load body. load_inplace: replace an adapter registered under that name (else a 400)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str = Field(pattern=NAME.pattern)
    lora_path: str = Field(min_length=1, max_length=_MAX_PATH)
    load_inplace: bool = False


class UnloadLoraAdapter(BaseModel):
    """vLLM's unload body; lora_int_id is accepted and unused: names identify adapters (vLLM, too, unloads by name)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def spec_json(spec: AdapterSpec) -> dict:
    """available: false for a local directory that is gone (restored from registry_path, say):
    tenants asking for it are told it is unavailable."""
    available = None if spec.path.startswith("s3://") else os.path.isdir(spec.path)
    return {"name": spec.name, "path": spec.path, "version": spec.version, "available": available}


def _outside() -> InvalidAdapterError:
    return InvalidAdapterError(OUTSIDE_ROOTS)


def check_path(path: str, roots: tuple[str, ...]) -> str:
    """The adapter's location as registered (a local path resolved), if inside one of roots;
    else InvalidAdapterError(OUTSIDE_ROOTS), whatever the reason."""
    if path.startswith("s3://"):
        if not any(path.startswith(r if r.endswith("/") else r + "/") for r in roots if r.startswith("s3://")):
            raise _outside()
        return path
    if "\0" in path or not os.path.isabs(path):  # replicas run elsewhere: no working directory to be relative to
        raise _outside()
    try:
        real = Path(os.path.realpath(path, strict=True))
        is_adapter = real.is_dir() and (real / "adapter_config.json").is_file()
    except (OSError, ValueError):  # missing, a loop, too long, unreadable
        raise _outside() from None
    if not is_adapter or not any(real.is_relative_to(r) for r in roots if not r.startswith("s3://")):
        raise _outside()
    return str(real)


class AdapterAdmin:
    def __init__(self, base_name: str, replica, registry, roots: tuple[str, ...] = ("s3://",), view=None):
        """roots: Settings.adapter_roots (resolved local directories and s3:// prefixes); view: the
        Ingress's AdapterView, through which each change is settled into every Ingress's copy."""
        self.base_name = base_name
        self.replica = replica
        self.registry = registry
        self.roots = roots
        self.view = view

    async def _settle(self, epoch: int | None = None) -> None:
        if self.view is not None:
            await self.view.settle(epoch)

    async def list(self) -> dict:
        specs, _ = await self.registry.list.remote()
        return {"object": "list", "data": [spec_json(s) for s in specs]}

    async def register(self, body: RegisterAdapter) -> dict:
        if body.name == self.base_name:
            raise InvalidRequestError(f"{body.name!r} is the base model's name")
        uri = check_path(body.path, self.roots)
        local = not uri.startswith("s3://")
        try:
            version = await self.replica.load_adapter.remote(body.name, uri)  # InvalidAdapterError if bad
        except Exception as exc:  # a RayTaskError: its str() is the replica's traceback, never shown
            cause = loraplex_cause(exc)
            if cause is None and isinstance(getattr(exc, "cause", None), OSError):  # unreadable, not a bug
                raise (
                    _outside() if local else InvalidAdapterError(f"cannot read the adapter: {exc.cause.strerror}")
                ) from None
            if cause is None:
                raise
            if isinstance(cause, AdapterNotFoundError):  # gone since the check, or no S3 object: a 400 here
                raise _outside() if local else InvalidAdapterError(str(cause)) from None
            raise type(cause)(*cause.args) from None  # the admin sees the reason in full (see http_errors)
        spec = await self.registry.put.remote(body.name, uri, version)
        await self._settle(spec.serial)  # a spec's serial is the epoch that registered it
        return spec_json(spec)

    async def unregister(self, name: str) -> dict:
        if not await self.registry.remove.remote(name):
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        await self._settle()  # the registry's epoch now, which is at least the removal's
        return {"name": name, "deleted": True}

    # -- vLLM's routes -----------------------------------------------------------------------
    async def load_lora_adapter(self, body: LoadLoraAdapter) -> str:
        """register, under vLLM's rule that a loaded name is only replaced when asked to."""
        specs, _ = await self.registry.list.remote()
        if not body.load_inplace and any(s.name == body.lora_name for s in specs):
            raise InvalidRequestError(f"adapter {body.lora_name!r} is already loaded (load_inplace: true replaces it)")
        await self.register(RegisterAdapter(name=body.lora_name, path=body.lora_path))
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload_lora_adapter(self, body: UnloadLoraAdapter) -> str:
        await self.unregister(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
