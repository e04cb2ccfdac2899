"""The model's output text → content and OpenAI `tool_calls`, incrementally.

A `Format` says how a model family writes its calls (vLLM's `--tool-call-parser` names):
- `hermes` (Qwen2/2.5/3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated;
- `llama3_json` (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several calls joined by `;`;
- `mistral` (Mistral v0.3 tokenizer): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- `json` (grammar-constrained `required` / named choices): the whole output is a JSON array of calls.

`CallStream` is fed the text as it streams and returns deltas: content, a call's first delta
(id and name, with the arguments known so far) and argument fragments. The non-streamed answer
is the same machine fed once, so a stream's deltas always reassemble to it. Text that may still
turn out to be part of a call (a marker's prefix, a call object before its name) is held back
until it is decided; whitespace around calls is not content. A call object without a name of
one of the request's tools makes it and the rest of the output plain content.
"""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field

from app.openai.tool_calls.scan import CallScanner

_SPACE = " \t\r\n"
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Format:
    name: str
    open: str | None  # the marker that starts calls
    close: str | None = None  # the marker that ends each call (its own open marker starts the next)
    array: bool = False  # after `open` (or `bare`): a JSON array of call objects
    separator: str | None = None  # between call objects of one run: "," in arrays, ";" for Llama 3
    bare: str | None = None  # output that starts with this (after whitespace) starts calls unmarked
    args_key: str = "arguments"  # the key this family's calls (and constrained output) use
    short_ids: bool = False  # Mistral's templates take 9-character alphanumeric call ids

    def new_id(self) -> str:
        if self.short_ids:
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(m for m in (self.open, self.close) if m)


FORMATS = {
    "hermes": Format("hermes", "<tool_call>", close="</tool_call>"),
    "llama3_json": Format("llama3_json", "<|python_tag|>", separator=";", bare="{", args_key="parameters"),
    "mistral": Format("mistral", "[TOOL_CALLS]", array=True, separator=",", short_ids=True),
}


def constrained_format(family: Format | None) -> Format:
    """The output a JSON-schema-constrained choice produces: an array of this family's call objects."""
    base = family or FORMATS["hermes"]
    return Format("json", None, array=True, separator=",", bare="[", args_key=base.args_key, short_ids=base.short_ids)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class CallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add_arguments(self, index: int, text: str) -> None:
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += text
        else:
            self.calls.append(CallDelta(index, arguments=text))


# modes
_CONTENT, _START_RUN, _OBJECT, _CALL, _AFTER, _TEXT, _DISCARD = range(7)


class CallStream:
    def __init__(self, fmt: Format, tools: frozenset[str], max_calls: int | None = None):
        self.fmt, self.tools, self.max_calls = fmt, tools, max_calls
        self.calls: list[ToolCall] = []
        self.mode = _CONTENT
        self.pending = ""  # text not decided yet
        self.unsure = ""  # text of a run whose first call is not known yet: content if it fails
        self.fresh = True  # nothing but whitespace since the output's start or the last call
        self.scanner: CallScanner | None = None
        self.header = False  # the current object's call was announced
        self.args = ""  # its arguments before it was announced
        self.out = Delta()

    def feed(self, text: str) -> Delta:
        self.pending += text
        while self._step():
            pass
        out, self.out = self.out, Delta()
        return out

    def finish(self) -> Delta:
        """The output ended: what was held back is decided now."""
        if self.mode == _CALL and self.header:
            self._arguments(self.scanner.finish_scalar())
        elif self.mode == _CONTENT:
            self._content(self.pending if not self.calls else self.pending.rstrip(_SPACE))
        elif self.mode in (_START_RUN, _OBJECT, _CALL) and not self.header:
            self._content(self.unsure + self.pending)
        self.pending, self.unsure = "", ""
        out, self.out = self.out, Delta()
        return out

    # -- modes: each returns whether it made progress ---------------------------------
    def _step(self) -> bool:
        if not self.pending:
            return False
        return (
            self._in_content,
            self._run_start,
            self._object_start,
            self._in_call,
            self._after_call,
            self._in_text,
            self._discard,
        )[self.mode]()

    def _in_content(self) -> bool:
        text, fmt = self.pending, self.fmt
        if self.fresh:  # only whitespace since the output's start or the last call: not content yet
            stripped = text.lstrip(_SPACE)
            if not stripped:
                return False
            self.fresh = False
            if fmt.bare and not self.calls and stripped[0] == fmt.bare:
                return self._begin_run(stripped, text[: len(text) - len(stripped)])
            text = stripped if self.calls else text
        at = text.find(fmt.open) if fmt.open else -1
        if at >= 0:
            before = text[:at].rstrip(_SPACE)
            self._content(before)
            return self._begin_run(text[at + len(fmt.open) :], text[len(before) : at + len(fmt.open)])
        keep = _partial_marker(text, fmt.open)
        keep += _trailing_space(text[: len(text) - keep])  # whitespace before a marker is not content
        self._content(text[: len(text) - keep])
        self.pending = text[len(text) - keep :]
        return False

    def _begin_run(self, rest: str, opening: str) -> bool:
        """opening: the text that started the run (content again if it fails)."""
        self.unsure, self.pending = opening, rest
        self.mode = _START_RUN if self.fmt.array else _OBJECT
        return True

    def _run_start(self) -> bool:
        """Expecting the `[` of an array of calls."""
        found = self._opening("[")
        if found:
            self.unsure, self.pending, self.mode = self.unsure + "[", self.pending[1:], _OBJECT
        return self._fail() if found is False else bool(found)

    def _object_start(self) -> bool:
        found = self._opening("{")
        if found:
            self.mode, self.scanner, self.header, self.args = _CALL, CallScanner(), False, ""
        return self._fail() if found is False else bool(found)

    def _opening(self, char: str) -> bool | None:
        """Whitespace, then ``char``? True: ``pending`` now starts at it; None: only whitespace so
        far; False: something else."""
        text = self.pending.lstrip(_SPACE)
        if not text:
            return None
        if text[0] != char:
            return False
        self.unsure += self.pending[: len(self.pending) - len(text)]
        self.pending = text
        return True

    def _in_call(self) -> bool:
        used, args = self.scanner.feed(self.pending)
        if not self.header:
            self.unsure += self.pending[:used]
        self.pending = self.pending[used:]
        self._arguments(args)
        if not self.header and self.scanner.name is not None:
            if self.scanner.name not in self.tools:
                return self._fail()
            self._announce()
            if self.mode == _DISCARD:
                return False
        if self.scanner.done:
            if not self.header:
                return self._fail()
            self.mode = _AFTER
        return bool(used) or self.mode != _CALL

    def _after_call(self) -> bool:
        text, fmt = self.pending.lstrip(_SPACE), self.fmt
        if not text:
            self.pending = ""
            return False
        if fmt.close and fmt.close.startswith(text) and text != fmt.close:
            self.pending = text
            return False  # part of the close marker
        self.mode, self.fresh = _CONTENT, True
        if fmt.close and text.startswith(fmt.close):
            self.pending = text[len(fmt.close) :]
        elif fmt.separator and text[0] == fmt.separator:
            self.pending, self.mode = text[1:], _OBJECT
        elif fmt.array and text[0] == "]":
            self.pending = text[1:]
        else:
            self.pending = text
        return True

    def _in_text(self) -> bool:
        self._content(self.pending)
        self.pending = ""
        return False

    def _discard(self) -> bool:
        self.pending = ""
        return False

    # -- events ----------------------------------------------------------------------
    def _fail(self) -> bool:
        """Not a call of this request's tools: the run's text and everything after is content."""
        self.pending, self.unsure, self.mode = self.unsure + self.pending, "", _TEXT
        return True

    def _announce(self) -> None:
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.mode = _DISCARD  # parallel_tool_calls false: calls after the first are dropped
            self.pending = ""
            return
        call = ToolCall(self.fmt.new_id(), self.scanner.name, self.args)
        self.calls.append(call)
        self.out.calls.append(CallDelta(len(self.calls) - 1, call.id, call.name, call.arguments))
        self.header, self.unsure = True, ""

    def _arguments(self, text: str) -> None:
        if not text:
            return
        if not self.header:
            self.args += text
            return
        self.calls[-1].arguments += text
        self.out.add_arguments(len(self.calls) - 1, text)

    def _content(self, text: str) -> None:
        self.out.content += text


def _partial_marker(text: str, marker: str | None) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    if not marker:
        return 0
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _trailing_space(text: str) -> int:
    return len(text) - len(text.rstrip(_SPACE))
