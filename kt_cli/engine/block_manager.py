"""Paged KV blocks: a fixed pool, reference counts, and a prefix cache.

A full block is named by a hash chain over token ids: hash_i = H(hash_{i-1} || tokens of
block i), so equal hashes mean equal prefixes up to and including that block. Freed blocks
that carry a hash stay findable until the pool needs them back, least recently freed first.
"""

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from .sequence import Sequence

HASH_BYTES = 16


class EvictionListener(Protocol):
    """Told about a cached block just before its slots are handed to another sequence, so a
    slower tier (RAM, disk) can copy the block's KV out of the cache first."""

    def block_evicted(self, block_hash: bytes, token_ids: tuple[int, ...], block_id: int) -> None: ...


class PrefixSource(Protocol):
    """A slower tier that may still hold a block the pool has evicted; restore_block copies
    it into pool block block_id and says whether it could."""

    def has_block(self, block_hash: bytes) -> bool: ...

    def restore_block(self, block_hash: bytes, token_ids: tuple[int, ...], block_id: int) -> bool: ...


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = field(default=())


def chain_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    digest = hashlib.blake2b(digest_size=HASH_BYTES)
    if parent is not None:
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 eviction_listener: EvictionListener | None = None):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.eviction_listener = eviction_listener
        self.prefix_source: PrefixSource | None = None
        self.num_restored_blocks = 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_plain: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[bytes, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def admit(self, seq: Sequence, num_new_tokens: int, reuse_prefix: bool = True) -> bool:
        """Give a sequence without blocks its cached prefix plus room for num_new_tokens more;
        False (and nothing changed) when the pool is too small. Sets seq.num_computed."""
        matched = self.match_prefix(seq) if reuse_prefix else []
        num_hit_tokens = len(matched) * self.block_size
        num_new_tokens = min(num_new_tokens, len(seq) - num_hit_tokens)
        needed = seq.blocks_needed(num_hit_tokens + num_new_tokens) - len(matched)
        reclaimed = sum(1 for block_id in matched if block_id in self.free_cached)
        if self.num_free_blocks - reclaimed < needed:
            return False
        for block_id in matched:
            self._take(block_id)
        seq.block_table = matched + [self._allocate() for _ in range(needed)]
        seq.num_computed = num_hit_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_hit_tokens
        return True

    def grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens after seq.num_computed; False when the pool is too small."""
        needed = seq.blocks_needed(seq.num_computed + num_new_tokens) - len(seq.block_table)
        if self.num_free_blocks < needed:
            return False
        seq.block_table.extend(self._allocate() for _ in range(needed))
        return True

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.reset_cache_state()

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering the longest prefix of seq, leaving at least its last token
        to compute (the model must produce logits for it)."""
        if not self.prefix_caching:
            return []
        matched = []
        for index in range((len(seq) - 1) // self.block_size):
            block_hash = self._seq_block_hash(seq, index)
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                block_id = self._restore(block_hash, tuple(seq.block_tokens(index)), set(matched))
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block_tokens(index)):
                break
            matched.append(block_id)
        return matched

    def commit_computed(self, seq: Sequence) -> None:
        """Register the blocks the last step filled, so later requests can find them."""
        if not self.prefix_caching:
            return
        for index in range(seq.num_committed_blocks, seq.num_full_blocks):
            block = self.blocks[seq.block_table[index]]
            if block.hash is not None:
                continue
            block_hash = self._seq_block_hash(seq, index)
            if block_hash in self.hash_to_block:
                continue
            block.hash, block.token_ids = block_hash, tuple(seq.block_tokens(index))
            self.hash_to_block[block_hash] = block.block_id
        seq.num_committed_blocks = seq.num_full_blocks

    def _seq_block_hash(self, seq: Sequence, index: int) -> bytes:
        while len(seq.block_hashes) <= index:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(chain_hash(parent, seq.block_tokens(len(seq.block_hashes))))
        return seq.block_hashes[index]

    def _restore(self, block_hash: bytes, token_ids: tuple[int, ...], keep: set[int]) -> int | None:
        """Bring a block back from the prefix source into a free pool block (never one of
        `keep`); it joins the free cached blocks, ready to be taken."""
        source = self.prefix_source
        if source is None or not source.has_block(block_hash):
            return None
        block_id = self._free_block_outside(keep)
        if block_id is None:
            return None
        if not source.restore_block(block_hash, token_ids, block_id):
            self.free_plain.appendleft(block_id)
            return None
        block = self.blocks[block_id]
        block.hash, block.token_ids = block_hash, token_ids
        self.hash_to_block[block_hash] = block_id
        self.free_cached[block_id] = None
        self.num_restored_blocks += 1
        return block_id

    def _free_block_outside(self, keep: set[int]) -> int | None:
        if self.free_plain:
            return self.free_plain.popleft()
        block_id = next((b for b in self.free_cached if b not in keep), None)
        if block_id is not None:
            del self.free_cached[block_id]
            self._evict(self.blocks[block_id])
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_cached[block_id]
        block.ref_count += 1

    def _allocate(self) -> int:
        if self.free_plain:
            block = self.blocks[self.free_plain.popleft()]
        else:
            block_id, _ = self.free_cached.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
        block.ref_count = 1
        return block.block_id

    def _evict(self, block: Block) -> None:
        if self.eviction_listener is not None:
            self.eviction_listener.block_evicted(block.hash, block.token_ids, block.block_id)
        del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.hash is None:
            self.free_plain.append(block_id)
        else:
            self.free_cached[block_id] = None
