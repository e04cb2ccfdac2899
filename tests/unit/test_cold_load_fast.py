"""The cold load in a handful of ops (adapters_store/fast_load.py): the same values as the
library path for every dtype and file order, the library's exact refusal for anything it
refuses, no aliasing of the reused staging buffer, and host buffers reused only once nothing
holds them."""

import json
import struct

import numpy as np
import pytest
import torch

from adapters_store.errors import InvalidAdapterError, SourceChangedError
from adapters_store.fast_load import FastLoader, all_finite, copy_into
from adapters_store.gpu_pool import LoraPool, PoolConfig
from adapters_store.host_cache import HostCache, HostCacheConfig, pack
from adapters_store.manifest import parse_manifest
from adapters_store.peft_weights import ModelShape, parse_weights
from adapters_store.sources import LocalSource, Staging
from adapters_store.store import AdapterStore, StoreConfig
from tests.support.store_helpers import load_local, write_adapter

# 12 layers: a file sorted by name holds them as 0, 1, 10, 11, 2, 3, ... (PEFT's save sorts)
SHAPE = ModelShape(12, {"q_proj": (32, 32), "v_proj": (32, 8), "down_proj": (48, 32)})
TARGETS = ("q_proj", "v_proj", "down_proj")
RANK = 4


def _state(dtype, layers=range(12), seed=0) -> dict[str, torch.Tensor]:
    gen, state = torch.Generator().manual_seed(seed), {}
    for layer in layers:
        for m in TARGETS:
            d_in, d_out = SHAPE.dims[m]
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if m == 'down_proj' else 'self_attn'}.{m}"
            state[f"{prefix}.lora_A.weight"] = (torch.randn(RANK, d_in, generator=gen) * 0.1).to(dtype)
            state[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, RANK, generator=gen) * 0.1).to(dtype)
    return state


def _file(state: dict[str, torch.Tensor], order="layer", header_edit=None, pad=True) -> np.ndarray:
    """A safetensors file written by hand, tensors in ``order``: "name" (sorted, as the library
    writes) or "layer" (layer by layer, as the benchmark's stand-in)."""
    keys = sorted(state) if order == "name" else list(state)
    names = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}
    header, data, at = {}, [], 0
    for k in keys:
        raw = state[k].contiguous().view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": names[state[k].dtype], "shape": list(state[k].shape), "data_offsets": [at, at + len(raw)]}
        data.append(raw)
        at += len(raw)
    text = json.dumps(header) if header_edit is None else header_edit(header)
    text += " " * (-len(text) % 8 if pad else 0)
    blob = struct.pack("<Q", len(text.encode())) + text.encode() + b"".join(data)
    return np.frombuffer(bytearray(blob), np.uint8)


def _manifest():
    return parse_manifest(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": TARGETS}), 16)


def _fast(raw, dst=torch.float16, loader=None):
    loader = loader or FastLoader(SHAPE)
    return loader.load("a", _manifest(), raw, "v1", lambda n: torch.empty(n, dtype=dst)), loader


def _same(w1, w2) -> None:
    assert set(w1.tensors) == set(w2.tensors)
    for key, (a, b) in w1.tensors.items():
        a2, b2 = w2.tensors[key]
        assert a.dtype == a2.dtype and torch.equal(a, a2) and torch.equal(b, b2), key


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("order", ["name", "layer"])
def test_the_fast_path_gives_the_library_paths_values_and_slots(src, dst, order):
    state = _state(src)
    raw = _file(state, order)
    fast, loader = _fast(raw, dst)
    assert loader.fallbacks == 0 and fast.buffer.dtype == dst
    slow = pack(parse_weights("a", _manifest(), raw.tobytes(), SHAPE, "v1"), dtype=dst)
    _same(fast, slow)
    assert fast.nbytes == slow.nbytes
    pools = [LoraPool(SHAPE, PoolConfig(2, 8, dst)) for _ in range(2)]
    for pool, w in zip(pools, (fast, slow)):
        assert pool.acquire(w) == 0
    for m in SHAPE.dims:  # the GPU pool's fill from file-ordered strided stacks: the same slot
        assert torch.equal(pools[0].A[m], pools[1].A[m]) and torch.equal(pools[0].B[m], pools[1].B[m])


def test_some_layers_only_and_one_layer_take_the_fast_path():
    for layers in ([3, 7, 11], [5]):
        raw = _file(_state(torch.float32, layers), "name")
        fast, loader = _fast(raw)
        assert loader.fallbacks == 0 and {k[0] for k in fast.tensors} == set(layers)
        _same(fast, pack(parse_weights("a", _manifest(), raw.tobytes(), SHAPE, "v1"), dtype=torch.float16))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["layers.0.self_attn.q_proj.lora_A", "layers.11.mlp.down_proj.lora_B"])
def test_a_non_finite_value_anywhere_gets_the_library_refusal(bad, where):
    """One reduction over the data section finds it; the library path then names the matrix."""
    state = _state(torch.float16)
    key = f"base_model.model.model.{where}.weight"
    state[key].view(-1)[-1] = bad
    layer, m, ab = where.split(".")[1], where.split(".")[3], where[-1]
    with pytest.raises(InvalidAdapterError, match=f"layer {layer} {m}: lora_{ab} holds NaN or Inf"):
        _fast(_file(state, "name"))


@pytest.mark.parametrize("dtype, bits", [(torch.float16, 16), (torch.bfloat16, 16), (torch.float32, 32)])
def test_the_bit_test_for_nan_and_inf_agrees_with_torch_on_every_pattern(dtype, bits):
    """Every 16-bit pattern, and for fp32 every exponent with random signs and mantissas (the
    test is on the exponent field), one value at a time inside finite fresh random values."""
    if bits == 16:
        patterns = np.arange(2**16, dtype=np.uint16)
    else:
        rng = np.random.default_rng(1)
        exps = np.repeat(np.arange(256, dtype=np.uint32), 64)
        mant = rng.integers(0, 2**23, exps.size, dtype=np.uint32)
        mant[::64] = 0  # ±Inf itself at the top exponent
        patterns = (rng.integers(0, 2, exps.size, dtype=np.uint32) << 31) | (exps << 23) | mant
    values = torch.from_numpy(patterns.view(np.int16 if bits == 16 else np.int32)).view(dtype)
    expected = torch.isfinite(values.float() if dtype == torch.bfloat16 else values)
    base = (torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 0.1).to(dtype)
    for k in np.random.default_rng(3).choice(values.numel(), 3000, replace=False).tolist() + [
        int(i) for i in torch.nonzero(~expected).flatten()
    ]:
        base[517] = values[k]
        raw = base.view(torch.uint8).numpy()
        assert all_finite(raw, dtype) == bool(expected[k]), hex(int(patterns[k]))


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16, torch.float32])
def test_the_copy_converts_as_torch_does(src, dst):
    """Round to nearest even, and fp32 beyond fp16's range to ±Inf, bit for bit."""
    x = torch.randn(4099, generator=torch.Generator().manual_seed(4), dtype=torch.float32) * 3000
    x = x.to(src)
    buf = torch.empty(x.numel(), dtype=dst)
    copy_into(buf, x.view(torch.uint8).numpy(), src)
    assert torch.equal(buf.view(torch.uint8), x.to(dst).view(torch.uint8))


def _outcome(fn):
    try:
        return "ok", fn()
    except InvalidAdapterError as exc:
        return "refused", str(exc)


def _edits():
    def hole(h):  # a gap of 8 bytes before the last tensor, the file one tensor-end short
        last = max(h.values(), key=lambda v: v["data_offsets"][0])
        last["data_offsets"] = [last["data_offsets"][0] + 8, last["data_offsets"][1]]
        last["shape"] = [last["shape"][0] - 1 if last["shape"][0] > 1 else 1, last["shape"][1]]
        return json.dumps(h)

    def overlap(h):
        first = min(h.values(), key=lambda v: v["data_offsets"][0])
        second = sorted(h.values(), key=lambda v: v["data_offsets"][0])[1]
        second["data_offsets"] = [
            first["data_offsets"][0],
            first["data_offsets"][0] + 2 * int(np.prod(second["shape"])),
        ]
        return json.dumps(h)

    def shape_mismatch(h):
        next(iter(h.values()))["shape"] = [RANK, 31]
        return json.dumps(h)

    def bool_shape(h):
        v = next(iter(h.values()))
        v["shape"] = [True] * len(v["shape"])
        return json.dumps(h)

    def f64_name(h):
        next(iter(h.values()))["dtype"] = "F64"
        return json.dumps(h)

    def extra_field(h):
        next(iter(h.values()))["extra"] = 1
        return json.dumps(h)

    def bad_metadata(h):
        return json.dumps({"__metadata__": {"format": 1}, **h})

    def duplicate(h):
        text = json.dumps(h)
        first = next(iter(h))
        return text[:-1] + ", " + json.dumps(first) + ": " + json.dumps(h[first]) + "}"

    def not_object(h):
        return json.dumps(list(h))

    def stray_key(h):
        v = h.pop(next(iter(h)))
        h["base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight"] = v
        return json.dumps(h)

    return [
        hole,
        overlap,
        shape_mismatch,
        bool_shape,
        f64_name,
        extra_field,
        bad_metadata,
        duplicate,
        not_object,
        stray_key,
    ]


@pytest.mark.parametrize("edit", _edits(), ids=lambda f: f.__name__)
def test_a_malformed_file_has_the_library_paths_outcome(edit):
    """The fast path never accepts what the safetensors library refuses: an edited header either
    loads the same values both ways or is refused with the library path's own message."""
    raw = _file(_state(torch.float16), "name", header_edit=edit)
    slow = _outcome(lambda: pack(parse_weights("a", _manifest(), raw.tobytes(), SHAPE, "v"), torch.float16))
    fast = _outcome(lambda: _fast(raw)[0])
    assert fast[0] == slow[0]
    if fast[0] == "ok":
        _same(fast[1], slow[1])
    else:
        assert fast[1] == slow[1]


def test_trailing_bytes_and_an_unaligned_data_section_take_the_library_path():
    for raw in (np.append(_file(_state(torch.float16)), np.uint8(0)), _file(_state(torch.float16), pad=False)):
        slow = _outcome(lambda: parse_weights("a", _manifest(), raw.tobytes(), SHAPE, "v"))
        fast = _outcome(lambda: _fast(raw)[0])
        assert fast[0] == slow[0] and (fast[0] == "ok" or fast[1] == slow[1])


def test_weights_never_alias_the_reused_staging_buffer(tmp_path):
    """The loader thread reads the next file into the same buffer: what it returned is a copy."""
    staging, loader = Staging(), FastLoader(SHAPE)
    dirs = [write_adapter(tmp_path / f"a{k}", SHAPE, rank=RANK, targets=TARGETS, seed=k) for k in range(2)]
    loaded = []
    for d in dirs:
        source = LocalSource(d)
        snap = source.snapshot()
        raw, _ = source.read_into(snap, staging.get)
        man = parse_manifest(snap.config, 16)
        loaded.append(loader.load(d.name, man, raw, snap.version, lambda n: torch.empty(n)))
    assert loader.fallbacks == 0
    for d, w in zip(dirs, loaded):  # the first still holds its own values after the second's read
        _same(w, pack(load_local(d.name, d, 16, SHAPE), dtype=torch.float32))


def test_a_file_changed_between_snapshot_and_read_is_refused(tmp_path):
    d = write_adapter(tmp_path / "a", SHAPE, rank=RANK, targets=TARGETS, seed=0)
    source = LocalSource(d)
    snap = source.snapshot()
    write_adapter(tmp_path / "a", SHAPE, rank=RANK, targets=TARGETS, seed=1)
    with pytest.raises(SourceChangedError):
        source.read_into(snap, Staging().get)


def test_an_evicted_buffer_is_reused_only_once_nothing_holds_it():
    cache = HostCache(HostCacheConfig(budget_bytes=1, dtype=torch.float16))
    cache.config = HostCacheConfig(budget_bytes=_fast(_file(_state(torch.float16)))[0].nbytes, dtype=torch.float16)
    load = lambda seed: cache.put(  # noqa: E731
        FastLoader(SHAPE).load(f"a{seed}", _manifest(), _file(_state(torch.float16, seed=seed)), "v", cache.alloc)
    )
    first = load(0)
    ptr = first.buffer.data_ptr()
    load(1)  # evicts the first, which this test still holds
    assert load(2).buffer.data_ptr() != ptr and cache.spares.reused == 0  # not reused while held
    a_view = first.stacks["q_proj"].A
    del first
    assert load(3).buffer.data_ptr() != ptr  # a view of it is still held
    del a_view
    assert load(4).buffer.data_ptr() == ptr and cache.spares.reused >= 1  # now nothing holds it


def test_the_store_loads_through_the_fast_path(tmp_path):
    d = write_adapter(tmp_path / "root" / "a", SHAPE, rank=RANK, targets=TARGETS, seed=3)
    host = HostCacheConfig(budget_bytes=1 << 20, dtype=torch.float16)
    store = AdapterStore(SHAPE, StoreConfig(max_rank=16, host=host, default_root=str(tmp_path / "root")))
    try:
        w = store.get("a")
        assert store.fast.fallbacks == 0 and w.buffer.dtype == torch.float16
        _same(w, pack(load_local("a", d, 16, SHAPE), dtype=torch.float16))
    finally:
        store.close()
