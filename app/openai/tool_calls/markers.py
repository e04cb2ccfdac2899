"""Marker tokens put back into the streamed text.

The engine's detokenizer skips special tokens, and some families' call markers are special
tokens (Mistral's `[TOOL_CALLS]`, Llama 3's `<|python_tag|>`, `<tool_call>` in some Hermes
tokenizers), so their text never reaches the parser. The chunks still carry the token ids: a
marker token at output position k goes back at the character position where the text of the
output's first k tokens ends. Decoding a prefix costs one tokenizer call per marker (a few per
answer); text the detokenizer held back is accounted for, since positions are absolute.
"""

from __future__ import annotations


def dropped_markers(tokenizer, markers: tuple[str, ...]) -> dict[int, str]:
    """{token id: marker} for the markers that are single tokens the detokenizer drops."""
    out = {}
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "" and tokenizer.decode(ids) == marker:
            out[ids[0]] = marker
    return out


class MarkerText:
    """Feed each chunk's (token ids, text); get the text with dropped markers restored."""

    def __init__(self, tokenizer, markers: dict[int, str]):
        self.tokenizer, self.markers = tokenizer, markers
        self.ids: list[int] = []
        self.chars = 0  # characters of engine text seen so far
        self.waiting: list[tuple[int, str]] = []  # (absolute position, marker) not yet reached

    def __call__(self, token_ids, text: str, final: bool = False) -> str:
        """final: the output's last chunk (a marker not placed yet goes at its end)."""
        if not self.markers:
            return text
        for i, token in enumerate(token_ids):
            if token in self.markers:
                prefix = self.tokenizer.decode(self.ids + list(token_ids[:i]), skip_special_tokens=True)
                self.waiting.append((len(prefix), self.markers[token]))
        self.ids += token_ids
        out, cut = [], 0
        while self.waiting and (final or self.waiting[0][0] <= self.chars + len(text)):
            position, marker = self.waiting.pop(0)
            at = min(max(position - self.chars, cut), len(text))
            out += [text[cut:at], marker]
            cut = at
        out.append(text[cut:])
        self.chars += len(text)
        return "".join(out)
