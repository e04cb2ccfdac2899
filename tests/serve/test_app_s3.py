"""Adapters from S3 served through the HTTP app: a real S3 protocol server on 127.0.0.1
(moto), Ray Serve started for real, the official `openai` client. An adapter registered
from S3 answers exactly what the same adapter answers from its local directory, and a
re-uploaded adapter is served with its new weights once re-registered, never the stale ones."""

import os

import pytest

from app.builder import build_app
from app.generate import EXAMPLE_ADAPTERS
from app.model.default import DEFAULT_MODEL_NAME as BASE
from tests.support.app_fixtures import APP, config_args, example_adapter_names, serving
from tests.support.error_hygiene import checked_client, checked_openai

pytest_plugins = ["tests.support.s3_fixtures"]

ADAPTERS = example_adapter_names()
BUCKET = "tenant-adapters"
PROMPTS = ["The capital of France is", "Tell me about the sea."]
MAX_TOKENS = 16

pytestmark = pytest.mark.skipif(len(ADAPTERS) < 2, reason="needs the example adapters in examples/adapters/")


def _upload(s3, local_name: str, key_prefix: str) -> str:
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        s3.client.upload_file(str(EXAMPLE_ADAPTERS / local_name / f), BUCKET, f"{key_prefix}/{f}")
    return f"s3://{BUCKET}/{key_prefix}/"


@pytest.fixture(scope="module")
def server(s3):
    s3.bucket(BUCKET)
    aws = (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_DEFAULT_REGION",
        "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
    )
    env = {"AWS_ENDPOINT_URL": s3.endpoint, **{k: os.environ[k] for k in aws}}  # the replicas' boto3 → moto
    with serving({APP: (build_app(config_args()), "/")}, env=env) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return checked_openai(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def admin(server):
    return checked_client(base_url=f"{server}/v1", timeout=120)  # every error body checked for leaks


def _answers(client, model: str) -> list[str]:
    return [
        client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
        for p in PROMPTS
    ]


def test_adapters_from_s3_answer_as_from_a_local_directory(s3, client, admin):
    base = _answers(client, BASE)
    for name in ADAPTERS:
        r = admin.post("/adapters", json={"name": f"s3-{name}", "path": _upload(s3, name, f"prod/{name}")})
        assert r.status_code == 200, r.text
    for name in ADAPTERS:
        local = _answers(client, name)
        assert local != base  # the adapter changes the output, so equality below means something
        assert _answers(client, f"s3-{name}") == local


def test_a_reuploaded_adapter_is_served_with_its_new_weights(s3, client, admin):
    first, second = ADAPTERS[0], ADAPTERS[1]
    expected = {n: _answers(client, n) for n in (first, second)}
    assert expected[first] != expected[second]
    uri = _upload(s3, first, "mutable/tenant")
    assert admin.post("/adapters", json={"name": "tenant", "path": uri}).status_code == 200
    assert _answers(client, "tenant") == expected[first]
    _upload(s3, second, "mutable/tenant")  # same name, new weights
    r = admin.post("/adapters", json={"name": "tenant", "path": uri})
    assert r.status_code == 200, r.text
    assert _answers(client, "tenant") == expected[second]
    assert _answers(client, "tenant") == expected[second]  # again: no stale copy comes back from any tier


def test_a_missing_s3_adapter_is_a_clear_error(client, admin):
    r = admin.post("/adapters", json={"name": "ghost", "path": f"s3://{BUCKET}/nothing/here/"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter", r.text
    assert "ghost" not in [m.id for m in client.models.list().data]
