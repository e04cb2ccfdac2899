"""The model runner: a schedule in, a StepTokens out. Every step is built in one format
(app/engine/batch.py: a PagedBatch, whatever the device) and run by the model's forward; on CUDA
a step of decode rows only is instead a replay of the CUDA graph of the batch's bucket
(EngineConfig.cuda_graphs), and the next decode step is launched ahead where it is certain
(app/engine/run_ahead.py; the scheduler picks its rows and gives them their blocks). Either way
the step's rows are sampled right behind its logits, on their device (app/engine/sampler.py).
The model itself knows none of this."""

from __future__ import annotations

import numpy as np
import torch

from app.engine.batch import build_step, step_order
from app.engine.config import EngineConfig
from app.engine.cuda_graphs import DecodeGraphs
from app.engine.mixed_graphs import MixedGraphs
from app.engine.prompt_logprobs import entries, prompt_rows, with_rows
from app.engine.run_ahead import DecodeAhead
from app.engine.sampler import draw
from app.engine.scheduler import blocks_for
from app.engine.sequence import Sequence
from app.engine.step_sampling import Staging, step_sampling
from app.engine.step_tokens import DrawnRows, Readback, StepTokens, host_rows
from ops import paged_attention, sampling, small_ops


class ModelRunner:
    def __init__(self, model, kv, config: EngineConfig, max_model_len: int):
        self.model, self.kv, self.config = model, kv, config
        c = model.cfg
        # the CUDA kernels serve this model's attention (ops/attention.py dispatches by the same test)
        kernels = torch.device(config.device).type == "cuda" and paged_attention.supported(
            model.dtype, c.head_dim, c.num_heads, c.num_kv_heads, config.block_size
        )
        if kernels:  # a first-use compile would stall a step mid-serving
            small_ops.warm_up(model.dtype, config.device)
            paged_attention.warm_up(model.dtype, c.head_dim, c.num_heads // c.num_kv_heads, config.device)
        if torch.device(config.device).type == "cuda":
            sampling.warm_up(config.device)
        # graphs and the asynchronous readback serve one GPU (a graph cannot hold the workers' steps)
        single = kernels and config.tensor_parallel_size == 1
        self.graphs = (
            DecodeGraphs(
                model,
                kv,
                config.max_num_seqs,
                min(blocks_for(max_model_len, config.block_size), config.num_kv_blocks),
                config.block_size,
                config.device,
            )
            if single and config.cuda_graphs
            else None
        )
        # steps carrying prefills: graphs of the pieces between attention calls (app/engine/mixed_graphs.py)
        self.mixed = (
            MixedGraphs(
                model,
                kv,
                config.max_num_seqs,
                min(config.max_tokens_per_step, config.mixed_graph_tokens),
                config.block_size,
                config.device,
            )
            if self.graphs is not None and config.mixed_graph_tokens > 0
            else None
        )
        self.readback = Readback(config.max_num_seqs) if single else None
        self.staging = Staging(config.device)
        self.ahead: DecodeAhead | None = None
        self.prompt_logprobs: dict = {}  # the step run now: Sequence → its prompt logprob entries
        self.steps_taken_ahead = 0

    def step(self, scheduled: list[tuple[Sequence, int]]) -> StepTokens:
        """This schedule's output: the step launched ahead if it computed it, else a step run now."""
        ahead, self.ahead = self.ahead, None
        out = ahead.take(scheduled) if ahead is not None else None
        if out is not None:
            self.steps_taken_ahead += 1
            return out
        self.prompt_logprobs = {}
        logits, sampled = self.run(scheduled)
        return StepTokens(sampled, self._draw(logits, sampled), prompt_logprobs=self.prompt_logprobs)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], ahead: int = 0, pending=None) -> DrawnRows:
        """Queue the sampling of each row of logits (see step_sampling for `ahead` and `pending`)."""
        sp = step_sampling(seqs, self.model.cfg.eos_token_ids, self.model.cfg.vocab_size, self.staging, ahead, pending)
        drawn = draw(logits, sp)
        return self.readback.start(drawn, sp) if self.readback is not None else host_rows(drawn, sp)

    @property
    def max_ahead(self) -> int:
        """The most rows a step launched ahead may have (0: none is)."""
        return self.graphs.max_batch if self.graphs is not None else 0

    def run_ahead(self, out: StepTokens, rows: tuple[list[Sequence], list[int]] | None) -> None:
        """Queue the decode step that must follow `out`: `rows` (Scheduler.reserve_next_decode) are its
        sequences, their blocks given, and each one's row in `out`; None: there is none."""
        if rows is None:
            return
        order, src = rows
        positions = [s.num_computed for s in order]
        logits = self.graphs.run(order, next_tokens=(out.drawn.tokens, src))
        if any(s.grammar is not None for s in order):  # masks need step N's tokens: drawn when taken
            later = lambda rows, seqs: self._draw(self._rows(logits, rows), seqs)  # noqa: E731
            self.ahead = DecodeAhead(order, positions, src, out, None, later)
            return
        # penalised rows count the token they gained from the device, as the graph reads it: no need to
        # keep them (and with them the whole batch) out of the step launched ahead
        drawn = self._draw(logits, order, ahead=1, pending=(out.drawn.tokens, src))
        self.ahead = DecodeAhead(order, positions, src, out, StepTokens(order, drawn))

    def _rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """These rows of logits, selected on the device (indices through the staging copy: no host sync)."""
        if rows == list(range(logits.shape[0])):
            return logits
        return logits.index_select(0, self.staging.upload(np.array(rows, dtype=np.float64)).long())

    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits [n, vocab] (fp32) and the n sequences whose next token they give, in row order."""
        if (
            self.graphs is not None
            and len(scheduled) <= self.graphs.max_batch
            and all(n == 1 and s.num_uncomputed == 1 for s, n in scheduled)
        ):
            order = sorted((s for s, _ in scheduled), key=lambda s: s.lora_slot)
            return self.graphs.run(order), order
        m, c = self.model, self.config
        extra = prompt_rows(step_order(scheduled))  # a decode-only step (the graphs' above) never has any
        replayed = self.mixed.run(scheduled) if self.mixed is not None and extra is None else None
        if replayed is not None:
            return replayed
        inputs, sampled = build_step(scheduled, m.lora_pool, c.block_size, c.device, m.cfg.num_kv_heads)
        if extra is None:
            return m.forward(inputs, self.kv), sampled
        logits = m.forward(with_rows(inputs, extra), self.kv)
        self.prompt_logprobs = entries(logits[len(sampled) :], extra)
        return logits[: len(sampled)], sampled
