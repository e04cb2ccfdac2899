"""The clients people use, against the shipped app as `serve run serve_config.yaml` starts it (the
embedded SmolLM2-135M-Instruct with its tools template and the hermes parser; issue 47), on one
app start for the module: LangChain's `bind_tools` with a forced tool and `with_structured_output`
by both methods, instructor's TOOLS and JSON_SCHEMA modes, the `openai` client's
`responses.create` (plain, streamed, json_schema, a function tool round trip through
previous_response_id), `echo` + `logprobs` equal HF's prompt logprobs, /tokenize and /detokenize,
and the Responses API's bad input refused in one line."""

import json

import httpx
import instructor
import jsonschema
import pytest
import torch
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import BadRequestError
from pydantic import BaseModel, Field

from app.builder import app_from_args
from app.model.default import DEFAULT_MODEL_NAME as BASE
from tests.support.app_fixtures import config_args, serving
from tests.support.error_hygiene import checked_openai
from tests.support.helpers import _hf_model

ASK = [{"role": "user", "content": "Make up a person: a name and an age."}]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def server():
    with serving({"loraplex": (app_from_args(config_args(max_batch_size=4)), "/")}) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return checked_openai(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)


def _chat_model(server, **kw):
    return ChatOpenAI(model=BASE, base_url=f"{server}/v1", api_key="none", temperature=0, max_retries=0, **kw)


# -- LangChain ------------------------------------------------------------------------------------
def test_langchain_bind_tools_with_a_forced_tool(server):
    message = _chat_model(server, max_tokens=48).bind_tools([add], tool_choice="add").invoke("What is 2 plus 3?")
    assert [c["name"] for c in message.tool_calls] == ["add"]
    assert all(isinstance(message.tool_calls[0]["args"][k], int) for k in ("a", "b"))


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(server, method):
    person = _chat_model(server, max_tokens=48).with_structured_output(Person, method=method).invoke(ASK)
    assert isinstance(person, Person)


# -- instructor -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_modes(client, mode):
    patched = instructor.from_openai(client, mode=mode)
    person = patched.chat.completions.create(
        model=BASE, messages=ASK, response_model=Person, temperature=0, max_tokens=48, max_retries=0
    )
    assert isinstance(person, Person)


# -- the Responses API ----------------------------------------------------------------------------
def test_responses_plain_and_streamed(client):
    plain = client.responses.create(model=BASE, input="Say hello.", max_output_tokens=12, temperature=0)
    assert plain.status in ("completed", "incomplete") and plain.output_text
    assert plain.usage.output_tokens <= 12
    kinds, numbers, deltas, final = [], [], "", None
    for event in client.responses.create(
        model=BASE, input="Say hello.", instructions="Be brief.", max_output_tokens=12, temperature=0, stream=True
    ):
        kinds.append(event.type)
        numbers.append(event.sequence_number)
        deltas += event.delta if event.type == "response.output_text.delta" else ""
        final = event.response if event.type in ("response.completed", "response.incomplete") else final
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert numbers == list(range(len(numbers))) and deltas and deltas == final.output_text


def test_responses_json_schema(client):
    schema = Person.model_json_schema()
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    answer = client.responses.create(model=BASE, input=ASK, text={"format": fmt}, max_output_tokens=48, temperature=0)
    jsonschema.validate(json.loads(answer.output_text), schema)


def test_responses_function_tool_round_trip(client):
    tools = [
        {
            "type": "function",
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        }
    ]
    first = client.responses.create(
        model=BASE, input="What is 2 plus 3?", tools=tools, tool_choice="required", max_output_tokens=48, temperature=0
    )
    call = next(item for item in first.output if item.type == "function_call")
    arguments = json.loads(call.arguments)  # the grammar holds them to the parameters
    assert call.name == "add" and set(arguments) == {"a", "b"} and all(isinstance(v, int) for v in arguments.values())
    second = client.responses.create(
        model=BASE,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
        tools=tools,
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    assert second.output[0].type == "message"
    # the earlier turn and its call were rendered before the output
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).id == second.id
    unstored = client.responses.create(model=BASE, input="Hi.", store=False, max_output_tokens=2)
    with pytest.raises(BadRequestError, match="not stored"):
        client.responses.create(model=BASE, input="Hi.", previous_response_id=unstored.id, max_output_tokens=2)


def test_responses_bad_input_is_a_one_line_400(server):
    for body, words in (
        ({"model": BASE, "input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"model": BASE, "input": "x", "background": True}, "background"),
        ({"model": BASE, "input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ):
        answer = httpx.post(f"{server}/v1/responses", json=body, timeout=60)
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert words in message and "\n" not in message


# -- prompt logprobs, tokens --------------------------------------------------------------------------
def test_echo_logprobs_equal_hf(client, server, default_model_dir):
    prompt = "The capital of France is Paris. The capital of Italy is"
    answer = client.completions.create(model=BASE, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0)
    choice = answer.choices[0]
    ids = httpx.post(f"{server}/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        logits = _hf_model(default_model_dir, None)(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < 1e-4
        assert len(lp.top_logprobs[p]) == 2
    assert lp.text_offset[0] == 0 and lp.text_offset[len(ids)] == len(prompt)


def test_tokenize_and_detokenize(client, server):
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] > 0
    text = httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello there"
    chat = httpx.post(f"{server}/tokenize", json={"messages": ASK}).json()
    answer = client.chat.completions.create(model=BASE, messages=ASK, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens
    bad = httpx.post(f"{server}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]


# -- lm-evaluation-harness ----------------------------------------------------------------------------
CAPITALS = [
    ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
    ("Egypt", "Cairo"), ("Russia", "Moscow"), ("China", "Beijing"), ("England", "London"), ("Greece", "Athens"),
    ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Poland", "Warsaw"),
    ("Canada", "Ottawa"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Cuba", "Havana"), ("Sweden", "Stockholm"),
]  # fmt: skip
TASK = """task: loraplex_capitals
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "The capital of {{{{country}}}} is"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow
def test_lm_eval_loglikelihood_task(server, default_model_dir, tmp_path, monkeypatch):
    """lm-evaluation-harness's `local-completions` (echo + logprobs) on a 20-question task file of its
    own format, offline: each answer against a wrong one, scored by the server's prompt logprobs
    (20 s against the served app here; lm_eval is not in the test extras: skipped without it)."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "capitals.jsonl"
    data.write_text(
        "".join(
            json.dumps({"country": c, "choices": [a, "banana"] if i % 2 else ["banana", a], "answer": i % 2 ^ 1}) + "\n"
            for i, (c, a) in enumerate(CAPITALS)
        )
    )
    (tmp_path / "capitals.yaml").write_text(TASK.format(data=data))
    args = f"model={BASE},base_url={server}/v1/completions,tokenizer_backend=huggingface,tokenizer={default_model_dir}"
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=args + ",num_concurrent=1,max_retries=1",
        tasks=["loraplex_capitals"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),  # indexing its own: +70 s
    )
    scores = results["results"]["loraplex_capitals"]
    assert results["n-samples"]["loraplex_capitals"]["effective"] == len(CAPITALS)
    assert scores["acc,none"] >= 0.75  # the capital over "banana": a working scorer, not chance
