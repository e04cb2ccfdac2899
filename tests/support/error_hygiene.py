"""What no error body may hold: a traceback, an ANSI escape, an IP address, or a
filesystem path the client did not send itself. Used on every error case of the app
tests (also through `checked_client`, an httpx client that checks each error it gets, and
`checked_openai`, the official `openai` client on top of it)."""

from __future__ import annotations

import json
import re

import httpx

_IP = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])")
_PATH = re.compile(r"(?<![\w:/])/(?:[\w.\-]+/)+[\w.\-]*")  # two segments or more: /a/b, /usr/lib/x.py
_TRACE = ("Traceback", 'File "', "site-packages", "ray::", "pid=")


def leaks(message: str, sent: str = "") -> list[str]:
    """What in ``message`` should not be there, given the client sent ``sent``."""
    found = [f"traceback marker {m!r}" for m in _TRACE if m in message]
    if "\x1b[" in message:
        found.append("ANSI escape")
    found += [f"IP address {ip}" for ip in _IP.findall(message)]
    found += [f"path {p!r}" for p in _PATH.findall(message) if p not in sent]
    return found


def assert_clean_error(response: httpx.Response, sent: str = "") -> None:
    """An error response (or an SSE stream's error events) reveals nothing internal."""
    text = response.text
    bodies = (
        [text]
        if not text.startswith("data: ")
        else [line[6:] for line in text.splitlines() if line.startswith("data: {") and '"error"' in line]
    )
    for body in bodies:
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body
        problems = leaks(message, sent) + leaks(body, sent)
        assert not problems, f"{response.request.method} {response.request.url.path} → {problems}: {body[:500]}"


def _check(response: httpx.Response) -> None:
    if response.status_code >= 400:
        response.read()
        try:
            content = response.request.content
        except httpx.RequestNotRead:  # a streamed upload: nothing of it to allow
            content = b""
        assert_clean_error(response, content.decode(errors="replace") + str(response.request.url))


def checked_client(**kwargs) -> httpx.Client:
    """An httpx.Client whose every error response is checked with assert_clean_error."""
    return httpx.Client(event_hooks={"response": [_check]}, **kwargs)


def checked_openai(**kwargs):
    """The official `openai` client (OpenAI(**kwargs)) whose every error response is checked."""
    from openai import OpenAI

    return OpenAI(http_client=checked_client(), **kwargs)
