"""`/v1/responses` answers: a chat generation's chunks as a Responses object, whole or as the
typed SSE events the `openai` client parses (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, …, `response.completed`).
Text becomes a `message` item with one `output_text` part; each parsed tool call a `function_call`
item (app/openai/tool_calls/ parses the text exactly as for chat). Stored responses are kept for
`previous_response_id` and `GET /v1/responses/{id}` in a bounded LRU of this process (ResponseStore)."""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing

from app.errors import InvalidRequestError
from app.openai.responses_models import ResponsesRequest
from app.protocol import ErrorChunk, TokenChunk

MAX_STORED_RESPONSES = 1024  # per ingress process; the oldest is forgotten first


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """Stored responses: id → (the response object, the conversation it ended, as chat messages),
    each readable only by the credentials that created it (`owner`: a digest of the API key)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[str, dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()  # read on the prepare threads, written on the event loop

    def put(self, owner: str, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._items[response["id"]] = (owner, response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, owner: str, response_id: str) -> tuple[dict, list[dict]]:
        """Another key's response answers as one never stored."""
        with self._lock:
            found = self._items.get(response_id)
            if found is not None and found[0] == owner:
                self._items.move_to_end(response_id)
        if found is None or found[0] != owner:
            raise InvalidRequestError(
                f"previous response {response_id!r} is not stored here (not stored, or past this server's "
                f"retention of {self.capacity} responses)"
            )
        return found[1], found[2]


class ResponseRun:
    """One response: its head fields, the output items as they form, and the events that tell them."""

    def __init__(self, body: ResponsesRequest, parser, history: list[dict], store: ResponseStore, owner: str):
        self.body, self.parser, self.store, self.owner = body, parser, store, owner
        self.history = history  # the conversation before this output (chat messages)
        self.id, self.created = _id("resp"), int(time.time())
        self.items: list[dict] = []  # output items; the last may still be open
        self.open = False  # the last item still takes deltas
        self.text = ""
        self.tokens = (0, 0)
        self.finish: str | None = None
        self.seq = 0

    # -- the response object -----------------------------------------------------
    def response(self, status: str) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else None
        choice = (
            b.tool_choice if isinstance(b.tool_choice, str) or b.tool_choice is None else b.tool_choice.model_dump()
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": b.model,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "output": self.items if status != "in_progress" else [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": choice or ("auto" if b.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "truncation": "disabled",
            "store": b.stored,
            "user": b.user,
            "usage": self._usage() if status != "in_progress" else None,
        }

    def _usage(self) -> dict:
        prompt, completion = self.tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        }

    def finished(self) -> dict:
        """The whole response, stored unless `store: false`."""
        status = "incomplete" if self.finish == "length" else "completed"
        response = self.response(status)
        if self.body.stored:
            self.store.put(self.owner, response, self.history + self._as_messages())
        return response

    def _as_messages(self) -> list[dict]:
        """This output as chat messages, for a later previous_response_id."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [
            {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in self.items
            if i["type"] == "function_call"
        ]
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]

    # -- chunks in, events out --------------------------------------------------------
    def add(self, chunk: TokenChunk) -> list[dict]:
        """Events for one chunk (the items it grew)."""
        final = chunk.finish_reason is not None
        self.tokens = (chunk.prompt_tokens, chunk.completion_tokens)
        self.finish = chunk.finish_reason or self.finish
        if self.parser is None:
            events = self._content(chunk.text)
        else:
            delta = self.parser.feed(chunk.token_ids, chunk.text, final=final)
            events = self._content(delta.content)
            for call in delta.calls:
                events += self._call(call)
        if final:
            events += self._close()
            if not self.items:  # an empty answer is still a message
                events += self._content("", force=True) + self._close()
        return events

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _content(self, text: str, force: bool = False) -> list[dict]:
        if not text and not force:
            return []
        events = []
        if not (self.open and self.items[-1]["type"] == "message"):
            events += self._close()
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            events += self._added(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
            item["content"].append(dict(part))
        part = self.items[-1]["content"][0]
        part["text"] += text
        if text:
            events.append(
                self._event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])
            )
        return events

    def _call(self, call) -> list[dict]:
        events = []
        if call.id is not None:  # a call's first delta: a new item
            events += self._close()
            item = {
                "id": _id("fc"),
                "type": "function_call",
                "call_id": call.id,
                "name": call.name,
                "arguments": "",
                "status": "in_progress",
            }
            events += self._added(item)
        if call.arguments:
            self.items[-1]["arguments"] += call.arguments
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=call.arguments))
        return events

    def _added(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = True
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))]

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _close(self) -> list[dict]:
        if not self.open:
            return []
        self.open = False
        item = self.items[-1]
        item["status"] = "incomplete" if self.finish == "length" else "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._event(
                    "response.output_text.done", **self._where(), content_index=0, text=part["text"], logprobs=[]
                )
            )
            events.append(self._event("response.content_part.done", **self._where(), content_index=0, part=dict(part)))
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **self._where(),
                    arguments=item["arguments"],
                    name=item["name"],
                )
            )
        events.append(
            self._event("response.output_item.done", output_index=len(self.items) - 1, item=copy.deepcopy(item))
        )
        return events


def _failure(chunk) -> tuple[str, int] | None:
    """What ended the generation early, as (message, HTTP status); None for a chunk to relay."""
    if isinstance(chunk, ErrorChunk):
        return chunk.message, chunk.status
    if isinstance(chunk, TokenChunk) and chunk.finish_reason == "abort":
        return "the request was aborted by the server", 503
    return None if isinstance(chunk, TokenChunk) else (f"unexpected chunk {type(chunk).__name__}", 500)


def _sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


async def stream_events(run: ResponseRun, stream) -> AsyncIterator[bytes]:
    """The response as SSE events; a failure mid-way ends it with an `error` event."""
    yield _sse(run._event("response.created", response=run.response("in_progress")))
    yield _sse(run._event("response.in_progress", response=run.response("in_progress")))
    async with aclosing(stream.chunks()) as chunks:
        async for chunk in chunks:
            failed = _failure(chunk)
            if failed:
                yield _sse(run._event("error", code="engine_error", message=failed[0], param=None))
                return
            for event in run.add(chunk):
                yield _sse(event)
    response = run.finished()
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield _sse(run._event(kind, response=response))


async def collect_response(run: ResponseRun, stream) -> dict | tuple[str, int]:
    """The whole response, or (message, status) of the failure that ended it."""
    async with aclosing(stream.chunks()) as chunks:
        async for chunk in chunks:
            failed = _failure(chunk)
            if failed:
                return failed
            run.add(chunk)
    return run.finished()
