"""Tool calling through the serving app with the official `openai` client (issue 36): a tiny
random Llama whose chat template renders tools (tests/support/tool_fixtures.py), base model and an
adapter, streamed and not. `required` and named choices return tool_calls whose arguments
validate against the tool's schema (the grammar engine holds the output to the calls schema);
streamed deltas reassemble to the same calls; `none` (and `auto`, when the random model writes no
call) answers exactly what the model generates from the prompt with the tools rendered; the
calls go back into the conversation with the tools' results; n sampled choices carry their own
calls, each what that choice's seed answers alone."""

import json

import jsonschema
import pytest
from openai import BadRequestError

from app.builder import app_from_args
from app.engine.factory import load_tokenizer
from tests.support.app_fixtures import config_args, serving
from tests.support.error_hygiene import checked_openai
from tests.support.helpers import make_random_adapter
from tests.support.tool_fixtures import TOOLS, make_tiny_tool_llama

MODEL, ADAPTER = "tiny-tools", "tool-adapter"
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what is 2+3?"}]
NAMED = {"type": "function", "function": {"name": "add"}}
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_tool_llama(tmp_path_factory.mktemp("tools") / "model")


@pytest.fixture(scope="module")
def server(model_dir):
    adapters = model_dir.parent / "adapters"
    make_random_adapter(model_dir, adapters / ADAPTER, rank=4, targets=["q_proj", "v_proj", "down_proj"])
    args = config_args(
        model=str(model_dir),
        model_name=MODEL,
        dtype="float64",
        max_model_len=1024,
        adapter_dirs=[str(adapters)],
        adapter_roots=None,
        max_loras=2,
        max_lora_rank=8,
    )
    with serving({"tools": (app_from_args(args), "/")}) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return checked_openai(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(client, model, stream, **fields):
    """(message content, [(name, arguments)], finish_reason): the whole answer, or the stream reassembled."""
    request = dict(model=model, messages=QUESTION, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0.0, **fields)
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.message.content, calls, choice.finish_reason
    content, calls, ids, finish = "", [], [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            if d.id is not None:  # a call's first delta: id, type and name
                assert d.index == len(calls) and d.type == "function" and d.function.name
                calls.append([d.function.name, ""])
                ids.append(d.id)
            calls[d.index][1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert len(set(ids)) == len(ids)
    return content or None, [tuple(c) for c in calls], finish


def _check_calls(calls, names):
    assert calls, "no tool call"
    for name, arguments in calls:
        assert name in names
        schema = next(t for t in TOOLS if t["function"]["name"] == name)["function"]["parameters"]
        jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize("model", [MODEL, ADAPTER])
def test_required_and_named_choices_call_tools_with_valid_arguments(client, model):
    for choice, names in (("required", {"add", "get_weather"}), (NAMED, {"add"})):
        whole = _ask(client, model, False, tool_choice=choice)
        content, calls, finish = whole
        assert content is None and finish == "tool_calls", whole
        _check_calls(calls, names)
        if choice == NAMED:
            assert len(calls) == 1
        assert _ask(client, model, True, tool_choice=choice) == whole  # greedy: the stream is the same answer


def _raw_text(client, model_dir, model, **fields):
    """What the model writes for the chat prompt with the tools rendered (by /v1/completions on its ids)."""
    tok = load_tokenizer(model_dir)
    ids = tok(
        tok.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    return (
        client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0.0, **fields)
        .choices[0]
        .text
    )


@pytest.mark.parametrize("stream", [False, True])
def test_none_and_auto_answer_what_the_model_writes(client, model_dir, stream):
    text = _raw_text(client, model_dir, MODEL)
    assert "<tool_call>" not in text  # a random model: no call to parse, so content is the text itself
    for choice in ("none", "auto"):
        content, calls, finish = _ask(client, MODEL, stream, tool_choice=choice)
        assert (content, calls, finish) == (text, [], "length")


def test_a_conversation_carries_calls_and_results(client):
    """Turn 1 calls the tools; turn 2 sends the assistant's calls and the tools' results back."""
    first = (
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS, temperature=0.0
        )
        .choices[0]
        .message
    )
    results = [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in first.tool_calls]
    messages = QUESTION + [first.model_dump(exclude_none=True)] + results
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0.0
    ).choices[0]
    assert second.message.tool_calls is None and second.finish_reason == "length" and second.message.content


@pytest.mark.parametrize(
    "fields, says",
    [
        (dict(tool_choice={"type": "function", "function": {"name": "mul"}}), "not in tools"),
        (
            dict(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/x"}}}],
                tool_choice="required",
            ),
            "#/x",
        ),
    ],
)
def test_bad_tool_requests_are_400s(client, fields, says):
    with pytest.raises(BadRequestError, match=says):
        client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, "tools": TOOLS, **fields})


def test_n_sampled_choices_each_carry_their_own_calls(client):
    """n = 2 under `required`, sampled: each choice's calls are parsed on their own and valid, the
    interleaved stream reassembles per choice to the whole answer, and choice j is what the same
    request alone with seed + j answers."""
    request = dict(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=1234,
    )
    whole = client.chat.completions.create(n=2, **request).choices
    assert [c.index for c in whole] == [0, 1]
    answers = [_calls_of(c) for c in whole]
    for content, calls, finish in answers:
        assert content is None and finish == "tool_calls"
        _check_calls(calls, {"add", "get_weather"})
    streamed = {0: ["", [], None], 1: ["", [], None]}
    for chunk in client.chat.completions.create(n=2, stream=True, **request):
        choice = chunk.choices[0]
        content, calls, _ = streamed[choice.index]
        streamed[choice.index][0] = content + (choice.delta.content or "")
        for d in choice.delta.tool_calls or ():
            if d.id is not None:
                calls.append([d.function.name, ""])
            calls[d.index][1] += d.function.arguments or ""
        streamed[choice.index][2] = choice.finish_reason or streamed[choice.index][2]
    assert [(c or None, [tuple(x) for x in calls], f) for c, calls, f in streamed.values()] == answers
    for j in range(2):
        alone = client.chat.completions.create(**{**request, "seed": 1234 + j}).choices[0]
        assert _calls_of(alone) == answers[j]


def _calls_of(choice):
    return (
        choice.message.content,
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()],
        choice.finish_reason,
    )
