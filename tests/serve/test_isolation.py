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
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.builder import app_from_args
from app.generate import EXAMPLE_ADAPTERS
from app.model.default import DEFAULT_MODEL_NAME as BASE
from app.serving.config import parse_args
from tests.support.app_fixtures import (
    APP,
    FLAKY_ADAPTER,
    GATED_PREFIX,
    config_args,
    gated_tokenizer,
    replica_stats,
    serving,
    tokenize_gate,
    wait_for,
)
from tests.support.error_hygiene import checked_client, checked_openai
from tests.support.isolation_checks import (
    ADAPTERS,
    ADMIN,
    CASE_IDS,
    CHATS,
    COMPLETIONS,
    OVERFLOWING,
    PROMPT,
    VICTIMS,
    adapter_copy,
    alongside_victims,
    completion,
    engine_holding_victims,
    hostile_cases,
    overflow,
    read_stream,
    replica_idle,
    set_first_b,
    text_of,
    victim_body,
)
from tests.support.isolation_fuzz import FUZZ_COUNT, FUZZ_SEED, fuzz_request, send

_CHUNK = 1 << 16  # the 10 MB body's pieces, as a client streaming it would send them

pytestmark = pytest.mark.skipif(len(ADAPTERS) < 3, reason="needs the example adapters in examples/adapters/")


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> dict:
    return config_args(
        registry_path=str(tmp_path_factory.mktemp("registry") / "adapters.json"),
        adapter_roots=[str(EXAMPLE_ADAPTERS), str(tmp_path_factory.getbasetemp())],
    )  # the tests' adapters


@pytest.fixture(scope="module")
def server(args):
    with serving({APP: (isolation_app(args), "/")}) as url:
        yield url


def isolation_app(args):
    """The application with two faults the tests can trigger: an adapter whose load fails, and
    a prompt held inside the tokenizer (tests/support/app_fixtures.py); and victims held in the engine
    until a hostile request joins them (tests/support/isolation_checks.py)."""
    return app_from_args(args, engine_factory=engine_holding_victims, tokenizer_loader=gated_tokenizer)


@pytest.fixture(scope="module")
def http(server):
    with checked_client(base_url=server, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def dirs(http, tmp_path_factory):
    """Adapter directories for the hostile cases; the two that are valid are registered."""
    root = tmp_path_factory.mktemp("hostile")
    made = {
        "nan": adapter_copy(root, "nan", lambda t: set_first_b(t, float("nan"))),
        "inf": adapter_copy(root, "inf", lambda t: set_first_b(t, float("-inf"))),
        OVERFLOWING: adapter_copy(root, OVERFLOWING, overflow),
        FLAKY_ADAPTER: adapter_copy(root, FLAKY_ADAPTER),
        "empty": root / "empty",
    }
    made["empty"].mkdir()
    for name in (OVERFLOWING, FLAKY_ADAPTER):
        r = http.post(ADMIN, json={"name": name, "path": str(made[name])})
        assert r.status_code == 200, r.text
    return made


@pytest.fixture(scope="module")
def solo(http):
    """Each victim's stream with nothing else running."""
    out = {}
    for model in VICTIMS:
        with http.stream("POST", CHATS, json=victim_body(model)) as response:
            out[model], error = read_stream(response)
        assert error is None and out[model]
    return out


@pytest.mark.parametrize("case", CASE_IDS)
def test_a_hostile_request_fails_alone(http, dirs, solo, case):
    hostile, check = hostile_cases(http, dirs)[case]
    texts, result = alongside_victims(http, hostile)
    assert check(result), getattr(result, "text", result)
    assert texts == solo
    assert wait_for(replica_idle, timeout=30), replica_stats()


def test_a_10_mb_body_does_not_hold_up_a_small_request(http, server, args):
    """The 10 MB body streams in (chunked: no Content-Length to refuse it by): as many bytes as
    the limit allows go first, then the rest waits until a small request sent meanwhile has been
    answered. That answer came while the big body was still arriving, by construction."""
    payload = json.dumps({"model": BASE, "messages": [{"role": "user", "content": "a " * 5_000_000}]}).encode()
    held = parse_args(args, BASE).max_body_bytes  # up to the limit the server must keep reading
    first_part_sent, small_answered = threading.Event(), threading.Event()

    def body():
        yield from (payload[i : min(i + _CHUNK, held)] for i in range(0, held, _CHUNK))
        first_part_sent.set()  # httpx asks for more only once it has written all of the above
        small_answered.wait()
        yield from (payload[i : i + _CHUNK] for i in range(held, len(payload), _CHUNK))

    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server, timeout=120) as big_client:
        big = pool.submit(big_client.post, CHATS, content=body(), headers={"content-type": "application/json"})
        try:
            assert first_part_sent.wait(timeout=120), big.exception(timeout=0) if big.done() else "not sent"
            small = http.post(COMPLETIONS, json=completion(max_tokens=1))  # its timeout: only if held up
            in_flight = not big.done()
        finally:
            small_answered.set()  # the rest of the body goes, whatever happened
        assert big.result().status_code == 413, big.result().text
    assert small.status_code == 200 and in_flight, (small.status_code, small.text)


def test_a_large_prompt_is_tokenized_off_the_event_loop(http, server):
    """A prompt just under the body limit is held inside the Ingress's tokenizer call (the gate
    of tests/support/app_fixtures.py) until a small request sent meanwhile has been answered: had the
    tokenizer run on the event loop, nothing could be answered then (it runs on a pool thread)."""
    body = {"model": BASE, "prompt": GATED_PREFIX + "hello world " * 300_000, "max_tokens": 1}  # 3.6 MB
    with tokenize_gate() as gate:
        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server, timeout=120) as big_client:
            big = pool.submit(big_client.post, COMPLETIONS, json=body)
            try:
                assert gate.entered(), big.result(timeout=0).text if big.done() else "the tokenizer never began"
                small = http.post(COMPLETIONS, json=completion(max_tokens=1))  # its timeout: only if the loop is held
                tokenizing = not big.done()
            finally:
                gate.open()
            big = big.result()
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded", big.text
    assert small.status_code == 200 and tokenizing, (small.status_code, small.text)


# -- fuzz ------------------------------------------------------------------------------------------


def test_fuzz_malformed_requests_on_every_route(http, solo):
    rng = random.Random(FUZZ_SEED)
    requests = [fuzz_request(rng) for _ in range(FUZZ_COUNT)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda r: send(http, r), requests))
    statuses = [s for s, _ in results]
    assert not [r for r in results if r[0] >= 500], [r for r in results if r[0] >= 500][:5]
    assert sum(400 <= s < 500 for s in statuses) >= 0.6 * FUZZ_COUNT  # mostly rejected: the inputs are malformed
    assert len({p for _, p, _ in requests}) >= 10  # every route, and some that do not exist
    for model in VICTIMS:
        with http.stream("POST", CHATS, json=victim_body(model)) as response:
            assert read_stream(response) == (solo[model], None)
    idle = wait_for(replica_idle, timeout=30)
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
    `serve run` would), with its registry_path (a local file here; tests/unit/test_registry_durable.py
    covers the s3:// object)."""
    from ray import serve

    copy = shutil.copytree(EXAMPLE_ADAPTERS / ADAPTERS[1], tmp_path / "tenant-copy")
    body = {"model": "tenant-copy", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    registered = http.post(ADMIN, json={"name": "tenant-copy", "path": str(copy)})
    assert registered.status_code == 200, registered.text
    assert http.delete(f"{ADMIN}/{ADAPTERS[2]}").status_code == 200  # from adapter_dirs: stays unregistered
    before = text_of(http.post(COMPLETIONS, json=body))
    listed_before = http.get(ADMIN).json()["data"]

    serve.delete(APP)  # the application is gone, its registry actor included
    assert httpx.get(f"{http.base_url}/v1/models").status_code == 404
    serve.run(isolation_app(args), name=APP, route_prefix="/")

    assert http.get(ADMIN).json()["data"] == listed_before
    assert {"tenant-copy", OVERFLOWING, FLAKY_ADAPTER} <= {a["name"] for a in listed_before}
    assert ADAPTERS[2] not in {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert (
        text_of(http.post(COMPLETIONS, json=body))
        == before
        != text_of(http.post(COMPLETIONS, json={**body, "model": BASE}))
    )
