"""Bad input, engine failure and client disconnects over raw HTTP: OpenAI-shaped errors
with the documented status (never a 500 for bad input), nothing left behind in the
engine, and the server keeps serving. The app runs with serve_config.yaml's args as
they are (no API keys: open); its engine fails on purpose for requests with FAIL_SEED."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.builder import app_from_args
from app.model.default import DEFAULT_MODEL_NAME as BASE
from tests.support.app_fixtures import (
    APP,
    FAIL_SEED,
    config_args,
    engine_failing_on_seed,
    example_adapter_names,
    replica_stats,
    serving,
    wait_for,
)
from tests.support.error_hygiene import checked_client

ADAPTER = (example_adapter_names() or [BASE])[0]
PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story."}]
COMPLETIONS, CHATS = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    with serving({APP: (app_from_args(config_args(), engine_factory=engine_failing_on_seed), "/")}) as url:
        yield url


@pytest.fixture(scope="module")
def http(server):
    with checked_client(base_url=server, timeout=120) as client:  # every error body checked for leaks
        yield client


def _completion(**fields):
    return {"model": BASE, "prompt": PROMPT, "max_tokens": 4, **fields}


def _chat(**fields):
    return {"model": BASE, "messages": CHAT, "max_tokens": 4, **fields}


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if code:
        assert error["code"] == code, error
    return error


BAD_BODIES = {  # id: (path, raw body or JSON fields, status, code, param)
    "unknown-model": (COMPLETIONS, _completion(model="no-such-model"), 404, "model_not_found", None),
    "unknown-chat-model": (CHATS, _chat(model="no-such-model"), 404, "model_not_found", None),
    "malformed-json": (COMPLETIONS, b'{"model": "x", ', 400, None, None),
    "empty-body": (CHATS, b"", 400, None, None),
    "array-body": (CHATS, b"[1, 2]", 400, None, None),
    "string-body": (COMPLETIONS, b'"hello"', 400, None, None),
    "null-body": (COMPLETIONS, b"null", 400, None, None),
    "missing-model": (COMPLETIONS, {"prompt": PROMPT}, 400, "invalid_value", "model"),
    "missing-messages": (CHATS, {"model": BASE}, 400, "invalid_value", "messages"),
    "max-tokens-string": (COMPLETIONS, _completion(max_tokens="5"), 400, "invalid_value", "max_tokens"),
    "temperature-string": (CHATS, _chat(temperature="hot"), 400, "invalid_value", "temperature"),
    "stream-string": (CHATS, _chat(stream="yes"), 400, "invalid_value", "stream"),
    "messages-string": (CHATS, _chat(messages="hi"), 400, "invalid_value", "messages"),
    "prompt-number": (COMPLETIONS, _completion(prompt=5), 400, "invalid_value", "prompt"),
    "seed-float": (COMPLETIONS, _completion(seed=1.5), 400, "invalid_value", "seed"),
    "temperature-high": (CHATS, _chat(temperature=2.5), 400, "invalid_value", "temperature"),
    "top-p-zero": (COMPLETIONS, _completion(top_p=0), 400, "invalid_value", "top_p"),
    "max-tokens-zero": (COMPLETIONS, _completion(max_tokens=0), 400, "invalid_value", "max_tokens"),
    "max-completion-tokens-negative": (CHATS, _chat(max_completion_tokens=-1), 400, "invalid_value", None),
    "logprobs-high": (COMPLETIONS, _completion(logprobs=21), 400, "invalid_value", "logprobs"),
    "top-logprobs-high": (CHATS, _chat(logprobs=True, top_logprobs=21), 400, "invalid_value", None),
    "top-logprobs-alone": (CHATS, _chat(top_logprobs=2), 400, "invalid_value", None),
    "n-17": (CHATS, _chat(n=17), 400, "invalid_value", "n"),  # above MAX_CHOICES
    "penalty": (COMPLETIONS, _completion(presence_penalty=2.5), 400, "invalid_value", "presence_penalty"),
    "logit-bias": (CHATS, _chat(logit_bias={"50": 101}), 400, "invalid_value", "logit_bias"),
    "logit-bias-outside-vocab": (CHATS, _chat(logit_bias={"10000000": 1}), 400, "invalid_request_error", None),
    # variables the ingress passes itself (docs/tool_calling.md)
    "template-kwargs-reserved": (CHATS, _chat(chat_template_kwargs={"tools": []}), 400, "invalid_value", None),
    "template-fails": (CHATS, _chat(chat_template_kwargs={"default_system": 5}), 400, "invalid_request_error", None),
    "echo-stream": (COMPLETIONS, _completion(echo=True, stream=True), 400, "invalid_value", None),
    "stream-options-alone": (CHATS, _chat(stream_options={"include_usage": True}), 400, "invalid_value", None),
    "empty-messages": (CHATS, _chat(messages=[]), 400, "invalid_value", "messages"),
    "bad-role": (CHATS, _chat(messages=[{"role": "robot", "content": "x"}]), 400, "invalid_value", "messages"),
    "image-part": (
        CHATS,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "invalid_value",
        "messages",
    ),
    "empty-prompt": (COMPLETIONS, _completion(prompt=""), 400, "invalid_value", "prompt"),
    "two-prompts": (COMPLETIONS, _completion(prompt=["a", "b"]), 400, "invalid_value", "prompt"),
    "empty-stop": (COMPLETIONS, _completion(stop=[""]), 400, "invalid_value", "stop"),
    "token-outside-vocab": (COMPLETIONS, _completion(prompt=[10**7]), 400, "invalid_request_error", None),
    "beyond-context": (COMPLETIONS, _completion(max_tokens=10**6), 400, "context_length_exceeded", None),
    "prompt-fills-context": (
        CHATS,
        _chat(messages=[{"role": "user", "content": "hi " * 5000}], max_tokens=None),
        400,
        "context_length_exceeded",
        None,
    ),
}


@pytest.mark.parametrize("case", list(BAD_BODIES), ids=list(BAD_BODIES))
def test_bad_requests_get_openai_errors(http, case):
    path, body, status, code, param = BAD_BODIES[case]
    raw = isinstance(body, bytes)
    sent = {"content": body, "headers": {"content-type": "application/json"}} if raw else {"json": body}
    error = assert_openai_error(http.post(path, **sent), status, code)
    if param:
        assert error["param"] == param


def test_unknown_routes_and_methods_are_openai_errors(http):
    assert_openai_error(http.get("/v1/no-such-route"), 404)
    assert_openai_error(http.get(COMPLETIONS), 405)
    assert_openai_error(http.delete("/v1/adapters/no-such-adapter"), 404, "model_not_found")


def test_open_mode_needs_no_key(http):
    assert http.get("/v1/models").json()["data"][0]["id"] == BASE
    assert http.get("/v1/adapters").status_code == 200  # no keys configured: admin routes are open


def _idle() -> dict | None:
    s = replica_stats()
    return s if s["running"] == s["waiting"] == 0 and s["free_kv_blocks"] == s["total_kv_blocks"] else None


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_client_disconnect_aborts_the_request(server, stream):
    body = _completion(model=ADAPTER, max_tokens=500, min_tokens=500, stream=stream)
    with httpx.Client(base_url=server, timeout=httpx.Timeout(120, read=None if stream else 3)) as client:
        if stream:
            with client.stream("POST", COMPLETIONS, json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: {")
                busy = replica_stats()
        else:
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(client.post, COMPLETIONS, json=body)
                busy = wait_for(lambda: (s := replica_stats())["running"] and s, timeout=30)
                with pytest.raises(httpx.ReadTimeout):  # the client gives up after 3 s
                    pending.result()
    assert busy["running"] == 1 and busy["free_kv_blocks"] < busy["total_kv_blocks"], busy
    assert wait_for(_idle, timeout=30), replica_stats()  # aborted long before its 500 tokens


def test_engine_failure_mid_stream_ends_with_an_error_event(http):
    body = _completion(max_tokens=20, min_tokens=20, stream=True, seed=FAIL_SEED)
    with http.stream("POST", COMPLETIONS, json=body) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_error"
    assert len(events) - 2 >= 3, "tokens came before the failure"
    assert_openai_error(
        http.post(COMPLETIONS, json=_completion(max_tokens=20, min_tokens=20, seed=FAIL_SEED)), 500, "engine_error"
    )
    assert _idle()


def test_the_server_keeps_serving(http):
    reply = http.post(CHATS, json=_chat(model=ADAPTER, max_tokens=3))
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    assert _idle()
