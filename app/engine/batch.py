"""Turn a schedule into StepInputs: prefill rows first, then decode rows, each part
ordered by adapter so every adapter's rows form one SGMV segment."""

from __future__ import annotations

import torch

from app.engine.sequence import Sequence
from app.model.inputs import LoraSegments, StepInputs
from ops.attention import AttentionGroup
from ops.paged_attention import DecodeRows, PagedBatch, PrefillRows, decode_splits


def _attention_group(rows: list[tuple[Sequence, int, int]], block_size: int, num_tokens: int) -> AttentionGroup:
    """rows: (sequence, first token row, tokens this step), all of one kind (prefill or decode)."""
    max_q = max(n for _, _, n in rows)
    # keys padded to 16: the CUDA memory-efficient kernel wants the mask's rows 16-aligned
    max_ctx = -(-max(s.num_computed + n for s, _, n in rows) // 16) * 16
    q_index = torch.full((len(rows), max_q), num_tokens, dtype=torch.long)
    q_pos = torch.zeros(len(rows), max_q, dtype=torch.long)  # padding queries see key 0 only
    kv_index = torch.zeros(len(rows), max_ctx, dtype=torch.long)
    out_rows, out_index = [], []
    for i, (seq, row, n) in enumerate(rows):
        q_index[i, :n] = torch.arange(row, row + n)
        q_pos[i, :n] = torch.arange(seq.num_computed, seq.num_computed + n)
        ctx = torch.arange(seq.num_computed + n)
        kv_index[i, : len(ctx)] = torch.tensor(seq.block_table)[ctx // block_size] * block_size + ctx % block_size
        out_rows += range(row, row + n)
        out_index += range(i * max_q, i * max_q + n)
    visible = torch.arange(max_ctx)[None, None, :] <= q_pos[:, :, None]  # causal within each sequence
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    return AttentionGroup(q_index, kv_index, mask[:, None], torch.tensor(out_rows), torch.tensor(out_index))


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


def build_step(
    scheduled: list[tuple[Sequence, int]], pool, block_size: int, device
) -> tuple[StepInputs, list[Sequence]]:
    """StepInputs for the schedule and the sequences whose next token is sampled (in row order)."""
    by_adapter = lambda item: item[0].lora_slot  # noqa: E731
    prefill = sorted([x for x in scheduled if x[1] > 1], key=by_adapter)
    decode = sorted([x for x in scheduled if x[1] == 1], key=by_adapter)
    order = prefill + decode
    token_ids, positions, slot_mapping, sample_rows, sampled = [], [], [], [], []
    groups = {"prefill": [], "decode": []}
    for seq, n in order:
        row, start = len(token_ids), seq.num_computed
        ids = seq.token_ids()
        token_ids += ids[start : start + n]
        positions += range(start, start + n)
        slot_mapping += [
            seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)
        ]
        groups["prefill" if n > 1 else "decode"].append((seq, row, n))
        if start + n == seq.num_tokens:
            sample_rows.append(row + n - 1)
            sampled.append(seq)
    attention = tuple(_attention_group(rows, block_size, len(token_ids)) for rows in groups.values() if rows)
    lora = _segments(order, pool) if pool is not None else None
    to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    inputs = StepInputs(
        token_ids=to(torch.tensor(token_ids)),
        positions=to(torch.tensor(positions)),
        slot_mapping=to(torch.tensor(slot_mapping)),
        attention=tuple(g.to(device) for g in attention),
        sample_rows=to(torch.tensor(sample_rows, dtype=torch.long)),
        lora=lora if lora is None else lora.to(device),
    )
    return inputs, sampled


def build_paged_step(
    scheduled: list[tuple[Sequence, int]], pool, block_size: int, device, kv_heads: int
) -> tuple[StepInputs, list[Sequence]]:
    """build_step for CUDA: a PagedBatch instead of padded AttentionGroups (block tables and
    lengths for the decode rows, varlen offsets for the prefill rows) and int32 index tensors."""
    by_adapter = lambda item: item[0].lora_slot  # noqa: E731
    prefill = sorted([x for x in scheduled if x[1] > 1], key=by_adapter)
    decode = sorted([x for x in scheduled if x[1] == 1], key=by_adapter)
    order = prefill + decode
    token_ids, positions, slot_mapping, sample_rows, sampled = [], [], [], [], []
    cu_q, cu_k, kv_index = [0], [0], []
    for seq, n in order:
        row, start = len(token_ids), seq.num_computed
        token_ids += seq.token_ids()[start : start + n]
        positions += range(start, start + n)
        table = seq.block_table
        slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        if n > 1:
            kv_index += [table[p // block_size] * block_size + p % block_size for p in range(start + n)]
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + start + n)
        if start + n == seq.num_tokens:
            sample_rows.append(row + n - 1)
            sampled.append(seq)
    to = lambda values, dtype=torch.int32: torch.tensor(values, dtype=dtype).to(device, non_blocking=True)  # noqa: E731
    pre = (
        PrefillRows(
            cu_q[-1],
            to(cu_q),
            to(cu_k),
            to(kv_index, torch.long),
            max(n for _, n in prefill),
            max(s.num_computed + n for s, n in prefill),
        )
        if prefill
        else None
    )
    dec = None
    if decode:
        width = max(len(s.block_table) for s, _ in decode)
        tables = torch.zeros(len(decode), width, dtype=torch.int32)
        for i, (s, _) in enumerate(decode):
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        dec = DecodeRows(
            len(token_ids) - len(decode),
            tables.to(device, non_blocking=True),
            to([s.num_computed + 1 for s, _ in decode]),
            decode_splits(len(decode), kv_heads, device),
        )
    lora = _segments(order, pool) if pool is not None else None
    inputs = StepInputs(
        token_ids=to(token_ids),
        positions=to(positions),
        slot_mapping=to(slot_mapping),
        attention=PagedBatch(pre, dec),
        sample_rows=to(sample_rows, torch.long),
        lora=lora if lora is None else lora.to(device),
    )
    return inputs, sampled
