"""The served path against the engine alone on one GPU (issue: HTTP ≥ 0.9× the engine).

    source .device-wheels/install.sh && python -m benchmarks.serve_throughput   # on the H200, ~5 min
    python -m benchmarks.serve_throughput --plot-only

Writes a random Llama-2-7B-shape fp16 checkpoint in HF layout (no EOS: every request runs to
max_tokens; a 32000-word tokenizer, so text is decoded per token as in production) and 32
random rank-16 PEFT adapters on all seven projections under /tmp. Then, closed-loop
streaming load at 1, 8, 32, 64 clients, base model and 32 distinct adapters (client i uses
adapter i mod 32), 128 random prompt token ids, max_tokens 128, greedy:
- path "engine": the AsyncEngine alone in this process (the replica's engine, tokenizer and
  all), before Serve starts;
- path "http": Serve with one LoraReplica (max batch 64, CUDA graphs) and two Ingress
  replicas, as serve_config_gpu.yaml builds it, through Serve's proxy and HTTP.
Rows: path, clients, workload, tok_s, ttft_p50/p99, tpot_p50/p99 (s) (benchmarks/sse_load.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import pathlib
import random
import time
from dataclasses import replace

from benchmarks.sse_load import completion_body, http_client, summarize

OUT = pathlib.Path(__file__).resolve().parent / "results" / "serve_throughput_h200.json"
CLIENTS, ADAPTERS, RANK, PROMPT, NEW = (1, 8, 32, 64), 32, 16, 128, 128
WARMUP_S, MEASURE_S = 2.0, 8.0
SHAPE = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
)
MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
ENGINE = dict(
    max_batch_size=64,
    max_tokens_per_step=4096,
    num_kv_blocks=4096,
    block_size=16,
    max_loras=32,
    max_lora_rank=RANK,
    max_model_len=2048,
    cuda_graphs=True,
    dtype="float16",
    device="cuda",
)


def _dims(name: str, s=SHAPE) -> tuple[int, int]:
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = h // s["num_attention_heads"] * s.get("num_key_value_heads", s["num_attention_heads"])  # GQA
    return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "k_proj": (h, kv), "v_proj": (h, kv)}.get(
        name, (h, h)
    )


def word_tokenizer(vocab: int):
    """A fast tokenizer of ``vocab`` words "w0", "w1", …: a random model's text, decoded as in production."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0")


def make_checkpoint(root: pathlib.Path, tiny: bool, base_shape: dict = SHAPE) -> pathlib.Path:
    """base_shape: the model's config fields (SHAPE: Llama-2-7B's); tiny keeps its vocabulary only."""
    import torch
    from safetensors.torch import save_file

    shape = (
        dict(
            base_shape,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
        if tiny
        else base_shape
    )
    path, device = root / "model", "cuda" if torch.cuda.is_available() else "cpu"
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, device=device, generator=g) * 0.02).half().cpu()  # noqa: E731
    h, v = shape["hidden_size"], shape["vocab_size"]
    index = {}
    for layer in range(-1, shape["num_hidden_layers"]):  # -1: embeddings, final norm, lm_head
        if layer < 0:
            part = {
                "model.embed_tokens.weight": rnd(v, h),
                "model.norm.weight": torch.ones(h).half(),
                "lm_head.weight": rnd(v, h),
            }
        else:
            pre = f"model.layers.{layer}."
            part = {f"{pre}{MODULES[m]}.{m}.weight": rnd(o, i) for m in MODULES for i, o in [_dims(m, shape)]}
            part[pre + "input_layernorm.weight"] = torch.ones(h).half()
            part[pre + "post_attention_layernorm.weight"] = torch.ones(h).half()
        name = f"model-{layer + 1:05d}.safetensors"
        save_file(part, str(path / name), metadata={"format": "pt"})
        index.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "torch_dtype": "float16",
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "eos_token_id": None,
                "bos_token_id": None,
                **shape,
            }
        )
    )
    word_tokenizer(v).save_pretrained(str(path))
    _adapters(root / "adapters", shape, rnd)
    return path


def _adapters(root: pathlib.Path, shape: dict, rnd) -> None:
    for k in range(ADAPTERS):
        out = root / f"a{k}"
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(shape["num_hidden_layers"]):
            for m in MODULES:
                i, o = _dims(m, shape)
                key = f"base_model.model.model.layers.{layer}.{MODULES[m]}.{m}"
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = rnd(RANK, i), rnd(o, RANK)
        from safetensors.torch import save_file

        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "task_type": "CAUSAL_LM",
                    "r": RANK,
                    "lora_alpha": 2 * RANK,
                    "lora_dropout": 0.0,
                    "target_modules": list(MODULES),
                    "bias": "none",
                    "use_rslora": False,
                }
            )
        )


def _bodies(workload: str, client: int, rng: random.Random, model_name: str):
    model = f"a{client % ADAPTERS}" if workload == "adapters" else model_name
    while True:
        yield completion_body([rng.randrange(32000) for _ in range(PROMPT)], NEW, model)


async def _points(run_point) -> list[dict]:
    rows = []
    for workload, clients in itertools.product(("base", "adapters"), CLIENTS):
        records: list = []
        start = time.monotonic()
        t0, t1 = start + WARMUP_S, start + WARMUP_S + MEASURE_S
        await run_point(workload, clients, t1, records)
        rows.append({"clients": clients, "workload": workload, **summarize(records, t0, t1)})
        print(rows[-1], flush=True)
    return rows


async def engine_rows(model: pathlib.Path, adapters: pathlib.Path, settings) -> list[dict]:
    """The engine alone: closed-loop callers of AsyncEngine.generate, as the replica makes them."""
    from app.engine.async_engine import AsyncEngine
    from app.engine.factory import build_engine
    from app.protocol import GenerateRequest, SamplingParams

    config = replace(settings.engine, requeue_preempted=True)  # one engine: nowhere to move a preempted request
    engine = AsyncEngine(build_engine(model, config, {f"a{k}": str(adapters / f"a{k}") for k in range(ADAPTERS)}))
    ids = itertools.count()

    async def caller(workload, client, until, records, rng):
        while time.monotonic() < until:
            request = GenerateRequest(
                f"e{next(ids)}",
                tuple(rng.randrange(32000) for _ in range(PROMPT)),
                SamplingParams(max_tokens=NEW, temperature=0.0),
                f"a{client % ADAPTERS}" if workload == "adapters" else None,
            )
            start, first, n, items = time.monotonic(), None, 0, 0
            async for chunk in engine.generate(request):
                n, items = n + len(chunk.token_ids), items + 1
                first = first or time.monotonic()
            records.append((start, first, time.monotonic(), n, items))

    async def point(workload, clients, until, records):
        await asyncio.gather(*(caller(workload, c, until, records, random.Random(c)) for c in range(clients)))

    try:
        return [{"path": "engine", **r} for r in await _points(point)]
    finally:
        engine.shutdown()


async def http_rows(args: dict, port: int) -> list[dict]:
    async def point(workload, clients, until, records):
        await asyncio.gather(
            *(
                http_client(port, _bodies(workload, c, random.Random(c), args["model_name"]), until, records)
                for c in range(clients)
            )
        )

    return [{"path": "http", **r} for r in await _points(point)]


def main(tiny: bool) -> None:
    import gc

    import ray
    import torch
    from ray import serve

    from app.builder import app_from_args
    from app.serving.config import parse_args

    root = pathlib.Path("/tmp/serve_throughput")
    started = time.time()
    model = make_checkpoint(root, tiny)
    engine = dict(ENGINE, dtype="float32", device="cpu", cuda_graphs=False) if tiny else ENGINE
    args = {
        **engine,
        "model": str(model),
        "model_name": "base",
        "adapter_dirs": [str(root / "adapters")],
        "replica": {
            "num_replicas": 1,
            "max_ongoing_requests": 256,
            "ray_actor_options": {"num_gpus": 0 if tiny else 1, "num_cpus": 4},
        },
        "ingress": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
    }
    print(f"checkpoint written in {time.time() - started:.0f} s", flush=True)
    rows = asyncio.run(engine_rows(model, root / "adapters", parse_args(args, "base")))
    gc.collect()
    torch.cuda.empty_cache()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = 8000
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app_from_args(args), name="loraplex", route_prefix="/")
    try:
        rows += asyncio.run(http_rows(args, port))
    finally:
        serve.shutdown()
        ray.shutdown()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (tiny model: plumbing only)"
    OUT.write_text(
        json.dumps(
            {
                "device": device,
                "prompt": PROMPT,
                "max_tokens": NEW,
                "adapters": ADAPTERS,
                "rank": RANK,
                "measure_s": MEASURE_S,
                "wall_s": time.time() - started,
                "rows": rows,
            },
            indent=1,
        )
    )


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.method import save_figure

    data = json.loads(OUT.read_text())
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, workload in zip(axes, ("base", "adapters")):
        for path, style in (("engine", "o--"), ("http", "s-")):
            pts = [r for r in data["rows"] if r["path"] == path and r["workload"] == workload]
            ax.plot([r["clients"] for r in pts], [r["tok_s"] for r in pts], style, label=path)
        ax.set_title(f"{workload} ({ADAPTERS} distinct adapters)" if workload == "adapters" else workload)
        ax.set_xlabel("streaming clients")
        ax.set_xscale("log", base=2)
        ax.set_xticks(CLIENTS, [str(c) for c in CLIENTS])
        ax.legend()
    axes[0].set_ylabel("tokens/s")
    save_figure(
        fig, f"Served path vs engine alone, streaming /v1/completions ({data['device']})", OUT.with_suffix(".png")
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: checks the plumbing only")
    p.add_argument("--out", type=pathlib.Path)
    a = p.parse_args()
    OUT = a.out or (OUT.with_name("serve_throughput_tiny_cpu.json") if a.tiny else OUT)
    if a.tiny:
        WARMUP_S, MEASURE_S = 1.0, 3.0
    if not a.plot_only:
        main(a.tiny)
    plot()
