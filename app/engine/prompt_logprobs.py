"""Prompt logprobs (SamplingParams.prompt_logprobs; `/v1/completions` with `echo` and `logprobs`):
the logprob of every prompt token under the model given the tokens before it, with the top-k
alternatives, from the raw logits (no temperature, penalty or bias), as vLLM and OpenAI's legacy
API report them.

A step's prefill rows of such a request are added to the rows whose logits the model computes
(`StepInputs.sample_rows`): row p of the chunk gives token p+1's logprob. The request's own
sampled row stays where it was, so drawing is untouched. Such a request skips the prefix
cache's hit (app/engine/scheduler.py): a cached block's positions are never run, and their
logits are not kept."""

from __future__ import annotations

import dataclasses

import torch

from app.engine.sequence import Sequence


def wanted(seq: Sequence) -> bool:
    """Until its first output token: a request resumed (or requeued) after tokens were relayed got its
    prompt logprobs with its first chunk."""
    return seq.params.prompt_logprobs is not None and not seq.output_ids


@dataclasses.dataclass
class PromptRows:
    """The extra logits rows of one step: for each sequence, its rows and the tokens they score."""

    seqs: list[Sequence]
    counts: list[int]  # rows of each sequence, in order
    rows: list[int]  # batch rows (token rows of the step)
    targets: list[int]  # the prompt token each row's logits score


def prompt_rows(order: list[tuple[Sequence, int]]) -> PromptRows | None:
    """order: the step's sequences and their token counts, in row order (app/engine/batch.py)."""
    found = PromptRows([], [], [], [])
    row = 0
    for seq, n in order:
        start = seq.num_computed
        last = min(start + n, len(seq.prompt_ids) - 1)  # the last prompt row predicts the first output
        if wanted(seq) and last > start:
            found.seqs.append(seq)
            found.counts.append(last - start)
            found.rows += range(row, row + last - start)
            found.targets += seq.prompt_ids[start + 1 : last + 1]
        row += n
    return found if found.seqs else None


def with_rows(inputs, extra: PromptRows):
    """The step's inputs computing logits for the extra rows too (after the sampled ones)."""
    rows = torch.tensor(extra.rows, dtype=torch.long).to(inputs.sample_rows.device)
    return dataclasses.replace(inputs, sample_rows=torch.cat([inputs.sample_rows, rows]))


def entries(logits: torch.Tensor, extra: PromptRows) -> dict[Sequence, list[dict]]:
    """Each sequence's prompt logprob entries for this step ({"token_id", "logprob", "top"})."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(extra.targets, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    k = max(seq.params.prompt_logprobs for seq in extra.seqs)
    top_v, top_i = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    out, row = {}, 0
    for seq, count in zip(extra.seqs, extra.counts):
        want = seq.params.prompt_logprobs
        out[seq] = [
            {"token_id": extra.targets[r], "logprob": chosen[r], "top": list(zip(top_i[r][:want], top_v[r][:want]))}
            for r in range(row, row + count)
        ]
        row += count
    return out
