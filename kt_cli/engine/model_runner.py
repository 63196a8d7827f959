"""Scheduled chunks -> ForwardBatch -> model -> logits -> sampled tokens. Owns the KV cache."""

from contextlib import ExitStack, contextmanager
from typing import Protocol

import torch

from .. import ops
from ..errors import KtError
from ..layers.sampler import Sampler
from .forward_batch import ForwardBatch, KVCache, KVSpec
from .scheduler import ScheduledChunk


class CausalLM(Protocol):
    """A model may also have greedy_tokens(batch) -> [R] int64, the argmax of forward(batch)'s
    rows: steps whose every sampling row only takes the argmax (Sampler.argmax_only) call it."""

    def kv_specs(self) -> list[KVSpec]: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


def kv_bytes_per_token(specs: list[KVSpec]) -> int:
    return sum(spec.bytes_per_token() for spec in specs)


def blocks_in_budget(specs: list[KVSpec], block_size: int, budget_bytes: int) -> int:
    return budget_bytes // (block_size * kv_bytes_per_token(specs))


WIDE_STEP_TOKENS = 64


class ModelRunner:
    """prefill_threads: torch's intra-op threads for steps of WIDE_STEP_TOKENS tokens or
    more (None: leave torch's setting). On the CPU torch runs with one thread, as more
    fought kt's pool in decode; but prefill attention over 512 tokens is large enough
    to use the cores, and kt's pool is idle while it runs (scaled Qwen3-MoE, pp512:
    attention 242 ms per layer on one thread)."""

    def __init__(self, model: CausalLM, block_size: int, num_blocks: int, sampler: Sampler,
                 device: torch.device | str = "cpu", prefill_threads: int | None = None):
        if num_blocks < 1:
            raise KtError("the KV cache budget holds no block at all; raise kv_memory_gb")
        self.prefill_threads = prefill_threads
        self.model = model
        self.sampler = sampler
        self.device = torch.device(device)
        self.kv = KVCache.allocate(model.kv_specs(), block_size, num_blocks, self.device)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> list[int]:
        """One step; returns the next token of each chunk that reaches its sequence's end, in order."""
        sampling = [chunk.seq for chunk in chunks if chunk.samples]
        greedy = getattr(self.model, "greedy_tokens", None) if self.sampler.argmax_only(sampling) else None
        with self._torch_threads(sum(chunk.num_tokens for chunk in chunks)):
            batch = self.build_batch(chunks, all_rows=False)
            if greedy is not None:
                return greedy(batch).tolist()
            logits = self.model.forward(batch)   # [R, V]
        return self.sampler(logits, sampling) if sampling else []

    @contextmanager
    def _torch_threads(self, n_tokens: int):
        """Steps of WIDE_STEP_TOKENS tokens or more run torch on prefill_threads threads;
        when that is more than one, kt's idle workers sleep at once instead of spinning
        on the cores torch's threads need between kt's kernels."""
        before = torch.get_num_threads()
        wide = self.prefill_threads is not None and n_tokens >= WIDE_STEP_TOKENS
        threads = self.prefill_threads if wide else before
        with ExitStack() as stack:
            if threads != before:
                torch.set_num_threads(threads)
                stack.callback(torch.set_num_threads, before)
            if wide and threads > 1:
                stack.enter_context(ops.pool().sleeping_workers())
            yield

    @torch.inference_mode()
    def logits(self, chunks: list[ScheduledChunk], first: int = 0) -> torch.Tensor:
        """Logits at every scheduled position from row `first` on: [N - first, V]."""
        with self._torch_threads(sum(chunk.num_tokens for chunk in chunks)):
            if first >= sum(chunk.num_tokens for chunk in chunks):
                self.model.forward(self.build_batch(chunks, all_rows=False))
                return torch.empty(0)
            return self.model.forward(self.build_batch(chunks, all_rows=True, first=first)).float().cpu()

    def build_batch(self, chunks: list[ScheduledChunk], all_rows: bool, first: int = 0) -> ForwardBatch:
        """Logits rows: every position from row `first` on (all_rows) or the last position of
        each sampling chunk; a step without one still asks for one row, as models need R >= 1."""
        input_ids, positions, slots, logits_rows = [], [], [], []
        q_start, context_lens, block_tables = [0], [], []
        for chunk in chunks:
            seq, start = chunk.seq, chunk.start
            end = start + chunk.num_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(seq.block_table, start, end))
            if all_rows:
                logits_rows.extend(range(q_start[-1], q_start[-1] + chunk.num_tokens))
            elif chunk.samples:
                logits_rows.append(q_start[-1] + chunk.num_tokens - 1)
            q_start.append(q_start[-1] + chunk.num_tokens)
            context_lens.append(end)
            block_tables.append(list(seq.block_table))
        logits_rows = logits_rows[first:] or [len(input_ids) - 1]
        return ForwardBatch(
            input_ids=self._tensor(input_ids), positions=self._tensor(positions),
            q_start=q_start, context_lens=context_lens, block_tables=block_tables,
            slot_mapping=self._tensor(slots), logits_rows=self._tensor(logits_rows), kv=self.kv)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        size = self.kv.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
