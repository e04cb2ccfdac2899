"""Messages between a replica and its engine process (app/engine/process_engine.py,
app/engine/core_process.py): pickled tuples over a private pipe between a process and the
child it spawned — never data from outside. A step's chunks travel as plain tuples, which
pickle several times faster than the dataclasses they stand for.

replica → engine: ("add", GenerateRequest, arrival) | ("abort", request_id)
                  | ("call", id, fn, args) | ("drain", id) | ("store", id, method, args)
                  | ("sample", id) | ("stop",)
engine → replica: ("ready", None) | ("failed", traceback text)
                  | ("step", [(request_id, error or None)], [chunk tuple]) | ("reply", id, ok, value)
"""

from __future__ import annotations

import dataclasses
import operator
import pickle

from app.protocol import Chunk, ErrorChunk, Migrate, TokenChunk

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
