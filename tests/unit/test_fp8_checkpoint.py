"""fp8 checkpoints and the quantization setting on the CPU: a compressed-tensors fp8 checkpoint
(written here with safetensors) loads with its scales placed exactly as the quantizer places
them, equal to quantizing the bf16 checkpoint at load; what is not served is refused by name;
tensor-parallel shards hold the single GPU's fp8 values; the engine serves fp8 with adapters."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.engine.prefix_cache import model_key
from app.engine.tp.sharding import COLUMN, Shard, load_shard_weights
from app.model.config import ModelConfig
from app.model.family import check_checkpoint
from app.model.quantization import Quantization, gpu_refusal
from app.model.weights import FUSED, load_weights
from ops.fp8 import quantize

CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
PER_TENSOR = ("k_proj", "down_proj")  # written with one scale per tensor, the rest per channel


def qconfig(**changes):
    group = {"targets": ["Linear"], "weights": dict(CHANNEL), "input_activations": dict(TOKEN)}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
    for key, value in changes.items():
        where, _, name = key.rpartition("__")
        target = group if where == "group" else group[where] if where else qc
        target[name] = value
    return qc


def _module_keys(cfg):
    for i in range(cfg.num_layers):
        for block, modules in FUSED.values():
            for m in modules:
                yield f"model.layers.{i}.{block}.{m}", m


def write_fp8(src, dst, qc=None, edit=None):
    """src's checkpoint with every projection written as llm-compressor writes it; edit(state) last."""
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(src))
    for key, m in _module_keys(cfg):
        w = state[key + ".weight"]
        if m in PER_TENSOR:
            q, s = quantize(w, scale=(w.abs().max() / 448).expand(w.shape[0]))
            state[key + ".weight_scale"] = s[:1].clone()  # shape [1]
        else:
            q, s = quantize(w)
            state[key + ".weight_scale"] = s[:, None].clone()  # [N, 1]
        state[key + ".weight"] = q
    if edit:
        edit(state)
    save_file(state, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc or qconfig()
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _cfg(path, quantization=None):
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(path), quantization)


@pytest.fixture(scope="module")
def fp8_dir(tiny_model_dir, tmp_path_factory):
    return write_fp8(tiny_model_dir, tmp_path_factory.mktemp("fp8") / "ckpt")


def test_a_written_fp8_checkpoint_loads_its_scales_where_the_quantizer_puts_them(tiny_model_dir, fp8_dir):
    cfg = _cfg(fp8_dir)
    assert cfg.quantization == Quantization(checkpoint=True)
    loaded = load_weights(fp8_dir, cfg, torch.float32, "cpu")
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    made = load_weights(tiny_model_dir, _cfg(tiny_model_dir, "fp8"), torch.float32, "cpu")  # quantized at load
    for i, layer in enumerate(loaded.layers):
        assert set(layer.scale) == set(FUSED)
        for fused, (block, modules) in FUSED.items():
            qs, ss = [], []
            for m in modules:
                w = state[f"model.layers.{i}.{block}.{m}.weight"]
                per_tensor = (w.abs().max() / 448).expand(w.shape[0]) if m in PER_TENSOR else None
                q, s = quantize(w, scale=per_tensor)
                qs.append(q)
                ss.append(s)
            expected_q = torch.cat(qs)
            assert layer.proj[fused].dtype == torch.float8_e4m3fn
            assert torch.equal(layer.proj[fused].view(torch.uint8), expected_q.view(torch.uint8)), (i, fused)
            assert torch.equal(layer.scale[fused], torch.cat(ss)), (i, fused)
            if not any(m in PER_TENSOR for m in modules):  # per channel: what quantizing at load makes
                assert torch.equal(made.layers[i].proj[fused].view(torch.uint8), expected_q.view(torch.uint8))
                assert torch.equal(made.layers[i].scale[fused], layer.scale[fused])
    # embeddings, norms and lm_head are not quantized
    assert loaded.embed.dtype == loaded.lm_head.dtype == loaded.layers[0].input_norm.dtype == torch.float32


REFUSED = [
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"quant_method": "fp8"}, "quant_method 'fp8'"),  # HF's block-wise fp8
    ({"format": "pack-quantized"}, "format 'pack-quantized'"),
    ({"weights__strategy": "block"}, "weights strategy 'block'"),
    ({"weights__type": "int"}, "weights 'int' 8-bit"),
    ({"weights__num_bits": 4}, "weights 'float' 4-bit"),
    ({"input_activations__type": "int"}, "input_activations 'int' 8-bit"),
    ({"group__output_activations": {"num_bits": 8}}, "output_activations"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ({"quantization_status": "frozen"}, "quantization_status 'frozen'"),
    ({"sparsity_config": {"format": "sparse-24"}}, "sparsity_config"),
]


@pytest.mark.parametrize("changes,named", REFUSED, ids=[n for _, n in REFUSED])
def test_unsupported_quantization_configs_are_refused_by_name(tiny_model_dir, tmp_path, changes, named):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["quantization_config"] = qconfig(**changes)
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    for check in (lambda: _cfg(tmp_path / "m"), lambda: check_checkpoint(str(tmp_path / "m"))):
        with pytest.raises(ValueError) as err:
            check()
        assert named in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="quantization 'int8' is not served"):
        _cfg(tiny_model_dir, "int8")


def test_static_activation_scales_are_read_as_dynamic_per_token(tiny_model_dir, tmp_path):
    static = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
    path = write_fp8(tiny_model_dir, tmp_path / "m", qconfig(group__input_activations=static))
    assert _cfg(path).quantization.activations == "fp8 per token, dynamic"


def _drop_scale(state):
    del state["model.layers.1.mlp.up_proj.weight_scale"]


def _unquantize(state):
    key = "model.layers.0.self_attn.o_proj"
    state[key + ".weight"] = state[key + ".weight"].float()
    del state[key + ".weight_scale"]


def _nan(state):
    state["model.layers.2.self_attn.q_proj.weight"].view(torch.uint8)[0, 0] = 0x7F


def _inf_scale(state):
    state["model.layers.0.mlp.gate_proj.weight_scale"][3] = float("inf")


@pytest.mark.parametrize(
    "edit,named",
    [
        (_drop_scale, "model.layers.1.mlp.up_proj is not fp8"),
        (_unquantize, "model.layers.0.self_attn.o_proj is not fp8"),
        (_nan, "model.layers.2.self_attn.q_proj: NaN in the fp8 weight"),
        (_inf_scale, "model.layers.0.mlp.gate_proj: weight_scale holds NaN, Inf"),
    ],
)
def test_a_bad_fp8_checkpoint_is_refused_naming_the_tensor(tiny_model_dir, tmp_path, edit, named):
    path = write_fp8(tiny_model_dir, tmp_path / "m", edit=edit)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        load_weights(path, _cfg(path), torch.float32, "cpu")


def test_gpus_without_fp8_tensor_cores_are_refused_in_one_line():
    why = gpu_refusal((8, 0), "NVIDIA A100-SXM4-80GB")
    assert "sm_80" in why and "A100" in why and "\n" not in why
    assert gpu_refusal((9, 0), "NVIDIA H100") is None and gpu_refusal((8, 9), "NVIDIA L40S") is None


@pytest.mark.parametrize("source", ["made", "checkpoint"])
def test_tensor_parallel_shards_hold_the_single_gpus_fp8_values(tiny_model_dir, fp8_dir, source):
    path, quant = (tiny_model_dir, "fp8") if source == "made" else (fp8_dir, None)
    cfg = _cfg(path, quant)
    whole = load_weights(path, cfg, torch.float32, "cpu")
    shards = [load_shard_weights(path, cfg, Shard(r, 2), torch.float32, "cpu") for r in range(2)]
    for i, layer in enumerate(whole.layers):
        for fused, (_, modules) in FUSED.items():
            column = modules[0] in COLUMN
            parts = [s.layers[i] for s in shards]
            if column:  # rows (and their scales) split per member module, then fused per rank
                n = [cfg.module_dims[m][1] // 2 for m in modules]
                got = torch.cat([torch.cat(c) for c in zip(*(p.proj[fused].view(torch.uint8).split(n) for p in parts))])
                got_s = torch.cat([torch.cat(c) for c in zip(*(p.scale[fused].split(n) for p in parts))])
            else:  # input columns split, every rank the whole row's scales
                got = torch.cat([p.proj[fused].view(torch.uint8) for p in parts], dim=1)
                got_s = parts[0].scale[fused]
                assert torch.equal(parts[1].scale[fused], got_s)
            assert torch.equal(got, layer.proj[fused].view(torch.uint8)), (i, fused)
            assert torch.equal(got_s, layer.scale[fused]), (i, fused)


def test_the_prefix_cache_key_includes_the_quantization(tiny_model_dir, fp8_dir):
    keys = {model_key(_cfg(tiny_model_dir)), model_key(_cfg(tiny_model_dir, "fp8")), model_key(_cfg(fp8_dir))}
    assert len(keys) == 3


def test_the_engine_serves_fp8_with_the_same_adapters(tiny_model_dir, tmp_path):
    """Teacher-forced logits of the fp8 engine (CPU: the GEMM's fp32 reference) against the fp32
    engine's, base and with a rank-8 adapter on all seven projections: close, and the adapter's
    own contribution (its logits minus the base's) as close. The projections are scaled to a
    real model's range (std 0.05, not the tiny model's 0.2, whose 3 layers amplify any rounding:
    its own bf16 logits lie 2.5 % from fp64)."""
    from adapters_store.manifest import TARGET_MODULES
    from app.engine.config import EngineConfig
    from app.engine.factory import build_engine
    from tests.support.family_precision import engine_logits
    from tests.support.helpers import make_random_adapter

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    state = load_file(str(model / "model.safetensors"))
    save_file({k: v * 0.25 if "_proj" in k else v for k, v in state.items()}, str(model / "model.safetensors"))
    adapter = {"a": str(make_random_adapter(model, tmp_path / "a", rank=8, targets=TARGET_MODULES, seed=3))}
    tokens = [int(t) for t in torch.randint(0, 320, (16,), generator=torch.Generator().manual_seed(4))]
    out = {}
    for quant in (None, "fp8"):
        engine = build_engine(model, EngineConfig(quantization=quant), adapter, tokenizer=None)
        assert engine.runner.model.cfg.quantization == (None if quant is None else Quantization())
        out[quant] = {a: engine_logits(engine, tokens, a) for a in (None, "a")}
    cos = torch.nn.functional.cosine_similarity
    for a in (None, "a"):
        assert cos(out["fp8"][a], out[None][a], dim=-1).min() > 0.99
        assert not torch.equal(out["fp8"][a], out[None][a])  # it did run in fp8
    delta = {q: out[q]["a"] - out[q][None] for q in out}
    assert delta[None].abs().max() > 0.1  # the adapter matters
    assert cos(delta["fp8"], delta[None], dim=-1).min() > 0.98


def test_the_app_argument_reaches_the_engine_config():
    from app.serving.config import ConfigError, parse_args

    assert parse_args({"quantization": "fp8"}, "m").engine.quantization == "fp8"
    assert parse_args({}, "m").engine.quantization is None
    with pytest.raises(ConfigError, match="quantization"):
        parse_args({"quantization": "int8"}, "m")
