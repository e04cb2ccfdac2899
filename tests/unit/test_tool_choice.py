"""Tool calling's request side and response shapes, without Serve (CPU, seconds): request
validation, which models may take tools (a template that renders them) and how their output
is parsed, the JSON schema that `required` / named choices are constrained to (valid calls
pass, invalid ones fail, and both grammar engines compile it), template rendering of tools and
tool messages, and the chat responses and stream chunks (validated as the `openai` client's
types) carrying the same calls whether streamed or not."""

import dataclasses
import json
import random
import shutil

import jsonschema
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from app.engine.factory import load_tokenizer
from app.errors import InvalidRequestError
from app.model.default import default_model_dir
from app.openai.http_errors import RequestValidationError, parse_json
from app.openai.requests import ChatCompletionRequest
from app.openai.responses import Formatter, Output
from app.openai.tool_calls.choice import ToolSupport, calls_schema, renders_tools, select_format
from app.protocol import Guide, SamplingParams, TokenChunk
from tests.support.tool_fixtures import ADD, HERMES_TEMPLATE, TOOLS, WEATHER

USER = [{"role": "user", "content": "Weather in Paris, and 2+3?"}]
NAMED = {"type": "function", "function": {"name": "add"}}


def _body(**fields) -> ChatCompletionRequest:
    return parse_json(json.dumps({"model": "m", "messages": USER, **fields}).encode(), ChatCompletionRequest)


@pytest.fixture(scope="module")
def tools_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)
    (path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def support(tools_tokenizer):
    return ToolSupport.of(tools_tokenizer, "llama", "auto")


# -- request validation ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, says",
    [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not in tools"),
        (dict(tool_choice="required"), "tool_choice needs tools"),
        (dict(tools=[]), "at least 1"),
        (dict(tools=[ADD, ADD]), "unique"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "pattern"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(functions=[ADD["function"]]), "use tools"),
        (dict(messages=[{"role": "tool", "content": "5"}]), "tool_call_id"),
        (dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "only assistant"),
    ],
)
def test_bad_tool_requests_are_refused_by_name(fields, says):
    with pytest.raises(RequestValidationError) as err:
        _body(**fields)
    assert says in str(err.value.errors())


def test_tool_choice_defaults_as_openai():
    assert _body().choice() == "none" and _body(tools=TOOLS).choice() == "auto"
    assert _body(tools=TOOLS, tool_choice=NAMED).choice() == NAMED


# -- which models, which parser ---------------------------------------------------------------
def test_default_model_template_does_not_render_tools():
    """SmolLM2's template never reads `tools`: tools and tool messages are refused, plain chat is not."""
    support = ToolSupport.of(load_tokenizer(default_model_dir()), "llama", "auto")
    assert not support.renders_tools
    for tools, messages in ((TOOLS, False), (None, True)):
        with pytest.raises(InvalidRequestError, match="does not render `tools`"):
            support.plan(tools, "auto", True, messages)
    assert support.plan(None, "none", True, False) is None


def test_parser_from_template_markers_else_family():
    assert renders_tools(HERMES_TEMPLATE) and not renders_tools("{{ messages[0].content }} tools")
    assert select_format("auto", HERMES_TEMPLATE, "llama").name == "hermes"
    assert select_format("auto", "{{ '[AVAILABLE_TOOLS][TOOL_CALLS]' }}", "mistral").name == "mistral"
    assert select_format("auto", "<|start_header_id|>{{ tools }}", "llama").name == "llama3_json"
    assert select_format("auto", "{{ tools }}", "qwen2").name == "hermes"
    assert select_format("auto", "{{ tools }}", "gemma3_text") is None
    assert select_format("mistral", HERMES_TEMPLATE, "llama").name == "mistral"


def test_auto_without_a_parser_is_refused_but_constrained_choices_work(support):
    bare = ToolSupport(True, None, ())
    with pytest.raises(InvalidRequestError, match="tool_parser"):
        bare.plan(TOOLS, "auto", True, False)
    assert bare.plan(TOOLS, "required", True, False).schema is not None


def test_plans(support):
    assert support.plan(TOOLS, "none", True, False) is None
    auto = support.plan(TOOLS, "auto", False, False)
    assert (auto.format.name, auto.schema, auto.max_calls, auto.tools) == ("hermes", None, 1, {"add", "get_weather"})
    named = support.plan(TOOLS, NAMED, True, False)
    assert named.tools == {"add"} and json.loads(named.schema)["maxItems"] == 1
    # property order is generation order (llguidance, xgrammar): the name must come before the arguments
    assert named.schema.index('"name"') < named.schema.index('"arguments"')
    assert auto.constrain(SamplingParams()) == SamplingParams()
    assert named.constrain(SamplingParams()).guide == Guide("json_schema", named.schema)
    with pytest.raises(InvalidRequestError, match="response_format"):
        named.constrain(SamplingParams(guide=Guide("json_object", "{}")))


# -- the constrained output's schema ------------------------------------------------------------
def _valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_required_schema_accepts_exactly_valid_calls():
    schema = calls_schema(TOOLS, "arguments", None)
    jsonschema.Draft202012Validator.check_schema(schema)
    rng = random.Random(0)
    for _ in range(100):
        calls = [
            rng.choice(
                [
                    {"name": "add", "arguments": {"a": rng.randint(-1000, 1000), "b": rng.randint(-1000, 1000)}},
                    {
                        "name": "get_weather",
                        "arguments": {
                            "city": "Paris"[: rng.randint(1, 5)],
                            "unit": rng.choice(["celsius", "fahrenheit"]),
                        },
                    },
                ]
            )
            for _ in range(rng.randint(1, 3))
        ]
        assert _valid(schema, calls)
    for bad in (
        [],
        [{"name": "add", "arguments": {"a": 1}}],
        [{"name": "mul", "arguments": {"a": 1, "b": 2}}],
        [{"name": "add", "arguments": {"a": 1, "b": 2}, "x": 1}],
        [{"name": "get_weather", "arguments": {"a": 1, "b": 2}}],
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        [{"name": "add", "parameters": {"a": 1, "b": 2}}],
    ):
        assert not _valid(schema, bad), bad


def test_named_and_single_call_schemas():
    schema = calls_schema([WEATHER], "parameters", 1)
    one = {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}
    assert _valid(schema, [one]) and not _valid(schema, [one, one])
    no_params = calls_schema([{"type": "function", "function": {"name": "ping"}}], "arguments", None)
    assert _valid(no_params, [{"name": "ping", "arguments": {}}])
    assert not _valid(no_params, [{"name": "ping", "arguments": {"x": 1}}])


def test_parameter_defs_are_hoisted_per_tool():
    def tool(name, inner):
        return {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {
                    "type": "object",
                    "properties": {"v": {"$ref": "#/$defs/V"}},
                    "required": ["v"],
                    "$defs": {"V": inner},
                },
            },
        }

    schema = calls_schema([tool("f", {"type": "integer"}), tool("g", {"type": "string"})], "arguments", None)
    assert _valid(schema, [{"name": "f", "arguments": {"v": 1}}, {"name": "g", "arguments": {"v": "s"}}])
    assert not _valid(schema, [{"name": "f", "arguments": {"v": "s"}}])
    with pytest.raises(InvalidRequestError, match="#/properties/a"):
        calls_schema([tool("h", {"$ref": "#/properties/a"})], "arguments", None)


def test_the_grammar_engine_compiles_the_schema_and_accepts_a_call(tools_tokenizer):
    """llguidance, the engine app/engine/grammar.py uses, takes the calls schema."""
    import llguidance
    import llguidance.hf

    text = json.dumps(calls_schema(TOOLS, "arguments", None))
    ids = tools_tokenizer.encode('[{"name": "add", "arguments": {"a": 2, "b": 3}}]', add_special_tokens=False)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
    guided = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tools_tokenizer), grammar)
    assert guided.consume_tokens(ids) and guided.is_accepting(), guided.get_error()


# -- rendering ------------------------------------------------------------------------------------
def test_template_renders_tools_calls_and_results(tools_tokenizer):
    messages = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    body = _body(messages=messages, tools=TOOLS)
    text = tools_tokenizer.apply_chat_template(
        body.chat(), tools=body.template_tools(), add_generation_prompt=True, tokenize=False
    )
    assert json.dumps(TOOLS[0]) in text and json.dumps(TOOLS[1]) in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


# -- responses --------------------------------------------------------------------------------------
def _chunks(tok, text, rng, finish="stop"):
    """TokenChunks of ``text`` as the engine sends them (a few tokens each)."""
    ids = tok.encode(text, add_special_tokens=False)
    cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randrange(1, 20))))
    out, sent = [], ""
    for a, b in zip([0] + cuts, cuts + [len(ids)]):
        now = tok.decode(ids[:b])
        now = now if b == len(ids) else now.rstrip("\ufffd")
        out.append(TokenChunk("r", tuple(ids[a:b]), now[len(sent) :], None, finish if b == len(ids) else None, 9, b))
        sent = now
    return out


def _stream(chunks):
    """The streamed message, reassembled as a client does."""
    content, calls, finish = "", [], None
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
        choice = c["choices"][0]
        content += choice["delta"].get("content") or ""
        for d in choice["delta"].get("tool_calls", []):
            if "id" in d:
                calls.append(
                    {"id": d["id"], "type": d["type"], "function": {"name": d["function"]["name"], "arguments": ""}}
                )
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content or None, calls, finish


@pytest.mark.parametrize(
    "choice, text, finish",
    [
        (
            "auto",
            'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
            "tool_calls",
        ),
        ("auto", "Paris is sunny, and 2+3 is 5.", "stop"),
        (
            "required",
            '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
            '{"name": "add", "arguments": {"a": 2, "b": 3}}]',
            "tool_calls",
        ),
        (NAMED, '[{"name": "add", "arguments": {"a": 2, "b": 3}}]', "tool_calls"),
    ],
)
def test_streamed_and_whole_answers_carry_the_same_calls(support, tools_tokenizer, choice, text, finish):
    rng = random.Random(text)
    plan = support.plan(TOOLS, choice, True, False)
    whole, out = Formatter("id", "m", tools_tokenizer, True, False, tools=[plan.parser(tools_tokenizer)]), Output()
    for c in _chunks(tools_tokenizer, text, rng):
        out.add(c)
    response = ChatCompletion.model_validate(whole.response([out])).model_dump()
    message = response["choices"][0]["message"]
    assert response["choices"][0]["finish_reason"] == finish
    for _ in range(3):
        streamed = Formatter("id", "m", tools_tokenizer, True, False, tools=[plan.parser(tools_tokenizer)])
        content, calls, stream_finish = _stream(
            streamed.first_chunks() + [streamed.chunk(c) for c in _chunks(tools_tokenizer, text, rng)]
        )
        assert (content, stream_finish) == (message["content"], finish)
        strip = [{**c, "id": None} for c in calls]
        assert strip == [{**c, "id": None} for c in message["tool_calls"] or []]
    if finish == "tool_calls":
        assert message["content"] in (None, "Sure.")
        for call in message["tool_calls"]:
            tool = next(t for t in TOOLS if t["function"]["name"] == call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    else:
        assert message["content"] == text and message["tool_calls"] is None


@pytest.mark.parametrize(
    "second, second_finish",
    [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
            "tool_calls",
        ),
        ("It is sunny in Paris.", "stop"),
    ],
)
def test_each_of_n_choices_parses_its_own_calls(support, tools_tokenizer, second, second_finish):
    """n = 2: each choice's text goes to its own parser, whole or streamed with the choices interleaved."""
    rng = random.Random(second)
    plan = support.plan(TOOLS, "auto", True, False)
    texts = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', second]
    per_choice = [
        [dataclasses.replace(c, index=i) for c in _chunks(tools_tokenizer, t, rng)] for i, t in enumerate(texts)
    ]
    whole, outs = (
        Formatter("id", "m", tools_tokenizer, True, False, n=2, tools=_parsers(plan, tools_tokenizer)),
        [Output(), Output()],
    )
    for i, chunks in enumerate(per_choice):
        for c in chunks:
            outs[i].add(c)
    choices = ChatCompletion.model_validate(whole.response(outs)).model_dump()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["finish_reason"] for c in choices] == ["tool_calls", second_finish]
    first_calls = choices[0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first_calls] == [
        ("add", {"a": 2, "b": 3})
    ]
    if second_finish == "tool_calls":
        assert [c["function"]["name"] for c in choices[1]["message"]["tool_calls"]] == ["get_weather"]
    else:
        assert (choices[1]["message"]["content"], choices[1]["message"]["tool_calls"]) == (second, None)
    streamed = Formatter("id", "m", tools_tokenizer, True, False, n=2, tools=_parsers(plan, tools_tokenizer))
    events = streamed.first_chunks() + [streamed.chunk(c) for c in _interleaved(per_choice, rng)]
    for i, choice in enumerate(choices):
        content, calls, finish = _stream([e for e in events if e["choices"][0]["index"] == i])
        assert (content, finish) == (choice["message"]["content"], choice["finish_reason"])
        assert [{**c, "id": None} for c in calls] == [{**c, "id": None} for c in choice["message"]["tool_calls"] or []]


def _parsers(plan, tok):
    return [plan.parser(tok) for _ in range(2)]


def _interleaved(streams, rng):
    """The chunks of several choices in one random order that keeps each choice's own order."""
    queues = [list(s) for s in streams]
    out = []
    while any(queues):
        out.append(rng.choice([q for q in queues if q]).pop(0))
    return out
