"""The `chat_template` app arg (a file, the project's shipped one, or inline Jinja; a syntax error
stops start-up) and the rendering of a request: `chat_template_kwargs` reach the template, the
names the ingress sets are refused, a template that fails to render is a one-line 400. The shipped
SmolLM2 tools template renders plain chat exactly as SmolLM2's own and renders tools."""

import pytest
from transformers import AutoTokenizer

from app.errors import InvalidRequestError
from app.openai import chat_template
from app.openai.requests import ChatCompletionRequest
from app.openai.tool_calls.choice import ToolSupport
from app.serving.config import ConfigError, parse_args

SHIPPED = "app/openai/templates/smollm2_tools.jinja"
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def test_the_arg_is_a_file_the_shipped_one_or_jinja(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert parse_args({"chat_template": str(path)}, "m").chat_template == "{{ messages[0].content }}"
    assert "<tool_call>" in parse_args({"chat_template": SHIPPED}, "m").chat_template
    assert parse_args({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}, "m").chat_template
    assert parse_args({}, "m").chat_template is None
    with pytest.raises(ConfigError, match="no file"):
        parse_args({"chat_template": "missing.jinja"}, "m")
    with pytest.raises(ConfigError, match="chat_template"):
        parse_args({"chat_template": "{% for m in messages %}"}, "m")


def test_shipped_template_renders_chat_as_smollm2_and_renders_tools(tokenizer):
    own = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = parse_args({"chat_template": SHIPPED}, "m").chat_template
    assert chat_template.render(tokenizer, CHAT, None, {}) == own
    assert '"name": "add"' in chat_template.render(tokenizer, CHAT, TOOLS, {})
    support = ToolSupport.of(tokenizer, "llama", "hermes")
    assert support.renders_tools and support.plan(TOOLS, "required", True, False).schema is not None


def test_kwargs_reach_the_template_and_failures_are_one_line_400s(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = "{{ greeting }} {{ messages[0].content }}{{ messages[0].nope.deeper }}"
    with pytest.raises(InvalidRequestError, match="failed to render") as failed:
        chat_template.render(tokenizer, CHAT, None, {"greeting": "hello"})
    assert "\n" not in str(failed.value)
    tokenizer.chat_template = "{{ greeting }} {{ messages[0].content }}"
    assert chat_template.render(tokenizer, CHAT, None, {"greeting": "hello"}) == "hello hi"
    body = {"model": "m", "messages": CHAT}
    with pytest.raises(ValueError, match="may not set tools"):
        ChatCompletionRequest.model_validate({**body, "chat_template_kwargs": {"tools": []}})
    with pytest.raises(ValueError, match="per-request chat_template"):
        ChatCompletionRequest.model_validate({**body, "chat_template": "{{ x }}"})
