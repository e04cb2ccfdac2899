"""Long streaming completions from worker threads, as the fault tests' clients: each
records its SSE events and text, and signals once its first token arrived."""

from __future__ import annotations

import json
import threading

import httpx


def stream_completion(url: str, body: dict, out: dict) -> None:
    """POST a streaming /v1/completions; out gets "events" (every `data:` payload) and "text"."""
    text, events = [], []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=900) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if line[6:].startswith("{") and '"choices"' in line:
                        text.append(json.loads(line[6:])["choices"][0]["text"])
                        out["started"].set()
    finally:  # a bare close leaves events without [DONE]: the test sees it
        out["text"], out["events"] = "".join(text), events


def start_streams(url: str, bodies: list[dict]) -> tuple[list[threading.Thread], list[dict]]:
    results = [{"started": threading.Event()} for _ in bodies]
    threads = [
        threading.Thread(target=stream_completion, args=(url, b, r), daemon=True) for b, r in zip(bodies, results)
    ]
    for t in threads:
        t.start()
    return threads, results


def finish(threads: list[threading.Thread], results: list[dict]) -> list[dict]:
    for t in threads:
        t.join(900)
    return results


def errors(result: dict) -> list[str]:
    return [e for e in result["events"] if e.startswith("{") and '"error"' in e]
