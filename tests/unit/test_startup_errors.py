"""Start-up failures say why, once (app/engine/startup.py): an unsupported GPU, a checkpoint that does
not match its config, out of memory in a stage — each one line with its fix, no exception chain.
And the probe's plumbing (app/engine/kv_probe.py) and the start-up report, on the CPU."""

import json
import shutil

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.engine.kv_probe import exercise, probe_config, probe_rows
from app.engine.startup import StartupError, check_checkpoint, check_gpu, stage, startup_cause
from app.model.config import ModelConfig
from tests.support.family_fixtures import FAMILIES, make_family_checkpoint


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and exc.__cause__ is None
    assert exc.__context__ is None or exc.__suppress_context__  # no chain printed below it
    return text


def test_gpus_older_than_sm80_are_refused_by_name():
    with pytest.raises(StartupError) as refused:
        check_gpu("cuda", capability=(7, 5))
    assert "sm_75" in str(refused.value) and "sm_80" in str(refused.value) and "\n" not in str(refused.value)
    check_gpu("cuda", capability=(8, 0))
    check_gpu("cuda:1", capability=(9, 0))
    check_gpu("cpu")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_checkpoint_matches_its_config(family, tmp_path):
    from transformers import AutoConfig

    path, _ = make_family_checkpoint(family, tmp_path)
    check_checkpoint(path, ModelConfig.from_hf(AutoConfig.from_pretrained(str(path))))


def test_a_config_that_does_not_describe_the_weights_is_refused(tiny_model_dir, tmp_path):
    """config.json of another size beside the weights: one line naming the first tensor that differs."""
    ckpt = shutil.copytree(tiny_model_dir, tmp_path / "mismatched")
    config = json.loads((ckpt / "config.json").read_text())
    config["intermediate_size"] = 2 * config["intermediate_size"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(StartupError) as refused:
        build_engine(ckpt, EngineConfig(num_kv_blocks=16), tokenizer=None)
    text = _one_line(refused.value)
    assert "mlp.gate_proj.weight is [160, 64], the config implies [320, 64]" in text
    assert "config.json that came with the weights" in text


def test_a_checkpoint_missing_layers_is_refused(tiny_model_dir, tmp_path):
    ckpt = shutil.copytree(tiny_model_dir, tmp_path / "short")
    config = json.loads((ckpt / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(StartupError, match="has no tensor model.layers.3.self_attn.q_proj.weight"):
        build_engine(ckpt, EngineConfig(num_kv_blocks=16), tokenizer=None)


@pytest.mark.parametrize(
    ("name", "fix"),
    [("weights", "tensor_parallel_size"), ("adapters", "max_loras"), ("kv", "num_kv_blocks (or set it to auto)")],
)
def test_out_of_memory_in_a_stage_is_one_line_with_its_fix(name, fix):
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB. GPU 0 has a total capacity of ...")
    with pytest.raises(StartupError) as refused:
        with stage(name, "cpu"):
            raise oom
    text = _one_line(refused.value)
    assert text.startswith("out of GPU memory ") and "(tried to allocate 64.00 GiB)" in text and fix in text


def test_kernel_compile_failures_are_one_line():
    from ops.nvrtc import CompileError

    with pytest.raises(StartupError) as refused:
        with stage("kv", "cpu"):
            raise CompileError("sgmv.cu sgmv_kernel<...>:\nerror: identifier __hmax2 is undefined\n1 error")
    text = _one_line(refused.value)
    assert "NVRTC could not compile" in text and "sgmv.cu" in text and "sm_80" in text


def test_the_cause_survives_a_traceback_in_text():
    """An engine built in a child process reports its failure as its traceback's text."""
    remote = RuntimeError(
        "the engine failed to start in its process:\nTraceback (most recent call last):\n  File ...\n"
        "app.engine.kv_sizing.KvCacheError: num_kv_blocks 8192 (64.0 GB) does not fit: ...\n"
    )
    assert startup_cause(remote) == "num_kv_blocks 8192 (64.0 GB) does not fit: ..."
    assert startup_cause(StartupError("x")) == "x"
    assert startup_cause(RuntimeError("something else")) is None


def test_the_probe_runs_its_requests_to_the_end(tiny_model_dir):
    """The probe's step (max_tokens_per_step tokens over max_batch_size requests, every sampler
    feature on) fits the probe's KV and finishes; on the CPU, plumbing only (no memory to measure)."""
    config = EngineConfig(max_num_seqs=6, max_tokens_per_step=40, block_size=4, num_kv_blocks=8)
    rows, per = probe_rows(config, max_model_len=64)
    assert (rows, per) == (6, 6)
    assert probe_rows(config, max_model_len=5) == (6, 2)  # each prompt leaves room for its tokens
    engine = build_engine(tiny_model_dir, probe_config(config, 64), tokenizer=None)
    assert engine.config.num_kv_blocks == 6 * 3 and not engine.config.prefix_caching
    exercise(engine, config, engine.model.cfg.vocab_size, 64)
    assert not engine.has_work() and engine.tokens_computed == rows * (per + 2)  # the last token is not computed
    assert engine.allocator.num_free == engine.config.num_kv_blocks


def test_stats_report_the_kv_cache_and_start_up_times(tiny_model_dir):
    engine = build_engine(tiny_model_dir, EngineConfig(num_kv_blocks=24, block_size=4), tokenizer=None)
    kv = engine.stats().kv_cache
    assert (kv["blocks"], kv["tokens"], kv["mode"]) == (24, 96, "explicit")
    block = 2 * engine.model.cfg.num_layers * 4 * engine.model.cfg.num_kv_heads * engine.model.cfg.head_dim * 4
    assert kv["bytes"] == 24 * block
    assert set(engine.stats().startup_seconds) >= {"weights", "adapters", "kv_sizing", "graph_capture"}
