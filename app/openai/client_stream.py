"""The client's side of a generation, in the ingress: one stream over as many replica
streams as it takes (migration, failover, drain), relayed to the HTTP client as SSE
events or collected into one response.

A replica stream can end unfinished three ways, and all take one path: re-submit the
request through the router with the tokens already relayed to the client as
``resume_token_ids`` (the new replica recomputes their KV by prefill and streams only
what follows), and keep relaying.
- ``Migrate`` chunk: its engine ran out of KV (or the replica is draining); the source
  replica is avoided while another has room.
- The stream fails (actor died, node lost, killed past its grace period): the failed
  replica is never chosen again for this request. With no other replica, the request
  waits up to ``failover_wait_s`` for Serve's replacement.
- The router saw the replica leave the running set (a scale-down stops it): the call is
  cancelled (which aborts it there) and re-submitted before the replica dies.
The ingress fixes the seed before the first token and sampling is seeded per absolute
position, so the output equals the uninterrupted one token for token; an item may carry
several tokens, and the resubmission counts exactly the tokens of the items relayed. Each
request moves at most ``max_migrations`` times, then ends with an explicit error.

The router tells which replicas left through the ingress's LiveStreams
(app/openai/live_streams.py), where each stream is listed under the replica serving it.
Leaving the relay early (client gone, error) cancels the replica call, which aborts the
request in the engine and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError
from ray.serve.metrics import Counter

from app.errors import LoraplexError, OverloadedError
from app.openai.http_errors import error_body, error_response
from app.openai.live_streams import LiveStreams
from app.openai.responses import Formatter, Output, best, sse
from app.protocol import Accepted, ErrorChunk, GenerateRequest, Migrate, TokenChunk, is_final

log = logging.getLogger("ray.serve")

REPLICA_FAILURES = (RayActorError, WorkerCrashedError, NodeDiedError)  # ActorDied / ActorUnavailable included


@dataclass(frozen=True)
class MigrationPolicy:
    max_migrations: int = 8  # moves (migrations + failovers) one request may make
    failover_wait_s: float = 60.0  # how long a moved request may wait for a replica to take it


def with_fixed_seed(request: GenerateRequest) -> GenerateRequest:
    """The user's seed, or one drawn here: a failover then resamples the same tokens."""
    if request.params.seed is not None:
        return request
    return dataclasses.replace(request, params=dataclasses.replace(request.params, seed=random.getrandbits(63)))


def replica_submit(generate, adapter, epoch: int) -> Callable:
    """submit(GenerateRequest) → a call of ``generate`` (LoraReplica.generate on a streaming handle)."""
    return lambda request: generate.remote(request, adapter, epoch)


_migrations = Counter("loraplex_migrations", "requests moved to another replica, by reason", tag_keys=("reason",))


class ResubmittingStream:
    """What the ingress relays (`chunks()`): TokenChunks, or a final ErrorChunk."""

    def __init__(self, submit: Callable, request: GenerateRequest, policy: MigrationPolicy, live: LiveStreams):
        """submit(GenerateRequest) → the replica's DeploymentResponseGenerator; live: where it is
        listed under its replica while connected, so that the replica leaving stops it."""
        self.submit = submit
        self.request = request
        self.policy = policy
        self.live = live
        self.token_ids: list[int] = []  # relayed to the client
        self.text_chars = 0
        self.moves: list[tuple[str, int]] = []  # (reason, tokens relayed) per move
        self.failed: tuple[str, ...] = ()
        self.replica: str | None = None
        self.stopping = False  # its replica is leaving: the read in progress ends as a move
        self.loop = asyncio.get_running_loop()
        self._step: asyncio.Future | None = None  # the read in progress
        self._generator = None
        self._first = None

    @classmethod
    async def open(
        cls, submit: Callable, request: GenerateRequest, policy: MigrationPolicy, live: LiveStreams
    ) -> ResubmittingStream:
        """Validation errors (a LoraplexError) raise here, before any HTTP response starts."""
        stream = cls(submit, request, policy, live)
        await stream.start()
        return stream

    async def start(self) -> None:
        try:
            self._first = await self._connect(self.request, wait_s=None)
        except BackPressureError:
            raise OverloadedError("too many requests are waiting for a replica; retry later") from None

    def close(self) -> None:
        """Give up a stream that was opened (or failed to) but will not be read."""
        self._release(cancel=True)

    async def chunks(self) -> AsyncIterator[TokenChunk | ErrorChunk]:
        finished = False
        try:
            item = self._first
            while True:
                while isinstance(item, Migrate):
                    item = await self._move(item.reason)
                if isinstance(item, TokenChunk):
                    self.token_ids += item.token_ids
                    self.text_chars += len(item.text)
                finished = is_final(item)  # a TokenChunk's last, or an ErrorChunk (the relay reports it)
                yield item
                if finished:
                    return
                item = await self._read()
        finally:
            self._release(cancel=not finished)

    async def _move(self, reason: str):
        """Re-submit after the replica stream ended unfinished: the new stream's first item,
        or an ErrorChunk that ends the request."""
        self._release(cancel=True)
        self.moves.append((reason, len(self.token_ids)))
        _migrations.inc(tags={"reason": reason})
        if len(self.moves) > self.policy.max_migrations:
            return ErrorChunk(
                self.request.request_id,
                f"the request was moved between replicas {len(self.moves) - 1} "
                f"times (limit max_migrations) without finishing: no replica has room for it",
                503,
                self.request.index,
            )
        log.info(
            "moving %s off %s (%s) after %d tokens", self.request.request_id, self.replica, reason, len(self.token_ids)
        )
        resumed = dataclasses.replace(
            self.request,
            resume_token_ids=tuple(self.token_ids),
            resume_text_chars=self.text_chars,
            avoid_replicas=self.failed,
            migrated_from=self.replica,
        )
        try:
            return await self._connect(resumed, wait_s=self.policy.failover_wait_s)
        except TimeoutError:
            return ErrorChunk(
                self.request.request_id,
                f"no replica took the request within {self.policy.failover_wait_s:g} s after its replica stopped",
                503,
                self.request.index,
            )
        except (LoraplexError, BackPressureError) as exc:
            return ErrorChunk(
                self.request.request_id, f"the request could not be resumed: {exc}", 503, self.request.index
            )

    async def _connect(self, request: GenerateRequest, wait_s: float | None):
        """Submit; wait (bounded by wait_s) for a replica to accept; return its first item."""
        self.replica = None
        self._generator = self.submit(request)
        try:
            accepted = await asyncio.wait_for(self._generator.__anext__(), wait_s)
        except REPLICA_FAILURES as exc:
            return self._failed(exc)
        except BaseException:
            self._release(cancel=True)
            raise
        if not isinstance(accepted, Accepted):
            raise TypeError(f"a replica stream must open with Accepted, not {type(accepted).__name__}")
        self.replica = accepted.replica_id
        self.stopping = False
        self.live.add(self.replica, self)
        first = await self._read()
        if isinstance(first, LoraplexError):  # rejected: bad input, not a replica failure
            self._release(cancel=True)
            raise first
        return first

    def stop(self) -> None:
        self.stopping = True
        if self._step is not None:
            self._step.cancel()

    async def _read(self):
        """The replica stream's next item; its failure or stop as a Migrate to act on. One
        task per item (stop() cancels it), not a race of two: this runs for every item."""
        if self.stopping:
            return self._stopped()
        self._step = asyncio.ensure_future(self._generator.__anext__())
        try:
            return await self._step
        except asyncio.CancelledError:
            if self.stopping and not asyncio.current_task().cancelling():  # stop(), not the caller leaving
                return self._stopped()
            raise
        except StopAsyncIteration:
            return self._failed(RuntimeError("the replica stream ended without a final chunk"))
        except REPLICA_FAILURES as exc:
            return self._failed(exc)
        finally:
            self._step = None

    def _failed(self, exc: BaseException) -> Migrate:
        log.warning(
            "replica %s failed under %s (%s): failing over", self.replica, self.request.request_id, type(exc).__name__
        )
        if self.replica is not None:
            self.failed += (self.replica,)
        return Migrate(self.request.request_id, (), (), 0, "failover")

    def _stopped(self) -> Migrate:
        return Migrate(self.request.request_id, (), (), 0, "replica_stopped")

    def _release(self, cancel: bool) -> None:
        if self.replica is not None:
            self.live.discard(self.replica, self)
        if self._generator is not None and cancel:
            self._generator.cancel()
        self._generator = None


# -- relay to the HTTP client ------------------------------------------------------------


def _failure(chunk) -> tuple[str, int] | None:
    if isinstance(chunk, ErrorChunk):
        return chunk.message, chunk.status
    if isinstance(chunk, TokenChunk) and chunk.finish_reason == "abort":
        return "the request was aborted by the server", 503
    if not isinstance(chunk, TokenChunk):
        return f"unexpected chunk {type(chunk).__name__}", 500
    return None


async def sse_events(fmt: Formatter, stream, include_usage: bool) -> AsyncIterator[bytes]:
    """SSE events ending with `data: [DONE]` (one event per item, however many tokens it carries;
    a request's fmt.n choices interleaved, the usage chunk after the last one ends); a failure
    mid-stream becomes an error event first. stream: a ResubmittingStream or app.openai.choice_streams.Choices."""
    try:
        for opening in fmt.first_chunks():
            yield sse(opening, fmt.encode)
        completion: dict[int, int] = {}  # choice → its completion tokens so far
        async with aclosing(stream.chunks()) as chunks:
            async for chunk in chunks:
                failed = _failure(chunk)
                if failed:
                    yield sse(error_body(failed[0], failed[1], "engine_error"))
                    break
                event = sse(fmt.chunk(chunk), fmt.encode)
                if chunk.finish_reason:
                    completion[chunk.index] = chunk.completion_tokens
                    if include_usage and len(completion) == fmt.n:
                        event += sse(fmt.usage_chunk(chunk.prompt_tokens, sum(completion.values())))
                yield event
    except Exception as exc:  # the replica died or the call failed: tell the client in-band
        log.exception("stream failed")
        yield sse(error_body(f"generation failed: {type(exc).__name__}", 500, "engine_error"))
    yield sse("[DONE]")


async def collect(fmt: Formatter, stream, generated: int = 1) -> JSONResponse:
    """The whole response: ``generated`` choices, of which the fmt.n best are returned when
    generated > fmt.n (best_of)."""
    outputs = [Output() for _ in range(generated)]
    async with aclosing(stream.chunks()) as chunks:
        async for chunk in chunks:
            failed = _failure(chunk)
            if failed:
                return error_response(failed[0], failed[1], "engine_error")
            outputs[chunk.index].add(chunk)
    if generated == fmt.n:
        return JSONResponse(fmt.response(outputs))
    return JSONResponse(fmt.response(best(outputs, fmt.n), sum(o.completion_tokens for o in outputs)))
