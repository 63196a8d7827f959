"""Which sequences run in the next step, and how many of their tokens.

Every step has a token budget. Running sequences are served first, oldest first: a decode
needs one token, a sequence part-way through its prompt takes what the budget leaves (chunked
prefill). Waiting sequences are then admitted first-come first-served while the budget, the
batch cap and the KV pool allow. When the pool runs dry the newest running sequence is
preempted: its blocks are freed and it goes back to the front of the queue to be recomputed
(its full blocks usually survive in the prefix cache, which makes the recompute cheap).
"""

from collections import deque
from dataclasses import dataclass, field

from ..errors import KtError
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 8
    max_step_tokens: int = 512

    def __post_init__(self):
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise KtError(f"max_batch must be an integer >= 1, got {self.max_batch!r}")
        if not isinstance(self.max_step_tokens, int) or self.max_step_tokens < 1:
            raise KtError(f"max_step_tokens must be an integer >= 1, got {self.max_step_tokens!r}")


@dataclass(frozen=True)
class ScheduledChunk:
    """Positions start .. start + num_tokens - 1 of seq run this step; samples is True when
    the chunk reaches the sequence's last token, so its logits pick the next one."""
    seq: Sequence
    num_tokens: int
    start: int = field(init=False)
    samples: bool = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "start", self.seq.num_computed)
        object.__setattr__(self, "samples", self.start + self.num_tokens == len(self.seq))


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._preempted_this_step = False
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def schedule(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        self._preempted_this_step = False
        budget = self._schedule_running(chunks, self.config.max_step_tokens)
        if not self._preempted_this_step:
            self._admit_waiting(chunks, budget)
        return chunks

    def on_computed(self, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            chunk.seq.num_computed += chunk.num_tokens
            self.block_manager.commit_computed(chunk.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _schedule_running(self, chunks: list[ScheduledChunk], budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_pending, budget)
            if not self._make_room(seq, num_tokens):
                break
            chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
            index += 1
        return budget

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the newest running sequences until seq fits; False if seq itself had to go."""
        while not self.block_manager.grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._preempted_this_step = True
        self.num_preemptions += 1

    def _admit_waiting(self, chunks: list[ScheduledChunk], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch:
            seq = self.waiting[0]
            if not self.block_manager.admit(seq, budget):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_tokens = min(seq.num_pending, budget)
            chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
