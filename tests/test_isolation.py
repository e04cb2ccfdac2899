"""Tenant isolation over real Ray Serve (the default model, the example adapters): each
hostile-but-accepted input is sent while 4 streams of other tenants run in the same
engine, and those 4 end exactly as they do alone; the hostile request gets a 4xx or an
error of its own. Then a bounded fuzz of malformed requests over every route: no 5xx,
every 4xx in OpenAI's shape with nothing internal in it, and afterwards the references
are unchanged and the replica is empty. One Ray cluster serves the whole module."""

import json
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from app.builder import app_from_args
from app.generate import EXAMPLE_ADAPTERS
from app.model.default import DEFAULT_MODEL_NAME as BASE
from tests.app_fixtures import (
    APP,
    FLAKY_ADAPTER,
    config_args,
    engine_with_flaky_adapter_load,
    example_adapter_names,
    replica_stats,
    serving,
    wait_for,
)
from tests.error_hygiene import checked_client, checked_openai, leaks

ADAPTERS = example_adapter_names()
VICTIMS = [BASE, *ADAPTERS][:4]
QUESTION = [{"role": "user", "content": "Tell me a short story about the sea."}]
PROMPT = "The capital of France is"
VICTIM_TOKENS = 20  # long enough to still be running when the hostile request lands, on a loaded machine too
COMPLETIONS, CHATS, ADMIN = "/v1/completions", "/v1/chat/completions", "/v1/adapters"
OVERFLOWING = "overflowing"  # finite weights so large that the adapter's activations overflow

pytestmark = pytest.mark.skipif(len(ADAPTERS) < 3, reason="needs the example adapters in examples/adapters/")


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> dict:
    return config_args(
        registry_path=str(tmp_path_factory.mktemp("registry") / "adapters.json"),
        adapter_roots=[str(EXAMPLE_ADAPTERS), str(tmp_path_factory.getbasetemp())],
    )  # the tests' adapters


@pytest.fixture(scope="module")
def server(args):
    with serving({APP: (app_from_args(args, engine_factory=engine_with_flaky_adapter_load), "/")}) as url:
        yield url


@pytest.fixture(scope="module")
def http(server):
    with checked_client(base_url=server, timeout=120) as client:
        yield client


def _adapter_copy(root, name: str, edit=None):
    """A copy of the first example adapter under ``name``, its tensors passed through edit."""
    out = shutil.copytree(EXAMPLE_ADAPTERS / ADAPTERS[0], root / name)
    if edit is not None:
        weights = out / "adapter_model.safetensors"
        tensors = load_file(weights)
        edit(tensors)
        save_file(tensors, weights)
    return out


def _first_b(tensors, value):
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = value


def _overflow(tensors):
    for k in tensors:
        if "lora_B" in k:
            tensors[k] = torch.full_like(tensors[k], 3e38)  # finite in float32; B·(A·x) is not


@pytest.fixture(scope="module")
def dirs(http, tmp_path_factory):
    """Adapter directories for the hostile cases; the two that are valid are registered."""
    root = tmp_path_factory.mktemp("hostile")
    made = {
        "nan": _adapter_copy(root, "nan", lambda t: _first_b(t, float("nan"))),
        "inf": _adapter_copy(root, "inf", lambda t: _first_b(t, float("-inf"))),
        OVERFLOWING: _adapter_copy(root, OVERFLOWING, _overflow),
        FLAKY_ADAPTER: _adapter_copy(root, FLAKY_ADAPTER),
        "empty": root / "empty",
    }
    made["empty"].mkdir()
    for name in (OVERFLOWING, FLAKY_ADAPTER):
        r = http.post(ADMIN, json={"name": name, "path": str(made[name])})
        assert r.status_code == 200, r.text
    return made


def _victim_body(model: str) -> dict:
    return {"model": model, "messages": QUESTION, "max_tokens": VICTIM_TOKENS, "temperature": 0, "stream": True}


def _read_stream(response: httpx.Response, on_token=None) -> tuple[str, dict | None]:
    """(text, the error event or None) of an SSE response that must end with [DONE]."""
    text, error, last = "", None, None
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        last = line[6:]
        if last == "[DONE]":
            break
        event = json.loads(last)
        if "error" in event:
            error = event["error"]
            assert not leaks(error["message"]), error
            continue
        piece = event["choices"][0].get("delta", {}).get("content") or event["choices"][0].get("text") or ""
        text += piece
        if piece and on_token:
            on_token()
    assert last == "[DONE]"
    return text, error


def _victim(http, model: str, started: threading.Semaphore, finished: dict) -> str:
    with http.stream("POST", CHATS, json=_victim_body(model)) as response:
        assert response.status_code == 200
        once = []
        text, error = _read_stream(response, lambda: once or (once.append(1), started.release()))
    finished[model] = time.monotonic()
    assert error is None, error
    return text


@pytest.fixture(scope="module")
def solo(http):
    """Each victim's stream with nothing else running."""
    out = {}
    for model in VICTIMS:
        with http.stream("POST", CHATS, json=_victim_body(model)) as response:
            out[model], error = _read_stream(response)
        assert error is None and out[model]
    return out


def _alongside_victims(http, hostile):
    """Run hostile() once all 4 victim streams are producing tokens; their texts and its result."""
    started, finished = threading.Semaphore(0), {}
    with ThreadPoolExecutor(len(VICTIMS)) as pool:
        futures = {m: pool.submit(_victim, http, m, started, finished) for m in VICTIMS}
        for _ in VICTIMS:
            assert started.acquire(timeout=120)
        sent = time.monotonic()
        result = hostile(http)
        texts = {m: f.result() for m, f in futures.items()}
    assert all(t > sent for t in finished.values()), "a victim ended before the hostile request was sent"
    return texts, result


def _completion(**fields):
    return {"model": BASE, "prompt": PROMPT, "max_tokens": 6, **fields}


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"]


_GREEDY: dict[str, str] = {}


def _greedy_equal(http, **fields):
    """A request with these fields answers what the same greedy request answers."""

    def run(client):
        return _text(client.post(COMPLETIONS, json=_completion(**fields)))

    if not _GREEDY:
        _GREEDY["text"] = _text(http.post(COMPLETIONS, json=_completion(temperature=0)))
    return run, lambda got: got == _GREEDY["text"]


def _client_error(status: int, *words):
    def check(response: httpx.Response) -> bool:
        error = response.json()["error"]
        assert response.status_code == status and set(error) == {"message", "type", "param", "code"}, response.text
        assert "\n" not in error["message"] and all(w in error["message"] for w in words), error
        return True

    return check


def _post(path, **kwargs):
    return lambda client: client.post(path, **kwargs)


def _stream_error(model: str, *words):
    def run(client):
        with client.stream("POST", COMPLETIONS, json=_completion(model=model, stream=True)) as response:
            assert response.status_code == 200
            return _read_stream(response)[1]

    def check(error) -> bool:
        assert error is not None and error["code"] == "engine_error", error
        assert all(w in error["message"] for w in words), error
        return True

    return run, check


def _cases(http, dirs) -> dict:
    """id: (hostile(client) → result, check(result) → True)."""
    return {
        "temperature-1e-38": _greedy_equal(http, temperature=1e-38, seed=1),
        "temperature-smallest-subnormal": _greedy_equal(http, temperature=5e-324, seed=2),
        "top-p-1e-46": _greedy_equal(http, top_p=1e-46, seed=3),
        "top-p-smallest-subnormal-hot": _greedy_equal(http, top_p=5e-324, temperature=2.0, seed=4),
        "top-k-beyond-vocab": (
            lambda c: c.post(COMPLETIONS, json=_completion(top_k=10**15, seed=5)),
            lambda r: r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1,
        ),
        "every-extreme-with-logprobs": (
            lambda c: c.post(
                COMPLETIONS,
                json=_completion(
                    temperature=1e-300, top_p=1e-300, top_k=2**62, logprobs=20, seed=-(2**63), min_tokens=8
                ),
            ),
            lambda r: (
                r.status_code == 200 and all(v == v for v in r.json()["choices"][0]["logprobs"]["token_logprobs"])
            ),
        ),
        "nan-adapter": (
            _post(ADMIN, json={"name": "nan", "path": str(dirs["nan"])}),
            _client_error(400, "NaN", "lora_B"),
        ),
        "inf-adapter": (
            _post(ADMIN, json={"name": "inf", "path": str(dirs["inf"])}),
            _client_error(400, "Inf", "lora_B"),
        ),
        # accepted (its weights are finite) and answers garbage of its own; the others are untouched
        "overflowing-adapter": (
            _stream_error(OVERFLOWING)[0],
            lambda error: error is None or error["code"] == "engine_error",
        ),
        "adapter-failing-to-load-mid-batch": _stream_error(FLAKY_ADAPTER, "could not be loaded", FLAKY_ADAPTER),
        "adapter-without-config": (
            _post(ADMIN, json={"name": "empty", "path": str(dirs["empty"])}),
            _client_error(400, "adapter_roots"),
        ),  # the same answer as for no directory
        "path-of-10000-chars": (_post(ADMIN, json={"name": "long", "path": "/" + "a" * 10000}), _client_error(400)),
        "10000-stop-strings": (_post(COMPLETIONS, json=_completion(stop=["x"] * 10000)), _client_error(400, "stop")),
        "10-mb-body": (
            _post(
                CHATS,
                content=json.dumps(
                    {"model": BASE, "messages": [{"role": "user", "content": "a " * 5_000_000}]}
                ).encode(),
                headers={"content-type": "application/json"},
            ),
            _client_error(413, "limit"),
        ),
    }


CASE_IDS = [
    "temperature-1e-38",
    "temperature-smallest-subnormal",
    "top-p-1e-46",
    "top-p-smallest-subnormal-hot",
    "top-k-beyond-vocab",
    "every-extreme-with-logprobs",
    "nan-adapter",
    "inf-adapter",
    "overflowing-adapter",
    "adapter-failing-to-load-mid-batch",
    "adapter-without-config",
    "path-of-10000-chars",
    "10000-stop-strings",
    "10-mb-body",
]


def _idle() -> dict | None:
    s = replica_stats()
    return s if s["running"] == s["waiting"] == 0 and s["free_kv_blocks"] == s["total_kv_blocks"] else None


@pytest.mark.parametrize("case", CASE_IDS)
def test_a_hostile_request_fails_alone(http, dirs, solo, case):
    hostile, check = _cases(http, dirs)[case]
    texts, result = _alongside_victims(http, hostile)
    assert check(result), getattr(result, "text", result)
    assert texts == solo
    assert wait_for(_idle, timeout=30), replica_stats()


def test_a_10_mb_body_does_not_hold_up_a_small_request(http, server):
    body = json.dumps({"model": BASE, "messages": [{"role": "user", "content": "a " * 5_000_000}]}).encode()
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server, timeout=120) as big_client:
        big = pool.submit(big_client.post, CHATS, content=body, headers={"content-type": "application/json"})
        start = time.monotonic()
        small = http.post(COMPLETIONS, json=_completion(max_tokens=1))
        small_s = time.monotonic() - start
        assert big.result().status_code == 413, big.result().text
    assert small.status_code == 200 and small_s < 2.0, (small.status_code, small_s)


def test_a_large_prompt_is_tokenized_off_the_event_loop(http, server):
    """A prompt just under the body limit takes seconds to tokenize: a small request sent
    meanwhile is answered first (the tokenizer runs on a pool thread, not the event loop)."""
    body = {"model": BASE, "prompt": "hello world " * 300_000, "max_tokens": 1}  # 3.6 MB: fails the context check
    done = {}
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server, timeout=120) as big_client:

        def big_request():
            r = big_client.post(COMPLETIONS, json=body)
            done["big"] = time.monotonic()
            return r

        big = pool.submit(big_request)
        time.sleep(0.5)  # the big body is in
        small = http.post(COMPLETIONS, json=_completion(max_tokens=1))
        done["small"] = time.monotonic()
        assert big.result().status_code == 400 and big.result().json()["error"]["code"] == "context_length_exceeded"
    assert small.status_code == 200 and done["small"] < done["big"], done


# -- fuzz ------------------------------------------------------------------------------------------
FUZZ_SEED, FUZZ_COUNT = 20261201, 1000
_HOSTILE_VALUES = [
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
_FIELDS = [
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


def _fuzz_body(rng: random.Random, chat: bool):
    body = (
        {"model": rng.choice(VICTIMS), "messages": QUESTION, "max_completion_tokens": 2}
        if chat
        else _completion(model=rng.choice(VICTIMS), max_tokens=2)
    )
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(_FIELDS)
        if rng.random() < 0.15:
            body.pop(field, None)
        else:
            body[field] = rng.choice(_HOSTILE_VALUES)
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


def _fuzz_request(rng: random.Random) -> tuple[str, str, dict]:
    """(method, path, httpx keyword arguments) of one malformed request."""
    kind = rng.randrange(10)
    name = f"fz{rng.randrange(10**6)}" + rng.choice(["", "..", "/x", "%2e%2e", "💥", " ", "a" * 300])
    if kind < 3:
        return "POST", COMPLETIONS, {"json": _fuzz_body(rng, chat=False)}
    if kind < 6:
        return "POST", CHATS, {"json": _fuzz_body(rng, chat=True)}
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


def _send(http, request) -> tuple[int, str]:
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


def test_fuzz_malformed_requests_on_every_route(http, solo):
    rng = random.Random(FUZZ_SEED)
    requests = [_fuzz_request(rng) for _ in range(FUZZ_COUNT)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda r: _send(http, r), requests))
    statuses = [s for s, _ in results]
    assert not [r for r in results if r[0] >= 500], [r for r in results if r[0] >= 500][:5]
    assert sum(400 <= s < 500 for s in statuses) >= 0.6 * FUZZ_COUNT  # mostly rejected: the inputs are malformed
    assert len({p for _, p, _ in requests}) >= 10  # every route, and some that do not exist
    for model in VICTIMS:
        with http.stream("POST", CHATS, json=_victim_body(model)) as response:
            assert _read_stream(response) == (solo[model], None)
    idle = wait_for(_idle, timeout=30)
    assert idle, replica_stats()


def test_registered_adapters_list_their_version_and_resolve_by_id(http):
    listed = http.get(ADMIN).json()["data"]
    assert [a["name"] for a in listed if a["name"] in ADAPTERS] == ADAPTERS
    assert all(isinstance(a["version"], str) and len(a["version"]) >= 16 for a in listed)
    card = http.get(f"/v1/models/{ADAPTERS[0]}").json()
    assert card["id"] == ADAPTERS[0] and card["parent"] == BASE
    from openai import NotFoundError

    client = checked_openai(
        base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="unused", max_retries=0, timeout=60
    )
    assert client.models.retrieve(ADAPTERS[0]).id == ADAPTERS[0]
    with pytest.raises(NotFoundError):
        client.models.retrieve("no-such-model")
    assert http.get(f"/v1/models/{BASE}").json()["id"] == BASE
    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert http.get("/health").json() == {"status": "ok"}


def test_a_registration_survives_an_app_restart(http, args, tmp_path):
    """Last in this module: it deploys the application again (same config, as a second
    `serve run` would), with its registry_path (a local file here; tests/test_registry_durable.py
    covers the s3:// object)."""
    from ray import serve

    copy = shutil.copytree(EXAMPLE_ADAPTERS / ADAPTERS[1], tmp_path / "tenant-copy")
    body = {"model": "tenant-copy", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    registered = http.post(ADMIN, json={"name": "tenant-copy", "path": str(copy)})
    assert registered.status_code == 200, registered.text
    assert http.delete(f"{ADMIN}/{ADAPTERS[2]}").status_code == 200  # from adapter_dirs: stays unregistered
    before = _text(http.post(COMPLETIONS, json=body))
    listed_before = http.get(ADMIN).json()["data"]

    serve.delete(APP)  # the application is gone, its registry actor included
    assert httpx.get(f"{http.base_url}/v1/models").status_code == 404
    serve.run(app_from_args(args, engine_factory=engine_with_flaky_adapter_load), name=APP, route_prefix="/")

    assert http.get(ADMIN).json()["data"] == listed_before
    assert {"tenant-copy", OVERFLOWING, FLAKY_ADAPTER} <= {a["name"] for a in listed_before}
    assert ADAPTERS[2] not in {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert (
        _text(http.post(COMPLETIONS, json=body))
        == before
        != _text(http.post(COMPLETIONS, json={**body, "model": BASE}))
    )
