"""Prefix caching on one H200: a multi-tenant chat trace with the cache on and off, same run.

On the device:  python benchmarks/prefix_cache.py --out $OUT/prefix_cache_h200.json   (about 3 minutes;
                default --out benchmarks/results/prefix_cache_h200.json; the .png lands beside it)
Anywhere:       python benchmarks/prefix_cache.py --plot-only

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
Cross-adapter hits are impossible by construction (app/engine/prefix_cache.py); the JSON records
the hit tokens per adapter name, each tenant's only from its own requests.
"""

import argparse
import datetime
import json
import pathlib
import random
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.e2e_throughput import adapters, model_config, random_weights  # noqa: E402
from benchmarks.method import save_figure  # noqa: E402

TENANTS, SYSTEM, USER, NEW, BATCH = 32, 1024, 64, 128, 32
KV_BLOCKS = 4800  # 32 running requests (76 blocks each) + every tenant's prompt (64 each), with room
LOAD = 0.7


def engine_for(model, cache: bool):
    from app.engine.config import EngineConfig
    from app.engine.core import EngineCore

    cfg = EngineConfig(
        max_num_seqs=BATCH,
        max_tokens_per_step=2048,
        num_kv_blocks=KV_BLOCKS,
        max_loras=TENANTS,
        max_lora_rank=16,
        dtype=torch.float16,
        device="cuda",
        max_model_len=4096,
        prefix_caching=cache,
    )
    return EngineCore(model, None, None, cfg)


def requests(n, rng, systems, tag):
    """(request, tenant) pairs; systems None: no shared prefix."""
    from app.protocol import GenerateRequest, SamplingParams

    out = []
    for i in range(n):
        t = rng.randrange(TENANTS)
        head = systems[t] if systems else tuple(rng.randrange(32000) for _ in range(SYSTEM))
        prompt = head + tuple(rng.randrange(32000) for _ in range(USER))
        out.append((GenerateRequest(f"{tag}{i}", prompt, SamplingParams(max_tokens=NEW, temperature=0.0), f"a{t}"), t))
    return out


def run(engine, names, reqs, arrivals):
    """Feed requests at their arrival offsets (s); per request TTFT and TPOT, and the totals."""
    first, last, count = {}, {}, {}
    hit0, query0 = sum(engine.prefix.hit_tokens.values()), sum(engine.prefix.query_tokens.values())
    torch.cuda.synchronize()
    start = time.perf_counter()
    pending = sorted(zip(arrivals, range(len(reqs))))
    k = 0
    while k < len(pending) or engine.has_work():
        now = time.perf_counter() - start
        while k < len(pending) and pending[k][0] <= now:
            req, t = reqs[pending[k][1]]
            engine.add(req, adapter=names[t])
            k += 1
        if not engine.has_work():
            time.sleep(max(0.0, pending[k][0] - now))
            continue
        chunks = engine.step()
        now = time.perf_counter() - start
        for c in chunks:
            if getattr(c, "token_ids", None):
                first.setdefault(c.request_id, now)
                last[c.request_id] = now
                count[c.request_id] = count.get(c.request_id, 0) + len(c.token_ids)
    wall = time.perf_counter() - start
    arrival = {reqs[i][0].request_id: a for a, i in pending}
    ttft = [first[r] - arrival[r] for r in first]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]
    hits = sum(engine.prefix.hit_tokens.values()) - hit0
    queried = sum(engine.prefix.query_tokens.values()) - query0
    return dict(
        requests=len(reqs),
        wall_s=wall,
        tok_s=sum(count.values()) / wall,
        req_s=len(reqs) / wall,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        tpot_mean_s=float(np.mean(tpot)),
        tpot_p99_s=float(np.percentile(tpot, 99)),
        hit_rate=hits / queried if queried else 0.0,
    )


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [
        ("trace", "TTFT p50 (s)", "ttft_p50_s"),
        ("trace", "TTFT p99 (s)", "ttft_p99_s"),
        ("trace", "TPOT mean (ms)", "tpot_mean_s"),
        ("saturation", "throughput (tok/s)", "tok_s"),
        ("no_shared_prefix", "no shared prefix: tok/s", "tok_s"),
    ]
    fig, axes = plt.subplots(1, len(parts), figsize=(3.2 * len(parts), 3.2))
    for ax, (part, title, key) in zip(axes, parts):
        vals = [data[part][m][key] * (1e3 if key.startswith("tpot") else 1) for m in ("off", "on")]
        ax.bar(["cache off", "cache on"], vals, color=["#999999", "#2a7ab9"])
        ax.set_title(title, fontsize=9)
    save_figure(
        fig,
        f"prefix cache, {TENANTS} tenants x {SYSTEM}-token system prompts, Llama-2-7B shape fp16, {data['device']}",
        png,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "prefix_cache_h200.json"
    )
    ap.add_argument("--trace-s", type=float, default=30.0)
    ap.add_argument("--saturation-requests", type=int, default=96)
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    from adapters_store.gpu_pool import LoraPool, PoolConfig
    from app.model.llama import LlamaModel

    cfg = model_config()
    model = LlamaModel(cfg, random_weights(cfg), LoraPool(cfg.shape, PoolConfig(TENANTS, 16, torch.float16, "cuda")))
    names = adapters(cfg, TENANTS)
    engines = {"off": engine_for(model, False), "on": engine_for(model, True)}
    rng = random.Random(0)
    systems = [tuple(rng.randrange(32000) for _ in range(SYSTEM)) for _ in range(TENANTS)]
    data = dict(
        device=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        tenants=TENANTS,
        system_tokens=SYSTEM,
        user_tokens=USER,
        new_tokens=NEW,
        max_batch=BATCH,
        kv_blocks=KV_BLOCKS,
        load=LOAD,
        saturation={},
        trace={},
        no_shared_prefix={},
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: args.out.write_text(json.dumps(data, indent=1))  # noqa: E731

    def report(part, mode, r):
        data[part][mode] = r
        save()
        print(
            f"{part:17s} cache {mode:3s}: {r['requests']} req {r['wall_s']:.1f} s {r['tok_s']:.0f} tok/s "
            f"TTFT p50 {r['ttft_p50_s']:.3f} p99 {r['ttft_p99_s']:.3f} s TPOT {1e3 * r['tpot_mean_s']:.1f} ms "
            f"hit rate {r['hit_rate']:.2f}",
            flush=True,
        )

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
    on = engines["on"].prefix
    data["hit_tokens_by_adapter"] = dict(on.hit_tokens)
    data["query_tokens_by_adapter"] = dict(on.query_tokens)
    t, s, u = data["trace"], data["saturation"], data["no_shared_prefix"]
    data["summary"] = dict(
        ttft_p50_speedup=t["off"]["ttft_p50_s"] / t["on"]["ttft_p50_s"],
        saturation_throughput_ratio=s["on"]["tok_s"] / s["off"]["tok_s"],
        no_shared_prefix_throughput_ratio=u["on"]["tok_s"] / u["off"]["tok_s"],
    )
    save()
    print(json.dumps(data["summary"], indent=1))
    plot(data, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
