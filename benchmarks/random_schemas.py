"""Random JSON schemas for the structured-output tests and benchmarks, drawn from a seeded RNG.

Every schema is an object (OpenAI's structured outputs want one at the top) whose every part has a
bounded size: strings carry maxLength or a pattern of bounded length, arrays maxItems, objects
`additionalProperties: false`, so a random model cannot wander in one forever and the output
finishes within a few hundred tokens. Numbers carry bounds (their fraction digits are not bounded:
they end as soon as a separator is drawn). Features: nested objects, arrays, enums, required and
optional properties, string patterns, bounded integers and numbers, booleans, nullable values.
"""

from __future__ import annotations

import random

WORDS = ("name", "age", "city", "tags", "score", "ok", "kind", "items", "note", "id", "level", "color")
PATTERNS = (
    r"^[a-z]{1,6}$",
    r"^[A-Z][a-z]{0,4}$",
    r"^[0-9]{3}-[0-9]{2}$",
    r"^(yes|no|maybe)$",
    r"^#[0-9a-f]{6}$",
    r"^[a-z]{1,8}@[a-z]{2,4}\.com$",
)


def _string(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    low = rng.randint(0, 3)
    return {"type": "string", "minLength": low, "maxLength": low + rng.randint(1, 6)}


def _enum(rng: random.Random) -> dict:
    pool = ["red", "green", "blue", "alpha", "beta", 1, 2, 42, None, True]
    return {"enum": rng.sample(pool, rng.randint(2, 5))}


def _integer(rng: random.Random) -> dict:
    low = rng.randint(-50, 50)
    return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}


def _number(rng: random.Random) -> dict:
    low = rng.choice([0, -1, 0.5, 10])
    return {"type": "number", "minimum": low, "maximum": low + rng.choice([1, 10, 100])}


LEAVES = (_string, _enum, _integer, _number, lambda rng: {"type": "boolean"})


def _value(rng: random.Random, depth: int) -> dict:
    roll = rng.random()
    if depth < 2 and roll < 0.15:
        return _object(rng, depth + 1)
    if depth < 2 and roll < 0.3:
        low = rng.randint(0, 1)
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(1, 2)}
    leaf = rng.choice(LEAVES)(rng)
    return {"anyOf": [leaf, {"type": "null"}]} if roll > 0.9 else leaf


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(WORDS, rng.randint(1, 4 if depth == 0 else 2))
    required = [n for n in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": {n: _value(rng, depth) for n in names},
        "required": required,
        "additionalProperties": False,
    }


def random_schemas(n: int = 50, seed: int = 0) -> list[dict]:
    """n random object schemas (the same n for the same seed)."""
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(n)]
