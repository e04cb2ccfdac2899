"""OpenAI response bodies built from engine chunks: whole responses and SSE chunks,
for `/v1/completions` (`text_completion`) and `/v1/chat/completions` (with `tool_calls` when
the request's tools were called: app/openai/tool_calls/). A request of n choices answers with n
choices, each with its `index`; its stream interleaves them, each chunk carrying one choice
(docs/n_choices.md), and each choice's tool calls are parsed on their own."""

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
    prompt_logprobs: tuple | None = None  # echo: the prompt tokens' entries (the first None)

    def add(self, chunk: TokenChunk) -> None:
        if self.prompt_logprobs is None:  # a resumed stream's repeat is dropped
            self.prompt_logprobs = chunk.prompt_logprobs
        self.text.append(chunk.text)
        self.token_ids += chunk.token_ids
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
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


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
    """Shapes one request's responses; `chat` selects the chat.completion flavour; `tools` (one
    app.openai.tool_calls OutputParser per choice) turn each answer's tool-call text into `tool_calls`."""

    def __init__(
        self,
        request_id: str,
        model: str,
        tokenizer,
        chat: bool,
        want_logprobs: bool,
        n: int = 1,
        tools: list | None = None,
    ):
        """n: the choices the client gets; tools: None, or n parsers, the one of choice i at i."""
        self.id, self.model, self.chat, self.want_logprobs, self.n = request_id, model, chat, want_logprobs, n
        if tools is not None and len(tools) != n:
            raise ValueError(f"{len(tools)} tool-call parsers for {n} choices")
        self.tools = tools
        self.created = int(time.time())
        self.piece = lru_cache(maxsize=4096)(lambda t: tokenizer.decode([t]))
        self.decode = tokenizer.decode
        self.offsets = [0] * n  # completions' text_offset runs across a choice's stream chunks
        self.encode = _json if want_logprobs else _fast  # logprobs carry floats that may be -inf
        self.echoed: tuple[str, list[int]] | None = None  # completions' echo: (prompt text, its token ids)

    def echo(self, body, ids: list[int]) -> None:
        """A completion with `echo` answers the prompt before its text (and its tokens' logprobs)."""
        if getattr(body, "echo", False):
            prompt = body.prompt if isinstance(body.prompt, str) else self.decode(ids)
            self.echoed = (prompt, ids)

    # -- logprobs ---------------------------------------------------------------
    def _logprobs(self, entries, index: int) -> dict | None:
        if not self.want_logprobs:
            return None
        return self._chat_logprobs(entries) if self.chat else self._completion_logprobs(entries, index)

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _chat_logprobs(self, entries) -> dict:
        content = [
            {**self._token(e["token_id"], e["logprob"]), "top_logprobs": [self._token(t, lp) for t, lp in e["top"]]}
            for e in entries
        ]
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
        choice = {"index": index, "logprobs": self._logprobs(out.logprobs, index)}
        if self.chat:
            choice["message"] = (
                self._tool_message(index, out.token_ids, text) if self.tools else {"role": "assistant", "content": text}
            )
        else:
            choice["text"] = text if self.echoed is None else self.echoed[0] + text
            if self.echoed is not None and self.want_logprobs:
                choice["logprobs"] = self._echo_logprobs(out, index)
        choice["finish_reason"] = self._finish(out.finish_reason, index)  # after the message: its calls decide
        return choice

    def _echo_logprobs(self, out: Output, index: int) -> dict:
        """The prompt's tokens (the first without a logprob, as OpenAI's legacy API) then the answer's."""
        self.offsets[index] = 0
        prompt = self._completion_logprobs([e for e in out.prompt_logprobs or () if e is not None], index)
        first = self.echoed[1][0]
        prompt = {
            "tokens": [self.piece(first)] + prompt["tokens"],
            "token_logprobs": [None] + prompt["token_logprobs"],
            "top_logprobs": [None] + prompt["top_logprobs"],
            "text_offset": [0] + [o + len(self.piece(first)) for o in prompt["text_offset"]],
        }
        self.offsets[index] = len(self.echoed[0])
        answer = self._completion_logprobs(out.logprobs, index)
        return {key: prompt[key] + answer[key] for key in prompt}

    def _tool_message(self, index: int, token_ids: list[int], text: str) -> dict:
        parser = self.tools[index]
        delta = parser.feed(token_ids, text, final=True)
        if not parser.calls:
            return {"role": "assistant", "content": delta.content}
        return {"role": "assistant", "content": delta.content or None, "tool_calls": _tool_calls(parser.calls)}

    def _finish(self, reason: str | None, index: int) -> str | None:
        """A choice that stopped after calling tools finished with "tool_calls" (as OpenAI says)."""
        return "tool_calls" if reason == "stop" and self.tools and self.tools[index].calls else reason

    # -- stream chunks --------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
        """Chat streams open with the assistant role, once per choice (as OpenAI's do)."""
        return (
            [self._chunk({"role": "assistant", "content": ""}, None, None, i) for i in range(self.n)]
            if self.chat
            else []
        )

    def chunk(self, c: TokenChunk) -> dict:
        if self.chat and self.tools:
            return self._chunk(self._tool_delta(c), c.logprobs or (), self._finish(c.finish_reason, c.index), c.index)
        return self._chunk({"content": c.text} if self.chat else c.text, c.logprobs or (), c.finish_reason, c.index)

    def _tool_delta(self, c: TokenChunk) -> dict:
        """Text held back while it may still be part of a call makes an empty delta (as OpenAI's last)."""
        parsed = self.tools[c.index].feed(c.token_ids, c.text, final=c.finish_reason is not None)
        delta = {"content": parsed.content} if parsed.content else {}
        if parsed.calls:
            delta["tool_calls"] = _call_deltas(parsed.calls)
        return delta

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head(stream=True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

    def _chunk(self, delta, entries, finish_reason, index: int) -> dict:
        choice = {
            "index": index,
            "logprobs": self._logprobs(entries, index) if entries is not None else None,
            "finish_reason": finish_reason,
        }
        choice["delta" if self.chat else "text"] = delta
        return {**self._head(stream=True), "choices": [choice]}

    def _head(self, stream: bool = False) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
