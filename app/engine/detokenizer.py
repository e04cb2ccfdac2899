"""Incremental detokenization with stop strings that may span token boundaries.

Text is released only when it can no longer turn out to be part of a stop
string (the last ``len(longest stop) - 1`` characters are held back) nor an
incomplete UTF-8 character.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...], resumed_ids: list[int], sent: int | None = None):
        """sent: characters of the resumed tokens' text the client already has (None: all;
        fewer when text held back for a stop string had not been released before a migration)."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = len(self._decode(resumed_ids)) if sent is None else sent

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, output_ids: list[int], check_stop: bool) -> tuple[str, bool]:
        """New text to stream, and whether a stop string ended the output (text cut before it)."""
        text = self._decode(output_ids)
        if check_stop:
            hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
            if hits:
                return self._release(text, min(hits)), True
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        return self._release(text, safe), False

    def flush(self, output_ids: list[int]) -> str:
        return self._release(self._decode(output_ids), None)

    def _release(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta
