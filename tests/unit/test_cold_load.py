"""The cold-load path (bytes → parsed, validated weights → packed host buffer) after it stopped
making fp32 copies, hashing the blob and stacking temporaries: the same refusals, bit-identical
packed values for every source dtype, the caller's content version, and host bytes counted
exactly through evictions."""

import json

import pytest
import torch
from safetensors.torch import save

from adapters_store.errors import InvalidAdapterError
from adapters_store.host_cache import HostCache, HostCacheConfig, pack
from adapters_store.manifest import parse_manifest
from adapters_store.peft_weights import parse_weights
from adapters_store.sources import LocalSource
from adapters_store.store import AdapterStore, StoreConfig
from tests.support.store_helpers import TINY_SHAPE, load_local, write_adapter

TARGETS = ("q_proj", "down_proj")


def _blob(dtype: torch.dtype, rank: int = 4, seed: int = 0, scale: torch.Tensor | None = None) -> tuple[bytes, dict]:
    """A PEFT safetensors file in memory, in ``dtype``; values spread over many binades so that
    conversions to narrower dtypes round (and fp32 → fp16 overflows where fp16 ends)."""
    gen, state = torch.Generator().manual_seed(seed), {}
    for layer in range(TINY_SHAPE.num_layers):
        for m in TARGETS:
            d_in, d_out = TINY_SHAPE.dims[m]
            group = "mlp" if m == "down_proj" else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{m}"
            for ab, shp in (("A", (rank, d_in)), ("B", (d_out, rank))):
                top = 3 if dtype == torch.float16 else 5  # an fp16 file holds no value past 65504
                spread = torch.logspace(-9, top, shp[1], dtype=torch.float64) if scale is None else scale
                state[f"{prefix}.lora_{ab}.weight"] = (
                    torch.randn(*shp, generator=gen, dtype=torch.float64) * spread
                ).to(dtype)
    return save(state), state


def _manifest(rank: int = 4):
    return parse_manifest(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": TARGETS}), 16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("ab, at", [("A", 0), ("A", -1), ("B", 0), ("B", 37)])
def test_non_finite_values_are_refused_in_every_dtype(dtype, bad, ab, at):
    """The finiteness check now reduces in the file's own dtype (aminmax): a NaN or an infinity
    anywhere, first, last or inside, in a half tensor as in any other, is still refused."""
    blob, state = _blob(dtype, scale=torch.tensor(0.01, dtype=torch.float64))
    key = f"base_model.model.model.layers.2.mlp.down_proj.lora_{ab}.weight"
    state[key].view(-1)[at] = bad
    with pytest.raises(InvalidAdapterError, match=f"layer 2 down_proj: lora_{ab} holds NaN or Inf"):
        parse_weights("a", _manifest(), save(state), TINY_SHAPE, "v1")
    parse_weights("a", _manifest(), blob, TINY_SHAPE, "v1")  # the same file without it loads


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16, torch.float32])
def test_packed_values_are_bit_identical_to_the_fp32_round_trip(src, dst):
    """Before, every matrix became fp32 (``.float()``) and was then converted to the serving
    dtype; now fp16/bf16/fp32 go straight there (fp32 holds them exactly, so the rounding is the
    same) and only other dtypes (fp64) still pass through fp32 (rounding twice, as before)."""
    blob, state = _blob(src)
    w = parse_weights("a", _manifest(), blob, TINY_SHAPE, "v1")
    kept = src if src != torch.float64 else torch.float32
    assert all(t.dtype == kept for pair in w.tensors.values() for t in pair)  # no fp32 copy of a half file
    packed = pack(w, dtype=dst)
    assert packed.buffer.dtype == dst and packed.buffer.numel() * dst.itemsize == packed.nbytes
    for (layer, m), (a, b) in packed.tensors.items():
        group = "mlp" if m == "down_proj" else "self_attn"
        prefix = f"base_model.model.model.layers.{layer}.{group}.{m}"
        for got, ab in ((a, "A"), (b, "B")):
            want = state[f"{prefix}.lora_{ab}.weight"].float().to(dst)  # the old path
            assert got.dtype == dst and torch.equal(
                got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
            )
        assert torch.equal(packed.stacks[m].Bt[layer], b.T)  # the pool's layout views the same bytes


def test_every_path_keeps_a_content_version(tmp_path):
    """parse_weights does not hash the blob: the version is its source's (a local directory's from
    the files' sha256), in the store and read the plain way (load_local) alike."""
    d = write_adapter(tmp_path / "a", TINY_SHAPE, targets=TARGETS)
    local = load_local("a", d, 16, TINY_SHAPE)
    assert local.version == LocalSource(d).snapshot().version
    store = AdapterStore(TINY_SHAPE, StoreConfig(max_rank=16))
    try:
        store.register("a", d)
        first = store.get("a")
        assert first.version == LocalSource(d).snapshot().version == store.version("a")
        write_adapter(d, TINY_SHAPE, targets=TARGETS, seed=1)  # new content under the same name
        store.host.drop_name("a")  # the next get is a cold load
        second = store.get("a")
        assert second.version != first.version
        assert second.version == LocalSource(d).snapshot().version
    finally:
        store.close()


def test_accounting_stays_exact_through_evictions():
    cache = HostCache(HostCacheConfig(budget_bytes=1 << 30, dtype=torch.float16))
    sizes = []
    for i in range(4):
        blob, _ = _blob(torch.float16, rank=1 + i)
        w = cache.put(parse_weights(f"a{i}", _manifest(1 + i), blob, TINY_SHAPE, "v"))
        sizes.append(w.nbytes)
        assert w.nbytes == w.buffer.untyped_storage().nbytes()
    assert cache.nbytes == sum(sizes)
    cache.drop_name("a1")
    assert cache.nbytes == sum(sizes) - sizes[1]


def test_the_host_cache_holds_the_serving_dtype_of_a_half_file():
    """Parsing keeps an fp16 file in fp16; a cache serving fp32 (the CPU's) still holds fp32."""
    blob, state = _blob(torch.float16)
    cache = HostCache(HostCacheConfig(budget_bytes=1 << 30, dtype=torch.float32))
    held = cache.put(parse_weights("a", _manifest(), blob, TINY_SHAPE, "v"))
    assert held.buffer is not None and held.buffer.dtype == torch.float32 and cache.nbytes == held.nbytes
    a = state["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert torch.equal(held.tensors[0, "q_proj"][0], a.float())
