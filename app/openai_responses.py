"""OpenAI response bodies built from engine chunks: whole responses and SSE chunks,
for `/v1/completions` (`text_completion`) and `/v1/chat/completions`. A request of n
choices answers with n choices, each with its `index`; its stream interleaves them, each
chunk carrying one choice (docs/n_choices.md)."""
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

    @property
    def cumulative_logprob(self) -> float:
        """The sum of its tokens' logprobs: what best_of ranks choices by."""
        return sum(e["logprob"] for e in self.logprobs)


def best(outputs: list[Output], n: int) -> list[Output]:
    """best_of: the n outputs of highest cumulative logprob (ties: the lower index first), best first."""
    order = sorted(range(len(outputs)), key=lambda i: (-outputs[i].cumulative_logprob, i))
    return [outputs[i] for i in order[:n]]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Formatter:
    """Shapes one request's responses; `chat` selects the chat.completion flavour."""

    def __init__(self, request_id: str, model: str, tokenizer, chat: bool, want_logprobs: bool, n: int = 1):
        """n: the choices the client gets."""
        self.id, self.model, self.chat, self.want_logprobs, self.n = request_id, model, chat, want_logprobs, n
        self.created = int(time.time())
        self.piece = lru_cache(maxsize=4096)(lambda t: tokenizer.decode([t]))
        self.offsets = [0] * n  # completions' text_offset runs across a choice's stream chunks
        self.encode = _json if want_logprobs else _fast  # logprobs carry floats that may be -inf

    # -- logprobs ---------------------------------------------------------------
    def _logprobs(self, entries, index: int) -> dict | None:
        if not self.want_logprobs:
            return None
        return self._chat_logprobs(entries) if self.chat else self._completion_logprobs(entries, index)

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _chat_logprobs(self, entries) -> dict:
        content = [{**self._token(e["token_id"], e["logprob"]),
                    "top_logprobs": [self._token(t, lp) for t, lp in e["top"]]} for e in entries]
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, entries, index: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.piece(e["token_id"])
            out["tokens"].append(text)
            out["token_logprobs"].append(e["logprob"])
            out["top_logprobs"].append({self.piece(t): lp for t, lp in e["top"]})
            out["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(text)
        return out

    # -- whole responses ----------------------------------------------------------
    def response(self, outputs: list[Output], generated: int | None = None) -> dict:
        """outputs: the choices returned, in index order; generated: completion tokens of every
        choice generated (best_of counts those it dropped too)."""
        choices = [self._choice(i, out) for i, out in enumerate(outputs)]
        completion = sum(o.completion_tokens for o in outputs) if generated is None else generated
        return {**self._head(), "choices": choices, "usage": usage(outputs[0].prompt_tokens, completion)}

    def _choice(self, index: int, out: Output) -> dict:
        text = "".join(out.text)
        choice = {"index": index, "logprobs": self._logprobs(out.logprobs, index), "finish_reason": out.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    # -- stream chunks --------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
        """Chat streams open with the assistant role, once per choice (as OpenAI's do)."""
        return [self._chunk({"role": "assistant", "content": ""}, None, None, i) for i in range(self.n)] \
            if self.chat else []

    def chunk(self, c: TokenChunk) -> dict:
        return self._chunk({"content": c.text} if self.chat else c.text, c.logprobs or (), c.finish_reason, c.index)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head(stream=True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

    def _chunk(self, delta, entries, finish_reason, index: int) -> dict:
        choice = {"index": index, "logprobs": self._logprobs(entries, index) if entries is not None else None,
                  "finish_reason": finish_reason}
        choice["delta" if self.chat else "text"] = delta
        return {**self._head(stream=True), "choices": [choice]}

    def _head(self, stream: bool = False) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
