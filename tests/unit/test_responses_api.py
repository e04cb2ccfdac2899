"""The Responses API without a server: bodies (what is refused by name, how items become a chat
request), a ResponseRun's events and whole response validated as the `openai` client's types
(text then a parsed hermes call; a cut-off answer `incomplete`), the store's bound and owners,
and echo's legacy logprobs shape."""

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from app.errors import InvalidRequestError
from app.openai.responses import Formatter, Output
from app.openai.responses_api import ResponseRun, ResponseStore
from app.openai.responses_models import ResponsesRequest
from app.openai.tool_calls.choice import ToolSupport
from app.protocol import TokenChunk

TOOL = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
EVENTS = TypeAdapter(ResponseStreamEvent)


class Tokens:
    """A tokenizer stand-in: token i is the character chr(i)."""

    chat_template = "{{ tools }}<tool_call>"

    def get_chat_template(self, tools=None):
        return self.chat_template

    def decode(self, ids, **_):
        return "".join(map(chr, ids))

    def encode(self, text, **_):
        return list(map(ord, text))


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "input_image"}]}, "input"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(extra, words):
    with pytest.raises(ValidationError, match=words):
        ResponsesRequest.model_validate({"model": "m", "input": "x", **extra})


def test_items_become_one_chat_request():
    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "2+3?"}]},
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
                {"type": "function_call_output", "call_id": "c1", "output": "5"},
            ],
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "add"},
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "integer"}}},
            "max_output_tokens": 7,
        }
    )
    chat = body.to_chat([{"role": "user", "content": "earlier"}])
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "user", "assistant", "tool"]
    assert chat["messages"][3]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "integer"}
    assert chat["max_completion_tokens"] == 7 and chat["tools"][0]["function"]["name"] == "add"


def _run(texts, finish="stop"):
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [TOOL]})
    plan = ToolSupport.of(Tokens(), "llama", "hermes").plan(body.to_chat([])["tools"], "auto", True, False)
    store = ResponseStore(capacity=2)
    run = ResponseRun(body, plan.parser(Tokens()), [{"role": "user", "content": "hi"}], store, "me")
    events = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        events += run.add(TokenChunk("r", tuple(map(ord, text)), text, None, finish if last else None, 3, i + 1))
    return run, events, store


def test_events_and_response_are_the_clients_types():
    run, events, store = _run(["Sure. <tool_", 'call>\n{"name": "add", ', '"arguments": {"a": 1}}\n</tool_call>'])
    kinds = [EVENTS.validate_python(json.loads(json.dumps(e))).type for e in events]
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert events[0]["item"]["content"] == []  # as it was when added, not as it grew
    response = Response.model_validate(run.finished())
    assert response.output_text == "Sure." and response.output[1].arguments == '{"a": 1}'
    assert response.status == "completed" and response.usage.total_tokens == 6
    conversation = store.get("me", response.id)[1]
    assert conversation[-1]["tool_calls"][0]["function"]["name"] == "add"
    with pytest.raises(InvalidRequestError, match="not stored"):
        store.get("someone else", response.id)


def test_a_cut_answer_is_incomplete_and_the_store_is_bounded():
    run, _, store = _run(["Hello"], finish="length")
    first = Response.model_validate(run.finished())
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    for _ in range(2):
        _run(["x"])[0].finished()
    later = [_run(["x"])[0] for _ in range(2)]
    for run in later:
        run.store = store
        run.finished()
    with pytest.raises(InvalidRequestError, match="retention"):
        store.get("me", first.id)


def test_echo_puts_the_prompt_and_its_logprobs_first():
    class Body:
        echo, prompt = True, "ab"

    fmt = Formatter("cmpl-1", "m", Tokens(), chat=False, want_logprobs=True)
    fmt.echo(Body(), [ord("a"), ord("b")])
    out = Output()
    prompt_lp = (None, {"token_id": ord("b"), "logprob": -1.0, "top": [(ord("c"), -0.5)]})
    out.add(
        TokenChunk(
            "r", (ord("c"),), "c", ({"token_id": ord("c"), "logprob": -0.5, "top": []},), "length", 2, 1, 0, prompt_lp
        )
    )
    choice = fmt.response([out])["choices"][0]
    assert choice["text"] == "abc"
    assert choice["logprobs"] == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [None, -1.0, -0.5],
        "top_logprobs": [None, {"c": -0.5}, {}],
        "text_offset": [0, 1, 2],
    }
