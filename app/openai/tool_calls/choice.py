"""What a request's `tools` and `tool_choice` mean for the served model.

Per model (`ToolSupport`, once per ingress): whether its chat template renders tools at all,
and which call format its output uses (`tool_parser` in the app args; "auto": from markers in
the template, else from the family). Per request (`ToolPlan`): how the output is parsed, and
for `required` or a named function the JSON schema the grammar engine holds the output to: an
array of `{"name": <one of the tools>, "<args key>": <that tool's parameters>}` objects in the
family's own key (vLLM constrains these choices the same way, whatever the model).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from app.errors import InvalidRequestError
from app.openai.tool_calls.markers import MarkerText, dropped_markers
from app.openai.tool_calls.parse import FORMATS, CallStream, Delta, Format, constrained_format
from app.protocol import Guide, SamplingParams

_FAMILY_FORMATS = {"qwen2": "hermes", "qwen3": "hermes", "mistral": "mistral"}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted
_DEFS = ("$defs", "definitions")


def renders_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (the caller's input, as jinja sees it)."""
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateSyntaxError:  # an extension tag we do not load: fall back to the word
        return re.search(r"\btools\b", template) is not None


def select_format(setting: str, template: str, model_type: str) -> Format | None:
    """The family's call format: as configured, else from the template's markers, else the family's."""
    if setting != "auto":
        return FORMATS[setting]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return FORMATS["llama3_json"]
    name = _FAMILY_FORMATS.get(model_type)
    return FORMATS[name] if name else None


class OutputParser:
    """One answer's text (and token ids, for markers the detokenizer drops) → content and calls."""

    def __init__(self, calls: CallStream, markers: MarkerText):
        self.stream, self.markers = calls, markers

    def feed(self, token_ids, text: str, final: bool) -> Delta:
        delta = self.stream.feed(self.markers(token_ids, text, final))
        if final:
            done = self.stream.finish()
            delta.content += done.content
            for call in done.calls:
                delta.add_arguments(call.index, call.arguments)
        return delta

    @property
    def calls(self):
        return self.stream.calls


@dataclass(frozen=True)
class ToolPlan:
    format: Format
    tools: frozenset[str]
    max_calls: int | None  # 1 with parallel_tool_calls false
    schema: str | None  # required / named: the JSON schema (as text) the output is constrained to
    markers: tuple[tuple[int, str], ...]

    def parser(self, tokenizer) -> OutputParser:
        return OutputParser(
            CallStream(self.format, self.tools, self.max_calls), MarkerText(tokenizer, dict(self.markers))
        )

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """The request's sampling with the calls schema as its guide (required / named choices)."""
        if self.schema is None:
            return params
        if params.guide is not None:
            raise InvalidRequestError(
                'response_format cannot be combined with tool_choice "required" or a named '
                "function: both constrain the output"
            )
        return dataclasses.replace(params, guide=Guide("json_schema", self.schema))


@dataclass(frozen=True)
class ToolSupport:
    renders_tools: bool
    format: Format | None
    markers: tuple[tuple[int, str], ...]  # the format's markers that the detokenizer drops

    @classmethod
    def of(cls, tokenizer, model_type: str, setting: str) -> ToolSupport:
        template = tokenizer.get_chat_template(tools=[]) if tokenizer.chat_template else ""
        fmt = select_format(setting, template, model_type)
        markers = dropped_markers(tokenizer, fmt.markers) if fmt else {}
        return cls(bool(template) and renders_tools(template), fmt, tuple(markers.items()))

    def plan(
        self, tools: list[dict] | None, choice: str | dict, parallel: bool, tool_messages: bool
    ) -> ToolPlan | None:
        """None: a plain answer. Raises InvalidRequestError for what this model cannot do."""
        if (tools or tool_messages) and not self.renders_tools:
            raise InvalidRequestError(
                "tools are not supported by this model: its chat template does not render `tools` "
                "(a tools-aware template is needed; see docs/tool_calling.md)"
            )
        if not tools or choice == "none":
            return None
        max_calls = None if parallel else 1
        if choice == "auto":
            if self.format is None:
                raise InvalidRequestError(
                    'tool_choice "auto" needs a tool-call parser, and none fits this model\'s chat template: '
                    "set tool_parser (hermes, llama3_json, mistral) in the app args, or use tool_choice "
                    '"required" or a named function'
                )
            return ToolPlan(self.format, _names(tools), max_calls, None, self.markers)
        chosen = (
            tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
        )
        fmt = constrained_format(self.format)
        schema = calls_schema(chosen, fmt.args_key, 1 if choice != "required" else max_calls)
        # Keys keep their order (not sorted): property order is generation order for the grammar engines,
        # so `name` comes before the arguments, and a tool's parameters in the order its author gave.
        return ToolPlan(fmt, _names(chosen), max_calls, json.dumps(schema, separators=(",", ":")), ())


def _names(tools: list[dict]) -> frozenset[str]:
    return frozenset(t["function"]["name"] for t in tools)


def calls_schema(tools: list[dict], args_key: str, max_items: int | None) -> dict:
    """A JSON array of one or more calls of ``tools``, each with arguments valid for its schema.
    Key order is the generation order: name first, so a stream announces a call before its arguments."""
    defs, variants = {}, []
    for tool in tools:
        function = tool["function"]
        parameters, own_defs = _hoist(function.get("parameters") or NO_PARAMETERS, function["name"])
        defs.update(own_defs)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [function["name"]]}, args_key: parameters},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema = {"type": "array", "items": variants[0] if len(variants) == 1 else {"anyOf": variants}, "minItems": 1}
    if max_items is not None:
        schema["maxItems"] = max_items
    if defs:
        schema["$defs"] = defs
    return schema


def _hoist(parameters: dict, name: str) -> tuple[dict, dict]:
    """The parameters without their `$defs` (moved to the root, renamed `<tool>__<def>`, refs rewritten),
    since they are nested in the calls schema. Other local refs would point elsewhere: refused."""
    parameters = copy.deepcopy(parameters)
    defs = {}
    for key in _DEFS:
        defs.update({f"{name}__{k}": v for k, v in (parameters.pop(key, None) or {}).items()})
    return _rewrite(parameters, name), _rewrite(defs, name)


def _rewrite(node, name: str):
    if isinstance(node, dict):
        return {k: _ref(v, name) if k == "$ref" else _rewrite(v, name) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite(v, name) for v in node]
    return node


def _ref(ref, name: str):
    if not isinstance(ref, str) or not ref.startswith("#"):
        return ref
    for key in _DEFS:
        if ref.startswith(f"#/{key}/"):
            return f"#/$defs/{name}__{ref[len(key) + 3 :]}"
    raise InvalidRequestError(f"tool {name!r}: parameters may only reference their own #/$defs/..., not {ref!r}")
