"""Tool-call parsers (app/openai/tool_calls/parse.py, scan.py, markers.py) on CPU: each family's format
with random calls (random argument values, key orders, layouts) parses back to those calls,
fed whole or in pieces cut at random places; the streamed deltas follow OpenAI's protocol and
reassemble to exactly the non-streamed answer; text that is not a call stays content, unchanged."""

import json
import random
import shutil

import pytest

from app.openai.tool_calls.markers import MarkerText, dropped_markers
from app.openai.tool_calls.parse import FORMATS, CallStream, constrained_format

NAMES = ["get_weather", "add", "search_web"]
TOOLS = frozenset(NAMES)
FORMAT_NAMES = ["hermes", "llama3_json", "mistral", "json"]
TRICKY = [
    '"',
    "\\",
    "}",
    "{",
    "]",
    "[",
    ";",
    ",",
    ":",
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "é",
    "€",
    "\n",
    "\t",
    "\u2028",
    "😀",
]


def _fmt(name):
    return constrained_format(FORMATS["hermes"]) if name == "json" else FORMATS[name]


def _value(rng, depth=0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-(10**6), 10**6)
    if kind == 1:
        return "".join(rng.choice(TRICKY + list("abc xyz")) for _ in range(rng.randrange(8)))
    if kind == 2:
        return rng.choice([True, False, None, 1.5, -0.25, 1e-7])
    if kind == 3:
        return rng.random()
    if kind in (4, 5):
        return {f"k{i}{rng.choice(TRICKY)}": _value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def _calls(rng):
    return [
        (rng.choice(NAMES), {f"p{i}": _value(rng) for i in range(rng.randrange(4))}) for _ in range(rng.randint(1, 3))
    ]


def _dumps(rng, obj):
    return json.dumps(
        obj,
        indent=rng.choice([None, None, 2]),
        ensure_ascii=rng.random() < 0.5,
        separators=rng.choice([None, (",", ":")]),
    )


def _call_object(rng, fmt, name, args):
    pairs = [("name", name), (fmt.args_key, args)]
    if fmt.name != "json" and rng.random() < 0.25:  # some models put the arguments first
        pairs.reverse()
    return _dumps(rng, dict(pairs))


def _render(rng, fmt, calls, prefix=""):
    objects = [_call_object(rng, fmt, n, a) for n, a in calls]
    if fmt.name == "hermes":
        body = "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects)
        return f"{prefix}\n{body}" if prefix else body
    if fmt.name == "llama3_json":
        return rng.choice(["", "<|python_tag|>", " "]) + "; ".join(objects)
    if fmt.name == "mistral":
        return f"{prefix}[TOOL_CALLS]" + rng.choice(["", " "]) + "[" + ", ".join(objects) + "]"
    return "[" + ",".join(objects) + "]"


def _pieces(rng, text):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 40)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def parse(fmt, pieces, max_calls=None):
    """(content, [(name, arguments)], deltas) of the output fed in ``pieces``."""
    stream = CallStream(fmt, TOOLS, max_calls)
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(d.content for d in deltas), [(c.name, c.arguments) for c in stream.calls], deltas


def _reassemble(deltas):
    """What an OpenAI client builds from the stream: calls by index, arguments concatenated."""
    calls = []
    for d in deltas:
        for c in d.calls:
            if c.id is not None:
                assert c.index == len(calls), "a call's first delta comes in index order"
                calls.append([c.name, ""])
            else:
                assert c.index == len(calls) - 1 and c.name is None, "fragments follow their call's first delta"
            calls[c.index][1] += c.arguments
    return [tuple(c) for c in calls]


@pytest.mark.parametrize("format_name", FORMAT_NAMES)
def test_random_calls_parse_back_whole_and_streamed(format_name):
    rng, fmt = random.Random(f"calls-{format_name}"), _fmt(format_name)
    for _ in range(150):
        calls = _calls(rng)
        prefix = rng.choice(["", "Let me check that.", "Sure: "]) if format_name in ("hermes", "mistral") else ""
        text = _render(rng, fmt, calls, prefix)
        content, parsed, _ = parse(fmt, [text])
        assert content == prefix.rstrip(), text
        assert [(n, json.loads(a)) for n, a in parsed] == calls, text
        for _ in range(3):
            s_content, s_parsed, deltas = parse(fmt, _pieces(rng, text))
            assert (s_content, s_parsed) == (content, parsed), text
            assert _reassemble(deltas) == parsed


@pytest.mark.parametrize("format_name", ["hermes", "llama3_json", "mistral"])
def test_text_without_calls_is_content_unchanged(format_name):
    rng, fmt = random.Random(f"text-{format_name}"), _fmt(format_name)
    alphabet = list("abc xyz.!?\n\t\"'<>|[]_é") + ["<tool", "[TOOL", "<|python", "</tool_call>"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60)))
        if format_name == "llama3_json" and text.lstrip().startswith(("{", "<|python_tag|>")):
            continue
        for pieces in ([text], _pieces(rng, text)):
            assert parse(fmt, pieces)[:2] == (text, []), repr(text)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',  # not one of the request's tools
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call> and more',  # no name
        "<tool_call> not json </tool_call>",
        'Intro\n<tool_call>\n{"name": "ad',  # cut off before the name is known
    ],
)
def test_what_is_not_a_call_of_the_tools_stays_content(text):
    rng = random.Random(text)
    for pieces in ([text], _pieces(rng, text), _pieces(rng, text)):
        content, calls, _ = parse(FORMATS["hermes"], pieces)
        assert calls == [] and content == text


def test_llama3_json_objects_that_are_not_calls_are_content():
    for text in ['{"name": "Bob", "age": 3}', '  {"answer": 42}', '{"name": 7}']:
        assert parse(FORMATS["llama3_json"], [text])[:2] == (text, [])


def test_cut_off_call_keeps_what_arrived():
    """max_tokens ended the output inside the arguments: the call and its partial arguments stay
    (finish_reason "length" tells the client), streamed or not."""
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b'
    for pieces in ([text], list(text)):
        assert parse(FORMATS["hermes"], pieces)[:2] == ("", [("add", '{"a": 1, "b')])


def test_string_encoded_and_missing_arguments():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{"name": "search_web"}</tool_call>'
    for pieces in ([text], list(text)):
        assert parse(FORMATS["hermes"], pieces)[:2] == ("", [("add", '{"a": 1}'), ("search_web", "")])


def test_one_call_when_parallel_calls_are_off():
    text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert parse(FORMATS["hermes"], [text], max_calls=1)[:2] == ("", [("add", '{"a": 1}')])


def test_first_delta_announces_the_call_before_its_arguments_stream():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _, _, deltas = parse(FORMATS["hermes"], list(text))
    calls = [c for d in deltas for c in d.calls]
    assert (calls[0].id, calls[0].name, calls[0].arguments) == (calls[0].id, "get_weather", "")
    assert calls[0].id.startswith("call_") and all(c.id is None for c in calls[1:])
    assert "".join(c.arguments for c in calls) == '{"city": "Paris"}' and len(calls) > 5


def test_mistral_ids_fit_its_template():
    _, _, deltas = parse(FORMATS["mistral"], ['[TOOL_CALLS][{"name": "add", "arguments": {}}]'])
    call_id = deltas[0].calls[0].id
    assert len(call_id) == 9 and call_id.isalnum()


@pytest.fixture(scope="module")
def marker_tokenizer(tmp_path_factory):
    """The SmolLM2 tokenizer with Mistral's and Llama 3's markers added as special tokens."""
    from app.engine.factory import load_tokenizer
    from app.model.default import default_model_dir

    path = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)
    tok = load_tokenizer(path)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "<|python_tag|>"]})
    return tok


def test_dropped_markers_are_found(marker_tokenizer):
    tok = marker_tokenizer
    assert set(dropped_markers(tok, ("[TOOL_CALLS]", "<tool_call>")).values()) == {"[TOOL_CALLS]"}


@pytest.mark.parametrize("format_name", ["mistral", "llama3_json"])
def test_special_marker_tokens_are_put_back(marker_tokenizer, format_name):
    """The engine streams text without special tokens; the parser still sees the marker, at its place."""
    tok, fmt, rng = marker_tokenizer, FORMATS[format_name], random.Random(format_name)
    markers = dropped_markers(tok, fmt.markers)
    for _ in range(40):
        calls = _calls(rng)
        prefix = "Calling: " if format_name == "mistral" else ""
        text = _render(rng, fmt, calls, prefix)
        text = text if fmt.open in text else fmt.open + text
        if any(m in json.dumps(calls, ensure_ascii=False) for m in ("[TOOL_CALLS]", "<|python_tag|>")):
            continue  # a special token inside an argument: an engine drops it from the text (not a marker)
        ids = tok.encode(text, add_special_tokens=False)
        cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, 12)))
        restore, stream, sent, deltas = MarkerText(tok, markers), CallStream(fmt, TOOLS), "", []
        for a, b in zip([0] + cuts, cuts + [len(ids)]):  # chunks as the engine sends them
            engine_text = tok.decode(ids[:b], skip_special_tokens=True)
            engine_text = engine_text if b == len(ids) else engine_text.rstrip("\ufffd")  # held: a split character
            deltas.append(stream.feed(restore(ids[a:b], engine_text[len(sent) :], final=b == len(ids))))
            sent = engine_text
        deltas.append(stream.finish())
        assert "".join(d.content for d in deltas) == prefix.rstrip()
        assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == calls
