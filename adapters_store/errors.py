"""The store's transient error: the adapter exists (or may) but its source failed.

Bad adapters are app.errors.InvalidAdapterError (400) and unknown ones
AdapterNotFoundError (404); this one says "try again later", with the status a
gateway would give: 503 unavailable/throttled, 504 timed out, 502 bad data.
"""
from __future__ import annotations

from app.errors import LoraplexError


class AdapterFetchError(LoraplexError):
    status = 503
    code = "adapter_unavailable"

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


class SourceChangedError(AdapterFetchError):
    """The object changed between resolving its version and reading it: re-resolve and retry."""
