"""Incremental detokenization with stop strings that may span token boundaries.

Text is released only when it can no longer turn out to be part of a stop
string (the last ``len(longest stop) - 1`` characters are held back) nor an
incomplete UTF-8 character.

Each token decodes only a short window, not the whole output (which made every token
cost O(output length) on the engine thread): the window starts at an earlier commit
boundary (so the first new token decodes in context, e.g. a SentencePiece word's leading
space), and the new text is what it decodes to beyond its context's text (the offsets
scheme of vLLM's and TGI's detokenizers; here the window grows up to WINDOW tokens so that
a token costs one decode, not two). A window whose text ends
in an incomplete UTF-8 character is not committed, so the next token decodes it again with
its continuation.
"""

from __future__ import annotations

WINDOW = 16  # tokens a window may span before it restarts at the previous commit


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...], resumed_ids: list[int], sent: int | None = None):
        """sent: characters of the resumed tokens' text the client already has (None: all;
        fewer when text held back for a stop string had not been released before a migration)."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.committed = ""  # the text of ids[:read]
        self.context, self.read = 0, 0  # ids[context:read] decode as the window's context
        self.context_text = ""
        self.sent = len(self._text(resumed_ids)) if sent is None else sent

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, ids: list[int]) -> str:
        """The text of all of ``ids`` (which extend those of the previous call)."""
        if len(ids) == self.read:
            return self.committed
        window = self._decode(ids[self.context :])
        new = window[len(self.context_text) :] if len(window) > len(self.context_text) else ""
        if new and not new.endswith("\ufffd"):
            self.committed += new
            previous, self.read = self.read, len(ids)
            if self.read - self.context > WINDOW:  # start the window at the previous commit: one more decode
                self.context, self.context_text = previous, self._decode(ids[previous : self.read])
            else:  # the window grows: what it decoded to is the next one's context, no decode needed
                self.context_text = window
            return self.committed
        return self.committed + new

    def update(self, output_ids: list[int], check_stop: bool) -> tuple[str, bool]:
        """New text to stream, and whether a stop string ended the output (text cut before it)."""
        text = self._text(output_ids)
        if check_stop:
            hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
            if hits:
                return self._release(text, min(hits)), True
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        return self._release(text, safe), False

    def flush(self, output_ids: list[int]) -> str:
        return self._release(self._text(output_ids), None)

    def _release(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta
