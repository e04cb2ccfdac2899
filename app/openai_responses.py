"""OpenAI response bodies built from engine chunks: whole responses and SSE chunks,
for `/v1/completions` (`text_completion`) and `/v1/chat/completions`."""
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
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, chunk: TokenChunk) -> None:
        self.text.append(chunk.text)
        self.logprobs += chunk.logprobs or ()
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.prompt_tokens, self.completion_tokens = chunk.prompt_tokens, chunk.completion_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Formatter:
    """Shapes one request's responses; `chat` selects the chat.completion flavour."""

    def __init__(self, request_id: str, model: str, tokenizer, chat: bool, want_logprobs: bool):
        self.id, self.model, self.chat, self.want_logprobs = request_id, model, chat, want_logprobs
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
        choice = {"index": 0, "logprobs": self._logprobs(out.logprobs), "finish_reason": out.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(), "choices": [choice], "usage": usage(out.prompt_tokens, out.completion_tokens)}

    # -- stream chunks --------------------------------------------------------------
    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role (as OpenAI's do)."""
        return self._chunk({"role": "assistant", "content": ""}, None, None) if self.chat else None

    def chunk(self, c: TokenChunk) -> dict:
        return self._chunk({"content": c.text} if self.chat else c.text, c.logprobs or (), c.finish_reason)

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
