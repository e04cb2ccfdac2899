"""`serve run app.builder:build_app key=value …`: Ray's builder arguments, typed as YAML types them.

Ray hands a builder every command-line argument as a string ({"max_batch_size": "8"}), which the
strict validation of AppArgs (app/serving/config_schema.py) refuses. Each value is therefore read as
the YAML value it would be in serve_config.yaml's `args:`, by the field it sets: a field that
takes text keeps it as text (`null` is None where the field allows it); any other field reads it
as YAML (`8`, `0.9`, `true`, `auto`, `[a, b]`, `{num_replicas: 2}`); a list field also takes
comma-separated items (`adapter_dirs=a,b`). A dotted key sets a nested field
(`cluster.router=power_of_two`, `replica.autoscaling_config.max_replicas=4`). Validation is then the YAML's, with
its messages.

Only an all-text dict is read this way: that is what Ray's CLI passes. A dict from a YAML file
holds numbers, lists or mappings beside any text, and stays as strict as it is.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

_NULLS = ("null", "Null", "NULL", "~", "")


def is_cli(raw: dict | None) -> bool:
    """Whether ``raw`` looks like Ray's `key=value` arguments: every value is text."""
    return bool(raw) and all(isinstance(v, str) for v in raw.values())


def typed_args(raw: dict | None, model: type[BaseModel]) -> dict | None:
    """``raw`` with each `key=value` argument typed as its YAML value for ``model``'s field."""
    if not is_cli(raw):
        return raw
    out: dict[str, Any] = {}
    for key, text in raw.items():
        *parents, name = key.split(".")
        target, fields = out, model.model_fields
        for part in parents:
            target = target.setdefault(part, {})
            sub = _submodel(fields.get(part)) if fields is not None else None
            fields = sub.model_fields if sub is not None else None  # None: a free-form mapping
        target[name] = _yaml(text) if fields is None else _typed(text, fields.get(name))
    return out


def _yaml(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # validation says what the field wanted


def _leaves(annotation) -> list:
    """The plain types a field annotation admits (unions and Annotated unwrapped)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _leaves(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [leaf for arg in typing.get_args(annotation) for leaf in _leaves(arg)]
    return [annotation]


def _submodel(field: FieldInfo | None) -> type[BaseModel] | None:
    for leaf in _leaves(field.annotation) if field is not None else ():
        if isinstance(leaf, type) and issubclass(leaf, BaseModel):
            return leaf
    return None


def _typed(text: str, field: FieldInfo | None):
    if field is None:  # unknown key: validation names it, with the value YAML would show
        return _yaml(text)
    leaves = _leaves(field.annotation)
    if str in leaves:
        return None if type(None) in leaves and text in _NULLS else text
    value = _yaml(text)
    takes_list = any(typing.get_origin(leaf) is list for leaf in leaves)
    if takes_list and isinstance(value, str | int | float):
        return [item.strip() for item in text.split(",") if item.strip()]
    if isinstance(value, str) and any(typing.get_origin(leaf) is Literal for leaf in leaves):
        return text  # a Literal's text as typed (YAML would read `on`/`off` too as text here)
    return value
