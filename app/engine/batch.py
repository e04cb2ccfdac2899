"""Turn a schedule into StepInputs, the one step format of every device: prefill rows first, then
decode rows, each part ordered by adapter so every adapter's rows form one SGMV segment; their
attention is a PagedBatch (ops/paged_attention.py): varlen offsets and context slots for the
prefill rows, block tables and lengths for the decode rows, index tensors int32."""

from __future__ import annotations

import numpy as np
import torch

from app.engine.sequence import Sequence
from app.model.inputs import LoraSegments, StepInputs
from ops.paged_attention import DecodeRows, PagedBatch, PrefillRows, decode_splits


def _slots(table: list[int], block_size: int, start: int, end: int) -> np.ndarray:
    """The flat KV cache slots of positions start..end of a sequence with this block table (int64)."""
    p = np.arange(start, end)
    return np.asarray(table, dtype=np.int64)[p // block_size] * block_size + p % block_size


def _tokens(seq: Sequence, start: int, end: int):
    """Token ids start..end of the sequence (prompt, then outputs), without copying the rest."""
    prompt, out = seq.prompt_ids, seq.output_ids
    if end <= len(prompt):
        return prompt[start:end]
    if start >= len(prompt):
        return out[start - len(prompt) : end - len(prompt)]
    return [*prompt[start:], *out[: end - len(prompt)]]


def _device(values, dtype, device) -> torch.Tensor:
    """A host sequence of ints as a tensor on `device` (through numpy: torch.tensor of a long list
    took 15 ms a step at 2,048 prefill tokens and 254 decode rows)."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=dtype)).to(device, non_blocking=True)


def _segments(order: list[tuple[Sequence, int]], pool) -> LoraSegments | None:
    runs: list[list[int]] = []  # [slot, rows]
    for seq, n in order:
        if runs and runs[-1][0] == seq.lora_slot:
            runs[-1][1] += n
        else:
            runs.append([seq.lora_slot, n])
    slots = torch.tensor([slot for slot, _ in runs], dtype=torch.int32)
    if not (slots >= 0).any():
        return None
    bounds = [0]
    for _, n in runs:
        bounds.append(bounds[-1] + n)
    per_module, host = {}, {}
    for m, has in pool.has_module.items():
        ids = torch.where((slots >= 0) & has[slots.clamp(min=0).long()], slots, -1).to(torch.int32)
        segs = tuple(
            (bounds[i], bounds[i + 1], s, pool.slot_rank[s], pool.slot_scale[s])
            for i, s in enumerate(ids.tolist())
            if s >= 0
        )
        if segs:  # modules no adapter of this step has are left out
            per_module[m], host[m] = ids, segs
    return LoraSegments(torch.tensor(bounds, dtype=torch.int32), per_module, host)


def step_order(scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
    """The step's row order: prefill rows first, then decode rows, each part ordered by adapter."""
    by_adapter = lambda item: item[0].lora_slot  # noqa: E731
    prefill = sorted([x for x in scheduled if x[1] > 1], key=by_adapter)
    return prefill + sorted([x for x in scheduled if x[1] == 1], key=by_adapter)


def step_rows(scheduled: list[tuple[Sequence, int]], block_size: int):
    """The step's rows on the host: (order, prefill part, decode part, (token ids, positions, KV
    slots, rows sampled, the sequences sampled)), in the row order of step_order."""
    order = step_order(scheduled)
    decode = [x for x in order if x[1] == 1]
    prefill = order[: len(order) - len(decode)]
    token_ids, positions, slot_mapping, sample_rows, sampled = [], [], [], [], []
    row = 0
    for seq, n in order:
        start, table = seq.num_computed, seq.block_table
        token_ids += _tokens(seq, start, start + n)
        if n == 1:  # a decode row: no arrays for one position
            positions.append(start)
            slot_mapping.append(table[start // block_size] * block_size + start % block_size)
        else:
            positions += range(start, start + n)
            slot_mapping += _slots(table, block_size, start, start + n).tolist()
        row += n
        if start + n == len(seq.prompt_ids) + len(seq.output_ids):
            sample_rows.append(row - 1)
            sampled.append(seq)
    return order, prefill, decode, (token_ids, positions, slot_mapping, sample_rows, sampled)


def attention_rows(prefill, decode, first_decode: int, block_size: int, device, kv_heads: int) -> PagedBatch:
    """The step's PagedBatch (its index tensors copied to `device`)."""
    to = lambda values, dtype=np.int32: _device(values, dtype, device)  # noqa: E731
    return PagedBatch(
        _prefill_rows(prefill, block_size, to) if prefill else None,
        _decode_rows(decode, first_decode, device, kv_heads) if decode else None,
    )


def build_step(
    scheduled: list[tuple[Sequence, int]], pool, block_size: int, device, kv_heads: int
) -> tuple[StepInputs, list[Sequence]]:
    """StepInputs for the schedule and the sequences whose next token is sampled (in row order).
    kv_heads: the model's (this shard's) KV heads, which size the CUDA decode kernel's grid."""
    order, prefill, decode, (token_ids, positions, slot_mapping, sample_rows, sampled) = step_rows(
        scheduled, block_size
    )
    to = lambda values, dtype=np.int32: _device(values, dtype, device)  # noqa: E731
    attention = attention_rows(prefill, decode, len(token_ids) - len(decode), block_size, device, kv_heads)
    lora = _segments(order, pool) if pool is not None else None
    inputs = StepInputs(
        token_ids=to(token_ids),
        positions=to(positions),
        slot_mapping=to(slot_mapping),
        attention=attention,
        sample_rows=to(sample_rows, np.int64),
        lora=lora if lora is None else lora.to(device),
    )
    return inputs, sampled


def _prefill_rows(prefill: list[tuple[Sequence, int]], block_size: int, to) -> PrefillRows:
    """Each request's n new rows over its whole context (the cached tokens, then the n new ones)."""
    cu_q, cu_k, kv_index = [0], [0], []
    for seq, n in prefill:
        context = seq.num_computed + n
        kv_index.append(_slots(seq.block_table, block_size, 0, context))
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + context)
    max_q = max(n for _, n in prefill)
    max_k = max(s.num_computed + n for s, n in prefill)
    return PrefillRows(cu_q[-1], to(cu_q), to(cu_k), to(np.concatenate(kv_index), np.int64), max_q, max_k)


def _decode_rows(decode: list[tuple[Sequence, int]], first: int, device, kv_heads: int) -> DecodeRows:
    """The decode rows' block tables (zero-padded to the widest) and context lengths (this step's token included)."""
    tables = np.zeros((len(decode), max(len(s.block_table) for s, _ in decode)), dtype=np.int32)
    for i, (s, _) in enumerate(decode):
        tables[i, : len(s.block_table)] = s.block_table
    lens = [s.num_computed + 1 for s, _ in decode]
    # splits size the CUDA kernel's grid; the torch reference (CPU) has none
    splits = decode_splits(len(decode), kv_heads, device) if torch.device(device).type == "cuda" else 1
    return DecodeRows(
        first,
        torch.from_numpy(tables).to(device, non_blocking=True),
        _device(lens, np.int32, device),
        splits,
    )
