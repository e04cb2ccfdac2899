"""Every error leaves the API in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`, with a 4xx for bad input.
``ANSWERS`` is the one place an error class gets its HTTP status and code.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from app.errors import (
    AdapterError,
    AdapterFetchError,
    AdapterNotFoundError,
    AuthenticationError,
    BodyTooLargeError,
    ContextLengthError,
    InvalidAdapterError,
    LoraplexError,
    OverloadedError,
    PermissionDeniedError,
    RegistryUnavailableError,
    SourceResponseError,
    SourceTimeoutError,
    UnknownAdapterError,
)

log = logging.getLogger("ray.serve")

# error class → (HTTP status, OpenAI error code); a class not listed answers as its nearest listed base.
# The adapter source's failures answer as a gateway would: 503 unavailable, 504 timed out, 502 bad answer.
ANSWERS: dict[type[LoraplexError], tuple[int, str]] = {
    LoraplexError: (400, "invalid_request_error"),
    ContextLengthError: (400, "context_length_exceeded"),
    AuthenticationError: (401, "invalid_api_key"),
    PermissionDeniedError: (403, "permission_denied"),
    BodyTooLargeError: (413, "request_too_large"),
    RegistryUnavailableError: (503, "registry_unavailable"),
    OverloadedError: (503, "overloaded"),
    AdapterError: (400, "invalid_request_error"),
    AdapterNotFoundError: (404, "model_not_found"),
    InvalidAdapterError: (400, "invalid_adapter"),
    AdapterFetchError: (503, "adapter_unavailable"),
    SourceTimeoutError: (504, "adapter_unavailable"),
    SourceResponseError: (502, "adapter_unavailable"),
}


def status_and_code(exc: LoraplexError) -> tuple[int, str]:
    return next(ANSWERS[cls] for cls in type(exc).__mro__ if cls in ANSWERS)


def error_body(message: str, status: int, code: str | None = None, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(message: str, status: int, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, code, param), status_code=status)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused (413) once it passes ``limit`` bytes: by its Content-Length
    before anything is read, else while it streams in."""
    declared = request.headers.get("content-length", "")
    too_large = BodyTooLargeError(f"the request body exceeds the limit of {limit} bytes")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes, model: type[BaseModel]):
    """The JSON body as `model`; malformed JSON, a non-object, wrong types → 400."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=True)) from None


async def parse_body(request: Request, model: type[BaseModel], limit: int = 1 << 20):
    return parse_json(await read_body(request, limit), model)


def loraplex_cause(exc: BaseException) -> LoraplexError | None:
    """The LoraplexError behind exc, also when it crossed a Ray call. Ray re-raises a remote
    error as a RayTaskError that is *also* an instance of the original class but whose str()
    is the remote traceback: the original (its ``cause``) is what the client is told."""
    while exc is not None:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and cause is not exc:  # RayTaskError (possibly dual-class)
            exc = cause
            continue
        if isinstance(exc, LoraplexError):
            return exc
        exc = exc.__cause__
    return None


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return error_response(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}", 400)
    if first.get("type") == "model_type" and not loc:
        return error_response("the body must be a JSON object", 400)
    # `param` names the top-level field (as OpenAI's errors do); deeper parts stay in the message
    param = loc[0] if loc else None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return error_response(f"{'.'.join(loc)}: {message}" if loc else message, 400, "invalid_value", param)


def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return error_response(str(exc.detail), exc.status_code, None)


def answer(exc: LoraplexError) -> JSONResponse:
    """The error as the client sees it. An adapter that failed to load for a request names
    only the adapter: where it lives (a server path, a bucket) and why go to the log."""
    name = getattr(exc, "adapter", None)
    if not isinstance(exc, AdapterError) or name is None:
        return error_response(str(exc), *status_and_code(exc))
    if isinstance(exc, UnknownAdapterError):  # worded as the ingress's own 404: nothing to learn from it
        return error_response(
            f"The model `{name}` does not exist or you do not have access to it.", 404, "model_not_found"
        )
    log.warning("adapter %r is unavailable: %s: %s", name, type(exc).__name__, exc)
    status, code = status_and_code(exc)
    if isinstance(exc, AdapterNotFoundError):  # registered, but its files are gone: the server's fault
        status, code = 503, "adapter_unavailable"
    return error_response(f"adapter {name!r} is unavailable", status, code)


def _loraplex_error(_: Request, exc: LoraplexError) -> JSONResponse:
    return answer(loraplex_cause(exc) or exc)


def _any_error(_: Request, exc: Exception) -> JSONResponse:
    cause = loraplex_cause(exc)
    if cause is not None:
        return answer(cause)
    log.exception("unhandled error", exc_info=exc)
    return error_response("internal server error", 500, "internal_error")


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(LoraplexError, _loraplex_error)
    app.add_exception_handler(Exception, _any_error)
