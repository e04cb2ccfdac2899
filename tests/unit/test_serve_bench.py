"""benchmarks/serve_bench_core.py (vllm bench serve's workload and report) without a server:
exact lengths, the chat mix's clipping, max_concurrency honoured, vLLM's TPOT and ITL
definitions, and a rerun's rows replacing the ones they repeat."""

import asyncio
import json

from benchmarks.serve_bench_core import (
    CHAT_OUTPUT,
    CHAT_PROMPT,
    Outcome,
    chat_requests,
    drive,
    metrics,
    random_requests,
    save,
)


def test_random_and_chat_requests():
    reqs = random_requests(10, 64, 8, 1000, 4, seed=1)
    assert [len(r.prompt) for r in reqs] == [64] * 10 and {r.output_len for r in reqs} == {8}
    assert [r.adapter for r in reqs[:5]] == ["a0", "a1", "a2", "a3", "a0"]
    assert random_requests(3, 4, 2, 1000, 0, seed=1)[0].adapter is None
    assert reqs == random_requests(10, 64, 8, 1000, 4, seed=1)  # same seed, same list for both paths
    chat = chat_requests(300, 1000, 0, seed=2)
    assert all(CHAT_PROMPT[2] <= len(r.prompt) <= CHAT_PROMPT[3] for r in chat)
    assert all(CHAT_OUTPUT[2] <= r.output_len <= CHAT_OUTPUT[3] for r in chat)
    assert len({len(r.prompt) for r in chat}) > 50  # mixed lengths


def test_drive_honours_max_concurrency_and_keeps_order():
    reqs = random_requests(12, 4, 3, 100, 0, seed=0)
    in_flight, most = 0, 0

    async def send(req):
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        in_flight -= 1
        return Outcome(ok=True, output_tokens=req.index)

    outcomes, duration = asyncio.run(drive(reqs, send, float("inf"), 3, seed=0))
    assert most == 3 and [o.output_tokens for o in outcomes] == list(range(12)) and duration > 0
    most = 0
    asyncio.run(drive(reqs, send, float("inf"), None, seed=0))
    assert most == 12  # rate inf, no limit: all at once


def test_metrics_follow_vllm_definitions():
    reqs = random_requests(3, 10, 5, 100, 0, seed=0)
    outcomes = [
        Outcome(ok=True, ttft=0.1, latency=0.5, output_tokens=5, items=3, itl=[0.1, 0.2]),
        Outcome(ok=True, ttft=0.3, latency=0.7, output_tokens=5, items=2, itl=[0.4]),
        Outcome(ok=False, error="HTTP 500"),
    ]
    m = metrics(reqs, outcomes, duration=2.0)
    assert (m["completed"], m["failed"], m["first_error"]) == (2, 1, "HTTP 500")
    assert m["output_tok_s"] == 5.0 and m["total_tok_s"] == 15.0 and m["request_throughput"] == 1.0
    assert abs(m["tpot_mean_ms"] - 100.0) < 1e-9  # (latency - ttft) / (tokens - 1), both 0.1 s
    assert abs(m["ttft_median_ms"] - 200.0) < 1e-9 and abs(m["itl_p99_ms"] - 400.0) < 1e-9
    assert m["tokens_per_item"] == 2.0


def test_a_rerun_replaces_the_rows_it_repeats(tmp_path):
    out = tmp_path / "serve_bench_x.json"
    row = {"path": "http", "workload": "random", "adapters": 0, "input_len": 8, "output_len": 2}
    row.update(concurrency=None, request_rate="inf", shape="tiny", output_tok_s=1.0)
    save(out, [row, {**row, "adapters": 4}], {"device": "cpu"})
    save(out, [{**row, "output_tok_s": 2.0}], {"device": "cpu"})
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["adapters"], r["output_tok_s"]) for r in rows) == [(0, 2.0), (4, 1.0)]
