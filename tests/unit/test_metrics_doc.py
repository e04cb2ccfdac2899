"""docs/metrics.md and the Grafana dashboard name exactly the metrics the code exports (issue 49).

The exported names are read from the source, where each metric is constructed, so a metric added,
renamed or removed without the page (or a dashboard query of a name that does not exist) fails here.
"""

from __future__ import annotations

import json
import pathlib
import re

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # any tests/ depth
DASHBOARD = ROOT / "examples" / "grafana_loraplex.json"
# how each module spells a metric's name where it constructs it
BUILT = (
    (ROOT / "app" / "serving" / "engine_metrics.py", re.compile(r'\bname\(\s*"(\w+)"'), "loraplex_engine_"),
    (ROOT / "adapters_store" / "metrics.py", re.compile(r'\bcounter\(\s*"(\w+)"'), "loraplex_adapter_"),
)
LITERAL = re.compile(r'\b(?:Counter|Gauge|Histogram)\(\s*"(loraplex_\w+)"')
SCRAPED = re.compile(r"\b(?:ray_)?(loraplex_\w+)")
SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def unknown(text: str) -> set[str]:
    """Metric names in `text` (as defined or as scraped: ray_ prefix, Prometheus suffixes) that
    the code does not export."""
    names = exported()
    return {
        m
        for m in SCRAPED.findall(text)
        if m not in names and not any(m.endswith(s) and m[: -len(s)] in names for s in SUFFIXES)
    }


def exported() -> set[str]:
    names = set()
    for path, pattern, prefix in BUILT:
        names |= {prefix + m for m in pattern.findall(path.read_text())}
    for folder in ("app", "cluster", "adapters_store"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(LITERAL.findall(path.read_text()))
    return names


def test_the_source_scan_finds_every_kind_of_construction():
    names = exported()
    # one of each spelling: name("…"), counter("…"), a literal in app/, in cluster/, in adapters_store/
    assert {
        "loraplex_engine_generation_tokens",
        "loraplex_adapter_cache_events",
        "loraplex_migrations",
        "loraplex_autoscaler_target_replicas",
        "loraplex_adapter_tier",
    } <= names


def test_the_metrics_page_lists_every_exported_metric_and_nothing_else():
    page = (ROOT / "docs" / "metrics.md").read_text()
    listed = set(re.findall(r"^\| `(loraplex_\w+)` \|", page, re.M))
    assert listed == exported()
    assert unknown(page) == set()


def test_the_dashboard_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and all(t["refId"] for p in dashboard["panels"] for t in p["targets"])
    assert unknown("\n".join(exprs)) == set()
    assert unknown("ray_loraplex_engine_kv_blocks_total ray_loraplex_engine_step_seconds_bucket") == set()
    assert unknown("ray_loraplex_engine_tokens_total") == {"loraplex_engine_tokens_total"}  # the check bites
    assert all(e.count("(") == e.count(")") for e in exprs)
