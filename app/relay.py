"""Relay a request's chunk stream (cluster/migration.py's ResubmittingStream: one
stream however often the request moves between replicas) to the HTTP client, as SSE
events or collected into one response. Leaving early (client gone, error) cancels
the replica call, which aborts the request in the engine and frees its KV blocks."""
from __future__ import annotations

import logging
from contextlib import aclosing
from typing import AsyncIterator

from fastapi.responses import JSONResponse

from app.http_errors import error_body, error_response
from app.openai_responses import Formatter, Output, sse
from app.protocol import ErrorChunk, TokenChunk
from cluster.migration import ResubmittingStream

log = logging.getLogger("ray.serve")


def _failure(chunk) -> tuple[str, int] | None:
    if isinstance(chunk, ErrorChunk):
        return chunk.message, chunk.status
    if isinstance(chunk, TokenChunk) and chunk.finish_reason == "abort":
        return "the request was aborted by the server", 503
    if not isinstance(chunk, TokenChunk):
        return f"unexpected chunk {type(chunk).__name__}", 500
    return None


async def sse_events(fmt: Formatter, stream: ResubmittingStream, include_usage: bool) -> AsyncIterator[str]:
    """SSE events ending with `data: [DONE]`; a failure mid-stream becomes an error event first."""
    try:
        opening = fmt.first_chunk()
        if opening:
            yield sse(opening)
        async with aclosing(stream.chunks()) as chunks:
            async for chunk in chunks:
                failed = _failure(chunk)
                if failed:
                    yield sse(error_body(failed[0], failed[1], "engine_error"))
                    break
                yield sse(fmt.chunk(chunk))
                if chunk.finish_reason and include_usage:
                    yield sse(fmt.usage_chunk(chunk))
    except Exception as exc:  # the replica died or the call failed: tell the client in-band
        log.exception("stream failed")
        yield sse(error_body(f"generation failed: {type(exc).__name__}", 500, "engine_error"))
    yield sse("[DONE]")


async def collect(fmt: Formatter, stream: ResubmittingStream) -> JSONResponse:
    out = Output()
    async with aclosing(stream.chunks()) as chunks:
        async for chunk in chunks:
            failed = _failure(chunk)
            if failed:
                return error_response(failed[0], failed[1], "engine_error")
            out.add(chunk)
    return JSONResponse(fmt.response(out))
