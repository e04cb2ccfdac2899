"""The engine process on CUDA (app/engine/process_engine.py): a spawned child builds the model,
its adapter slots and CUDA graphs on the GPU and generates what the in-process engine generates
(each request alone, so both run the same batch shapes); through Serve, a LoraReplica (engine
process by default on CUDA) serves a streaming completion, and after a SIGKILL of the replica its
engine process — the one holding the GPU memory — is gone from the process table."""

import os
import shutil
import signal
import time

import httpx
import pytest
import torch

from app.engine.async_engine import build_async_engine
from app.engine.config import EngineConfig
from app.engine.process_engine import ProcessEngine
from app.protocol import GenerateRequest, SamplingParams
from app.serving.registry import AdapterSpec
from app.serving.replica import ReplicaSettings
from tests.support.helpers import make_random_adapter

pytestmark = pytest.mark.gpu
CONFIG = EngineConfig(
    max_num_seqs=8, num_kv_blocks=256, block_size=16, max_model_len=512, dtype=torch.float16, device="cuda"
)
DEADLINE_S = 120


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.model.default import default_model_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.3,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    path = tmp_path_factory.mktemp("engine-process-gpu") / "model"
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (default_model_dir() / name).exists():
            shutil.copy(default_model_dir() / name, path / name)
    make_random_adapter(
        path, path.parent / "adapters" / "a1", rank=8, targets=["q_proj", "v_proj", "down_proj"], seed=1
    )
    return path


async def _one(engine, request):
    tokens, text = [], ""
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        text += chunk.text
    return tokens, text


def _requests():
    return [
        GenerateRequest(
            f"g{i}",
            (100 + i, 2000, 3000 + i, 40),
            SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=i),
            "a1" if i % 3 == 0 else None,
        )
        for i in range(6)
    ]


def test_the_engine_process_on_cuda_generates_what_the_in_process_engine_does(model):
    import asyncio

    settings = ReplicaSettings(str(model), CONFIG, (AdapterSpec("a1", str(model.parent / "adapters" / "a1"), 1),))

    async def each_alone(engine):
        return [await _one(engine, r) for r in _requests()]

    local = build_async_engine(settings)
    try:
        want = asyncio.run(each_alone(local))
    finally:
        local.shutdown()
    del local
    torch.cuda.empty_cache()
    child = ProcessEngine(build_async_engine, settings)
    try:
        got = asyncio.run(each_alone(child))
        stats = child.stats().result(DEADLINE_S).stats
    finally:
        child.shutdown()
    assert got == want
    assert "a1" in stats.resident_adapters


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            out.append(int(entry))
    return out


def test_a_replica_serves_with_its_engine_process_and_takes_it_along_when_killed(model):
    import ray

    from app.builder import app_from_args
    from tests.support.app_fixtures import APP, config_args, serving
    from tests.support.cluster_fixtures import replica_actor, replica_ids

    args = config_args(
        model=str(model),
        model_name="model",
        device="cuda",
        dtype="float16",
        max_batch_size=8,
        num_kv_blocks=256,
        max_model_len=512,
        adapter_dirs=[str(model.parent / "adapters")],
        replica={"num_replicas": 1, "ray_actor_options": {"num_gpus": 1, "num_cpus": 1}},
    )
    assert "engine_process" not in args  # auto: the engine process on CUDA
    with serving({APP: (app_from_args(args), "/")}) as url:
        for name in ("model", "a1"):
            body = {"model": name, "prompt": "Hello there", "max_tokens": 16, "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
                assert r.status_code == 200
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) > 2
        (replica,) = replica_ids(APP)
        pid = ray.get(replica_actor(APP, replica).__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        (engine,) = _children(pid)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + DEADLINE_S
        while _alive(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(engine), "the engine process outlived its replica"
