"""What the store raises. Every error is an AdapterError; the serving app decides
how each is answered (app/openai/http_errors.py maps them to HTTP statuses).

Permanent (the store remembers them for ``miss_ttl_s``): the adapter does not
exist, cannot be served, or its name or URI is refused. Transient (the next
request retries): AdapterFetchError and its kinds, which say "try again later".
"""

from __future__ import annotations


class LoraplexError(Exception):
    """The root of every error a caller can act on (bad input, an unknown or unusable
    adapter, a source to retry later), as opposed to a bug. It lives in this, the lowest
    layer that raises one, so that one ``except LoraplexError`` in the app catches the
    store's errors too; app.errors re-exports it and derives the app's own errors from it."""


class AdapterError(LoraplexError):
    """Any failure to resolve or load an adapter. Its message may name where the adapter
    lives (for the log and the admin); ``adapter``, set by the store on a failed load,
    names it for a tenant who asked for it by name."""

    adapter: str | None = None


class AdapterNotFoundError(AdapterError):
    """Nothing at the adapter's location, or no adapter of that name."""


class UnknownAdapterError(AdapterNotFoundError):
    """No adapter of that name: not registered, and none under the on-demand source. A tenant
    asked for a model that does not exist (404), unlike a registered adapter whose files are gone."""


class InvalidAdapterError(AdapterError):
    """The adapter exists but cannot be served (bad config, shapes, rank, files)."""


class AdapterUriError(AdapterError):
    """An adapter name or URI the store refuses (unsupported scheme, bad bucket, ...)."""


class UnsafePathError(AdapterUriError):
    """A name, key or cache path that could escape the cache root or alias another."""


class AdapterFetchError(AdapterError):
    """The source is unavailable (down, throttling, unreachable, no credentials): retry later."""


class SourceTimeoutError(AdapterFetchError):
    """The source did not answer, or not fully, in time."""


class SourceResponseError(AdapterFetchError):
    """The source answered with something unusable: access denied, a client error,
    or bytes that failed verification (discarded)."""


class SourceChangedError(AdapterFetchError):
    """The object changed between resolving its version and reading it: re-resolve and retry."""
