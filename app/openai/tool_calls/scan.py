"""One tool-call JSON object, `{"name": ..., "arguments": {...}}`, scanned as its text arrives
in pieces of any size.

The name is reported once its string is complete; the arguments as their raw JSON text, as it
grows: a container value (`{...}`, `[...]`) streams character by character, so what was
reported never changes (OpenAI's argument deltas concatenate to the final string). A scalar
value is reported whole at its end: a string holding JSON (some models encode the arguments
so) as its decoded text, anything else as written. Only top-level keys count; `parameters` is
Llama 3's name for `arguments`.
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")
_SPACE = " \t\r\n"


class CallScanner:
    """Feed text starting at the object's `{`; `feed` stops at the object's closing `}`."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escape = False
        self.expect_key = False  # at depth 1: the next string is a key
        self.value = None  # what the current depth-1 value is: "key", "name", "args", "other"
        self.string = []  # the depth-1 string being read (a key or the name), raw
        self.scalar = []  # a scalar arguments value, raw
        self.args_open = False  # inside a container arguments value
        self.has_args = False
        self.name: str | None = None
        self.done = False

    def feed(self, text: str) -> tuple[int, str]:
        """(characters consumed, arguments text completed by them)."""
        out = []
        for i, c in enumerate(text):
            if self.in_string:
                self._string_char(c, out)
            elif c in _SPACE:
                if self.args_open:
                    out.append(c)
            elif c == '"':
                self._open_string(out)
            elif c in "{[":
                self._open(c, out)
            elif c in "}]":
                self._close(c, out)
                if self.done:
                    return i + 1, "".join(out)
            elif self.depth == 1 and c in ":,":
                self._punct(c, out)
            else:
                self._scalar_char(c, out)
        return len(text), "".join(out)

    def finish_scalar(self) -> str:
        """A scalar arguments value cut off at the end of the output: as written."""
        text, self.scalar = "".join(self.scalar).strip(), []
        return text

    # -- per character ---------------------------------------------------------
    def _string_char(self, c: str, out: list) -> None:
        closing = not self.escape and c == '"'
        self.escape = not self.escape and c == "\\"
        if closing:
            self.in_string = False
        if self.args_open:
            out.append(c)
        elif self.depth == 1 and self.value == "args":
            self.scalar.append(c)
            if closing:
                out.append(self._scalar_text())
        elif self.depth == 1 and self.value in ("key", "name"):
            if closing:
                self._string_done(json.loads('"' + "".join(self.string) + '"'))
            else:
                self.string.append(c)

    def _open_string(self, out: list) -> None:
        self.in_string = True
        if self.args_open:
            out.append('"')
        elif self.depth == 1:
            if self.expect_key:
                self.value, self.expect_key = "key", False
            if self.value == "args":
                self.scalar.append('"')
            self.string = []

    def _string_done(self, text: str) -> None:
        if self.value == "name":
            self.name = self.name if self.name is not None else text
            self.value = "other"
        else:  # a key: what its value will be
            fresh_args = text in ARGUMENT_KEYS and not self.has_args
            self.value = "name" if text == "name" else "args" if fresh_args else "other"
            self.has_args = self.has_args or fresh_args

    def _open(self, c: str, out: list) -> None:
        self.depth += 1
        if self.depth == 1:
            self.expect_key = True
        elif self.depth == 2 and self.value == "args":
            self.args_open = True
        if self.args_open:
            out.append(c)

    def _close(self, c: str, out: list) -> None:
        if self.args_open:
            out.append(c)
            self.args_open = self.depth > 2
        self.depth -= 1
        if self.depth == 1 and self.value == "args" and not self.args_open:
            self.value = "other"
        if self.depth == 0:
            if self.scalar:
                out.append(self._scalar_text())
            self.done = True

    def _punct(self, c: str, out: list) -> None:
        if c == ",":
            if self.scalar:
                out.append(self._scalar_text())
            self.value, self.expect_key = None, True

    def _scalar_char(self, c: str, out: list) -> None:
        if self.args_open:
            out.append(c)
        elif self.depth == 1 and self.value == "args":
            self.scalar.append(c)

    def _scalar_text(self) -> str:
        """A complete scalar arguments value: a JSON string's content, else its text."""
        raw, self.scalar, self.value = "".join(self.scalar).strip(), [], "other"
        if raw.startswith('"'):
            try:
                return json.loads(raw)
            except ValueError:
                return raw
        return raw
