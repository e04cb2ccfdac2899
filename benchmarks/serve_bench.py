"""`vllm bench serve` against this server, and the same requests through the engine alone.

    source .device-wheels/install.sh && python -m benchmarks.serve_bench            # vLLM's default rows
    python -m benchmarks.serve_bench --tiny                                       # plumbing, on the CPU
    python -m benchmarks.serve_bench --plot-only

A random checkpoint of a real model's shape (fp16, HF layout, a word-level tokenizer with no
EOS) and 32 random rank-16 PEFT adapters on all seven projections are written under /tmp
(benchmarks/serve_throughput.py's helpers; kept for the next run). For every scenario (the
product of --dataset, --adapters, --max-concurrency and --request-rate, see
benchmarks/serve_bench_core.py) the same request list runs
- path "engine": through the engine alone (AsyncEngine in this process), then
- path "http": through Serve (one LoraReplica, the real Ingress ×2, the proxy), as streaming
  /v1/completions with prompt token ids and min_tokens = max_tokens, so exactly the requested
  number of tokens is generated (the count is checked against each stream's usage).
Each run prints vLLM's report; rows (one per path × scenario, keyed by path, workload, adapters,
input_len, output_len, concurrency, request_rate) are merged into
benchmarks/results/serve_bench_<gpu>.json, and a PNG of output tok/s beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import pathlib
import time
from dataclasses import replace

from benchmarks import serve_throughput as st
from benchmarks.serve_bench_core import (
    Outcome,
    Req,
    chat_requests,
    drive,
    metrics,
    plot,
    random_requests,
    report,
    save,
)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SHAPES = {
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    ),
    "llama2-7b": st.SHAPE,
}


def engine_args(a, model: pathlib.Path, root: pathlib.Path) -> dict:
    tiny = dict(dtype="float32", device="cpu", cuda_graphs=False, num_kv_blocks=1024)
    return {
        **st.ENGINE,
        "max_batch_size": a.max_batch,
        "max_tokens_per_step": a.max_tokens_per_step,
        "num_kv_blocks": "auto",
        "max_model_len": 4096,
        "engine_process": {"auto": "auto", "on": True, "off": False}[a.engine_process],  # the http path's replica
        **(tiny if a.tiny else {}),
        "model": str(model),
        "model_name": "base",
        "adapter_dirs": [str(root / "adapters")],
        "replica": {
            "num_replicas": 1,
            "max_ongoing_requests": a.replica_max_ongoing,  # the engine queues what its batch cannot take
            "ray_actor_options": {"num_gpus": 0 if a.tiny else 1, "num_cpus": 4},
        },
        "ingress": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
    }


def scenarios(a, vocab: int) -> list[tuple[dict, list[Req]]]:
    out = []
    for dataset, adapters, conc, rate in itertools.product(a.dataset, a.adapters, a.max_concurrency, a.request_rate):
        if dataset == "random":
            reqs = random_requests(a.num_prompts, a.input_len, a.output_len, vocab, adapters, a.seed)
            lens = (a.input_len, a.output_len)
        else:
            reqs, lens = chat_requests(a.num_prompts, vocab, adapters, a.seed), (None, None)
        scenario = {
            "workload": dataset,
            "adapters": adapters,
            "input_len": lens[0],
            "output_len": lens[1],
            "concurrency": conc,
            "request_rate": "inf" if math.isinf(rate) else rate,
            "num_prompts": a.num_prompts,
        }
        out.append((scenario, reqs))
    return out


async def _run_all(path: str, send, runs, a) -> list[dict]:
    """Warm every model once (not measured: cold adapter loads, first graphs), then each scenario."""
    models = sorted({r.adapter for _, reqs in runs for r in reqs}, key=str)
    await asyncio.gather(*(send(Req(-1 - i, (1, 2, 3, 4) * 4, 4, m)) for i, m in enumerate(models)))
    rows = []
    for scenario, reqs in runs:
        outcomes, duration = await drive(reqs, send, float(scenario["request_rate"]), scenario["concurrency"], a.seed)
        m = metrics(reqs, outcomes, duration)
        title = f"{path} {scenario['workload']} adapters={scenario['adapters']} c={scenario['concurrency']}"
        print(report(title, m), flush=True)
        rows.append({"path": path, **scenario, **m})
    return rows


def engine_send(engine):
    from app.protocol import GenerateRequest, SamplingParams

    async def send(req: Req) -> Outcome:
        n = req.output_len
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        request = GenerateRequest(f"b{req.index}-{time.perf_counter_ns()}", req.prompt, params, req.adapter)
        o, start, last = Outcome(ok=True), time.perf_counter(), None
        async for chunk in engine.generate(request):
            ids = getattr(chunk, "token_ids", None)
            if ids is None:  # a Migrate or an error ends it: not a complete run
                return Outcome(ok=False, error=f"{type(chunk).__name__}: {chunk}")
            if ids:
                now = time.perf_counter()
                o.ttft = o.ttft or now - start
                if last is not None:
                    o.itl.append(now - last)
                last, o.output_tokens, o.items = now, o.output_tokens + len(ids), o.items + 1
        o.latency = time.perf_counter() - start
        return _checked(o, n)

    return send


def _checked(o: Outcome, expected: int) -> Outcome:
    if o.output_tokens != expected:
        return Outcome(ok=False, error=f"{o.output_tokens} tokens generated, {expected} asked for")
    return o


def http_send(port: int):
    async def send(req: Req) -> Outcome:
        n = req.output_len
        body = json.dumps(
            {
                "model": req.adapter or "base",
                "prompt": list(req.prompt),
                "max_tokens": n,
                "min_tokens": n,  # vLLM's extension: no stop before n tokens (the model has no EOS either)
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        start = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            status = await reader.readline()
            if b" 200 " not in status:
                return Outcome(ok=False, error=f"HTTP {status.decode().strip()}: {(await reader.read(400)).decode()}")
            return _checked(await _read_stream(reader, start), n)
        finally:
            writer.close()

    return send


async def _read_stream(reader, start: float) -> Outcome:
    """An SSE body in chunked framing: each `data:` line is one item; the usage event counts the tokens."""
    o, last = Outcome(ok=True), None
    while line := await reader.readline():
        if line.startswith(b"data: [DONE]"):
            break
        if not line.startswith(b"data: "):  # headers, chunk sizes, blank lines
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            o.output_tokens = event["usage"]["completion_tokens"]
        if event.get("choices") and event["choices"][0].get("text"):
            now = time.perf_counter()
            o.ttft = o.ttft or now - start
            if last is not None:
                o.itl.append(now - last)
            last, o.items = now, o.items + 1
    o.latency = time.perf_counter() - start
    return o


def engine_rows(a, settings, root: pathlib.Path, runs) -> list[dict]:
    from app.engine.async_engine import AsyncEngine
    from app.engine.factory import build_engine

    adapters = {f"a{k}": str(root / "adapters" / f"a{k}") for k in range(st.ADAPTERS)}
    config = replace(settings.engine, requeue_preempted=True)  # one engine: nowhere to move a preempted request
    engine = AsyncEngine(build_engine(root / "model", config, adapters))
    try:
        return asyncio.run(_run_all("engine", engine_send(engine), runs, a))
    finally:
        engine.shutdown()


def http_rows(a, args: dict, runs) -> list[dict]:
    import resource

    import ray

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # one connection per stream in flight
    cap = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, cap), hard))
    from ray import serve

    from app.builder import app_from_args

    ray.init(address="local", num_cpus=12, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    try:
        serve.run(app_from_args(args), name="loraplex", route_prefix="/")
        return asyncio.run(_run_all("http", http_send(a.port), runs, a))
    finally:
        serve.shutdown()
        ray.shutdown()


def checkpoint(a) -> pathlib.Path:
    """The random checkpoint and adapters for this shape, written once (a marker says it is whole)."""
    shape = "tiny" if a.tiny else a.shape
    root = pathlib.Path("/tmp/serve_bench") / shape
    if not (root / "written").exists():
        started = time.time()
        st.make_checkpoint(root, a.tiny, SHAPES[a.shape])
        (root / "written").write_text(shape)
        print(f"checkpoint written in {time.time() - started:.0f} s", flush=True)
    return root


def main(a) -> None:
    import gc

    import torch

    from app.serving.config import parse_args

    started = time.time()
    root = checkpoint(a)
    args = engine_args(a, root / "model", root)
    runs = scenarios(a, SHAPES[a.shape]["vocab_size"])
    rows = []
    if "engine" in a.paths:
        rows += engine_rows(a, parse_args(args, "base"), root, runs)
        gc.collect()
        torch.cuda.empty_cache()
    if "http" in a.paths:
        rows += http_rows(a, args, runs)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (tiny model: plumbing only)"
    for row in rows:
        row.update(shape=a.shape if not a.tiny else "tiny", device=device, max_batch=a.max_batch)
    save(a.out, rows, {"device": device, "wall_s": time.time() - started})


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: checks the plumbing only")
    p.add_argument("--paths", nargs="+", choices=("engine", "http"), default=["engine", "http"])
    p.add_argument("--dataset", nargs="+", choices=("random", "chat"), default=["random"])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", nargs="+", type=float, default=[math.inf], help="requests/s; inf: all at once")
    p.add_argument("--max-concurrency", nargs="+", type=lambda v: None if v == "none" else int(v), default=[None])
    p.add_argument("--adapters", nargs="+", type=int, default=[0, 32], help="round-robin over N adapters; 0: base")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--max-tokens-per-step", type=int, default=8192)
    p.add_argument("--replica-max-ongoing", type=int, default=1024)
    p.add_argument("--engine-process", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--plot-only", action="store_true")
    a = p.parse_args(argv)
    if a.tiny:  # small enough for 2 CPU cores; --num-prompts etc. still apply if given
        a.max_batch, a.max_tokens_per_step = min(a.max_batch, 16), min(a.max_tokens_per_step, 512)
    if any(n > st.ADAPTERS for n in a.adapters):
        p.error(f"--adapters: at most {st.ADAPTERS} (the adapters written)")
    return a


def _out(a) -> pathlib.Path:
    if a.out:
        return a.out
    if a.tiny:
        return RESULTS / "serve_bench_tiny_cpu.json"
    import torch

    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
    gpu = next((g for g in ("h200", "h100", "a100", "l40s") if g in name), name.split()[-1])
    return RESULTS / f"serve_bench_{gpu}.json"


if __name__ == "__main__":
    a = parse()
    a.out = _out(a)
    if not a.plot_only:
        main(a)
    plot(a.out)
