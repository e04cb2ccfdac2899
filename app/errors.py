"""The serving app's own errors, and the store's re-exported under the names the app
uses. Each is answered with the status and code app/openai/http_errors.py gives its class."""

from adapters_store.errors import (
    AdapterError,
    AdapterFetchError,
    AdapterNotFoundError,
    AdapterUriError,
    InvalidAdapterError,
    LoraplexError,
    SourceChangedError,
    SourceResponseError,
    SourceTimeoutError,
    UnknownAdapterError,
    UnsafePathError,
)

__all__ = [
    "LoraplexError",
    "InvalidRequestError",
    "ContextLengthError",
    "BodyTooLargeError",
    "AuthenticationError",
    "PermissionDeniedError",
    "RegistryUnavailableError",
    "OverloadedError",
    "AdapterError",
    "AdapterNotFoundError",
    "InvalidAdapterError",
    "AdapterUriError",
    "UnsafePathError",
    "AdapterFetchError",
    "SourceTimeoutError",
    "SourceResponseError",
    "SourceChangedError",
    "UnknownAdapterError",
]


class InvalidRequestError(LoraplexError):
    """Bad sampling parameters or a malformed request."""


class ContextLengthError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit the model's context."""


class BodyTooLargeError(LoraplexError):
    """The request body passed the ingress's size limit."""


class AuthenticationError(LoraplexError):
    """An API key is needed and is missing or wrong."""


class PermissionDeniedError(LoraplexError):
    """The key is valid but not for this route."""


class RegistryUnavailableError(LoraplexError):
    """The adapter registry could not be saved or read: nothing was changed."""


class OverloadedError(LoraplexError):
    """Too many requests are waiting for a replica: retry later."""
