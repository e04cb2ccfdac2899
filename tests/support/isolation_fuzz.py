"""The isolation tests' fuzz: malformed requests over every route (hostile field values,
broken JSON, bad adapter names and paths, wrong methods), drawn from one seeded generator,
and the check every answer must pass (a 4xx in OpenAI's shape, or a stream that ends)."""

import json
import random

from tests.support.isolation_checks import ADMIN, CHATS, COMPLETIONS, QUESTION, VICTIMS, completion

FUZZ_SEED, FUZZ_COUNT = 20261201, 1000
HOSTILE_VALUES = [
    None,
    "",
    "x",
    "💥" * 50,
    "\u0000",
    -1,
    0,
    1,
    2**31,
    2**64,
    -(2**70),
    1e308,
    -1e-308,
    0.5,
    True,
    [],
    [None],
    [[]],
    {},
    {"a": {"b": [1]}},
    "a" * 5000,
    [1] * 300,
    ["x"] * 20,
    [""],
    "2",
    "null",
]
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_tokens",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "presence_penalty",
    "logit_bias",
    "tools",
    "response_format",
    "user",
    "suffix",
    "best_of",
]


def fuzz_body(rng: random.Random, chat: bool):
    body = (
        {"model": rng.choice(VICTIMS), "messages": QUESTION, "max_completion_tokens": 2}
        if chat
        else completion(model=rng.choice(VICTIMS), max_tokens=2)
    )
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(FIELDS)
        if rng.random() < 0.15:
            body.pop(field, None)
        else:
            body[field] = rng.choice(HOSTILE_VALUES)
    if chat and not any(
        isinstance(body.get(k), int) and 0 < body[k] <= 4 for k in ("max_tokens", "max_completion_tokens")
    ):
        body["max_completion_tokens"] = rng.choice([2, 0, -3, "2"])  # a chat without a cap may run to the context
    if rng.random() < 0.25:  # broken bytes instead of JSON
        raw = json.dumps(body).encode()
        return rng.choice(
            [
                raw[: rng.randrange(len(raw))],
                raw + b"}",
                b"[" * 20000,
                rng.randbytes(64),
                b"\xff\xfe" + raw,
                b"",
                b"null",
                b"1e999999",
                json.dumps([body]).encode(),
            ]
        )
    return body


def fuzz_request(rng: random.Random) -> tuple[str, str, dict]:
    """(method, path, httpx keyword arguments) of one malformed request."""
    kind = rng.randrange(10)
    name = f"fz{rng.randrange(10**6)}" + rng.choice(["", "..", "/x", "%2e%2e", "💥", " ", "a" * 300])
    if kind < 3:
        return "POST", COMPLETIONS, {"json": fuzz_body(rng, chat=False)}
    if kind < 6:
        return "POST", CHATS, {"json": fuzz_body(rng, chat=True)}
    if kind == 6:
        path = rng.choice(
            [
                "relative/dir",
                "/",
                "/nonexistent/" + name,
                "/" + "b" * rng.choice([300, 5000]),
                "s3://",
                "s3://a",
                "s3://Bad_Bucket/x/",
                "s3://ok-bucket/%2e%2e/",
                "file://",
                "\u0000",
                "",
                5,
                None,
                ["/"],
            ]
        )
        body = rng.choice(
            [
                {"name": name, "path": path},
                {"name": path, "path": "/"},
                {"name": name},
                {"path": path},
                {"name": name, "path": path, "extra": 1},
                [name, path],
            ]
        )
        return "POST", ADMIN, {"json": body}
    if kind == 7:
        return "DELETE", f"{ADMIN}/{name}", {}
    if kind == 8:
        return "GET", rng.choice([f"/v1/models/{name}", "/v1/models", "/v1/adapters", "/health", "/v1/nothing"]), {}
    method = rng.choice(["PUT", "PATCH", "GET", "DELETE"])
    return method, rng.choice([COMPLETIONS, CHATS, "/v1/models", "/v1", "/", "/v1/adapters/x/y"]), {}


def send(http, request) -> tuple[int, str]:
    method, path, kwargs = request
    if "json" in kwargs and isinstance(kwargs["json"], bytes):
        kwargs = {"content": kwargs["json"], "headers": {"content-type": "application/json"}}
    response = http.request(method, path, **kwargs)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
        assert error["type"] == "invalid_request_error", response.text
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text
    return response.status_code, response.text[:300]
