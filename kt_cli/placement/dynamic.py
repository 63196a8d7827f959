"""Dynamic re-placement, hooked into each MoEBlock before it dispatches a batch.

Prefill: a batch of at least `prefill_tokens` tokens re-places the layer on that batch's
own routing: its N device slots go to the N experts the batch routes most tokens to
(ties by the lower id), before the batch is dispatched, so the batch already uses them.
Decode: smaller batches add their routing to decayed running counts; every
`decode_tokens` tokens up to `moves` of the hottest CPU experts that beat the coldest
device ones are uploaded by a background thread and swapped in at a later call."""

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .strategies import rank_by_count

DECAY = 0.5


@dataclass
class ReplacementLog:
    prefill_replacements: int = 0
    decode_swaps: int = 0
    experts_moved: int = 0


@dataclass
class _Pending:
    arriving: int
    leaving: int
    upload: Future


@dataclass
class Replacer:
    prefill_tokens: int | None
    decode_tokens: int | None
    moves: int
    log: ReplacementLog
    executor: ThreadPoolExecutor | None = None
    running: torch.Tensor | None = None
    seen: int = 0
    pending: list[_Pending] = field(default_factory=list)

    def before_dispatch(self, block, ids: torch.Tensor) -> None:
        """ids [T, K] on the CPU"""
        self._install_finished(block)
        tokens = ids.shape[0]
        if self.prefill_tokens is not None and tokens >= self.prefill_tokens:
            self._replace_for_batch(block, ids)
        elif self.decode_tokens is not None:
            self._track_decode(block, ids)

    def _replace_for_batch(self, block, ids: torch.Tensor) -> None:
        self._drop_pending()
        slots = int(block.on_device.sum())
        counts = torch.bincount(ids.flatten(), minlength=block.num_experts)
        row = torch.zeros_like(block.on_device)
        row[rank_by_count(counts)[:slots]] = True
        self.log.experts_moved += block.set_placement(row)
        self.log.prefill_replacements += 1

    def _track_decode(self, block, ids: torch.Tensor) -> None:
        if self.running is None:
            self.running = torch.zeros(block.num_experts, dtype=torch.float64)
        self.running += torch.bincount(ids.flatten(), minlength=block.num_experts)
        self.seen += ids.shape[0]
        if self.seen >= self.decode_tokens and not self.pending:
            self.seen = 0
            self._start_swaps(block)
            self.running *= DECAY

    def _start_swaps(self, block) -> None:
        on = block.on_device
        hot = [e for e in rank_by_count(self.running).tolist() if not on[e]][:self.moves]
        cold = [e for e in reversed(rank_by_count(self.running).tolist()) if on[e]][:self.moves]
        for arriving, leaving in zip(hot, cold):
            if self.running[arriving] <= self.running[leaving]:
                break
            upload = self._executor().submit(block.device_experts.upload, arriving)
            self.pending.append(_Pending(arriving, leaving, upload))

    def _install_finished(self, block) -> None:
        still = []
        for p in self.pending:
            if not p.upload.done():
                still.append(p)
                continue
            block.device_experts.install(p.arriving, p.upload.result())
            block.device_experts.evict(p.leaving)
            block.on_device[p.arriving], block.on_device[p.leaving] = True, False
            self.log.decode_swaps += 1
            self.log.experts_moved += 2
        self.pending = still

    def _drop_pending(self) -> None:
        for p in self.pending:
            p.upload.cancel()
        self.pending = []

    def _executor(self) -> ThreadPoolExecutor:
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kt-expert-upload")
        return self.executor
