"""Structured output: a request's Guide (app/protocol.py) compiled by llguidance, and the matcher
that follows one sequence's output through its grammar.

Why llguidance (docs/structured_outputs.md has the numbers): over 50 random schemas its compile is
≤ 8 ms at p99 even with a 262k-token vocabulary (xgrammar: 100 ms there), its per-step mask time has
the shorter tail, and it is one wheel with no dependencies.

- `Grammars`, one per engine: the tokenizer's vocabulary as llguidance sees it (built once: 0.4 s for
  49k tokens, 16 s for 262k on a 2-core CPU; the async engine starts it on a thread at start-up; EOS =
  the model's EOS ids, or the tokenizer's where the model names none),
  and compiled guides cached by Guide (kind, spec). `compile` is thread-safe and meant to run off the
  engine thread; a grammar llguidance rejects (bad schema, unsupported keyword, bad regex) is an
  InvalidRequestError naming the problem.
- `GrammarState`, one per constrained sequence: a fresh matcher (a copy of the compiled one in its
  initial state), advanced by every token the sequence accepts, resumed tokens first.
- `fill_masks`: the allowed-token bitmasks of a step's constrained rows, filled in parallel on the host.

JSON is generated compact with fixed separators (", " and ": "), no free whitespace: a model cannot
pad the output with whitespace forever, and the same schema always gives the same grammar.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict

import numpy as np

from app.errors import InvalidRequestError
from app.protocol import Guide

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_REASON = 300  # characters of llguidance's message in a 400
_CACHE_SIZE = 512  # compiled guides kept per engine (each a few KB to a few MB of lexer state)


class GrammarError(Exception):
    """A constrained sequence drew a token its grammar rejects; ends that request alone."""


def grammar_text(guide: Guide) -> str:
    """llguidance's grammar for a guide (not yet checked)."""
    import llguidance

    build = llguidance.LLMatcher
    if guide.kind == "json_schema":
        return build.grammar_from_json_schema(guide.spec, overrides=_JSON_OPTIONS)
    if guide.kind == "json_object":
        return build.grammar_from_json_schema('{"type": "object"}', overrides=_JSON_OPTIONS)
    if guide.kind == "regex":
        return build.grammar_from_regex(guide.spec)
    if guide.kind == "choice":  # JSON string literals are Lark string literals
        return build.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(guide.spec)))
    raise InvalidRequestError(f"unknown guide kind {guide.kind!r}")


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self._hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        eos = eos_ids or ((tokenizer.eos_token_id,) if getattr(tokenizer, "eos_token_id", None) is not None else ())
        self.eos_ids = tuple(eos)
        self._tokenizer = None
        self._cache: OrderedDict[Guide, object] = OrderedDict()
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build the vocabulary now (seconds for a 262k one), so no request waits for it; errors wait for one."""
        if self._hf_tokenizer is not None and self.eos_ids:
            self._llg_tokenizer()

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                if self._hf_tokenizer is None or not self.eos_ids:
                    raise InvalidRequestError("structured output needs the model's tokenizer and an EOS token")
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_ids)
                )
            return self._tokenizer

    def compile(self, guide: Guide):
        """The compiled guide (cached): a matcher in its initial state, copied per sequence."""
        with self._lock:
            if guide in self._cache:
                self._cache.move_to_end(guide)
                return self._cache[guide]
        import llguidance

        tokenizer = self._llg_tokenizer()
        grammar = grammar_text(guide)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        compiled = None if error else llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if error or compiled.is_error():
            reason = " ".join((error or compiled.get_error()).split())  # one line (a regex error draws a caret)
            raise InvalidRequestError(f"invalid {guide.kind.replace('_', ' ')}: {reason[:_MAX_REASON]}")
        with self._lock:
            self._cache[guide] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def state(self, compiled, resumed: tuple[int, ...] = ()) -> GrammarState:
        """A sequence's matcher, with its resumed tokens (from before a migration) replayed."""
        state = GrammarState(compiled.deep_copy(), self.eos_ids)
        if resumed and not state.matcher.consume_tokens(list(resumed)):
            raise InvalidRequestError("the resumed tokens do not follow the request's grammar")
        return state


class GrammarState:
    def __init__(self, matcher, eos_ids: tuple[int, ...]):
        self.matcher, self.eos_ids = matcher, eos_ids

    def advance(self, token: int) -> bool:
        """Accept the sequence's next token; True when the output is complete (nothing but EOS may follow)."""
        if not self.matcher.consume_token(token):
            reason = self.matcher.get_error().splitlines()[0] if self.matcher.get_error() else ""
            raise GrammarError(f"token {token} does not follow the request's grammar; generation stopped ({reason})")
        return self.matcher.is_stopped()


_executor = None
_executor_lock = threading.Lock()


def fill_masks(states: list[GrammarState], vocab_size: int) -> np.ndarray:
    """[len(states), ⌈vocab/32⌉] int32: bit t of row i set where states[i] allows token t next."""
    global _executor
    import llguidance
    import llguidance.numpy as lnp

    with _executor_lock:
        if _executor is None:
            # half the cores at most: its idle threads spin a while and would slow torch's own threads
            _executor = llguidance.LLExecutor(num_threads=min(8, max(1, (os.cpu_count() or 2) // 2)))
    bits = np.empty((len(states), (vocab_size + 31) // 32), dtype=np.int32)
    lnp.fill_next_token_bitmask_par(_executor, [(s.matcher, i) for i, s in enumerate(states)], bits)
    return bits
