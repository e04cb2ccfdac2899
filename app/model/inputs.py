"""Everything one forward step needs, built once per step and reused by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.paged_attention import PagedBatch


@dataclass(frozen=True)
class LoraSegments:
    """Token rows cut into runs of one adapter; per module, the slot each run uses (−1: none)."""

    indptr: torch.Tensor  # [segments + 1] int32
    slot_ids: dict[str, torch.Tensor]  # module -> [segments] int32; modules no run uses may be absent
    host: dict[str, tuple] | None  # module -> ((lo, hi, slot, rank, scale), ...); None on CUDA (unused)

    def to(self, device) -> LoraSegments:
        slot_ids = {m: t.to(device, non_blocking=True) for m, t in self.slot_ids.items()}
        return LoraSegments(self.indptr.to(device, non_blocking=True), slot_ids, self.host)


@dataclass(frozen=True)
class StepInputs:
    token_ids: torch.Tensor  # [tokens] int32
    positions: torch.Tensor  # [tokens] int32
    slot_mapping: torch.Tensor  # [tokens] int32 flat KV slot each token writes (−1: none, a graph's padding)
    attention: PagedBatch  # the same on every device (ops/attention.py)
    sample_rows: torch.Tensor  # [n] token rows whose logits are sampled
    lora: LoraSegments | None  # None: no token in this step uses an adapter
