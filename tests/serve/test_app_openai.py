"""The serving app over real HTTP with the official `openai` client: Ray Serve started
once for this module from serve_config.yaml's args (plus API keys), the default model
and every example adapter."""

import random
import threading

import pytest
from openai import BadRequestError, NotFoundError

from adapters_store.sources import local_adapters
from app.builder import build_app
from app.engine.factory import build_engine
from app.generate import EXAMPLE_ADAPTERS
from app.model.default import DEFAULT_MODEL_NAME as BASE
from app.protocol import GenerateRequest, SamplingParams
from app.serving.config import parse_args
from tests.support.app_fixtures import APP, config_args, example_adapter_names, replica_stats, serving
from tests.support.error_hygiene import checked_openai

ADAPTERS = example_adapter_names()
ALL_KEY, ADMIN_KEY = "sk-test-every-adapter", "sk-test-admin-key"
TENANT_KEY = "sk-test-one-tenant"  # may use the first adapter only
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12

pytestmark = pytest.mark.skipif(len(ADAPTERS) < 2, reason="needs the example adapters in examples/adapters/")


def _args(tmp_root) -> dict:
    keys = [{"key": ALL_KEY}, {"key": TENANT_KEY, "adapters": ADAPTERS[:1]}]
    return config_args(api_keys=keys, admin_key=ADMIN_KEY, adapter_roots=[str(EXAMPLE_ADAPTERS), str(tmp_root)])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving({APP: (build_app(_args(tmp_path_factory.getbasetemp())), "/")}) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return checked_openai(base_url=f"{server}/v1", api_key=ALL_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """The engine itself, in this process: what the server must answer for greedy requests."""
    settings = parse_args(_args(EXAMPLE_ADAPTERS), BASE)
    core = build_engine(None, settings.engine, local_adapters(EXAMPLE_ADAPTERS))
    tok = core.tokenizer
    chat_ids = tok(
        tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )["input_ids"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    requests = {
        (m, kind): GenerateRequest(f"{m}/{kind}", tuple(ids), params, None if m == BASE else m)
        for m in [BASE, *ADAPTERS]
        for kind, ids in [("text", tok(PROMPT)["input_ids"]), ("chat", chat_ids)]
    }
    for r in requests.values():  # one batch: rows of different adapters never mix (that's what SGMV guarantees)
        core.add(r)
    text = {r.request_id: "" for r in requests.values()}
    while core.has_work():
        for chunk in core.step():
            text[chunk.request_id] += chunk.text
    return {key: text[r.request_id] for key, r in requests.items()}


def test_models_lists_the_base_and_every_adapter(client):
    assert [m.id for m in client.models.list().data] == [BASE, *ADAPTERS]


@pytest.mark.parametrize("model", [BASE, *ADAPTERS])
def test_greedy_output_equals_the_engine(client, reference, model):
    common = dict(model=model, max_tokens=MAX_TOKENS, temperature=0)
    text = client.completions.create(prompt=PROMPT, **common)
    assert text.choices[0].text == reference[model, "text"]
    assert text.usage.completion_tokens <= MAX_TOKENS and text.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=PROMPT, stream=True, **common))
    assert streamed == reference[model, "text"]

    chat = client.chat.completions.create(messages=QUESTION, **common)
    assert chat.choices[0].message.content == reference[model, "chat"]
    assert chat.choices[0].message.role == "assistant" and chat.model == model
    chunks = list(
        client.chat.completions.create(messages=QUESTION, stream=True, stream_options={"include_usage": True}, **common)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference[model, "chat"]
    assert chunks[-1].usage.model_dump() == chat.usage.model_dump()  # the usage chunk comes last
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat.choices[0].finish_reason


def test_concurrent_requests_for_different_adapters_share_one_batch(client):
    models = [BASE, *ADAPTERS]
    started = threading.Barrier(len(models) + 1, timeout=120)
    texts = {}

    def stream(model):
        out = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True, extra_body={"min_tokens": 24}
        )  # no early stop: all stay running
        first = next(out)
        started.wait()
        texts[model] = first.choices[0].text + "".join(c.choices[0].text for c in out)

    threads = [threading.Thread(target=stream, args=(m,)) for m in models]
    for t in threads:
        t.start()
    started.wait()  # every request has its first token and none can have finished
    during = replica_stats()
    for t in threads:
        t.join(timeout=120)
    assert during["running"] == len(models), during
    assert replica_stats()["max_batch_seen"] >= len(models)
    assert len(texts) == len(models) and all(texts.values())


def test_logprobs(client):
    chat = client.chat.completions.create(
        model=ADAPTERS[0], messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the top token
    text = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == text.choices[0].text and lp.text_offset[0] == 0


def test_stop_seed_and_max_completion_tokens(client):
    full = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0).choices[0]
    word = full.text.split()[1]
    stopped = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[word])
    assert stopped.choices[0].finish_reason == "stop" and word not in stopped.choices[0].text
    assert full.text.startswith(stopped.choices[0].text)

    def sample(seed):
        return (
            client.completions.create(model=ADAPTERS[-1], prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)

    capped = client.chat.completions.create(
        model=BASE, messages=QUESTION, max_completion_tokens=3, extra_body={"min_tokens": 3}
    )
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"


def test_tenants_see_only_their_adapters(server):
    tenant = checked_openai(base_url=f"{server}/v1", api_key=TENANT_KEY, max_retries=0, timeout=60)
    assert [m.id for m in tenant.models.list().data] == [BASE, ADAPTERS[0]]
    for model in (BASE, ADAPTERS[0]):
        reply = tenant.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        assert reply.usage.completion_tokens >= 1
    bodies = []
    for model in (ADAPTERS[1], "no-such-adapter"):
        with pytest.raises(NotFoundError) as err:
            tenant.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
        bodies.append(err.value.body)
    assert bodies[0]["code"] == bodies[1]["code"] == "model_not_found"
    assert bodies[0]["message"].replace(ADAPTERS[1], "X") == bodies[1]["message"].replace("no-such-adapter", "X")


def test_a_key_is_required(server):
    import httpx

    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer sk-wrong-key-0000"}, {"Authorization": "Basic abc"}):
        for r in (
            httpx.post(f"{server}/v1/completions", json=body, headers=headers),
            httpx.get(f"{server}/v1/models", headers=headers),
        ):
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/health").status_code == 200  # health needs no key


def test_admin_registers_lists_and_unregisters_adapters(server, client, tmp_path):
    import shutil

    import httpx

    from tests.support.error_hygiene import checked_client

    admin = checked_client(base_url=f"{server}/v1", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    for key, status in ((TENANT_KEY, 403), (ALL_KEY, 403), (None, 401)):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx.get(f"{server}/v1/adapters", headers=headers).status_code == status
    assert [a["name"] for a in admin.get("/adapters").json()["data"]] == ADAPTERS

    copy = shutil.copytree(EXAMPLE_ADAPTERS / ADAPTERS[0], tmp_path / "copy")
    registered = admin.post("/adapters", json={"name": "copy", "path": str(copy)})
    assert registered.status_code == 200, registered.text
    assert "copy" in [m.id for m in client.models.list().data]
    same = [
        client.completions.create(model=m, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
        for m in (ADAPTERS[0], "copy")
    ]
    assert same[0] == same[1]  # same weights under a new name, loaded on demand

    for bad, code in (
        ({"name": "x", "path": str(tmp_path)}, "invalid_adapter"),  # no adapter files there
        ({"name": "x", "path": "relative/dir"}, "invalid_adapter"),
        ({"name": "../x", "path": str(copy)}, "invalid_value"),
        ({"name": BASE, "path": str(copy)}, "invalid_request_error"),
    ):
        r = admin.post("/adapters", json=bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text

    assert admin.delete("/adapters/copy").json() == {"name": "copy", "deleted": True}
    assert admin.delete("/adapters/copy").status_code == 404
    with pytest.raises(NotFoundError):
        client.completions.create(model="copy", prompt=PROMPT, max_tokens=2)
    client.completions.create(model=ADAPTERS[0], prompt=PROMPT, max_tokens=2)  # the replica syncs the removal
    assert "copy" not in replica_stats()["adapters"]


def test_n_choices_with_a_seed_equal_their_seeds_alone(client):
    """n=4 through the official client: four choices, each the request alone with seed + index; the
    prompt's full KV blocks computed once (the engine's token count); streamed chat choices interleave
    by index and reassemble to the whole answer; best_of returns the best of the same choices."""
    rng = random.Random(11)  # the same prompt and seed every run: a failure reproduces
    prompt = " ".join(
        rng.choice(["river", "stone", "quiet", "lamp", "north", "bread", "glass", "wind"]) for _ in range(60)
    )  # fresh: no cached prefix
    seed, common = rng.getrandbits(62), dict(model=ADAPTERS[0], max_tokens=8, temperature=0.8)
    before = replica_stats()["tokens_computed"]
    many = client.completions.create(prompt=prompt, n=4, seed=seed, logprobs=0, **common)
    computed = replica_stats()["tokens_computed"] - before
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(prompt=prompt, seed=seed + i, **common) for i in range(4)]
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone]
    prompt_tokens, completions = many.usage.prompt_tokens, [len(c.logprobs.tokens) for c in many.choices]
    assert many.usage.completion_tokens == sum(completions) == sum(a.usage.completion_tokens for a in alone)
    tail = prompt_tokens - (prompt_tokens - 1) // 16 * 16  # what each forked choice computes of the prompt
    assert computed == prompt_tokens + 3 * tail + sum(c - 1 for c in completions)

    best = client.completions.create(prompt=prompt, n=2, best_of=4, seed=seed, **common)
    ranked = sorted(many.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] and best.choices[0].logprobs is None
    with pytest.raises(BadRequestError, match="cannot be streamed"):
        client.completions.create(prompt=prompt, n=1, best_of=2, stream=True, **common)

    chat = client.chat.completions.create(messages=QUESTION, n=3, seed=seed, **common)
    chunks = list(
        client.chat.completions.create(
            messages=QUESTION, n=3, seed=seed, stream=True, stream_options={"include_usage": True}, **common
        )
    )
    texts, ends = ["", "", ""], []
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            ends += [choice.index] if choice.finish_reason else []
    assert texts == [c.message.content for c in chat.choices] and sorted(ends) == [0, 1, 2]
    assert chunks[-1].usage.model_dump() == chat.usage.model_dump()


def test_vllm_adapter_routes(server, client):
    """vLLM's load/unload routes, as a vLLM gateway calls them: the admin key, plain-text answers,
    the admin API's path checks and errors."""
    import httpx

    from tests.support.error_hygiene import checked_client

    admin = checked_client(base_url=f"{server}/v1", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    body = {"lora_name": "vllm-copy", "lora_path": str(EXAMPLE_ADAPTERS / ADAPTERS[0])}
    assert (
        httpx.post(
            f"{server}/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {ALL_KEY}"}
        ).status_code
        == 403
    )
    loaded = admin.post("/load_lora_adapter", json=body)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'vllm-copy' added successfully."
    assert client.completions.create(model="vllm-copy", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
    assert admin.post("/load_lora_adapter", json=body).status_code == 400  # loaded: only load_inplace replaces
    assert admin.post("/load_lora_adapter", json={**body, "load_inplace": True}).status_code == 200
    outside = admin.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"})
    assert outside.status_code == 400 and outside.json()["error"]["code"] == "invalid_adapter"
    unloaded = admin.post("/unload_lora_adapter", json={"lora_name": "vllm-copy"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'vllm-copy' removed successfully."
    assert admin.post("/unload_lora_adapter", json={"lora_name": "vllm-copy"}).status_code == 404
