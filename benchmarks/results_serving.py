"""Result rows of the serving, cluster and CPU benchmarks: see results_rows.py."""

from __future__ import annotations

import pathlib

from benchmarks.results_rows import Row, gpu_files, is_unbounded, load, n, pick, ratio, row


def serve_bench(folder: pathlib.Path) -> list[Row]:
    """vLLM's serving benchmark replicated (benchmarks/serve_bench.py): each HTTP row beside the
    engine-alone row of the same workload, adapters, lengths, concurrency and rate."""
    out = []
    keys = ("shape", "workload", "adapters", "input_len", "output_len", "concurrency", "request_rate")
    for name in gpu_files(folder, "serve_bench"):
        d = load(folder, name)
        rows = d.get("rows", [])
        for http in (r for r in rows if r.get("path") == "http" and r.get("shape") != "tiny"):
            twin = [r for r in rows if r.get("path") == "engine" and all(r.get(k) == http.get(k) for k in keys)]
            conc = "all at once" if is_unbounded(http.get("concurrency")) else f"{http['concurrency']} concurrent"
            rate = "" if is_unbounded(http.get("request_rate")) else f", Poisson {http['request_rate']} req/s"
            adapters = http.get("adapters") or 0
            lengths = f"{http['input_len']}/{http['output_len']}" if http.get("input_len") else "mixed lengths"
            shape = f"{http['shape']} shape, " if http.get("shape") else ""
            measure = (
                f"over HTTP, `serve_bench.py` {shape}{http.get('workload', '')} {lengths}, {conc}{rate}, "
                f"{f'{adapters} adapters' if adapters else 'base model'}"
            )
            beside = ""
            if twin:
                eng = twin[0]["output_tok_s"]
                beside = f"engine alone {n(eng)} ({ratio(http['output_tok_s'] / eng)})"
            ttft = http.get("ttft_p99_ms")
            ours = f"{n(http['output_tok_s'])} output tok/s" + (f", TTFT p99 {n(ttft)} ms" if ttft is not None else "")
            key = f"serve_bench_{name}_{http.get('shape')}_{http.get('workload')}_{adapters}_{lengths}_{conc}{rate}"
            default = (http.get("input_len"), http.get("output_len")) == (1024, 128) and not rate and "all" in conc
            out.append(row(d, name, key, measure, ours, beside, "results", headline=default))
    return out


def mixed_steps(folder: pathlib.Path) -> list[Row]:
    out = []
    for name in gpu_files(folder, "mixed_steps"):
        d = load(folder, name)
        s = d.get("summary") or {}
        if s.get("vllm_workload_tok_s"):
            out.append(
                row(
                    d,
                    name,
                    f"mixed_vllm_{name}",
                    "engine, vLLM's default serving workload (Llama-3-8B shape, 1,024/128, all at once, batch 256)",
                    f"{n(s['vllm_workload_tok_s'])} output tok/s",
                    # the benchmark's floor adds each step's decode reads to its prefill compute (no
                    # overlap), so a peer can pass it: vLLM's published figure beside it says how far
                    f"serial roofline {n(s['floor_tok_s'])} ({100 * s['floor_fraction']:.0f} % of it); "
                    "vLLM 0.23 published 5,333 (H100, Llama-3.1-8B)",
                    "results",
                )
            )
        wave = s.get("mixed_over_wave") or []
        if len(wave) == 2 and None not in wave:
            out.append(
                row(
                    d,
                    name,
                    f"mixed_chat_{name}",
                    "engine, chat-like mixed lengths against 128/128 waves, batch 64, backbone / distinct adapters",
                    f"{ratio(wave[0])} / {ratio(wave[1])} the waves' tok/s",
                    "128/128 waves, same run",
                    "results",
                )
            )
    return out


def kv_auto(folder: pathlib.Path) -> list[Row]:
    """`num_kv_blocks: auto` (issue 45): its summary's figures as the benchmark named them."""
    out = []
    for name in gpu_files(folder, "kv_auto"):
        d = load(folder, name)
        s = {k: v for k, v in (d.get("summary") or {}).items() if k not in ("gpu", "date")}
        if s:
            text = "; ".join(f"{k} {v:,.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items())
            out.append(row(d, name, f"kv_auto_{name}", "KV cache sized automatically", text, "", "results"))
    return out


def cpu(folder: pathlib.Path) -> list[Row]:
    name = "cpu_generate.json"
    d = load(folder, name)
    if d is None:
        return []
    out = []
    for case, label in (("batch 1 (adapter)", "batch 1, one adapter"), ("batch 16 (mixed)", "batch 16 mixed adapters")):
        r = pick(d["rows"], case=case)
        out.append(
            row(
                d,
                name,
                "cpu_" + case.split()[1],
                f"CPU, SmolLM2-135M fp32, {label}",
                f"{r['engine_tok_s']:.1f} tok/s",
                f"HF + PEFT {r['hf_tok_s']:.1f} ({r['speedup']:.2f}×); matmuls alone {r['blas_ceiling_tok_s']:.1f}",
                "cpu-generation-cpu",
            )
        )
    return out


def diurnal(folder: pathlib.Path) -> list[Row]:
    name = "diurnal_trace.json"
    d = load(folder, name)
    if d is None:
        return []
    ours, ray = d["policies"]["loraplex"], d["policies"]["default"]
    s = d.get("summary") or {}
    full = s.get("batch0_or_full_fraction", ours["share_batch_0_or_max"])
    busy = f", {s['busy_releases']} busy releases" if s.get("busy_releases") is not None else ""
    tail = f" ({ratio(s['ttft_p99_ratio'])} Ray's)" if s.get("ttft_p99_ratio") else ""
    return [
        row(
            d,
            name,
            "diurnal",
            "autoscaling, diurnal trace (simulated engine): replica-seconds, time at batch 0 or full, TTFT p99",
            f"{ratio(s.get('replica_seconds_ratio', d['replica_seconds_ratio']))} Ray's replica-seconds, "
            f"{100 * full:.0f} %, TTFT p99 {ours['p99_ttft_s']:.2f} s{tail}, {ours['lost']} lost{busy}",
            f"Ray Serve's router + autoscaler: {100 * ray['share_batch_0_or_max']:.0f} %, "
            f"TTFT p99 {ray['p99_ttft_s']:.2f} s, {ray['lost']} lost",
            "diurnal-trace-cpu-and-h200",
        )
    ]


def cluster(folder: pathlib.Path) -> list[Row]:
    out = []
    d = load(folder, "cluster_routing.json")
    if d is not None:
        c, p = d["routers"]["consolidating"], d["routers"]["power_of_two"]
        out.append(
            row(
                d,
                "cluster_routing.json",
                "routing",
                "routing, 4 replicas (simulated engine): replica-time at batch 0 or full, TTFT p99",
                f"{100 * c['share_batch_0_or_max']:.0f} %, {c['p99_ttft_s']:.2f} s",
                f"Ray Serve's power of two: {100 * p['share_batch_0_or_max']:.0f} %, {p['p99_ttft_s']:.2f} s",
                "routing-cpu",
            )
        )
    d = load(folder, "cluster_faults.json")
    if d is not None:
        out.append(
            row(
                d,
                "cluster_faults.json",
                "faults",
                f"replica kills and a soak, {n(d['requests'])} streams (simulated engine)",
                f"{d['lost']} lost, {d['duplicated_tokens']} duplicated tokens, {d['migrations']} moves",
                "",
                "faults-cpu",
            )
        )
    d = load(folder, "upgrade_faults.json")
    if d is not None:
        out.append(
            row(
                d,
                "upgrade_faults.json",
                "redeploys",
                f"a config change and a model upgrade under load, {d['requests']} streams (simulated engine)",
                f"{d['lost']} lost, {d['explicit_errors']} errors, {d['duplicated_tokens']} duplicated tokens",
                "",
                "redeploys-cpu",
            )
        )
    return out


def cpu_paths(folder: pathlib.Path) -> list[Row]:
    out = []
    d = load(folder, "detokenize.json")
    if d is not None:
        r = pick(d["rows"], tokenizer="smollm2", stop=False)
        out.append(
            row(
                d,
                "detokenize.json",
                "detokenize",
                "detokenization, engine-thread CPU per token, SmolLM2 tokenizer",
                f"{r['windowed_us']:.1f} µs",
                f"decoding the whole output per token {r['whole_output_us']:.1f} µs",
                "detokenization-cpu",
            )
        )
    d = load(folder, "grammar_engines.json")
    if d is not None:
        g = pick(d["rows"], tokenizer="smollm2-49k", engine="llguidance")
        x = pick(d["rows"], tokenizer="smollm2-49k", engine="xgrammar")
        out.append(
            row(
                d,
                "grammar_engines.json",
                "grammar",
                "grammar engine (llguidance), SmolLM2 vocabulary: schema compile p99 / mask p50 at batch 64",
                f"{g['compile_cpu_ms_p99']:.2f} / {g['mask64_cpu_ms_p50']:.2f} ms",
                f"xgrammar {x['compile_cpu_ms_p99']:.2f} / {x['mask64_cpu_ms_p50']:.2f} ms",
                "grammar-engines-cpu",
            )
        )
    return out


def served_path(folder: pathlib.Path) -> list[Row]:
    name = "serve_path.json"
    d = load(folder, name)
    if d is None:
        return []
    last = max(r["round"] for r in d["rows"])
    after = pick(d["rows"], round=last, variant="after")
    before = [r for r in d["rows"] if r["round"] == last and r is not after][0]
    return [
        row(
            d,
            name,
            "served_path",
            f"served path's ceiling, simulated engine, {after['clients']} streaming clients (round {last})",
            f"{n(after['tok_s'])} tok/s, {after['tokens_per_event']:.1f} tokens per SSE event",
            f"one Serve item per token (the tree at {before['variant'].split('(')[-1].rstrip(')')}), "
            f"same run: {n(before['tok_s'])} tok/s",
            "served-path-ceiling-cpu",
        )
    ]


def diurnal_gpu(folder: pathlib.Path) -> list[Row]:
    out = []
    for name in gpu_files(folder, "diurnal_trace_gpu"):
        d = load(folder, name)
        ours = d["loraplex"]
        out.append(
            row(
                d,
                name,
                f"diurnal_gpu_{name}",
                f"autoscaling policy on up to {d['replicas_per_gpu']} real-engine replicas sharing one GPU",
                f"{ours['requests']} requests, {ours['lost']} lost, "
                f"{100 * ours['share_batch_0_or_max']:.0f} % of replica-time at batch 0 or full",
                "",
                "diurnal-trace-cpu-and-h200",
            )
        )
    return out


def engine_process_cpu(folder: pathlib.Path) -> list[Row]:
    """The engine in its own process against in-process on the CPU (benchmarks/engine_process_cpu.py)."""
    out = []
    for name, model in (
        ("engine_process_cpu.json", "SmolLM2-135M"),
        ("engine_process_cpu_simulated.json", "simulated"),
    ):
        d = load(folder, name)
        if d is None or not d.get("rows"):
            continue
        rows = d["rows"]

        def median(flag):
            v = sorted(r["tok_s"] for r in rows if r["engine_process"] == flag)
            return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2 if v else float("nan")

        out.append(
            row(
                d,
                name,
                f"engine_process_{name}",
                f"CPU over HTTP, {model} engine, {rows[0]['clients']} streaming clients: engine in its own process "
                f"(median of {len(rows) // 2} alternating rounds)",
                f"{n(median(True))} tok/s",
                f"in-process, same run: {n(median(False))} tok/s",
                "results",
            )
        )
    return out
