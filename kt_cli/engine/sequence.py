"""One request as the scheduler sees it: its tokens, its KV blocks and how far the
cache has caught up with its tokens."""

from enum import Enum, auto
from itertools import count

import torch

from .sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """token_ids = prompt + generated. The KV cache holds positions 0..num_computed-1;
    positions num_computed..len-1 still have to be run through the model."""
    _ids = count()

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 block_size: int):
        self.request_id = request_id
        self.seq_id = next(Sequence._ids)
        self.params = params
        self.block_size = block_size
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_computed = 0
        self.num_committed_blocks = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.generator = _generator(params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_full_blocks(self) -> int:
        return self.num_computed // self.block_size

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, index: int) -> list[int]:
        return self.token_ids[index * self.block_size:(index + 1) * self.block_size]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def reset_cache_state(self) -> None:
        self.block_table = []
        self.num_computed = 0
        self.num_committed_blocks = 0


def _generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed)
