"""The stand-in for an adapter source at local-storage speed, for benchmarks/adapter_scale.py.

10,000 Llama-2-7B rank-16 adapters are 800 GB: they fit on no disk or host here. So adapter
``name``'s safetensors file is a fixed header plus an 80 MB slice of one random fp16 slab at an
offset of its own, its first STAMP values set from the sha256 of its name (no two adapters hold
the same content); making one is one memcpy. ``StandInStore`` is the product's AdapterStore with
only ``_source`` overridden: resolution on demand, single flight, the version asked of the
source on each cold load, parse and validation, the host LRU all run as in serving.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import replace

import numpy as np
import torch

from adapters_store.disk_cache import ObjectInfo
from adapters_store.sources import Snapshot, version_of
from adapters_store.store import AdapterStore, StoreConfig
from app.model.weights import FUSED, LayerWeights, ModelWeights
from benchmarks.adapter_load import RANK

STAMP = 16  # leading fp16 values of each adapter set from its name
MLP = ("gate_proj", "up_proj", "down_proj")


class Slab:
    """Random fp16 bytes (unpinned: only the CPU copies out of them) and the safetensors layout
    of one rank-RANK adapter of every module and layer, shared by every adapter."""

    def __init__(self, cfg, gib: float, device: str):
        self.dims = cfg.module_dims
        keys = [(layer, m, ab) for layer in range(cfg.num_layers) for m in self.dims for ab in "AB"]
        header, at = {}, 0
        for layer, m, ab in keys:
            shape = [RANK, self.dims[m][0]] if ab == "A" else [self.dims[m][1], RANK]
            size = 2 * shape[0] * shape[1]
            where = "mlp" if m in MLP else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{where}.{m}.lora_{ab}.weight"
            header[key] = {"dtype": "F16", "shape": shape, "data_offsets": [at, at + size]}
            at += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.prefix, self.nbytes = struct.pack("<Q", len(raw)) + raw, at
        n = max(int(gib * 2**30) // 2, at // 2 + 1)
        gen, values, chunk = torch.Generator(device).manual_seed(0), torch.empty(n, dtype=torch.float16), 1 << 28
        for i in range(0, n, chunk):  # made where it is fast, in pieces: no 2^31-element kernel
            piece = torch.randn(min(chunk, n - i), generator=gen, device=device, dtype=torch.float16)
            values[i : i + len(piece)] = (piece * 0.01).cpu()  # finite, LoRA-sized
        self.bytes = memoryview(values.view(torch.uint8).numpy())
        self.config = json.dumps(
            {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(self.dims)}
        )

    def offset(self, name: str) -> int:
        digest = hashlib.sha256(name.encode()).digest()
        return 2 * (int.from_bytes(digest[:8], "little") % ((len(self.bytes) - self.nbytes) // 2 + 1))

    def stamp(self, name: str) -> bytes:
        """STAMP fp16 values from the name's digest: 11 bits each (sign, mantissa) under a fixed finite exponent."""
        digest = hashlib.sha256(b"stamp\0" + name.encode()).digest()
        words = np.frombuffer(digest, dtype="<u2")[:STAMP]
        return ((words & 0x83FF) | 0x2000).astype("<u2").tobytes()


class SlabSource:
    """adapters_store.sources.Source for one name: its version known without hashing 80 MB (as an
    S3 ETag is), its file built by one memcpy out of the slab; with ``gbps``, each read is held
    to that bandwidth (one stream of a slower tier)."""

    def __init__(self, slab: Slab, name: str, gbps: float | None = None):
        self.slab, self.name, self.uri, self.gbps = slab, name, f"standin://{name}", gbps

    def snapshot(self) -> Snapshot:
        s, off = self.slab, self.slab.offset(self.name)
        size = len(s.prefix) + s.nbytes
        return Snapshot(self.uri, s.config.encode(), ObjectInfo(size), version_of("standin", self.name, str(off)))

    def read_weights(self, snap: Snapshot) -> tuple[bytes, str]:
        start, s, off = time.perf_counter(), self.slab, self.slab.offset(self.name)
        blob = b"".join((s.prefix, s.stamp(self.name), s.bytes[off + 2 * STAMP : off + s.nbytes]))
        if self.gbps:
            time.sleep(max(0.0, len(blob) / (self.gbps * 1e9) - (time.perf_counter() - start)))
        return blob, "local"

    def read_into(self, snap: Snapshot, buffer) -> tuple[np.ndarray, str]:
        """The same bytes into the loader's reused buffer: a read of a file into a buffer, not a
        bytes.join (which held the GIL for the whole 80 MB copy)."""
        start, s, off = time.perf_counter(), self.slab, self.slab.offset(self.name)
        head = len(s.prefix) + 2 * STAMP
        buf = buffer(len(s.prefix) + s.nbytes)
        buf[: len(s.prefix)] = np.frombuffer(s.prefix, np.uint8)
        buf[len(s.prefix) : head] = np.frombuffer(s.stamp(self.name), np.uint8)
        np.copyto(buf[head:], np.frombuffer(s.bytes[off + 2 * STAMP : off + s.nbytes], np.uint8))  # GIL released
        if self.gbps:
            time.sleep(max(0.0, buf.nbytes / (self.gbps * 1e9) - (time.perf_counter() - start)))
        return buf, "local"


class StandInStore(AdapterStore):
    """The product's store; only where bytes come from differs (see the module doc)."""

    def __init__(self, shape, config: StoreConfig, slab: Slab, gbps: float | None = None):
        super().__init__(shape, replace(config, default_root="/standin"))  # on demand: any valid name
        self.slab, self.gbps = slab, gbps

    def _source(self, location) -> SlabSource:
        return SlabSource(self.slab, location.name, self.gbps)

    def count(self, key: str) -> float:
        return self.metrics.snapshot().get(key, 0)


def random_weights(cfg, device: str, dtype: torch.dtype) -> ModelWeights:
    """Random weights (speed does not depend on their values), made where they run."""
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype) * 0.02  # noqa: E731
    ones = lambda: torch.ones(cfg.hidden_size, device=device, dtype=dtype)  # noqa: E731
    dims = cfg.module_dims
    proj = lambda: {f: rnd(sum(dims[m][1] for m in mods), dims[mods[0]][0]) for f, (_, mods) in FUSED.items()}  # noqa: E731
    layers = [LayerWeights(ones(), ones(), proj()) for _ in range(cfg.num_layers)]
    return ModelWeights(rnd(cfg.vocab_size, cfg.hidden_size), rnd(cfg.vocab_size, cfg.hidden_size), ones(), layers)


def tiny_config():
    from transformers import LlamaConfig

    from app.model.config import ModelConfig

    hf = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        eos_token_id=None,
    )
    return ModelConfig.from_hf(hf)
