"""Result rows of the engine and kernel benchmarks (device runs): see results_rows.py."""

from __future__ import annotations

import pathlib

from benchmarks.results_rows import Row, gpu_files, load, n, pick, ratio, row

E2E = "e2e_throughput_h200.json"
SHAPES = (("llama3-8b", "Llama-3-8B"), ("qwen2.5-7b", "Qwen2.5-7B"))


def e2e(folder: pathlib.Path) -> list[Row]:
    d = load(folder, E2E)
    if d is None:
        return []
    rows, out = d["rows"], []

    def ours(batch, workload, lengths="128/128"):
        return pick(rows, system="loraplex", max_batch=batch, workload=workload, lengths=lengths)

    for batch in (32, 64):
        b, a = ours(batch, "backbone"), ours(batch, "distinct")
        hf = pick(rows, system="hf", max_batch=batch)["tok_s"]
        peft = pick(rows, system="hf_peft", max_batch=batch)["tok_s"]
        out.append(
            row(
                d,
                E2E,
                f"e2e_b{batch}",
                f"engine, batch {batch}, 128/128 tokens, backbone / 32 distinct adapters, each workload's first run",
                f"{n(b['tok_s'])} / {n(a['tok_s'])} tok/s",
                f"roofline {n(b['roofline_tok_s'])} / {n(a['roofline_tok_s'])}; HF `generate` backbone "
                f"{n(hf)}; HF + PEFT, 8 adapters, 16 new tokens: {n(peft)}",
                "end-to-end-engine-h200",
            )
        )
    b, a = ours(32, "backbone", "sharegpt"), ours(32, "distinct", "sharegpt")
    out.append(
        row(
            d,
            E2E,
            "e2e_sharegpt",
            "engine, batch 32, ShareGPT-like lengths, backbone / distinct adapters",
            f"{n(b['tok_s'])} / {n(a['tok_s'])} tok/s",
            f"roofline {n(b['roofline_tok_s'])} / {n(a['roofline_tok_s'])}",
            "end-to-end-engine-h200",
        )
    )
    return out


def e2e_shapes(folder: pathlib.Path) -> list[Row]:
    out = []
    for shape, label in SHAPES:
        name = f"e2e_throughput_h200_{shape}.json"
        d = load(folder, name)
        if d is None:
            continue
        a = pick(d["rows"], system="loraplex", max_batch=32, workload="distinct", lengths="128/128")
        out.append(
            row(
                d,
                name,
                f"e2e_{shape}",
                f"{label} shape, batch 32, 128/128 tokens, distinct adapters",
                f"{n(a['tok_s'])} tok/s",
                f"roofline {n(a['roofline_tok_s'])}",
                "end-to-end-engine-h200",
            )
        )
    return out


def sampling(folder: pathlib.Path) -> list[Row]:
    name = "e2e_throughput_h200_sampling.json"
    d = load(folder, name)
    if d is None:
        return []

    def tok(batch, variant, workload="backbone"):
        return pick(d["rows"], max_batch=batch, workload=workload, variant=variant)["tok_s"]

    greedy = [tok(b, "greedy") for b in (32, 64)]
    top_p = [tok(b, "t0.8_top_p0.95_seeded") for b in (32, 64)]
    distinct = [tok(b, "greedy", "distinct") for b in (32, 64)]
    return [
        row(
            d,
            name,
            "greedy_warm",
            "engine, batch 32 / 64, 128/128 tokens, greedy after a discarded warm run, backbone (distinct adapters)",
            f"{n(greedy[0])} / {n(greedy[1])} tok/s ({n(distinct[0])} / {n(distinct[1])})",
            "",
            "sampled-decoding-against-greedy-h200",
        ),
        row(
            d,
            name,
            "sampled",
            "sampled (t 0.8, top-p 0.95, seeded), batch 32 / 64, backbone",
            f"{n(top_p[0])} / {n(top_p[1])} tok/s",
            f"greedy {n(greedy[0])} / {n(greedy[1])} ({ratio(top_p[0] / greedy[0])} / {ratio(top_p[1] / greedy[1])})",
            "sampled-decoding-against-greedy-h200",
        ),
    ]


def sgmv(folder: pathlib.Path) -> list[Row]:
    name = "sgmv_h200.json"
    d = load(folder, name)
    if d is None:
        return []
    r = pick(d["rows"], rank=16, batch=64, workload="distinct")
    return [
        row(
            d,
            name,
            "sgmv",
            "SGMV add-on, rank 16, batch 64, distinct adapters",
            f"{r['ours_us']:.1f} µs",
            f"vLLM {d['meta']['vllm']} Triton kernels {r['vllm_us']:.1f} µs; read-only floor {r['read_only_us']:.1f} µs",
            "sgmv-add-on-h200",
        )
    ]


def attention(folder: pathlib.Path) -> list[Row]:
    name = "attention_h200.json"
    d = load(folder, name)
    if d is None:
        return []
    out = []
    for shape, label in (("gqa_32_8", "GQA 32 / 8 (Llama-3-8B)"), ("mha_32_32", "MHA 32 / 32 (Llama-2-7B)")):
        r = pick(d["rows"], shape=shape, context=4096)
        ours = r["ours_us_by_splits"]["1"]  # one split per (sequence, KV head): what the engine runs at 32 sequences
        out.append(
            row(
                d,
                name,
                f"attention_{shape}",
                f"decode attention, {label}, 32 sequences, context 4096",
                f"{ours:.1f} µs ({ours / r['floor_us']:.2f}× its floor)",
                f"vLLM {d['vllm']} Triton kernel {r['vllm_us']:.1f} µs (its time ÷ ours {r['vllm_us'] / ours:.2f})",
                "decode-attention-h200",
            )
        )
    return out


def adapter_load(folder: pathlib.Path) -> list[Row]:
    name = "adapter_load_h200.json"
    d = load(folder, name)
    if d is None:
        return []
    return [
        row(
            d,
            name,
            "adapter_load",
            "adapter host → GPU slot load (80 MB, rank 16)",
            f"{d['h2d_GBps']:.1f} GB/s ({d['load_ms']:.1f} ms)",
            f"pinned copy alone {d['pinned_bw_GBps']:.1f} GB/s",
            "adapter-loading-h200",
        ),
        row(
            d,
            name,
            "adapter_burst",
            "TTFT p99 of 64 requests for 64 GPU-cold adapters in 100 ms beside 32 decoding",
            f"{n(d['ttft_p99_ms'])} ms",
            f"adapters already resident {n(d['warm_ttft_p99_ms'])} ms",
            "adapter-loading-h200",
        ),
    ]


def adapter_scale(folder: pathlib.Path) -> list[Row]:
    name = "adapter_scale_h200.json"
    d = load(folder, name)
    if d is None:
        return []
    on, res = d["on_demand"], d["all_resident"]
    return [
        row(
            d,
            name,
            "adapter_scale",
            "10,000 adapters, Zipf(1.1), local-speed source (not S3)",
            f"{n(on['tokens_per_s'])} tok/s ({ratio(d['throughput_ratio'])}), TTFT p99 {n(on['ttft_p99_ms'])} ms",
            f"64 resident adapters, same trace: {n(res['tokens_per_s'])} tok/s, TTFT p99 {n(res['ttft_p99_ms'])} ms",
            "ten-thousand-adapters-h200",
        )
    ]


def prefix(folder: pathlib.Path) -> list[Row]:
    name = "prefix_cache_h200.json"
    d = load(folder, name)
    if d is None:
        return []
    on, off = d["saturation"]["on"]["tok_s"], d["saturation"]["off"]["tok_s"]
    return [
        row(
            d,
            name,
            "prefix_cache",
            f"prefix cache, {d['tenants']} tenants with {n(d['system_tokens'])}-token system prompts, saturated",
            f"{n(on)} tok/s",
            f"cache off {n(off)} ({ratio(on / off)})",
            "prefix-cache-h200",
        )
    ]


def structured(folder: pathlib.Path) -> list[Row]:
    out = []
    for name, label in (
        ("structured_throughput_h200.json", "Llama-2-7B shape, 32k vocabulary"),
        ("structured_throughput_h200_llama3-8b.json", "Llama-3-8B shape, 128k vocabulary"),
    ):
        d = load(folder, name)
        if d is None:
            continue
        c = [pick(d["rows"], max_batch=b, variant="constrained")["tok_s"] for b in (32, 64)]
        u = [pick(d["rows"], max_batch=b, variant="unconstrained")["tok_s"] for b in (32, 64)]
        out.append(
            row(
                d,
                name,
                "structured_" + d.get("shape", "llama2-7b"),
                f"JSON-schema constrained, batch 32 / 64, {label} (median of 3 runs)",
                f"{n(c[0])} / {n(c[1])} tok/s",
                f"unconstrained {n(u[0])} / {n(u[1])} ({ratio(c[0] / u[0])} / {ratio(c[1] / u[1])}); "
                f"schema compile p99 {d['compile']['compile_ms_p99']:.1f} ms",
                "structured-outputs-h200",
            )
        )
    return out


def serve_http(folder: pathlib.Path) -> list[Row]:
    name = "serve_throughput_h200.json"
    d = load(folder, name)
    if d is None:
        return []
    out = []
    for workload, label in (("base", "base model"), ("adapters", "32 adapters")):
        http = [pick(d["rows"], path="http", clients=c, workload=workload)["tok_s"] for c in (32, 64)]
        eng = [pick(d["rows"], path="engine", clients=c, workload=workload)["tok_s"] for c in (32, 64)]
        out.append(
            row(
                d,
                name,
                f"http_{workload}",
                f"over HTTP (`serve run`, streaming), 32 / 64 closed-loop clients, 128/128, {label}",
                f"{n(http[0])} / {n(http[1])} tok/s",
                f"engine alone {n(eng[0])} / {n(eng[1])} ({ratio(http[0] / eng[0])} / {ratio(http[1] / eng[1])})",
                "over-http-against-the-engine-alone-h200",
            )
        )
    return out


def fp8(folder: pathlib.Path) -> list[Row]:
    out = []
    for name in gpu_files(folder, "fp8"):
        d = load(folder, name)
        s = d.get("summary") or {}
        if not s:
            continue
        cos = s.get("logits_cosine_min")
        out.append(
            row(
                d,
                name,
                f"fp8_{name}",
                "fp8 base weights, engine decode at batch 32, backbone / distinct adapters",
                f"{ratio(s['speedup_b32_backbone'])} / {ratio(s['speedup_b32_distinct'])} bf16's tok/s",
                f"bf16, same run; smallest cell {ratio(s['speedup_min'])}"
                + (f"; logits cosine to bf16 ≥ {cos:.4f}" if cos is not None else ""),
                "results",
            )
        )
    return out


def determinism(folder: pathlib.Path) -> list[Row]:
    out = []
    for name in gpu_files(folder, "determinism"):
        d = load(folder, name)
        s = d.get("summary") or {}
        if not s:
            continue
        out.append(
            row(
                d,
                name,
                f"determinism_{name}",
                "`deterministic: true`: tokens alone / batched / migrated; throughput cost",
                f"{s.get('identical')} / {s.get('requests')} identical; cost ≤ {100 * s['cost_max']:.0f} %",
                "default mode, same run; two engine instances bitwise equal: "
                + ("yes" if s.get("instance_invariant") else "no"),
                "results",
            )
        )
    return out
