"""Rendering a conversation with the served chat template: the checkpoint's own, or the app's
`chat_template` arg (app/serving/config.py resolves it to text), with the request's
`chat_template_kwargs` (vLLM's field: extra variables for the template, e.g. `enable_thinking`).

A template that fails on a request's messages or kwargs (its own `raise_exception`, an undefined
attribute, a type error in an expression) is the request's 400, in one line; the ingress never
answers a render failure with a 500."""

from __future__ import annotations

from typing import Any

from app.errors import InvalidRequestError

# Variables the ingress itself passes, or apply_chat_template's own arguments: a request may not set them.
RESERVED_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "chat_template",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
    }
)


def check_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The request's template variables; a name the ingress sets itself is refused by name."""
    kwargs = kwargs or {}
    taken = sorted(RESERVED_KWARGS & kwargs.keys())
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}")
    return kwargs


def render(tokenizer, messages: list[dict], tools: list[dict] | None, kwargs: dict[str, Any], **options) -> str:
    """The prompt text for the generation (add_generation_prompt, unless `options` say otherwise:
    /tokenize passes its own), as transformers renders it."""
    if not tokenizer.chat_template:
        raise InvalidRequestError("this model has no chat template: use /v1/completions or set chat_template")
    options = {"add_generation_prompt": True, **options}
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **options, **kwargs)
    except Exception as exc:  # the template's own checks (raise_exception), undefined names, bad values
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise InvalidRequestError(f"the chat template failed to render the request: {reason}") from None
