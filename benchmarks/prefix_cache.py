"""Prefix caching on one H200: a multi-tenant chat trace with the cache on and off, same run.

On the device:  python -m benchmarks.prefix_cache --out $OUT/prefix_cache_h200.json   (default --out
                benchmarks/results/prefix_cache_h200.json; the .png lands beside it; the JSON records
                each part's seconds, durations_s)
Anywhere:       python -m benchmarks.prefix_cache --plot-only
CPU smoke run:  python -m benchmarks.prefix_cache --smoke   (tiny random model, 4 tenants, short
                prompts: the plumbing end to end; JSON + PNG in /tmp unless --out says otherwise)

Llama-2-7B shape, random fp16 weights; 32 tenants, each with its own rank-16 adapter (all seven
projections) and its own 1,024-token system prompt; a request is its tenant's system prompt + 64
random user tokens, 128 new tokens (greedy, no stop). Two engines on one model, identical but for
`prefix_caching`, each max batch 32 and the same KV blocks. Parts, in this order:
  1. saturation, cache off: all requests queued at once; its requests/s is the replica's capacity.
  2. trace: Poisson arrivals at 70 % of that capacity for --trace-s seconds, cache off then on
     (the on engine starts cold): TTFT p50/p99 (arrival → first token), time per output token,
     throughput, hit rate (prompt tokens read from the cache / prompt tokens).
  3. saturation, cache on (its throughput against part 1's).
  4. no shared prefix: every prompt 1,088 unique random tokens, all queued at once, cache off and
     on: throughput (what hashing, lookups and evictions cost when nothing is shared).
  5. multi-turn capacity, cache off: requests shaped like the chat turns of part 6 (prompt lengths
     in the trace's mix), all queued at once; its requests/s sets part 6's rate.
  6. multi-turn chat (benchmarks/chat_trace.py): conversations of 4-6 turns, each turn the whole
     conversation so far (system prompt, earlier user messages and the engine's own earlier
     answers) + 64 new user tokens, 128 new tokens; a conversation's next turn is sent when its
     answer is complete plus an exponential think time (--think-s); conversations arrive Poisson
     at 70 % of part 5's requests/s over the mean turns, for --chat-s seconds; cache off then on.
     System prompts new to both engines (the on engine starts cold for them). Same measures as
     part 2; TTFT runs from a turn's sending to its first token; also TTFT p50 by turn number and
     the share of turns whose answer is equal with the cache on and off.
Cross-adapter hits are impossible by construction (app/engine/prefix_cache.py); the JSON records
the hit tokens per adapter name, each tenant's only from its own requests.
"""

import argparse
import datetime
import heapq
import itertools
import json
import pathlib
import random
import time

import numpy as np
import torch

from benchmarks import e2e_throughput as e2e
from benchmarks.chat_trace import ChatTrace, capacity_prompts, conversations
from benchmarks.method import save_figure

TENANTS, SYSTEM, USER, NEW, BATCH = 32, 1024, 64, 128, 32
# 32 running requests (76 blocks each; a 6-turn chat's last turn 136) + every tenant's prompt (64 each), with room
KV_BLOCKS = 4800
LOAD = 0.7
TURNS = (4, 6)
DEVICE, DTYPE = "cuda", torch.float16
TINY = dict(vocab=32000, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16, family="llama")


def smoke_settings():
    """--smoke: CPU, float32, a tiny random model, few tenants, short prompts and answers."""
    global TENANTS, SYSTEM, USER, NEW, BATCH, KV_BLOCKS, DEVICE, DTYPE
    TENANTS, SYSTEM, USER, NEW, BATCH, KV_BLOCKS = 4, 64, 8, 8, 8, 400
    DEVICE, DTYPE = "cpu", torch.float32
    e2e.SHAPE.clear()
    e2e.SHAPE.update(TINY)


def engine_for(model, cache: bool):
    from app.engine.config import EngineConfig
    from app.engine.core import EngineCore

    cfg = EngineConfig(
        max_num_seqs=BATCH,
        max_tokens_per_step=2048,
        num_kv_blocks=KV_BLOCKS,
        max_loras=TENANTS,
        max_lora_rank=16,
        dtype=DTYPE,
        device=DEVICE,
        max_model_len=4096,
        prefix_caching=cache,
    )
    return EngineCore(model, None, None, cfg)


def request(rid, prompt, t):
    """Tenant t's request: its adapter, NEW tokens, greedy, no stop."""
    from app.protocol import GenerateRequest, SamplingParams

    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=NEW, temperature=0.0), f"a{t}")


def requests(n, rng, systems, tag):
    """(request, tenant) pairs; systems None: no shared prefix."""
    out = []
    for i in range(n):
        t = rng.randrange(TENANTS)
        head = systems[t] if systems else tuple(rng.randrange(32000) for _ in range(SYSTEM))
        out.append((request(f"{tag}{i}", head + tuple(rng.randrange(32000) for _ in range(USER)), t), t))
    return out


def run(engine, names, reqs, arrivals, chat=None):
    """Feed requests at their arrival offsets (s) and, with a ChatTrace, each conversation's next
    turn when the previous answer is in (plus think time); per request TTFT and TPOT, the totals."""
    from app.protocol import TokenChunk

    first, last, tokens, arrival = {}, {}, {}, {}
    hit0, query0 = sum(engine.prefix.hit_tokens.values()), sum(engine.prefix.query_tokens.values())
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    order = itertools.count()  # ties in arrival time keep their order (requests do not compare)
    pending = [(a, next(order), req, t) for (req, t), a in zip(reqs, arrivals)]
    heapq.heapify(pending)
    start = time.perf_counter()
    while pending or engine.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            a, _, req, t = heapq.heappop(pending)
            arrival[req.request_id] = a
            engine.add(req, adapter=names[t])
        if not engine.has_work():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        chunks = engine.step()
        now = time.perf_counter() - start
        for c in chunks:
            if not isinstance(c, TokenChunk):  # KV sized so nothing is preempted; a failure is a bug
                raise RuntimeError(f"request {c.request_id} left the engine: {c}")
            if c.token_ids:
                first.setdefault(c.request_id, now)
                last[c.request_id] = now
                tokens.setdefault(c.request_id, []).extend(c.token_ids)
            if c.finish_reason is not None and chat is not None:
                for delay, req, t in chat.finished(c.request_id, tokens[c.request_id]):
                    heapq.heappush(pending, (now + delay, next(order), req, t))
    wall = time.perf_counter() - start
    ttft = {r: first[r] - arrival[r] for r in first}
    tpot = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in first if len(tokens[r]) > 1]
    hits = sum(engine.prefix.hit_tokens.values()) - hit0
    queried = sum(engine.prefix.query_tokens.values()) - query0
    out = dict(
        requests=len(arrival),
        wall_s=wall,
        tok_s=sum(map(len, tokens.values())) / wall,
        req_s=len(arrival) / wall,
        ttft_p50_s=float(np.percentile(list(ttft.values()), 50)),
        ttft_p99_s=float(np.percentile(list(ttft.values()), 99)),
        tpot_mean_s=float(np.mean(tpot)),
        tpot_p99_s=float(np.percentile(tpot, 99)),
        hit_rate=hits / queried if queried else 0.0,
    )
    if chat is not None:
        out.update(conversations=len(chat.convs), ttft_p50_by_turn_s=chat.ttft_by_turn(ttft))
    return out


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latency = [("TTFT p50 (s)", "ttft_p50_s"), ("TTFT p99 (s)", "ttft_p99_s"), ("TPOT mean (ms)", "tpot_mean_s")]
    rows = [
        [("trace", *m) for m in latency]
        + [("saturation", "throughput (tok/s)", "tok_s"), ("no_shared_prefix", "no shared prefix: tok/s", "tok_s")],
        [("multiturn", f"multi-turn: {t}", k) for t, k in latency + [("tok/s", "tok_s"), ("hit rate", "hit_rate")]],
    ]
    rows = [row for row in rows if data.get(row[0][0])]  # results from before the multi-turn part have one row
    fig, axes = plt.subplots(len(rows), 5, figsize=(3.2 * 5, 3.2 * len(rows)), squeeze=False)
    for row, ax_row in zip(rows, axes):
        for ax, (part, title, key) in zip(ax_row, row):
            vals = [data[part][m][key] * (1e3 if key.startswith("tpot") else 1) for m in ("off", "on")]
            ax.bar(["cache off", "cache on"], vals, color=["#999999", "#2a7ab9"])
            ax.set_title(title, fontsize=9)
    model = "tiny random model" if data.get("smoke") else "Llama-2-7B shape fp16"
    tenants, system = data["tenants"], data["system_tokens"]
    save_figure(fig, f"prefix cache, {tenants} tenants x {system}-token system prompts, {model}, {data['device']}", png)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--trace-s", type=float, default=20.0)
    ap.add_argument("--saturation-requests", type=int, default=64)
    ap.add_argument("--chat-s", type=float, default=20.0, help="seconds of conversation arrivals (part 6)")
    ap.add_argument("--think-s", type=float, default=0.5, help="mean think time between turns (0: none)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model, short prompts")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    results = pathlib.Path("/tmp") if args.smoke else pathlib.Path(__file__).parent / "results"
    args.out = args.out or results / ("prefix_cache_cpu_smoke.json" if args.smoke else "prefix_cache_h200.json")
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    began = time.perf_counter()
    if args.smoke:
        smoke_settings()
        args.trace_s, args.chat_s, args.saturation_requests = min(args.trace_s, 3.0), min(args.chat_s, 3.0), 8
    from adapters_store.gpu_pool import LoraPool, PoolConfig
    from app.model.llama import LlamaModel

    cfg = e2e.model_config()
    pool = LoraPool(cfg.shape, PoolConfig(TENANTS, 16, DTYPE, DEVICE))
    model = LlamaModel(cfg, e2e.random_weights(cfg, DTYPE, DEVICE), pool)
    names = e2e.adapters(cfg, TENANTS)
    engines = {"off": engine_for(model, False), "on": engine_for(model, True)}
    rng = random.Random(0)
    systems = [tuple(rng.randrange(32000) for _ in range(SYSTEM)) for _ in range(TENANTS)]
    data = dict(
        smoke=args.smoke,
        device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        date=datetime.date.today().isoformat(),
        tenants=TENANTS,
        system_tokens=SYSTEM,
        user_tokens=USER,
        new_tokens=NEW,
        max_batch=BATCH,
        kv_blocks=KV_BLOCKS,
        load=LOAD,
        chat_turns=list(TURNS),
        think_s=args.think_s,
        saturation={},
        trace={},
        no_shared_prefix={},
        multiturn_capacity={},
        multiturn={},
        durations_s={},
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: args.out.write_text(json.dumps(data, indent=1))  # noqa: E731

    def report(part, mode, r):
        data[part][mode] = r
        data["durations_s"][f"{part} {mode}"] = r["wall_s"]
        save()
        print(
            f"{part:18s} cache {mode:3s}: {r['requests']} req {r['wall_s']:.1f} s {r['tok_s']:.0f} tok/s "
            f"TTFT p50 {r['ttft_p50_s']:.3f} p99 {r['ttft_p99_s']:.3f} s TPOT {1e3 * r['tpot_mean_s']:.1f} ms "
            f"hit rate {r['hit_rate']:.2f}",
            flush=True,
        )

    data["durations_s"]["setup"] = time.perf_counter() - began
    for engine in engines.values():  # first-use costs (allocator, kernels) out of the timed parts
        run(engine, names, requests(8, random.Random(9), None, "w"), [0.0] * 8)
    sat = requests(args.saturation_requests, random.Random(1), systems, "s")
    report("saturation", "off", run(engines["off"], names, sat, [0.0] * len(sat)))
    rate = LOAD * data["saturation"]["off"]["req_s"]
    gaps = np.random.default_rng(2).exponential(1 / rate, size=int(rate * args.trace_s * 2))
    arrivals = [float(a) for a in np.cumsum(gaps) if a < args.trace_s]
    trace = requests(len(arrivals), random.Random(3), systems, "t")
    data["trace_rate_req_s"] = rate
    for mode in ("off", "on"):
        report("trace", mode, run(engines[mode], names, trace, arrivals))
    report("saturation", "on", run(engines["on"], names, sat, [0.0] * len(sat)))
    unique = requests(args.saturation_requests // 2, random.Random(4), None, "u")
    for mode in ("off", "on"):
        report("no_shared_prefix", mode, run(engines[mode], names, unique, [0.0] * len(unique)))
    multiturn(args, data, engines, names, report)
    on = engines["on"].prefix
    data["hit_tokens_by_adapter"] = dict(on.hit_tokens)
    data["query_tokens_by_adapter"] = dict(on.query_tokens)
    t, s, u, m = data["trace"], data["saturation"], data["no_shared_prefix"], data["multiturn"]
    data["summary"] = dict(
        ttft_p50_speedup=t["off"]["ttft_p50_s"] / t["on"]["ttft_p50_s"],
        saturation_throughput_ratio=s["on"]["tok_s"] / s["off"]["tok_s"],
        no_shared_prefix_throughput_ratio=u["on"]["tok_s"] / u["off"]["tok_s"],
        multiturn_ttft_p50_speedup=m["off"]["ttft_p50_s"] / m["on"]["ttft_p50_s"],
        multiturn_ttft_p99_speedup=m["off"]["ttft_p99_s"] / m["on"]["ttft_p99_s"],
        multiturn_tpot_ratio=m["on"]["tpot_mean_s"] / m["off"]["tpot_mean_s"],
        multiturn_throughput_ratio=m["on"]["tok_s"] / m["off"]["tok_s"],
    )
    data["durations_s"]["total"] = time.perf_counter() - began
    save()
    print(json.dumps(data["summary"], indent=1))
    print(f"total {data['durations_s']['total']:.0f} s", flush=True)
    plot(data, args.out.with_suffix(".png"))


def multiturn(args, data, engines, names, report):
    """Parts 5 and 6: the chat turns' capacity with the cache off, then the chat trace off and on."""
    rng = random.Random(5)
    systems = [tuple(rng.randrange(32000) for _ in range(SYSTEM)) for _ in range(TENANTS)]  # new to both engines
    mix = capacity_prompts(rng, systems, args.saturation_requests, TURNS, USER, NEW, 32000)
    mix = [(request(f"m{i}", prompt, t), t) for i, (prompt, t) in enumerate(mix)]
    report("multiturn_capacity", "off", run(engines["off"], names, mix, [0.0] * len(mix)))
    rate = LOAD * data["multiturn_capacity"]["off"]["req_s"] / (sum(TURNS) / 2)  # conversations/s (70 % in turns/s)
    convs = conversations(args.chat_s, rate, TENANTS, TURNS, USER, 32000, args.think_s, seed=6)
    data["multiturn_rate_conversations_s"] = rate
    chats = {}
    for mode in ("off", "on"):
        chats[mode] = ChatTrace(convs, systems, NEW, "c")
        report("multiturn", mode, run(engines[mode], names, *chats[mode].first(), chats[mode]))
        assert data["multiturn"][mode]["requests"] == chats[mode].turns(), "every turn of every conversation ran"
    data["multiturn_same_answers"] = chats["off"].same_answers(chats["on"])
    print(f"multi-turn: {len(convs)} conversations, answers equal off/on: {data['multiturn_same_answers']:.2f}")


if __name__ == "__main__":
    main()
