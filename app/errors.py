"""Errors a caller can act on; each carries the HTTP status the ingress maps it to."""


class LoraplexError(Exception):
    status = 400
    code = "invalid_request_error"


class InvalidRequestError(LoraplexError):
    """Bad sampling parameters or a malformed request."""


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class AdapterNotFoundError(LoraplexError):
    status = 404
    code = "model_not_found"


class InvalidAdapterError(LoraplexError):
    """The adapter exists but cannot be served (bad config, shapes, rank, files)."""

    code = "invalid_adapter"
