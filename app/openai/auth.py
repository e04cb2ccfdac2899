"""Optional API keys (`Authorization: Bearer <key>`) with per-key adapter allow-lists.

No keys configured: inference is open. Admin routes need the admin key whenever
one is configured; without one they answer only while Serve's HTTP proxy listens on a
loopback address (a machine of your own), and are closed when API keys exist.
`check_bind` makes a non-loopback bind without an admin key a start-up error.
A key asking for an adapter outside its allow-list is told the adapter does not
exist (the same 404 as an unknown one), so tenants cannot probe each other.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from dataclasses import dataclass

from app.errors import AuthenticationError, PermissionDeniedError
from app.serving.config import ApiKey, ConfigError


@dataclass(frozen=True)
class Caller:
    adapters: frozenset[str] | None  # None = every adapter
    admin: bool

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters


_OPEN = Caller(adapters=None, admin=True)
_TENANT = Caller(adapters=None, admin=False)


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (0.0.0.0 and "" are every interface)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def serve_bind_host() -> str | None:
    """The host Serve's HTTP proxies bind (http_options.host); None before Serve has started."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    if not ray.is_initialized():
        return None
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return None
    return ray.get(controller.get_http_config.remote(), timeout=60).host


def check_bind(host: str | None, admin_key: str | None) -> None:
    """A server reachable from other machines must not leave the admin routes open."""
    if host is not None and not admin_key and not is_loopback(host):
        raise ConfigError(
            f"http_options.host is {host!r}, not a loopback address, and args.admin_key is not set: "
            "set admin_key (the admin routes register adapters from the server's disks) "
            "or bind 127.0.0.1"
        )


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


class Auth:
    def __init__(self, keys: tuple[ApiKey, ...], admin_key: str | None, loopback: bool = True):
        """loopback: whether the HTTP proxies listen on loopback addresses only."""
        self.keys = keys
        self.admin_key = admin_key
        self.loopback = loopback

    def caller(self, authorization: str | None) -> Caller:
        """Who sent this request; AuthenticationError when a key is needed and missing or wrong."""
        if not self.keys and not self.admin_key:
            return _OPEN if self.loopback else _TENANT
        token = _bearer(authorization)
        if token is not None and self.admin_key and _same(token, self.admin_key):
            return _OPEN
        if not self.keys:  # only the admin routes are guarded
            return _TENANT
        for key in self.keys:
            if token is not None and _same(token, key.key):
                return Caller(adapters=key.adapters, admin=False)
        message = "missing API key: send `Authorization: Bearer <key>`" if token is None else "incorrect API key"
        raise AuthenticationError(message)

    def admin(self, authorization: str | None) -> None:
        if self.caller(authorization).admin:
            return
        if self.admin_key:
            raise PermissionDeniedError("this route needs the admin key")
        raise PermissionDeniedError("the admin routes are closed: set admin_key to use them")
