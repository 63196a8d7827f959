"""ForwardBatch's cache-slot views: the slot range of a sequence whose blocks are
consecutive is exactly its gathered slot list."""

import pytest
import torch

from kt_cli.engine.forward_batch import ForwardBatch, KVCache, KVSpec

BLOCK = 4


def batch(tables: list[list[int]], lens: list[int]) -> ForwardBatch:
    kv = KVCache.allocate([KVSpec(((1, 2), (1, 2)))], BLOCK, 16)
    n = len(tables)
    return ForwardBatch(torch.zeros(n, dtype=torch.int64), torch.tensor([x - 1 for x in lens]),
                        list(range(n + 1)), lens, tables, torch.zeros(n, dtype=torch.int64),
                        torch.arange(n), kv)


@pytest.mark.parametrize("table,length", [([3], 1), ([3], 4), ([5, 6, 7], 9), ([5, 6, 7], 12), ([2, 3, 9], 8)])
def test_consecutive_blocks_give_the_slot_range(table, length):
    b = batch([table], [length])
    got = b.seq_slot_range(0)
    assert isinstance(got, slice)
    assert torch.equal(torch.arange(16 * BLOCK)[got], b.seq_slots(0))


@pytest.mark.parametrize("table,length", [([3, 1], 5), ([5, 6, 8], 9), ([7, 6], 8)])
def test_scattered_blocks_give_no_range(table, length):
    assert batch([table], [length]).seq_slot_range(0) is None


def test_logits_of_every_row_are_recognised():
    """R == N with strictly increasing rows is every row: the model then skips the gather"""
    decode = batch([[1], [2], [3]], [1, 2, 3])
    assert decode.logits_every_row
    prefill = ForwardBatch(torch.zeros(4, dtype=torch.int64), torch.arange(4), [0, 4], [4], [[0]],
                           torch.arange(4), torch.tensor([3]), decode.kv)
    assert not prefill.logits_every_row
