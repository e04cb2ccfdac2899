"""What the isolation tests send and compare: the victim streams (other tenants' requests,
run alongside a hostile one), the hostile cases with what each must answer, and adapter
copies with edited weights. One table of cases: tests/serve/test_isolation.py runs each."""

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import torch
from safetensors.torch import load_file, save_file

from app.generate import EXAMPLE_ADAPTERS
from app.model.default import DEFAULT_MODEL_NAME as BASE
from tests.support.app_fixtures import (
    FLAKY_ADAPTER,
    engine_with_flaky_adapter_load,
    example_adapter_names,
    replica_stats,
)
from tests.support.error_hygiene import leaks

ADAPTERS = example_adapter_names()
VICTIMS = [BASE, *ADAPTERS][:4]
QUESTION = [{"role": "user", "content": "Tell me a short story about the sea."}]
PROMPT = "The capital of France is"
VICTIM_TOKENS = 20
VICTIM_SEED = 7777  # marks the victims' requests (greedy: the seed changes nothing else) for the hold below
_HOLD = ("victims-hold", "loraplex-tests")  # a named actor (name, namespace): test and engine meet there
COMPLETIONS, CHATS, ADMIN = "/v1/completions", "/v1/chat/completions", "/v1/adapters"
OVERFLOWING = "overflowing"  # finite weights so large that the adapter's activations overflow


def adapter_copy(root, name: str, edit=None):
    """A copy of the first example adapter under ``name``, its tensors passed through edit."""
    out = shutil.copytree(EXAMPLE_ADAPTERS / ADAPTERS[0], root / name)
    if edit is not None:
        weights = out / "adapter_model.safetensors"
        tensors = load_file(weights)
        edit(tensors)
        save_file(tensors, weights)
    return out


def set_first_b(tensors, value):
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = value


def overflow(tensors):
    for k in tensors:
        if "lora_B" in k:
            tensors[k] = torch.full_like(tensors[k], 3e38)  # finite in float32; B·(A·x) is not


def victim_body(model: str) -> dict:
    return {
        "model": model,
        "messages": QUESTION,
        "max_tokens": VICTIM_TOKENS,
        "temperature": 0,
        "seed": VICTIM_SEED,
        "stream": True,
    }


class _Hold:
    def __init__(self):
        self.released = False

    def release(self):
        self.released = True

    def is_released(self):
        return self.released


def engine_holding_victims(settings):
    """The isolation app's engine (the flaky adapter load of tests/support/app_fixtures.py) that runs no
    step while a hold is up (hold_victims) and it holds only victims, each with a token: they wait
    for the hostile request to arrive (or the release), still running when it lands however slow
    the machine. Its thread keeps taking in requests meanwhile (a held step returns nothing)."""
    import ray

    engine = engine_with_flaky_adapter_load(settings)
    core, step = engine.core, engine.core.step

    def held() -> bool:
        seqs = list(core._seqs.values())
        if not seqs or any(s.params.seed != VICTIM_SEED or not s.output_ids for s in seqs):
            return False
        try:
            hold = ray.get_actor(_HOLD[0], namespace=_HOLD[1])
        except ValueError:  # no hold up: the victims run as any request
            return False
        return not ray.get(hold.is_released.remote())

    def step_or_hold():
        if held():
            time.sleep(0.01)
            return []
        return step()

    core.step = step_or_hold
    return engine


@contextmanager
def hold_victims():
    """Yields release(): until it is called the victims stop after their first token unless
    another request is in the engine (engine_holding_victims). Released on the way out too."""
    import ray

    actor = ray.remote(num_cpus=0)(_Hold).options(name=_HOLD[0], namespace=_HOLD[1]).remote()
    ray.get(actor.is_released.remote())  # up before the victims start
    try:
        yield lambda: ray.get(actor.release.remote())
    finally:
        ray.get(actor.release.remote())
        ray.kill(actor)


def read_stream(response: httpx.Response, on_token=None) -> tuple[str, dict | None]:
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


def victim(http, model: str, started: threading.Semaphore, finished: dict) -> str:
    with http.stream("POST", CHATS, json=victim_body(model)) as response:
        assert response.status_code == 200
        once = []
        text, error = read_stream(response, lambda: once or (once.append(1), started.release()))
    finished[model] = time.monotonic()
    assert error is None, error
    return text


def alongside_victims(http, hostile):
    """Run hostile() once all 4 victim streams are producing tokens; their texts and its result.
    The victims are held in the engine until hostile() has reached it or returned (hold_victims):
    they end after it was sent by construction, and the check below says so."""
    started, finished = threading.Semaphore(0), {}
    with hold_victims() as release, ThreadPoolExecutor(len(VICTIMS)) as pool:
        try:
            futures = {m: pool.submit(victim, http, m, started, finished) for m in VICTIMS}
            for _ in VICTIMS:
                assert started.acquire(timeout=120)
            sent = time.monotonic()
            result = hostile(http)
        finally:
            release()  # before the pool waits for the victims
        texts = {m: f.result() for m, f in futures.items()}
    assert all(t > sent for t in finished.values()), "a victim ended before the hostile request was sent"
    return texts, result


def completion(**fields):
    return {"model": BASE, "prompt": PROMPT, "max_tokens": 6, **fields}


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"]


_GREEDY: dict[str, str] = {}


def greedy_equal(http, **fields):
    """A request with these fields answers what the same greedy request answers."""

    def run(client):
        return text_of(client.post(COMPLETIONS, json=completion(**fields)))

    if not _GREEDY:
        _GREEDY["text"] = text_of(http.post(COMPLETIONS, json=completion(temperature=0)))
    return run, lambda got: got == _GREEDY["text"]


def client_error(status: int, *words):
    def check(response: httpx.Response) -> bool:
        error = response.json()["error"]
        assert response.status_code == status and set(error) == {"message", "type", "param", "code"}, response.text
        assert "\n" not in error["message"] and all(w in error["message"] for w in words), error
        return True

    return check


def post(path, **kwargs):
    return lambda client: client.post(path, **kwargs)


def stream_error(model: str, *words):
    def run(client):
        with client.stream("POST", COMPLETIONS, json=completion(model=model, stream=True)) as response:
            assert response.status_code == 200
            return read_stream(response)[1]

    def check(error) -> bool:
        assert error is not None and error["code"] == "engine_error", error
        assert all(w in error["message"] for w in words), error
        return True

    return run, check


def hostile_cases(http, dirs) -> dict:
    """id: (hostile(client) → result, check(result) → True)."""
    return {
        "temperature-1e-38": greedy_equal(http, temperature=1e-38, seed=1),
        "temperature-smallest-subnormal": greedy_equal(http, temperature=5e-324, seed=2),
        "top-p-1e-46": greedy_equal(http, top_p=1e-46, seed=3),
        "top-p-smallest-subnormal-hot": greedy_equal(http, top_p=5e-324, temperature=2.0, seed=4),
        "top-k-beyond-vocab": (
            lambda c: c.post(COMPLETIONS, json=completion(top_k=10**15, seed=5)),
            lambda r: r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1,
        ),
        "every-extreme-with-logprobs": (
            lambda c: c.post(
                COMPLETIONS,
                json=completion(
                    temperature=1e-300, top_p=1e-300, top_k=2**62, logprobs=20, seed=-(2**63), min_tokens=8
                ),
            ),
            lambda r: (
                r.status_code == 200 and all(v == v for v in r.json()["choices"][0]["logprobs"]["token_logprobs"])
            ),
        ),
        "nan-adapter": (
            post(ADMIN, json={"name": "nan", "path": str(dirs["nan"])}),
            client_error(400, "NaN", "lora_B"),
        ),
        "inf-adapter": (
            post(ADMIN, json={"name": "inf", "path": str(dirs["inf"])}),
            client_error(400, "Inf", "lora_B"),
        ),
        # accepted (its weights are finite) and answers garbage of its own; the others are untouched
        "overflowing-adapter": (
            stream_error(OVERFLOWING)[0],
            lambda error: error is None or error["code"] == "engine_error",
        ),
        "adapter-failing-to-load-mid-batch": stream_error(FLAKY_ADAPTER, "could not be loaded", FLAKY_ADAPTER),
        "adapter-without-config": (
            post(ADMIN, json={"name": "empty", "path": str(dirs["empty"])}),
            client_error(400, "adapter_roots"),
        ),  # the same answer as for no directory
        "path-of-10000-chars": (post(ADMIN, json={"name": "long", "path": "/" + "a" * 10000}), client_error(400)),
        "10000-stop-strings": (post(COMPLETIONS, json=completion(stop=["x"] * 10000)), client_error(400, "stop")),
        "10-mb-body": (
            post(
                CHATS,
                content=json.dumps(
                    {"model": BASE, "messages": [{"role": "user", "content": "a " * 5_000_000}]}
                ).encode(),
                headers={"content-type": "application/json"},
            ),
            client_error(413, "limit"),
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


def replica_idle() -> dict | None:
    s = replica_stats()
    return s if s["running"] == s["waiting"] == 0 and s["free_kv_blocks"] == s["total_kv_blocks"] else None
