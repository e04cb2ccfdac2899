"""`POST /tokenize` and `POST /detokenize` with vLLM's bodies, for gateways that count tokens:
a prompt, or chat messages rendered by the served chat template (as /v1/chat/completions
renders them), to token ids; token ids back to text."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from app.errors import InvalidRequestError
from app.openai import chat_template
from app.openai.requests import Message, Tool
from app.openai.sampling import StrictBody


class TokenizeRequest(StrictBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message exclude each other")
        chat_template.check_kwargs(self.chat_template_kwargs)
        return self


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def tokenize(tokenizer, body: TokenizeRequest, max_model_len: int) -> dict:
    if body.prompt is not None:
        ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens is not False)["input_ids"]
    else:
        text = chat_template.render(
            tokenizer,
            [m.for_template() for m in body.messages],
            [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            body.chat_template_kwargs or {},
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        )
        ids = tokenizer(text, add_special_tokens=bool(body.add_special_tokens))["input_ids"]
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(tokenizer, body: DetokenizeRequest, vocab_size: int) -> dict:
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return {"prompt": tokenizer.decode(body.tokens)}
