"""Optional API keys (`Authorization: Bearer <key>`) with per-key adapter allow-lists.

No keys configured: inference is open. Admin routes need the admin key whenever
one is configured, and are closed when API keys exist but no admin key does.
A key asking for an adapter outside its allow-list is told the adapter does not
exist (the same 404 as an unknown one), so tenants cannot probe each other.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass

from app.config import ApiKey
from app.errors import AuthenticationError, PermissionDeniedError


@dataclass(frozen=True)
class Caller:
    adapters: frozenset[str] | None  # None = every adapter
    admin: bool

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters


_OPEN = Caller(adapters=None, admin=True)


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


class Auth:
    def __init__(self, keys: tuple[ApiKey, ...], admin_key: str | None):
        self.keys = keys
        self.admin_key = admin_key

    def caller(self, authorization: str | None) -> Caller:
        """Who sent this request; AuthenticationError when a key is needed and missing or wrong."""
        if not self.keys and not self.admin_key:
            return _OPEN
        token = _bearer(authorization)
        if token is not None and self.admin_key and _same(token, self.admin_key):
            return _OPEN
        if not self.keys:  # only the admin routes are guarded
            return Caller(adapters=None, admin=False)
        for key in self.keys:
            if token is not None and _same(token, key.key):
                return Caller(adapters=key.adapters, admin=False)
        message = "missing API key: send `Authorization: Bearer <key>`" if token is None else "incorrect API key"
        raise AuthenticationError(message)

    def admin(self, authorization: str | None) -> None:
        if not self.caller(authorization).admin:
            raise PermissionDeniedError("this route needs the admin key")
