"""Relay a replica's chunk stream to the HTTP client: as SSE events, or collected
into one response. Leaving early (client gone, error) cancels the replica call,
which aborts the request in the engine and frees its KV blocks."""
from __future__ import annotations

import logging
from contextlib import aclosing
from typing import AsyncIterator

from fastapi.responses import JSONResponse

from app.errors import LoraplexError
from app.http_errors import error_body, error_response
from app.openai_responses import Formatter, Output, sse
from app.protocol import ErrorChunk, TokenChunk

log = logging.getLogger("ray.serve")


class ChunkStream:
    """A replica's DeploymentResponseGenerator, with its first chunk already awaited:
    validation errors raise from `open` before any HTTP response starts."""

    def __init__(self, generator, first):
        self.generator = generator
        self.first = first

    @classmethod
    async def open(cls, generator) -> "ChunkStream":
        try:
            first = await generator.__anext__()
        except BaseException:
            generator.cancel()
            raise
        if isinstance(first, LoraplexError):  # the replica rejected the request
            raise first
        return cls(generator, first)

    async def chunks(self) -> AsyncIterator:
        done = False
        try:
            yield self.first
            async for chunk in self.generator:
                yield chunk
            done = True
        finally:
            if not done:
                self.generator.cancel()


def _failure(chunk) -> tuple[str, int] | None:
    if isinstance(chunk, ErrorChunk):
        return chunk.message, chunk.status
    if isinstance(chunk, TokenChunk) and chunk.finish_reason == "abort":
        return "the request was aborted by the server", 503
    if not isinstance(chunk, TokenChunk):
        return f"unexpected chunk {type(chunk).__name__}", 500
    return None


async def sse_events(fmt: Formatter, stream: ChunkStream, include_usage: bool) -> AsyncIterator[str]:
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


async def collect(fmt: Formatter, stream: ChunkStream) -> JSONResponse:
    out = Output()
    async with aclosing(stream.chunks()) as chunks:
        async for chunk in chunks:
            failed = _failure(chunk)
            if failed:
                return error_response(failed[0], failed[1], "engine_error")
            out.add(chunk)
    return JSONResponse(fmt.response(out))
