"""Structured output over real HTTP with the official `openai` client, on Ray Serve (one deployment
of two apps for the module): the tiny random chat model (SmolLM2's real tokenizer) with a random
adapter for the 50 random schemas, each answered streamed and not, on the base model and the adapter,
every answer parsed and validated with jsonschema; guided_json / guided_regex / guided_choice; bad
guides → 400 in OpenAI's error shape before any token. The real SmolLM2-135M answers json_object
(a random model under json_object writes endless keys: its strings are unbounded)."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from app.builder import build_app
from app.model.default import DEFAULT_MODEL_NAME
from benchmarks.random_schemas import random_schemas
from tests.support.app_fixtures import config_args, serving
from tests.support.cluster_fixtures import make_tiny_chat_llama
from tests.support.error_hygiene import checked_openai
from tests.support.helpers import make_random_adapter

ASK = [{"role": "user", "content": "Fill in this record as JSON."}]
MAX_TOKENS = 200
BASE = "model"  # the tiny checkpoint directory's name: the base model's id


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-serve")
    model = make_tiny_chat_llama(root / "model")
    make_random_adapter(model, root / "adapters" / "ad", rank=4, targets=["q_proj", "v_proj", "down_proj"], seed=3)
    tiny = config_args(
        model=str(model),
        adapter_dirs=[str(root / "adapters")],
        max_batch_size=32,
        max_loras=2,
        max_lora_rank=8,
        max_model_len=256,
    )
    real = config_args(adapter_dirs=[], max_batch_size=4)
    with serving({"tiny": (build_app(tiny), "/tiny"), "real": (build_app(real), "/real")}, num_cpus=8) as url:
        yield url


@pytest.fixture(scope="module")
def tiny(server):
    return checked_openai(base_url=f"{server}/tiny/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def real(server):
    return checked_openai(base_url=f"{server}/real/v1", api_key="none", max_retries=0, timeout=300)


def _answer(client, stream: bool, **kw) -> tuple[str, str]:
    """(content, finish_reason) of a chat completion, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(stream=False, **kw).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_fifty_random_schemas_streamed_and_not_on_the_base_model_and_an_adapter(tiny):
    schemas = random_schemas(50, seed=0)

    def ask(job):
        i, stream = job
        fmt = {"type": "json_schema", "json_schema": {"name": f"record_{i}", "schema": schemas[i], "strict": True}}
        guide = {"extra_body": {"guided_json": schemas[i]}} if i % 5 == 0 else {"response_format": fmt}  # vLLM's field
        return _answer(
            tiny,
            stream,
            model="ad" if i % 2 else BASE,
            messages=ASK,
            temperature=1.0,
            seed=i,
            max_completion_tokens=MAX_TOKENS,
            **guide,
        )

    jobs = [(i, stream) for i in range(len(schemas)) for stream in (False, True)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, jobs))
    for (i, stream), (text, reason) in zip(jobs, answers):
        assert reason == "stop", (i, stream, reason, text)
        jsonschema.validate(json.loads(text), schemas[i])


def test_guided_regex_and_choice_on_both_endpoints(tiny):
    pattern, choices = r"[A-Z][a-z]{2,6}-[0-9]{2,4}", ["alpha", "beta", "gamma delta"]
    for stream in (False, True):
        text, reason = _answer(
            tiny,
            stream,
            model="ad",
            messages=ASK,
            seed=1,
            max_completion_tokens=MAX_TOKENS,
            extra_body={"guided_regex": pattern},
        )
        assert reason == "stop" and re.fullmatch(pattern, text), text
        text, reason = _answer(
            tiny,
            stream,
            model=BASE,
            messages=ASK,
            seed=2,
            max_completion_tokens=MAX_TOKENS,
            extra_body={"guided_choice": choices},
        )
        assert reason == "stop" and text in choices, text
    done = tiny.completions.create(
        model="ad", prompt="Pick:", max_tokens=MAX_TOKENS, seed=3, extra_body={"guided_choice": choices}
    )
    assert done.choices[0].text in choices and done.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in tiny.completions.create(
            model=BASE, prompt="Code:", max_tokens=MAX_TOKENS, seed=4, stream=True, extra_body={"guided_regex": pattern}
        )
    )
    assert re.fullmatch(pattern, streamed), streamed


@pytest.mark.parametrize(
    "body, named",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
            "strng",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "uniqueItems",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
        ({"extra_body": {"guided_regex": "[a-z"}}, "invalid regex"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        ({"extra_body": {"guided_grammar": "start: x"}}, "guided_grammar is not supported"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "at most one"),
    ],
)
def test_a_bad_guide_is_a_400_in_openai_shape_before_any_token(tiny, body, named):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            _answer(tiny, stream, model=BASE, messages=ASK, max_completion_tokens=4, **body)
        error = caught.value.body if "message" in caught.value.body else caught.value.body["error"]
        assert caught.value.status_code == 400 and error["type"] == "invalid_request_error", error
        assert named in error["message"] and "\n" not in error["message"], error["message"]


def test_json_object_on_the_real_model_streamed_and_not(real):
    ask = [{"role": "user", "content": "Describe a cat as a JSON object."}]
    for stream in (False, True):
        text, reason = _answer(
            real,
            stream,
            model=DEFAULT_MODEL_NAME,
            messages=ask,
            temperature=0,
            max_completion_tokens=MAX_TOKENS,
            response_format={"type": "json_object"},
        )
        assert reason == "stop" and isinstance(json.loads(text), dict) and json.loads(text), text
    done = real.completions.create(
        model=DEFAULT_MODEL_NAME,
        prompt="A cat, as JSON:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert done.choices[0].finish_reason == "stop" and isinstance(json.loads(done.choices[0].text), dict)
