"""The n choices of one request (docs/n_choices.md), in the ingress: one replica call generates
all of them, so they land on one replica and share the prompt's KV blocks there; each choice is
read through a ResubmittingStream of its own (app/openai/client_stream.py), so a choice that has to move
(its Migrate, the replica failing or leaving) re-submits alone, as the request of that choice
(``GenerateRequest.choice``: its index, its seed, its relayed tokens) — the moves of one choice
never touch the others, and every choice ends exactly once.

``_SharedCall`` reads the one replica stream and hands each choice its items (``Accepted`` and a
rejection to all); the call is cancelled, aborting what still runs there, once every choice has
ended or left it. ``Choices.chunks()`` interleaves the choices' streams as their items come."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from app.openai.client_stream import MigrationPolicy, ResubmittingStream
from app.openai.live_streams import LiveStreams
from app.protocol import ErrorChunk, GenerateRequest, Migrate, TokenChunk, is_final

_END = object()


class _Raise:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _SharedCall:
    def __init__(self, submit: Callable, request: GenerateRequest):
        self.submit, self.request = submit, request
        indices = range(request.index, request.index + request.n)
        self.queues: dict[int, asyncio.Queue] = {i: asyncio.Queue() for i in indices}
        self.ended: set[int] = set()  # choices whose final item came
        self.left: set[int] = set()  # choices that stopped reading (moved, or the relay ended)
        self.call = None
        self.pump: asyncio.Task | None = None
        self.done = False  # the replica stream ended (or failed)

    def submitter(self, index: int) -> Callable:
        """submit() for choice ``index``'s stream: its first call reads this shared call, later ones
        (the choice moving) submit that choice's own request."""
        first = [True]

        def submit(request: GenerateRequest):
            if first:
                first.clear()
                return _View(self, index)
            return self.submit(request)

        return submit

    def start(self) -> None:
        if self.pump is None:
            self.call = self.submit(self.request)
            self.pump = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            while True:
                self._route(await self.call.__anext__())
        except BaseException as exc:  # the end, a replica failure, back-pressure: every choice sees it
            self.done = True
            for queue in self.queues.values():
                queue.put_nowait(_Raise(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    def _route(self, item) -> None:
        if not isinstance(item, (TokenChunk, ErrorChunk, Migrate)):  # Accepted, or the replica's rejection
            for queue in self.queues.values():
                queue.put_nowait(item)
            return
        if is_final(item):
            self.ended.add(item.index)
        self.queues[item.index].put_nowait(item)

    def leave(self, index: int) -> None:
        """Choice ``index`` reads no more; once none reads, what still runs there is aborted."""
        self.left.add(index)
        if self.call is not None and not self.done and self.left | self.ended >= set(self.queues):
            self.call.cancel()


class _View:
    """One choice's side of the shared call, shaped as the replica stream ResubmittingStream reads."""

    def __init__(self, shared: _SharedCall, index: int):
        self.shared, self.index = shared, index

    async def __anext__(self):
        self.shared.start()
        item = await self.shared.queues[self.index].get()
        if isinstance(item, _Raise):
            raise item.exc
        return item

    def cancel(self) -> None:
        self.shared.leave(self.index)


class Choices:
    """What the ingress relays for a request of n > 1 choices (``chunks()``, as a ResubmittingStream)."""

    def __init__(self, streams: list[ResubmittingStream]):
        self.streams = streams

    @classmethod
    async def open(
        cls, submit: Callable, request: GenerateRequest, policy: MigrationPolicy, live: LiveStreams
    ) -> Choices:
        """Validation errors raise here (once the replica rejected the request), before any HTTP response."""
        shared = _SharedCall(submit, request)
        streams = [
            ResubmittingStream(shared.submitter(request.index + j), _alone(request, j), policy, live)
            for j in range(request.n)
        ]
        opened = await asyncio.gather(*(s.start() for s in streams), return_exceptions=True)
        failed = [e for e in opened if isinstance(e, BaseException)]
        if failed:
            for stream in streams:
                stream.close()
            raise failed[0]
        return cls(streams)

    async def chunks(self) -> AsyncIterator:
        queue: asyncio.Queue = asyncio.Queue()
        relays = [asyncio.ensure_future(_relay(s, queue)) for s in self.streams]
        running = len(relays)
        try:
            while running:
                item = await queue.get()
                if item is _END:
                    running -= 1
                elif isinstance(item, _Raise):
                    raise item.exc
                else:
                    yield item
        finally:
            for relay in relays:  # the client left or one choice failed: the others are cancelled
                relay.cancel()
            await asyncio.gather(*relays, return_exceptions=True)


def _alone(request: GenerateRequest, j: int) -> GenerateRequest:
    """Choice j's request when it moves: its own id too, so that on a replica still running its
    siblings it is a stream (and an abort) of its own."""
    choice = request.choice(j)
    return dataclasses.replace(choice, request_id=f"{request.request_id}-{choice.index}")


async def _relay(stream: ResubmittingStream, queue: asyncio.Queue) -> None:
    try:
        async for item in stream.chunks():
            queue.put_nowait(item)
    except Exception as exc:
        queue.put_nowait(_Raise(exc))
    finally:
        queue.put_nowait(_END)
