"""What the model runner hands the model for one step, and what the model tells
the engine about the KV cache it needs.

Tokens of all sequences in a step are flattened into one row dimension N:
sequence i owns rows q_start[i]:q_start[i+1]; its first new token sits at
position context_lens[i] - (q_start[i+1] - q_start[i]).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    """Per-token KV entries of one attention layer: one shape per cached tensor
    (GQA: [(n_kv_heads, head_dim), (n_kv_heads, v_head_dim)]; MLA: [(kv_lora_rank + rope_dim,)])."""
    token_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype = torch.float32

    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sum(itemsize * _prod(shape) for shape in self.token_shapes)


@dataclass
class KVCache:
    """Paged KV storage: for each layer, one tensor per KVSpec entry shaped
    [num_blocks * block_size, *token_shape]. Slot s = block * block_size + offset."""
    block_size: int
    num_blocks: int
    layers: list[list[torch.Tensor]]

    @classmethod
    def allocate(cls, specs: list[KVSpec], block_size: int, num_blocks: int,
                 device: torch.device | str = "cpu") -> "KVCache":
        slots = block_size * num_blocks
        layers = [[torch.zeros((slots, *shape), dtype=spec.dtype, device=device)
                   for shape in spec.token_shapes] for spec in specs]
        return cls(block_size, num_blocks, layers)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor       # [N] int64
    positions: torch.Tensor       # [N] int64
    q_start: list[int]            # [B + 1] row offsets of each sequence
    context_lens: list[int]       # [B] tokens in the cache after this step, per sequence
    block_tables: list[list[int]] # [B][blocks] cache blocks of each sequence, in order
    slot_mapping: torch.Tensor    # [N] int64 slot where each new token's K/V is written
    logits_rows: torch.Tensor     # [R] int64 rows of N whose logits are returned, strictly increasing
    kv: KVCache

    @property
    def logits_every_row(self) -> bool:
        """Whether logits_rows is every row 0..N-1 (being strictly increasing, R == N says so):
        decode steps whose sequences all sample, where the model skips the row gather."""
        return self.logits_rows.numel() == self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def seq_rows(self, i: int) -> slice:
        return slice(self.q_start[i], self.q_start[i + 1])

    def seq_slots(self, i: int) -> torch.Tensor:
        """Cache slots holding positions 0..context_lens[i]-1 of sequence i."""
        bs = self.kv.block_size
        blocks = torch.tensor(self.block_tables[i], dtype=torch.int64)
        slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)
        return slots[: self.context_lens[i]]

    def seq_slot_range(self, i: int) -> slice | None:
        """seq_slots(i) as one range of slots when the sequence's blocks are consecutive
        (a fresh cache hands them out in order), else None."""
        bs, length = self.kv.block_size, self.context_lens[i]
        table = self.block_tables[i][: -(-length // bs)]
        first = table[0]
        if table != list(range(first, first + len(table))):
            return None
        return slice(first * bs, first * bs + length)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out
