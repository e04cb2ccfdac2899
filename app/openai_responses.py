"""OpenAI response bodies built from engine chunks: whole responses and SSE chunks,
for `/v1/completions` (`text_completion`) and `/v1/chat/completions` (with `tool_calls` when
the request's tools were called: app/tool_calls/)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import lru_cache

from app.protocol import TokenChunk


def _json(payload: dict) -> bytes:
    """json's spelling of non-finite floats (a logprob may be -inf: -Infinity, as before)."""
    return json.dumps(payload, separators=(",", ":")).encode()


try:  # several times faster than json on these small bodies; writes non-finite floats as null
    from orjson import dumps as _fast
except ImportError:
    _fast = _json


def sse(payload: dict | str, encode=_fast) -> bytes:
    """One SSE event (its text delta may hold several tokens' text)."""
    body = payload.encode() if isinstance(payload, str) else encode(payload)
    return b"data: " + body + b"\n\n"


@dataclass
class Output:
    """One generation, accumulated chunk by chunk (for non-streamed responses)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, chunk: TokenChunk) -> None:
        self.text.append(chunk.text)
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs or ()
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.prompt_tokens, self.completion_tokens = chunk.prompt_tokens, chunk.completion_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _call_deltas(calls) -> list[dict]:
    """Stream deltas of tool calls: a call's first carries its id, type and name (OpenAI's shape)."""
    out = []
    for d in calls:
        head = {"id": d.id, "type": "function"} if d.id else {}
        name = {"name": d.name} if d.id else {}
        out.append({"index": d.index, **head, "function": {**name, "arguments": d.arguments}})
    return out


def _tool_calls(calls) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


class Formatter:
    """Shapes one request's responses; `chat` selects the chat.completion flavour; `tools` (an
    app.tool_calls OutputParser) turns the answer's tool-call text into `tool_calls`."""

    def __init__(self, request_id: str, model: str, tokenizer, chat: bool, want_logprobs: bool, tools=None):
        self.id, self.model, self.chat, self.want_logprobs = request_id, model, chat, want_logprobs
        self.tools = tools
        self.created = int(time.time())
        self.piece = lru_cache(maxsize=4096)(lambda t: tokenizer.decode([t]))
        self.offset = 0  # completions' text_offset runs across stream chunks
        self.encode = _json if want_logprobs else _fast  # logprobs carry floats that may be -inf

    # -- logprobs ---------------------------------------------------------------
    def _logprobs(self, entries) -> dict | None:
        if not self.want_logprobs:
            return None
        return self._chat_logprobs(entries) if self.chat else self._completion_logprobs(entries)

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _chat_logprobs(self, entries) -> dict:
        content = [{**self._token(e["token_id"], e["logprob"]),
                    "top_logprobs": [self._token(t, lp) for t, lp in e["top"]]} for e in entries]
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, entries) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.piece(e["token_id"])
            out["tokens"].append(text)
            out["token_logprobs"].append(e["logprob"])
            out["top_logprobs"].append({self.piece(t): lp for t, lp in e["top"]})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    # -- whole responses ----------------------------------------------------------
    def response(self, out: Output) -> dict:
        text = "".join(out.text)
        choice = {"index": 0, "logprobs": self._logprobs(out.logprobs)}
        if self.chat:
            message = self._tool_message(out.token_ids, text) if self.tools else {"role": "assistant", "content": text}
            choice["message"] = message
        else:
            choice["text"] = text
        choice["finish_reason"] = self._finish(out.finish_reason)  # after the message: its calls decide
        return {**self._head(), "choices": [choice], "usage": usage(out.prompt_tokens, out.completion_tokens)}

    def _tool_message(self, token_ids: list[int], text: str) -> dict:
        delta = self.tools.feed(token_ids, text, final=True)
        if not self.tools.calls:
            return {"role": "assistant", "content": delta.content}
        return {"role": "assistant", "content": delta.content or None, "tool_calls": _tool_calls(self.tools.calls)}

    def _finish(self, reason: str | None) -> str | None:
        """A model that stopped after calling tools finished with "tool_calls" (as OpenAI says)."""
        return "tool_calls" if reason == "stop" and self.tools and self.tools.calls else reason

    # -- stream chunks --------------------------------------------------------------
    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role (as OpenAI's do)."""
        return self._chunk({"role": "assistant", "content": ""}, None, None) if self.chat else None

    def chunk(self, c: TokenChunk) -> dict:
        if self.chat and self.tools:
            return self._chunk(self._tool_delta(c), c.logprobs or (), self._finish(c.finish_reason))
        return self._chunk({"content": c.text} if self.chat else c.text, c.logprobs or (), c.finish_reason)

    def _tool_delta(self, c: TokenChunk) -> dict:
        """Text held back while it may still be part of a call makes an empty delta (as OpenAI's last)."""
        parsed = self.tools.feed(c.token_ids, c.text, final=c.finish_reason is not None)
        delta = {"content": parsed.content} if parsed.content else {}
        if parsed.calls:
            delta["tool_calls"] = _call_deltas(parsed.calls)
        return delta

    def usage_chunk(self, c: TokenChunk) -> dict:
        return {**self._head(stream=True), "choices": [], "usage": usage(c.prompt_tokens, c.completion_tokens)}

    def _chunk(self, delta, entries, finish_reason) -> dict:
        choice = {"index": 0, "logprobs": self._logprobs(entries) if entries is not None else None,
                  "finish_reason": finish_reason}
        choice["delta" if self.chat else "text"] = delta
        return {**self._head(stream=True), "choices": [choice]}

    def _head(self, stream: bool = False) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
