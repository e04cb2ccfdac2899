"""Messages between a replica and its engine process (app/engine/process_engine.py,
app/engine/core_process.py): pickled over a private pipe between a process and the child it
spawned — never data from outside. Each message is a NamedTuple (a tuple on the wire, a name
and typed fields in the code); a step's chunks travel as plain tuples, which pickle several
times faster than the dataclasses they stand for.
"""

from __future__ import annotations

import dataclasses
import operator
import pickle
from collections.abc import Callable
from typing import Literal, NamedTuple

from app.protocol import Chunk, ErrorChunk, GenerateRequest, Migrate, TokenChunk


# -- replica → engine -------------------------------------------------------------------------
class Submit(NamedTuple):
    request: GenerateRequest
    arrival: float  # CLOCK_MONOTONIC when the replica took it


class Cancel(NamedTuple):
    request_id: str


class RunCall(NamedTuple):
    call_id: int
    fn: Callable  # fn(core, *args), pickled by reference (a module-level name)
    args: tuple


class Drain(NamedTuple):
    call_id: int


StoreMethod = Literal["register", "unregister", "load", "version"]


class StoreCall(NamedTuple):
    call_id: int
    method: StoreMethod
    args: tuple


class Sample(NamedTuple):
    call_id: int


class Stop(NamedTuple):
    pass


ToEngine = Submit | Cancel | RunCall | Drain | StoreCall | Sample | Stop


# -- engine → replica ---------------------------------------------------------------------------
class Ready(NamedTuple):
    pass


class Failed(NamedTuple):
    traceback: str  # the engine's start-up failure


class StepOut(NamedTuple):
    accepts: list[tuple[str, bytes | None]]  # (request id, encoded error or None) of adds answered
    chunks: list[tuple]  # encode_chunk of each chunk delivered


class Reply(NamedTuple):
    call_id: int
    ok: bool
    value: object  # the result, or encode_error of the exception


FromEngine = Ready | Failed | StepOut | Reply

_KINDS = (TokenChunk, Migrate, ErrorChunk)
# every field, in order, read at C speed: a field added to a chunk class travels without a change here
_FIELDS = {cls: operator.attrgetter(*(f.name for f in dataclasses.fields(cls))) for cls in _KINDS}
_KIND = {cls: i for i, cls in enumerate(_KINDS)}


def dumps(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes):
    return pickle.loads(data)  # noqa: S301 — our own child's bytes over a pipe only we hold


def encode_chunk(c: Chunk) -> tuple:
    cls = type(c)
    return (_KIND[cls], *_FIELDS[cls](c))


def decode_chunk(t: tuple) -> Chunk:
    return _KINDS[t[0]](*t[1:])


def encode_error(exc: BaseException) -> bytes:
    """An exception to raise on the other side: itself if it pickles, else a RuntimeError of its text."""
    try:
        data = dumps(exc)
        loads(data)
        return data
    except Exception:
        return dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


def decode_error(data: bytes) -> BaseException:
    return loads(data)
