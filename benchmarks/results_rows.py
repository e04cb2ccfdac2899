"""One row per headline measure, read from the result files under benchmarks/results/.

Each extractor takes the results folder and returns the rows its file(s) give; a file that is
not there gives no row, so a benchmark not yet run on a machine is simply absent from the
table. Figures are formatted here and nowhere else: the table, the README's headline rows and
the docs test (tests/unit/test_docs_figures.py) all read them from these functions.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    key: str  # stable id: the README picks its headline rows by it
    measure: str
    ours: str
    beside: str  # the floor or peer measured in the same run ("" where there is none)
    machine: str
    date: str
    file: str  # the result file, relative to benchmarks/results/
    section: str  # anchor of the section in docs/benchmarks.md with the method
    headline: bool = False  # quoted in the README's results table too


def n(x: float, digits: int = 0) -> str:
    """A figure as the docs write it: thousands separated, `digits` decimals."""
    return f"{x:,.{digits}f}"


def ratio(x: float) -> str:
    return f"{x:.2f}×"


def load(folder: pathlib.Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def machine(data: dict, name: str) -> str:
    """The machine a result ran on: its GPU's short name, or the CPU machine."""
    meta = data.get("meta", {}) if isinstance(data.get("meta"), dict) else {}
    summary = data.get("summary", {}) if isinstance(data.get("summary"), dict) else {}
    gpu = meta.get("gpu") or data.get("gpu") or data.get("device") or summary.get("gpu")
    if gpu:
        for short in ("H200", "H100", "A100", "L40S", "L4"):
            if short in str(gpu):
                return short
        return str(gpu)
    stem = name.rsplit(".", 1)[0]
    for short in ("h200", "h100", "a100"):
        if stem.endswith("_" + short) or f"_{short}_" in stem:
            return short.upper()
    return "CPU (2 cores)"


def date(data: dict) -> str:
    meta = data.get("meta", {}) if isinstance(data.get("meta"), dict) else {}
    summary = data.get("summary", {}) if isinstance(data.get("summary"), dict) else {}
    return str(meta.get("date") or data.get("date") or summary.get("date") or "not recorded")


def row(data: dict, name: str, key: str, measure: str, ours: str, beside: str, section: str, headline=False) -> Row:
    return Row(key, measure, ours, beside, machine(data, name), date(data), name, section, headline)


def gpu_files(folder: pathlib.Path, prefix: str) -> list[str]:
    """`<prefix>_<gpu>.json` result files (one per machine a benchmark ran on), by name; a
    benchmark's CPU plumbing run (`--tiny`, `--smoke`: `<prefix>_cpu.json`) is no result."""
    return sorted(
        p.name
        for p in folder.glob(f"{prefix}_*.json")
        if p.stem.count("_") == prefix.count("_") + 1 and not p.stem.endswith("_cpu")
    )


def pick(rows: list[dict], **match) -> dict:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise KeyError(f"{len(found)} rows match {match}")
    return found[0]


def is_unbounded(value) -> bool:
    """vLLM's `--request-rate inf` / no `--max-concurrency`, however the JSON spelled it."""
    if value in (None, 0, "inf", "Infinity", "none", "None"):
        return True
    return isinstance(value, float) and math.isinf(value)
