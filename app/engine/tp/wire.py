"""Rank 0 → tensor-parallel workers: one message per engine action, in the engine's order.

A message is a header (kind, skeleton length, payload bytes) and a JSON skeleton, both
broadcast over the gloo control group, then its tensors as one byte payload: a step's
inputs are broadcast over the data group from rank 0's device (NCCL on GPUs, so no
host round trip); an adapter load copies each worker's shard from the host to rank 0's
device and sends it on over the data group (NVLink, not a socket), so the shards reach
their GPUs without a host round trip through the workers and in order with the steps.
The skeleton names only the classes listed here and tensors by dtype and shape, so a
message rebuilds exactly what rank 0 had and nothing else (no pickle).
"""

from __future__ import annotations

import dataclasses
import json

import torch
import torch.distributed as dist

from app.model.inputs import LoraSegments, StepInputs
from ops.paged_attention import DecodeRows, PagedBatch, PrefillRows

STEP, LOAD, STOP = 1, 2, 3
_CLASSES = {c.__name__: c for c in (StepInputs, PagedBatch, PrefillRows, DecodeRows, LoraSegments)}
_DTYPES = {
    str(d): d
    for d in (
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )
}
_ALIGN = 8  # every tensor starts 8-byte aligned in the payload, so .view(dtype) is legal


def _flatten(obj, tensors: list[torch.Tensor]):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"t": [str(obj.dtype), list(obj.shape)]}
    if dataclasses.is_dataclass(obj):
        name = type(obj).__name__
        if _CLASSES.get(name) is not type(obj):
            raise TypeError(f"{name} cannot be sent to tensor-parallel workers")
        return {"c": name, "f": {f.name: _flatten(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj)}}
    if isinstance(obj, dict):
        return {"d": {k: _flatten(v, tensors) for k, v in obj.items()}}
    if isinstance(obj, (tuple, list)):
        return {"s": [_flatten(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise TypeError(f"{type(obj).__name__} cannot be sent to tensor-parallel workers")


def _unflatten(node, tensors):
    if "t" in node:
        return next(tensors)
    if "c" in node:
        return _CLASSES[node["c"]](**{k: _unflatten(v, tensors) for k, v in node["f"].items()})
    if "d" in node:
        return {k: _unflatten(v, tensors) for k, v in node["d"].items()}
    if "s" in node:
        return tuple(_unflatten(v, tensors) for v in node["s"])
    return node["v"]


def _tensor_metas(node, out: list):
    """(dtype, shape) of every tensor in the skeleton, in payload order."""
    if "t" in node:
        out.append((_DTYPES[node["t"][0]], tuple(node["t"][1])))
    for child in node.get("f", node.get("d", {})).values():
        _tensor_metas(child, out)
    for child in node.get("s", ()):
        _tensor_metas(child, out)
    return out


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _to_bytes(tensors: list[torch.Tensor], device) -> torch.Tensor:
    parts = []
    for t in tensors:
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        parts += [raw.to(device), torch.zeros(_padded(raw.numel()) - raw.numel(), dtype=torch.uint8, device=device)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def _from_bytes(buf: torch.Tensor, metas):
    offset = 0
    for dtype, shape in metas:
        n = dtype.itemsize * torch.Size(shape).numel()
        yield buf[offset : offset + n].view(dtype).view(shape)
        offset += _padded(n)


def encode(obj, device) -> tuple[dict, torch.Tensor]:
    """(JSON skeleton, uint8 payload on device) of a message."""
    tensors: list[torch.Tensor] = []
    skeleton = _flatten(obj, tensors)
    return skeleton, _to_bytes(tensors, device)


def decode(skeleton: dict, payload: torch.Tensor):
    """The message again; its tensors are views into payload."""
    return _unflatten(skeleton, _from_bytes(payload, _tensor_metas(skeleton, [])))


class Channel:
    """Both ends of the message stream; control/data are process groups (None: the default group)."""

    def __init__(self, world: int, device, control=None, data=None):
        self.world, self.device, self.control, self.data = world, torch.device(device), control, data

    # -- rank 0 ----------------------------------------------------------------------
    def send_step(self, inputs: StepInputs) -> None:
        """Workers compute no logits: their copy samples no rows."""
        skeleton, payload = encode(dataclasses.replace(inputs, sample_rows=inputs.sample_rows[:0]), self.device)
        self._header(STEP, skeleton, payload.numel())
        if payload.numel():
            dist.broadcast(payload, 0, group=self.data)

    def send_load(self, slot: int, rank: int, scale: float, stacks_per_worker: list[dict]) -> None:
        """stacks_per_worker[w]: worker w+1's {module: ModuleStack} of the adapter going into slot."""
        sent = [
            {
                "slot": slot,
                "rank": rank,
                "scale": scale,
                "stacks": {m: {"layers": list(st.layers), "A": st.A, "Bt": st.Bt} for m, st in stacks.items()},
            }
            for stacks in stacks_per_worker
        ]
        encoded = [encode(message, self.device) for message in sent]
        skeleton, payloads = encoded[0][0], [payload for _, payload in encoded]
        self._header(LOAD, skeleton, payloads[0].numel())  # same shapes on every worker
        for worker, payload in enumerate(payloads, start=1):
            dist.send(payload, worker, group=self.data)

    def send_stop(self) -> None:
        self._header(STOP, {"v": None}, 0)

    def _header(self, kind: int, skeleton, nbytes: int) -> None:
        text = torch.frombuffer(bytearray(json.dumps(skeleton).encode()), dtype=torch.uint8)
        dist.broadcast(torch.tensor([kind, text.numel(), nbytes]), 0, group=self.control)
        dist.broadcast(text, 0, group=self.control)

    # -- workers -----------------------------------------------------------------------
    def receive(self):
        """(kind, message): StepInputs or a load's dict, tensors on this rank's device."""
        header = torch.empty(3, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.control)
        kind, length, nbytes = header.tolist()
        text = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(text, 0, group=self.control)
        skeleton = json.loads(bytes(text.tolist()))
        payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if kind == STEP and nbytes:
            dist.broadcast(payload, 0, group=self.data)
        elif kind == LOAD:
            dist.recv(payload, 0, group=self.data)
        return kind, decode(skeleton, payload)
