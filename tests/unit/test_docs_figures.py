"""Figures in README.md and docs/ against the result files they cite (issue 49).

The convention (docs/benchmarks.md, "Results"): the results table and the README's headline rows
are generated from benchmarks/results/*.json by benchmarks/results_table.py, so they cannot drift;
outside those blocks, a paragraph or table that names a result file (a table inherits the file
named in the paragraph right above it) may quote a figure only if that file holds it: a number
with a unit in prose, every number in a table, equals at its shown precision a value of the file,
that value ×1000 / ×100 / ÷1000 (s → ms, fraction → %), bytes/s in GB/s or TB/s, or the ratio of
two values of one row or of one key across rows. This catches a stale table or a figure from a
run the file no longer holds; it does not catch every mistyped digit (a dense file holds many
values), which is why headline figures live in the generated blocks.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from collections import defaultdict

import numpy as np

from benchmarks import results_serving, results_table
from benchmarks.results_engine import determinism, fp8

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # any tests/ depth
RESULTS = ROOT / "benchmarks" / "results"
GENERATED = re.compile(r"<!-- results-[a-z]+:begin -->.*?<!-- results-[a-z]+:end -->", re.S)
NUMBER = re.compile(
    r"(?<![\w.\-/~≈±])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?![\w/\-]|\.\d)\s*"
    r"(tok/s|tokens/s|µs|ms|s\b|GB/s|TB/s|×|%|MB|GiB)?"
)
SCALES = (1, 1000, 100, 1e-3, 1e-9, 1e-12, 1e6)


def _leaves(obj, key, group, out):
    """(key, row, value) of every number in a result file; long lists (raw samples) skipped."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _leaves(v, k, group, out)
    elif isinstance(obj, list) and len(obj) <= 200:
        for v in obj:
            _leaves(v, key, id(v) if isinstance(v, dict) else group, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        out.append((key, group, float(obj)))
    elif isinstance(obj, str):
        out += [(key, group, float(m)) for m in re.findall(r"\d+(?:\.\d+)?", obj)]


def _values(path: pathlib.Path) -> np.ndarray:
    """Every value a figure citing `path` may show, sorted."""
    data = json.loads(path.read_text())
    leaves: list = []
    _leaves(data, None, id(data), leaves)
    parts = [np.array([v for _, _, v in leaves]) * s for s in SCALES]
    by_key, by_row = defaultdict(set), defaultdict(set)
    for key, group, v in leaves:
        if v:
            by_key[key].add(v)
            by_row[group].add(v)
    for same in [*by_key.values(), *by_row.values()]:
        if 1 < len(same) <= 400:
            a = np.array(sorted(same))
            quotients = np.divide.outer(a, a).ravel()
            parts += [quotients, quotients * 100]
    return np.unique(np.concatenate(parts))


def _named(text: str, stems: list[str]) -> list[str]:
    """Result files the text names: `stem.json`, `stem.*`, `stem*.*` (not a route or script of that name)."""
    return [s for s in stems if re.search(r"(?<![\w-])" + re.escape(s) + r"(?=\.(?:json|png|log|\*)|\*)", text)]


def _holds(values: np.ndarray, figure: float, decimals: int) -> bool:
    tol = 0.5 * 10**-decimals * 1.0001
    i = int(np.searchsorted(values, figure - tol))
    return i < len(values) and values[i] <= figure + tol


def unmatched(text: str, results: pathlib.Path = RESULTS) -> list[str]:
    """Figures of `text` (markdown) that the result file their paragraph names does not hold."""
    stems = sorted((p.stem for p in results.glob("*.json")), key=len, reverse=True)
    cache: dict[str, np.ndarray] = {}
    bad, previous = [], []
    for block in re.split(r"\n\s*\n", GENERATED.sub("", text)):
        table = block.lstrip().startswith("|")
        names = _named(block, stems) or (previous if table else [])
        previous = names
        if not names:
            continue
        for s in names:
            if s not in cache:
                cache[s] = _values(results / f"{s}.json")
        values = np.unique(np.concatenate([cache[s] for s in names]))
        for m in NUMBER.finditer(block):
            if not (table or m.group(3)):
                continue
            figure = float(m.group(1).replace(",", "") + ("." + m.group(2) if m.group(2) else ""))
            if not _holds(values, figure, len(m.group(2) or "")):
                bad.append(f"{m.group(0).strip()!r} not in {names}: …{block[max(0, m.start() - 60) : m.end()]}…")
    return bad


def test_generated_results_blocks_are_current():
    assert results_table.stale() == [], "run: python -m benchmarks.results_table"


def test_every_figure_that_names_a_result_file_is_in_that_file():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [f"{p.relative_to(ROOT)}: {b}" for p in docs for b in unmatched(p.read_text())]
    assert bad == [], "\n".join(bad)


def test_a_figure_from_an_older_run_is_caught():
    stale = "`cpu_generate.json`: batch 16 mixed adapters, 53.4 tok/s against HF + PEFT 49.0 tok/s."
    current = "`cpu_generate.json`: batch 16 mixed adapters, 112.0 tok/s against HF + PEFT 82.5 tok/s (1.36×)."
    assert len(unmatched(stale)) == 2
    assert unmatched(current) == []
    table = "`cpu_generate.json`:\n\n| case | ours |\n| --- | --- |\n| batch 16 | 53.4 |"
    assert len(unmatched(table)) == 1


def test_rows_of_result_files_other_benchmarks_add(tmp_path):
    """Files other issues' benchmarks write: a row each when present, none when absent."""
    assert fp8(tmp_path) == determinism(tmp_path) == results_serving.mixed_steps(tmp_path) == []
    assert results_serving.serve_bench(tmp_path) == results_serving.kv_auto(tmp_path) == []
    files = {
        "fp8_h100.json": {
            "gpu": "NVIDIA H100 80GB HBM3",
            "summary": dict(
                speedup_b32_backbone=1.71, speedup_b32_distinct=1.52, speedup_min=1.31, logits_cosine_min=0.9993
            ),
        },
        "determinism_h100.json": {
            "gpu": "NVIDIA H100 80GB HBM3",
            "summary": dict(instance_invariant=True, cost_max=0.07, requests=64, identical=64),
        },
        "mixed_steps_h100.json": {
            "gpu": "NVIDIA H100 80GB HBM3",
            "date": "2026-12-06",
            "summary": dict(
                gpu="NVIDIA H100 80GB HBM3",
                vllm_workload_tok_s=5400.0,
                floor_tok_s=6500.0,
                floor_fraction=0.83,
                mixed_over_wave=[0.85, None],
            ),
        },
        "kv_auto_h100.json": {"gpu": "NVIDIA H100 80GB HBM3", "summary": {"blocks": 4096, "kv_gb": 33.5}},
        "serve_bench_h100.json": {
            "gpu": "NVIDIA H100 80GB HBM3",
            "rows": [
                dict(
                    path=p,
                    shape="llama3-8b",
                    workload="random",
                    adapters=32,
                    input_len=1024,
                    output_len=128,
                    concurrency=None,
                    request_rate="inf",
                    output_tok_s=t,
                    ttft_p99_ms=900.0,
                )
                for p, t in (("engine", 2776.0), ("http", 2600.0))
            ],
        },
    }
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    (f,) = fp8(tmp_path)
    assert (f.ours, f.machine, f.date) == ("1.71× / 1.52× bf16's tok/s", "H100", "not recorded")
    (d,) = determinism(tmp_path)
    assert d.ours == "64 / 64 identical; cost ≤ 7 %"
    (m,) = results_serving.mixed_steps(tmp_path)  # the chat ratio is absent: no second row
    assert (m.ours, m.date) == ("5,400 output tok/s", "2026-12-06")
    assert m.beside == "serial roofline 6,500 (83 % of it); vLLM 0.23 published 5,333 (H100, Llama-3.1-8B)"
    (k,) = results_serving.kv_auto(tmp_path)
    assert k.ours == "blocks 4096; kv_gb 33.5"
    (s,) = results_serving.serve_bench(tmp_path)
    assert s.headline and s.beside == "engine alone 2,776 (0.94×)" and "all at once" in s.measure
    assert all(results_table.is_headline(r) for r in (f, d, m, s))


def test_the_diurnal_row_reads_the_summary_when_the_file_has_one(tmp_path):
    arm = dict(share_batch_0_or_max=0.5, p99_ttft_s=0.6, lost=0)
    data = dict(replica_seconds_ratio=0.7, policies=dict(loraplex=arm, default={**arm, "p99_ttft_s": 0.4}))
    (tmp_path / "diurnal_trace.json").write_text(json.dumps(data))
    (before,) = results_serving.diurnal(tmp_path)
    assert before.ours == "0.70× Ray's replica-seconds, 50 %, TTFT p99 0.60 s, 0 lost"
    summary = dict(replica_seconds_ratio=0.58, batch0_or_full_fraction=0.83, ttft_p99_ratio=1.5, busy_releases=0)
    (tmp_path / "diurnal_trace.json").write_text(json.dumps({**data, "summary": summary}))
    (after,) = results_serving.diurnal(tmp_path)
    assert after.ours == "0.58× Ray's replica-seconds, 83 %, TTFT p99 0.60 s (1.50× Ray's), 0 lost, 0 busy releases"


def test_the_engine_process_row_is_the_median_of_each_variant(tmp_path):
    assert results_serving.engine_process_cpu(tmp_path) == []
    runs = [(False, 100.0), (True, 120.0), (True, 110.0), (False, 90.0)]
    rows = [dict(engine_process=f, tok_s=t, clients=16, round=k // 2 + 1) for k, (f, t) in enumerate(runs)]
    (tmp_path / "engine_process_cpu.json").write_text(json.dumps({"machine": "2 CPU cores", "rows": rows}))
    (r,) = results_serving.engine_process_cpu(tmp_path)
    assert (r.ours, r.beside, r.machine) == ("115 tok/s", "in-process, same run: 95 tok/s", "CPU (2 cores)")
