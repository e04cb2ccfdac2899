"""The windowed Detokenizer releases exactly what decoding the whole output each token releases,
on the real tokenizers (SmolLM2's byte-level BPE, Gemma 3's SentencePiece-style BPE with byte
fallback): the same text per token, the same stop-string hits, the same flush, fresh and resumed."""

import random

import pytest

from app.engine.detokenizer import Detokenizer
from benchmarks.detokenize import FullDecode  # the reference: the whole output decoded every token

TEXTS = [
    "Hello, world! Ünïcödé façade — naïve café. 東京タワーは高い。 🤖🚀 emoji 👩‍💻 end.",
    "def f(x):\n    return x ** 2  # ½ ≈ 0.5\n\n\tTabs\tand  spaces   ",
    "Привет, мир! مرحبا بالعالم שלום עולם 안녕하세요 세계 ∑∫∂ 🧪",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tokenizer(request):
    from transformers import AutoTokenizer

    from app.model.default import default_model_dir
    from tests.support.helpers import gemma3_270m_dir

    try:
        path = default_model_dir() if request.param == "smollm2" else gemma3_270m_dir()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    return AutoTokenizer.from_pretrained(str(path))


def _sequences(tokenizer, rng):
    """Token ids of real text (multi-byte characters split across tokens), and random ids."""
    special = list(tokenizer.all_special_ids)
    for text in TEXTS:
        yield tokenizer.encode(text, add_special_tokens=False)
    for _ in range(6):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(20, 80))]
        for _ in range(3):  # special tokens are skipped: the window must not trip over them
            ids.insert(rng.randrange(len(ids)), rng.choice(special))
        yield ids


def _run(detok, ids, min_tokens, start=0):
    """What each token from ids[start] on releases, and the flush (unless a stop string ended it)."""
    out = []
    for n in range(start + 1, len(ids) + 1):
        delta, hit = detok.update(ids[:n], check_stop=n >= min_tokens)
        out.append((delta, hit))
        if hit:
            return out
    return out + [(detok.flush(ids), None)]


def test_windowed_decode_releases_what_full_decode_releases(tokenizer):
    rng = random.Random()
    hits = 0
    for i, ids in enumerate(_sequences(tokenizer, rng)):
        full = tokenizer.decode(ids, skip_special_tokens=True)
        start = rng.randrange(len(full) // 2 + 1)
        stops = [(), (full[start : start + rng.randrange(1, 6)],) if full.strip() else (), ("\ufffd\ufffd", "zz")]
        for stop in stops:
            if any(not s for s in stop):
                continue
            min_tokens = 0 if i % 2 == 0 else rng.randrange(len(ids))  # even: a stop from the text must hit
            want = _run(FullDecode(tokenizer, stop, []), ids, min_tokens)
            assert _run(Detokenizer(tokenizer, stop, []), ids, min_tokens) == want, (ids, stop)
            hits += want[-1][1] is True
            k = rng.randrange(len(ids))  # resumed after k tokens, the client had all or part of their text
            sent = rng.choice([None, len(tokenizer.decode(ids[:k], skip_special_tokens=True)) // 2])
            got = Detokenizer(tokenizer, stop, ids[:k], sent)
            want = FullDecode(tokenizer, stop, ids[:k], sent)
            assert got.sent == want.sent
            assert _run(got, ids, min_tokens, k) == _run(want, ids, min_tokens, k), (ids, stop, k, sent)
    assert hits, "no stop string was hit: the stop path went untested"


def test_no_tokenizer_gives_no_text():
    detok = Detokenizer(None, (), [1, 2])
    assert detok.update([1, 2, 3], check_stop=True) == ("", False)
    assert detok.flush([1, 2, 3, 4]) == ""
