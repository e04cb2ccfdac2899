"""Closed-loop streaming load and its summary, shared by the served-path benchmarks.

Each client keeps one request in flight and records per request (start, first token, last
token, tokens); `summarize` turns those into tokens/s over a window (each request's tokens
spread evenly over its first..last token, the part inside the window counted), TTFT and
time per output token percentiles. `http_client` speaks raw HTTP/1.1 + SSE on one
keep-alive connection (nothing to install, cheap per event); the token count comes from
the final usage chunk, so an event may carry any number of tokens.
"""

from __future__ import annotations

import asyncio
import json
import time

Record = tuple[float, float, float, int, int]  # start, first token, last token, tokens, events with text


def completion_body(prompt: list[int], max_tokens: int, model: str) -> bytes:
    return json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0.0,
            "stream_options": {"include_usage": True},
        }
    ).encode()


async def http_client(port: int, bodies, until: float, records: list[Record]) -> None:
    """POST /v1/completions with next(bodies) back to back until ``until`` (monotonic)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < until:
            body = next(bodies)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            start, first, last, tokens, events = time.monotonic(), None, None, 0, 0
            status = await reader.readline()
            if b" 200 " not in status:
                raise RuntimeError(f"HTTP {status!r}")
            while True:
                line = await reader.readline()  # chunked framing lines and SSE lines alike
                if not line:
                    raise RuntimeError("connection closed mid-stream")
                if line.startswith(b"data: [DONE]"):
                    break
                if line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    elif event["choices"] and event["choices"][0]["text"]:
                        last = time.monotonic()
                        first = first or last
                        events += 1
            while (await reader.readline()) not in (b"0\r\n", b""):  # the chunked body's end
                pass
            await reader.readline()
            records.append((start, first or start, last or start, tokens, events))
    finally:
        writer.close()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(records: list[Record], t0: float, t1: float) -> dict:
    """tok_s in [t0, t1]; TTFT and TPOT (s) of the requests that started inside it."""
    tokens = 0.0
    for _, first, last, n, _ in records:
        if last <= first:
            tokens += n if t0 <= first <= t1 else 0
        else:
            tokens += n * max(0.0, min(last, t1) - max(first, t0)) / (last - first)
    inside = [r for r in records if t0 <= r[0] <= t1]
    ttft = [first - start for start, first, _, _, _ in inside]
    tpot = [(last - first) / (n - 1) for _, first, last, n, _ in inside if n > 1]
    return {
        "tok_s": tokens / (t1 - t0),
        "requests": len(inside),
        "tokens_per_event": sum(r[3] for r in inside) / max(1, sum(r[4] for r in inside)),
        "ttft_p50": _pct(ttft, 0.5),
        "ttft_p99": _pct(ttft, 0.99),
        "tpot_p50": _pct(tpot, 0.5),
        "tpot_p99": _pct(tpot, 0.99),
    }
