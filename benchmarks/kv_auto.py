"""`num_kv_blocks: auto` on the GPU: serve_config_gpu.yaml's engine args, unchanged but for `model:`,
for the Llama-2-7B (MHA), Llama-3-8B (GQA) and Qwen2.5-7B shapes (random weights, real shapes).

For each shape: write the checkpoint (sharded safetensors, HF layout) and 4 rank-16 adapters, build
the engine as a replica does (app/engine/factory.py: weights, start-up adapters, probe, KV, graphs),
report the KV it chose (blocks, tokens, GB) and the start-up time split, and check it answers: the
probe's workload (a step of max_tokens_per_step prompt tokens over max_batch_size requests, then
decode) plus one request of max_model_len tokens.

Then, once, for one shape: bisect the largest explicit num_kv_blocks that builds and runs that
workload without running out of memory, (a) with the process capped at gpu_memory_utilization of
the device (torch.cuda.set_per_process_memory_fraction): the figure auto must come within 5 % of,
and (b) uncapped: the figure the rule's `largest` (what an explicit number may reach) estimates.

    python -m benchmarks.kv_auto            # the GPU: JSON at benchmarks/results/kv_auto_<gpu>.json
    python -m benchmarks.kv_auto --tiny     # the CPU: tiny shapes, explicit KV, a simulated bisection
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import shutil
import sys
import time
from dataclasses import replace

import yaml

from benchmarks.serve_throughput import word_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SERVE_CLI = "import sys; from ray.serve.scripts import cli; sys.exit(cli())"  # `serve`, where no script is installed
SHAPES = {
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, model_type="llama"),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, model_type="llama"),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, model_type="qwen2"),
}  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
BISECT_SHAPE = "llama3-8b"
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
MODULES |= {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
RANK, ADAPTERS = 16, 4


def _dims(m: str, s: dict) -> tuple[int, int]:
    """(in, out) of a projection."""
    h, i, hd = s["hidden_size"], s["intermediate_size"], s["hidden_size"] // s["num_attention_heads"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}.get(
        m, (i, h) if m == "down_proj" else (h, i)
    )


def write_checkpoint(root: pathlib.Path, shape: dict, device: str) -> pathlib.Path:
    """A random HF-layout checkpoint of ``shape`` (one safetensors file per layer), its tokenizer and
    ADAPTERS PEFT adapters under root/adapters."""
    import torch
    from safetensors.torch import save_file

    path = root / "model"
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    made: dict[tuple, torch.Tensor] = {}

    def rnd(*s):  # one random tensor per shape, written for every layer: values do not change the work
        if s not in made:
            made[s] = (torch.randn(*s, device=device, generator=g) * 0.02).to(torch.bfloat16).cpu()
        return made[s].clone()  # safetensors refuses one file holding shared storage twice

    h, v, bias = shape["hidden_size"], shape["vocab_size"], shape["model_type"] == "qwen2"
    index = {}
    for layer in range(-1, shape["num_hidden_layers"]):  # -1: embeddings, final norm, lm_head
        if layer < 0:
            part = {"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": rnd(v, h)}
            part["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        else:
            pre = f"model.layers.{layer}."
            part = {f"{pre}{MODULES[m]}.{m}.weight": rnd(o, i) for m in MODULES for i, o in [_dims(m, shape)]}
            for m in ("q_proj", "k_proj", "v_proj") if bias else ():
                part[f"{pre}self_attn.{m}.bias"] = rnd(_dims(m, shape)[1])
            for norm in ("input_layernorm", "post_attention_layernorm"):
                part[f"{pre}{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
        name = f"model-{layer + 1:05d}.safetensors"
        save_file(part, str(path / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config = {k: x for k, x in shape.items()}
    config |= {"architectures": ["Qwen2ForCausalLM" if bias else "LlamaForCausalLM"], "torch_dtype": "bfloat16"}
    config |= {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    config |= {"max_position_embeddings": 32768, "eos_token_id": None, "bos_token_id": None}
    (path / "config.json").write_text(json.dumps(config))
    word_tokenizer(v).save_pretrained(str(path))
    for k in range(ADAPTERS):
        out = root / "adapters" / f"a{k}"
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(shape["num_hidden_layers"]):
            for m in MODULES:
                i, o = _dims(m, shape)
                key = f"base_model.model.model.layers.{layer}.{MODULES[m]}.{m}"
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = rnd(RANK, i), rnd(o, RANK)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        peft = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK}
        peft |= {"lora_dropout": 0.0, "target_modules": list(MODULES), "bias": "none", "use_rslora": False}
        (out / "adapter_config.json").write_text(json.dumps(peft))
    return path


def gpu_config_args(model: pathlib.Path, adapters: pathlib.Path, tiny: bool) -> dict:
    """serve_config_gpu.yaml's args with only `model:` (and the adapters' directory) changed."""
    args = yaml.safe_load((ROOT / "serve_config_gpu.yaml").read_text())["applications"][0]["args"]
    args = {**args, "model": str(model), "adapter_dirs": [str(adapters)], "registry_path": None}
    if tiny:  # the CPU: no auto (nothing to measure), fp32, eager
        args |= {"device": "cpu", "dtype": "float32", "num_kv_blocks": 1024, "cuda_graphs": False}
        args |= {"max_model_len": 256, "max_batch_size": 8, "max_tokens_per_step": 256}
    return args


def workload(core, config, max_model_len: int) -> None:
    """The probe's step and decode, plus one request of max_model_len tokens (long-context prefill chunks)."""
    from app.engine.kv_probe import exercise
    from app.protocol import GenerateRequest, SamplingParams

    vocab = core.model.cfg.vocab_size
    long = tuple(i % vocab for i in range(max_model_len - 2))
    core.add(GenerateRequest("kv-auto-long", long, SamplingParams(max_tokens=2, ignore_eos=True, seed=0)))
    exercise(core, config, vocab, max_model_len)


def release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def fits(model, store, config, blocks: int, max_model_len: int) -> bool:
    """Whether an engine of ``blocks`` KV blocks builds and runs the workload without running out of memory."""
    import torch

    from app.engine.core import EngineCore
    from app.engine.startup import StartupError

    core = None
    try:
        core = EngineCore(model, store, None, replace(config, num_kv_blocks=blocks))
        workload(core, config, max_model_len)
        ok = True
    except (torch.OutOfMemoryError, StartupError):
        ok = False
    if core is not None:
        core.runner.graphs = None
    del core
    release()
    return ok


def bisect(model, store, config, max_model_len: int, lo: int, hi: int, tol: float, fits_fn=fits) -> dict:
    """The largest blocks in [lo, hi] that fit (lo must, hi must not; widened if they don't), to ``tol``."""
    tries = []

    def probe(n: int) -> bool:
        start = time.perf_counter()
        ok = fits_fn(model, store, config, n, max_model_len)
        tries.append({"blocks": n, "fits": ok, "seconds": round(time.perf_counter() - start, 2)})
        print(f"    {n} blocks: {'fits' if ok else 'out of memory'}", flush=True)
        return ok

    while not probe(lo) and lo > 1:
        hi, lo = lo, lo // 2
    while probe(hi):
        lo, hi = hi, int(hi * 1.25)
    while hi - lo > max(1, int(tol * lo)):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    return {"largest": lo, "tries": tries}


def one_shape(name: str, root: pathlib.Path, tiny: bool, device: str) -> tuple[dict, object]:
    from app.engine.factory import build_engine
    from app.serving.config import parse_args

    shape = dict(SHAPES[name], **TINY) if tiny else SHAPES[name]
    start = time.perf_counter()
    model_dir = write_checkpoint(root, shape, device)
    written = time.perf_counter() - start
    settings = parse_args(gpu_config_args(model_dir, root / "adapters", tiny), "base")
    adapters = {f"a{k}": str(root / "adapters" / f"a{k}") for k in range(ADAPTERS)}
    start = time.perf_counter()
    core = build_engine(model_dir, settings.engine, adapters, store_config=settings.adapter_store)
    built = time.perf_counter() - start
    workload(core, settings.engine, core.max_model_len)
    row = {
        "shape": name,
        "checkpoint_write_s": round(written, 1),
        "engine_start_s": round(built, 2),
        "answered": not core.has_work(),
        **core.stats().kv_cache,
        "startup_seconds": core.stats().startup_seconds,
    }
    return row, core


def table(rows: list[dict]) -> str:
    head = (
        f"{'shape':12} {'blocks':>7} {'tokens':>8} {'KV GB':>6} {'used GB':>7} {'wksp GB':>7} {'start s':>7}  split (s)"
    )
    lines = [head]
    for r in rows:
        split = ", ".join(f"{k} {v:.1f}" for k, v in r["startup_seconds"].items())
        lines.append(
            f"{r['shape']:12} {r['blocks']:7d} {r['tokens']:8d} {r['gb']:6.1f} {r['used_gb']:7.2f} "
            f"{r['workspace_gb']:7.2f} {r['engine_start_s']:7.1f}  {split}"
        )
    return "\n".join(lines)


def main(tiny: bool, shapes: list[str], bisect_shape: str | None) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (tiny shapes: plumbing only)"
    rows, bisection = [], None
    for name in shapes:
        root = pathlib.Path(f"/tmp/kv_auto/{name}")
        row, core = one_shape(name, root, tiny, device)
        rows.append(row)
        print(table([row]), flush=True)
        if name == bisect_shape:
            try:
                bisection = bisect_once(core, row, tiny)
            except Exception as exc:  # the rows measured so far are still written
                bisection = {"shape": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(f"bisection failed: {bisection['error']}", flush=True)
        core.runner.graphs = None
        del core
        release()
        shutil.rmtree(root, ignore_errors=True)  # three 15 GB checkpoints do not fit the disk together
    print(table(rows))
    tag = "tiny" if tiny else gpu.lower().replace("nvidia ", "").split()[0]
    out = RESULTS / f"kv_auto_{tag}.json"
    old = json.loads(out.read_text()) if out.exists() else {}  # runs of some shapes each add theirs
    kept = [r for r in old.get("rows", []) if r["shape"] not in {r["shape"] for r in rows}]
    bisection = bisection or old.get("bisection")
    out.write_text(json.dumps({"device": gpu, "rows": kept + rows, "bisection": bisection}, indent=1))
    print(f"wrote {out}")


def bisect_once(core, row: dict, tiny: bool) -> dict:
    """(a) capped at the utilization: auto's figure against the largest that fits there; (b) uncapped:
    the rule's `largest` against the largest that fits the whole device."""
    import torch

    model, store, config = core.model, core.adapters, core.config
    max_model_len, auto, util = core.max_model_len, row["blocks"], config.gpu_memory_utilization
    rule_largest = row["largest_blocks"] or int(1.2 * auto)  # None on the CPU
    core.runner.graphs = None  # the serving engine's KV and graphs go: the tries need the memory
    core.kv = core.runner.kv = None
    release()
    fits_fn = fits
    if tiny:  # no memory to run out of on the CPU: a budget stands in for it (the search's plumbing)
        fits_fn = lambda m, s, c, n, L: n <= 1.1 * auto  # noqa: E731
    out = {"shape": row["shape"], "auto_blocks": auto, "rule_largest_blocks": rule_largest}
    if not tiny:
        torch.cuda.set_per_process_memory_fraction(util)
    try:
        capped = bisect(model, store, config, max_model_len, int(auto * 0.95), int(auto * 1.1), 0.005, fits_fn)
    finally:
        if not tiny:
            torch.cuda.set_per_process_memory_fraction(1.0)
    out |= {"capped_largest_blocks": capped["largest"], "capped_tries": capped["tries"]}
    out["auto_vs_capped"] = round(auto / capped["largest"], 4)
    uncapped = bisect(
        model, store, config, max_model_len, int(rule_largest * 0.95), int(rule_largest * 1.05), 0.005, fits_fn
    )
    out |= {"uncapped_largest_blocks": uncapped["largest"], "uncapped_tries": uncapped["tries"]}
    out["rule_vs_uncapped"] = round(rule_largest / uncapped["largest"], 4)
    print(
        f"bisection ({row['shape']}): auto {auto} = {out['auto_vs_capped']:.3f} x the largest that fits within "
        f"utilization {util} ({capped['largest']}); the rule's largest {rule_largest} = {out['rule_vs_uncapped']:.3f} x "
        f"the largest that fits the device ({uncapped['largest']})",
        flush=True,
    )
    return out


def serve_once(name: str, tiny: bool) -> None:
    """`serve run` of serve_config_gpu.yaml with only `model:` (and adapter_dirs) changed: time to healthy,
    an answer, and the KV line the replica logged. Merged into the JSON as `serve`."""
    import os
    import signal
    import subprocess

    import httpx
    import torch

    root = pathlib.Path(f"/tmp/kv_auto/serve-{name}")
    shape = dict(SHAPES[name], **TINY) if tiny else SHAPES[name]
    model_dir = write_checkpoint(root, shape, "cuda" if torch.cuda.is_available() and not tiny else "cpu")
    config = yaml.safe_load((ROOT / "serve_config_gpu.yaml").read_text())
    config["applications"][0]["args"] = gpu_config_args(model_dir, root / "adapters", tiny)
    if tiny:
        config["applications"][0]["args"]["replica"]["ray_actor_options"] = {"num_cpus": 1}
    path = root / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    log = root / "serve.log"
    env = os.environ | {"RAY_ADDRESS": "local", "RAY_USAGE_STATS_ENABLED": "0"}  # a Ray of its own
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVE_CLI, "run", str(path)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    url, healthy, answer = "http://127.0.0.1:8000", None, None
    try:
        while time.perf_counter() - start < 420 and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    healthy = time.perf_counter() - start
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        if healthy is not None:
            body = {"model": "model", "prompt": "w1 w2 w3", "max_tokens": 8}
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    kv_lines = [line.strip() for line in text.splitlines() if "KV cache (" in line]
    result = {"shape": name, "healthy_after_s": healthy, "answer": answer, "kv_log": kv_lines[-1:] or None}
    if healthy is None:
        result["log_tail"] = text[-4000:]
    print(json.dumps(result, indent=1), flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not tiny else "cpu"
    tag = "tiny" if tiny else gpu.lower().replace("nvidia ", "").split()[0]
    out = RESULTS / f"kv_auto_{tag}.json"
    data = json.loads(out.read_text()) if out.exists() else {"device": gpu, "rows": [], "bisection": None}
    out.write_text(json.dumps({**data, "serve": result}, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU plumbing run: tiny shapes, no GPU")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--bisect", default=BISECT_SHAPE, help="the shape to bisect once ('' for none)")
    p.add_argument("--serve", choices=list(SHAPES), help="instead: `serve run` the GPU config with this shape")
    a = p.parse_args()
    if a.serve:
        serve_once(a.serve, a.tiny)
    else:
        main(a.tiny, a.shapes, a.bisect or None)
